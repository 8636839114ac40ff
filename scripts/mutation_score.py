"""Print the mutation score from ``mutmut results --all true`` (used by scripts/mutation.sh).

    python scripts/mutation_score.py RESULTS EQUIVALENTS SECONDS [SAMPLE]
    python scripts/mutation_score.py --sample RESULTS COUNT SEED MODULE...

RESULTS: the output of ``mutmut results --all true`` (``    name: status`` lines).
EQUIVALENTS: docs/equivalent-mutants.txt, one mutant name per line, then ``#`` and the
reason it cannot be killed (it behaves exactly as the original). The score is the share
of the other mutants that the tests kill, in all and per module; every surviving mutant
is listed. SAMPLE: a file of mutant names, one a line; only those count (a sampled run).

``--sample``: print COUNT mutant names of each MODULE (a path under the package, as in
scripts/mutation.sh), drawn at random with SEED from RESULTS (every one when it has
fewer), one a line: the sample a run then checks.
"""

from __future__ import annotations

import random
import sys
from collections import Counter, defaultdict
from pathlib import Path

KILLED = {"killed", "timeout", "caught by type check", "segfault"}
PACKAGE = "secondbox_scheduler"


def read_statuses(results: Path) -> dict[str, str]:
    statuses: dict[str, str] = {}
    for line in results.read_text().splitlines():
        name, _, status = line.strip().rpartition(": ")
        if name:
            statuses[name] = status
    return statuses


def module_of(name: str) -> str:
    """The dotted module of a mutant name (``pkg.mod.x_func__mutmut_3`` -> ``pkg.mod``)."""
    parts = name.split(".")
    for index, part in enumerate(parts):
        if part.startswith(("x_", "xǁ")):
            return ".".join(parts[:index])
    return ".".join(parts[:-1])


def sample(results: Path, count: int, seed: int, modules: list[str]) -> list[str]:
    names = sorted(read_statuses(results))
    rng = random.Random(seed)
    chosen: list[str] = []
    for module in modules:
        dotted = f"{PACKAGE}.{module.removesuffix('.py').replace('/', '.')}"
        own = [name for name in names if module_of(name) == dotted]
        chosen += sorted(rng.sample(own, min(count, len(own))))
    return chosen


def main(results: Path, equivalents: Path, seconds: int, sampled: Path | None = None) -> int:
    statuses = read_statuses(results)
    if sampled is not None:
        wanted = set(sampled.read_text().split())
        statuses = {name: status for name, status in statuses.items() if name in wanted}
        print(f"sampled run: {len(statuses)} mutants drawn ({sampled})")
    equivalent = {
        line.split("#", 1)[0].strip()
        for line in (equivalents.read_text().splitlines() if equivalents.exists() else [])
        if line.split("#", 1)[0].strip()
    }
    counts = Counter(statuses.values())
    considered = {name: status for name, status in statuses.items() if name not in equivalent}
    killed = sum(1 for status in considered.values() if status in KILLED)
    survivors = sorted(name for name, status in considered.items() if status not in KILLED)
    stale = sorted(equivalent - set(statuses)) if sampled is None else []
    score = 100.0 * killed / len(considered) if considered else 0.0
    print(f"mutants: {len(statuses)}  " + ", ".join(f"{s}: {n}" for s, n in sorted(counts.items())))
    print(f"equivalent (docs/equivalent-mutants.txt): {len(equivalent & set(statuses))}")
    for name in survivors:
        print(f"not killed: {name} ({considered[name]})")
    for name in stale:
        print(f"listed as equivalent but no longer generated: {name}")
    by_module: dict[str, list[str]] = defaultdict(list)
    for name, status in considered.items():
        by_module[module_of(name)].append(status)
    for module, module_statuses in sorted(by_module.items()):
        module_killed = sum(1 for status in module_statuses if status in KILLED)
        print(
            f"module {module}: {module_killed}/{len(module_statuses)} killed = "
            f"{100.0 * module_killed / len(module_statuses):.1f}%"
        )
    print(f"score: {killed}/{len(considered)} non-equivalent mutants killed = {score:.1f}%")
    print(f"time: {seconds // 60} min {seconds % 60} s")
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--sample":
        print(
            "\n".join(sample(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]))
        )
        sys.exit(0)
    sampled_names = Path(sys.argv[4]) if len(sys.argv) > 4 else None
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sampled_names))

"""Print the mutation score from ``mutmut results --all true`` (used by scripts/mutation.sh).

    python scripts/mutation_score.py RESULTS EQUIVALENTS SECONDS

RESULTS: the output of ``mutmut results --all true`` (``    name: status`` lines).
EQUIVALENTS: docs/equivalent-mutants.txt, one mutant name per line, then ``#`` and the
reason it cannot be killed (it behaves exactly as the original). The score is the share
of the other mutants that the tests kill; every surviving mutant is listed.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

KILLED = {"killed", "timeout", "caught by type check", "segfault"}


def main(results: Path, equivalents: Path, seconds: int) -> int:
    statuses: dict[str, str] = {}
    for line in results.read_text().splitlines():
        name, _, status = line.strip().rpartition(": ")
        if name:
            statuses[name] = status
    equivalent = {
        line.split("#", 1)[0].strip()
        for line in (equivalents.read_text().splitlines() if equivalents.exists() else [])
        if line.split("#", 1)[0].strip()
    }
    counts = Counter(statuses.values())
    considered = {name: status for name, status in statuses.items() if name not in equivalent}
    killed = sum(1 for status in considered.values() if status in KILLED)
    survivors = sorted(name for name, status in considered.items() if status not in KILLED)
    stale = sorted(equivalent - set(statuses))
    score = 100.0 * killed / len(considered) if considered else 0.0
    print(f"mutants: {len(statuses)}  " + ", ".join(f"{s}: {n}" for s, n in sorted(counts.items())))
    print(f"equivalent (docs/equivalent-mutants.txt): {len(equivalent & set(statuses))}")
    for name in survivors:
        print(f"not killed: {name} ({considered[name]})")
    for name in stale:
        print(f"listed as equivalent but no longer generated: {name}")
    print(f"score: {killed}/{len(considered)} non-equivalent mutants killed = {score:.1f}%")
    print(f"time: {seconds // 60} min {seconds % 60} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])))

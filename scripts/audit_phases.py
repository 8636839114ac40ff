"""Process CPU of the phases of ``audit verify``'s fold process, per event, on a kept log.

    .venv/bin/python scripts/audit_phases.py --database-url URL [--rounds 3] [--by-class]

Reads the log's notifications once (timed: the lean reader, no read-ahead thread), then,
each ``--rounds`` times, the garbage collector paused as ``audit verify`` pauses it:
decoding every event alone, and decoding and folding every event in turn as the fold's
process of ``audit verify --workers 2`` does (a new compact ``AuditFold`` each round).
Prints the minimum of each in microseconds of ``time.process_time`` per event, and the
fold's share (decode and fold less decode). ``--by-class``: after the rounds, the
fold's thread CPU per event of each event class (events decoded first). ``--verify N``:
instead, ``verify(app, workers=N)`` ``--rounds`` times, this process's CPU per event
(with ``N`` 2: the fold's process) and its children's, and the ratio to the raw read
timed just after it. Run it from
another checkout's virtual environment to measure that checkout's code (``cd
<checkout> && .venv/bin/python <this checkout>/scripts/audit_phases.py ...``). Keep a
log with ``secondbox-scheduler bench --only placement --keep`` (docs/performance.md).
"""

from __future__ import annotations

import argparse
import gc
import resource
import time
from collections import Counter
from typing import Any

from secondbox_scheduler.domain.audit.fold import AuditFold
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.settings import DATABASE_URL, READ_MODELS
from secondbox_scheduler.projections.event_decoder import EventDecoder
from secondbox_scheduler.projections.notification_reader import read_pages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--by-class", action="store_true")
    parser.add_argument("--verify", type=int, default=0, metavar="WORKERS")
    args = parser.parse_args()
    app = SchedulerApplication(env={DATABASE_URL: args.database_url, READ_MODELS: "off"})
    if args.verify:
        _verify(app, args.verify, args.rounds)
        return
    start = time.process_time()
    notifications = [n for page in read_pages(app.recorder, after=0) for n in page]
    read = time.process_time() - start
    count = len(notifications)
    decode_times: list[float] = []
    fold_times: list[float] = []
    violations = 0
    gc.disable()
    try:
        for _ in range(args.rounds):
            decode = EventDecoder(app.mapper)
            start = time.process_time()
            for notification in notifications:
                decode(notification)
            decode_times.append(time.process_time() - start)
            decode = EventDecoder(app.mapper)
            audit = AuditFold(compact=True)
            start = time.process_time()
            for notification in notifications:
                audit.apply(notification.id, decode(notification))
            fold_times.append(time.process_time() - start)
            violations = len(audit.finish())
            del audit
            gc.collect()
    finally:
        gc.enable()
    per = 1e6 / count
    decoded, folded = min(decode_times) * per, min(fold_times) * per
    print(
        f"events {count}  read {read * per:.2f}  decode {decoded:.2f}  "
        f"decode+fold {folded:.2f}  fold {folded - decoded:.2f} us/event  "
        f"violations {violations}"
    )
    if args.by_class:
        _by_class(app, notifications)


def _verify(app: SchedulerApplication, workers: int, rounds: int) -> None:
    """``verify(app, workers=...)`` as ``audit verify`` runs it: this process's CPU per
    event (the fold's, the raw read's baseline excluded) and its children's, and the
    ratio to the raw read."""
    from secondbox_scheduler.infrastructure.audit.verify import verify
    from secondbox_scheduler.projections.read_models import read_raw

    for _ in range(rounds):
        own = resource.getrusage(resource.RUSAGE_SELF)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        report = verify(app, workers=workers, measure_raw=False)
        own_after = resource.getrusage(resource.RUSAGE_SELF)
        children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        read_raw(app)
        raw = time.perf_counter() - start
        per = 1e6 / report.events
        print(
            f"verify --workers {workers}: {report.events} events in {report.seconds:.2f}s, "
            f"this process {_cpu(own, own_after) * per:.2f} us/event, children "
            f"{_cpu(children, children_after) * per:.2f}; raw read {raw:.2f}s, "
            f"ratio {raw / report.seconds:.3f}; violations {len(report.violations)}"
        )


def _cpu(before: Any, after: Any) -> float:
    return float(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)


def _by_class(app: SchedulerApplication, notifications: list[Any]) -> None:
    decode = EventDecoder(app.mapper)
    events = [(n.id, decode(n)) for n in notifications]
    spent: dict[str, float] = {}
    counted: Counter[str] = Counter()
    audit = AuditFold(compact=True)
    clock = time.thread_time
    gc.disable()
    try:
        for position, event in events:
            start = clock()
            audit.apply(position, event)
            name = type(event).__qualname__
            spent[name] = spent.get(name, 0.0) + clock() - start
            counted[name] += 1
    finally:
        gc.enable()
    total = sum(spent.values())
    for name, seconds in sorted(spent.items(), key=lambda item: -item[1]):
        print(
            f"  {name:34} {counted[name]:7}  {seconds / counted[name] * 1e6:7.2f} us each  "
            f"{seconds / len(events) * 1e6:6.2f} us/event  {seconds / total:5.1%}"
        )


if __name__ == "__main__":
    main()

"""Times along the log (docs/spec.md, section 6a): the scheduler's clock, as the events
record it, does not go backwards along the notification log by more than the largest
clock tolerance, and no event is recorded later than the auditor's clock plus it.

Every event records a reading of the clock: its timestamp (``create_sandbox``, the
lifecycle commands, a heartbeat's recording time), or, for an event dated by a request
(a placement's events, a refusal: the request's ``now``, which the clock checks keep
within the configured tolerance of the clock), the clock beside it (a placement's
``clock``) or else only a window of the largest tolerance around its timestamp. Writers
on several hosts commit in an order that their clocks (kept within the tolerance of
each other, NTP) follow within the tolerance. Rule ``time-order``, each event named at
its own position:

- an event recorded later than the auditor's clock (when the fold is given one:
  ``audit verify`` gives the application's) by more than the largest tolerance
  (``MAX_CLOCK_TOLERANCE``, 300 s): written "from the future" (a heartbeat a year ahead
  appended through the save function keeps a silent runner fresh);
- an event recorded later than the next event by more than the largest tolerance: from
  the future too, when the event after the next one is as early as the next one (the
  log went on at the earlier time); else the next event is the odd one, dated in the
  past (also at the end of the log). The check then goes on from the time the log went
  on at, so each such event is one finding, and a later one is found too.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, ClassVar

from secondbox_scheduler.domain.audit.state import FoldState, Stream
from secondbox_scheduler.domain.fencing_tokens import FencingTokenUse
from secondbox_scheduler.domain.refusals import RefusalLog
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox


class _Mark:
    """An event's clock reading, with what names it in a finding."""

    __slots__ = ("earliest", "event", "floor", "latest", "position", "stream")

    def __init__(
        self, position: int, event: Any, stream: Stream | None, earliest: datetime,
        latest: datetime, skew: timedelta,
    ) -> None:  # fmt: skip
        self.position = position
        self.event = event
        self.stream = stream
        self.earliest = earliest  # the earliest the clock can have read (== latest, usually)
        self.latest = latest
        self.floor = earliest - skew  # a later event may be recorded this early at the least


class LogTimes(FoldState):
    """The check of the clock readings along the log (called by the fold per event)."""

    # Events stamped with a request's time (within the configured tolerance of the clock),
    # not with a reading of the clock.
    REQUEST_DATED: ClassVar[frozenset[type[Any]]] = frozenset(
        {
            Sandbox.AssignmentFenced,
            Runner.CapacityReserved,
            FencingTokenUse.Used,
            RefusalLog.Opened,
            RefusalLog.Refused,
        }
    )

    def __init__(self) -> None:
        super().__init__()
        self.auditor_clock: datetime | None = None  # set by the caller: the clock now
        self._high: _Mark | None = None  # the latest reading the log has gone on from
        self._back: _Mark | None = None  # the event after it that went back, judged next

    def _log_time(self, event: Any) -> None:
        earliest = latest = event.timestamp
        if type(event) in self.REQUEST_DATED:
            clock = None
            if type(event) is Sandbox.AssignmentFenced:
                clock = event.placement.get("clock")  # recorded since release 0.2
            if clock is not None:
                earliest = latest = clock
            else:
                earliest = latest - self.MAX_CLOCK_SKEW
                latest = latest + self.MAX_CLOCK_SKEW
        auditor = self.auditor_clock
        if auditor is not None and earliest - self.MAX_CLOCK_SKEW > auditor:
            self._violate(
                "time-order",
                f"recorded at {earliest.isoformat()}, later than the auditor's clock "
                f"{auditor.isoformat()} by {_duration(earliest - auditor)}: more than the "
                f"largest clock tolerance {_duration(self.MAX_CLOCK_SKEW)} (an event from "
                "the future)",
            )
            return  # the events after it are not compared with it
        high = self._high
        if high is not None and (latest >= high.floor or self._back is not None):
            if self._back is not None:
                high = self._judge(latest)
            if latest >= high.floor:
                if earliest > high.earliest:  # the new high mark, written over the old
                    # one (held by nothing else here: no event went back), as _Mark sets it
                    high.floor = earliest - self.MAX_CLOCK_SKEW
                    high.position, high.event, high.stream = self.position, event, self._stream
                    high.earliest, high.latest = earliest, latest
                return
        mark = _Mark(self.position, event, self._stream, earliest, latest, self.MAX_CLOCK_SKEW)
        if high is None:
            self._high = mark
        else:
            self._back = mark  # went back: judged by the event after it

    def _judge(self, latest: datetime | None) -> _Mark:
        """The event that went back below the high mark, judged by the reading of the
        event after it (None: the log ends): which of the two is the odd one."""
        high, back = self._high, self._back
        assert high is not None
        assert back is not None
        self._back = None
        if latest is not None and latest < high.floor:  # the log went on at the earlier time
            self._report(high, back, "later than the next event", "the next one")
            self._high = back
            return back
        self._report(back, high, "earlier than an event before it", "the events before it")
        return high

    def _report(self, odd: _Mark, other: _Mark, how: str, whose: str) -> None:
        then = f"recorded at {other.latest.isoformat()}"
        if other.earliest != other.latest:
            then = f"dated by a request, the clock then at most {other.latest.isoformat()}"
        when = odd.earliest if how.startswith("later") else odd.latest
        gap = abs(when - (other.latest if how.startswith("later") else other.earliest))
        self._violate_at(
            odd.position,
            odd.event,
            odd.stream,
            "time-order",
            f"recorded at {when.isoformat()}, {how} #{other.position} "
            f"{type(other.event).__qualname__} ({then}) by {_duration(gap)}: more than the "
            f"largest clock tolerance {_duration(self.MAX_CLOCK_SKEW)} (the log goes on at "
            f"the time of {whose}: an event "
            f"{'from the future' if how.startswith('later') else 'dated in the past'})",
        )

    def _finish_times(self) -> None:
        if self._back is not None:
            self._judge(None)


def _duration(value: timedelta) -> str:
    seconds = value.total_seconds()
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:,.1f} days"
    return f"{seconds:,.0f}s"

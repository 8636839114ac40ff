"""Times along the log (docs/spec.md, section 6a): the scheduler's clock, as the events
record it, does not go backwards along the notification log by more than the largest
clock tolerance.

Every event records a reading of the clock: its timestamp (``create_sandbox``, the
lifecycle commands, a heartbeat's recording time), or, for an event dated by a request
(a placement's events, a refusal: the request's ``now``, which the clock checks keep
within the configured tolerance of the clock), the clock beside it (a placement's
``clock``) or else only a window of the largest tolerance around its timestamp. Writers
on several hosts commit in an order that their clocks (kept within the tolerance of
each other, NTP) follow within the tolerance. So an event recorded later than a next
event's recording time by more than the largest tolerance (``MAX_CLOCK_TOLERANCE``,
300 s) is a finding (rule ``time-order``), named at the later-dated event, the next one
named in the detail: an event written "from the future" (a heartbeat a year ahead
appended through the save function keeps a silent runner fresh), or one dated in the
past after it. The check then goes on from the next event's time, so each such event
is one finding, and a second one later in the log is found too.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, ClassVar

from secondbox_scheduler.domain.audit.state import FoldState, Stream
from secondbox_scheduler.domain.fencing_tokens import FencingTokenUse
from secondbox_scheduler.domain.refusals import RefusalLog
from secondbox_scheduler.domain.runner import Runner
from secondbox_scheduler.domain.sandbox import Sandbox


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
        # The latest clock reading the log has shown so far (its earliest possible value
        # for a request-dated event), and the event that showed it.
        self._latest: datetime | None = None
        self._latest_floor: datetime | None = None  # _latest - the largest tolerance
        self._latest_position = 0
        self._latest_event: Any = None
        self._latest_stream: Stream | None = None

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
        floor = self._latest_floor
        if floor is not None and latest < floor:
            self._time_went_back(event, latest, earliest != latest)
        elif self._latest is not None and earliest <= self._latest:
            return
        self._latest = earliest
        self._latest_floor = earliest - self.MAX_CLOCK_SKEW
        self._latest_position = self.position
        self._latest_event = event
        self._latest_stream = self._stream

    def _time_went_back(self, event: Any, latest: datetime, request_dated: bool) -> None:
        assert self._latest is not None
        then = f"recorded at {latest.isoformat()}"
        if request_dated:
            then = f"dated by a request, the clock then at most {latest.isoformat()}"
        self._violate_at(
            self._latest_position,
            self._latest_event,
            self._latest_stream,
            "time-order",
            f"recorded at {self._latest.isoformat()}, later than the next event "
            f"#{self.position} {type(event).__qualname__} ({then}) by "
            f"{_duration(self._latest - latest)}: more than the largest clock tolerance "
            f"{_duration(self.MAX_CLOCK_SKEW)} (an event from the future, or the next one "
            "dated in the past)",
        )


def _duration(value: timedelta) -> str:
    seconds = value.total_seconds()
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:,.1f} days"
    return f"{seconds:,.0f}s"

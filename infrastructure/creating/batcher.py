"""Group commit of concurrent ``create_sandbox`` calls in one process.

Callers queue their creations; one of them at a time, the leader, takes what is queued
(up to the batch size), decides and commits it as one :class:`~.batch.CreateBatch`
(one catch-up of the read models, one home search per requirements, one transaction),
answers every caller in it, and hands the lead to the first caller still queued. A lone
call leads at once and waits for nobody: batches form while a batch is being decided
and committed, as a database's group commit does. A batch is decided only once each of
its calls has arrived, so its catch-up reads the log as it stood at every call, or
later: each answer is one a serial execution of the calls would give.

Two calls for one sandbox id never share a batch: the later one stays queued, first in
line for the next batch, which finds the sandbox the earlier one recorded (a serial
execution's answer to the repeat). A caller interrupted while it waits or leads leaves
the queue and passes the lead on. Settings: those of the placement batcher
(``SECONDBOX_BATCHING``, ``SECONDBOX_BATCH_SIZE``): with batching off, each call is a
batch of its own.

The queue is the placement batcher's (:mod:`..batching.leader_queue`), with this
batcher's rules: what a batch takes (one call per sandbox id) and how a leader regroups
(the constants below).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence

from eventsourcing.utils import strtobool

from secondbox_scheduler.infrastructure.batching.leader_queue import LeaderQueue, Slot
from secondbox_scheduler.infrastructure.creating.batch import Created, CreateRequest
from secondbox_scheduler.infrastructure.settings import BATCH_SIZE, BATCHING, batch_setting

DEFAULT_CREATE_BATCH_SIZE = 64
# The callers a batch answered come back together (a caller's next creation follows its
# schedule), and the first of them would lead a batch of one while the rest queue
# behind it (batches of 1, 9, 1, 9, ...; a batch costs about the same whatever its
# size: one catch-up, one home search). So a leader waits for as many creations as the
# largest of the last REGROUP_MEMORY batches held to queue again, while they keep
# arriving: at most REGROUP_GAP after the latest arrival, REGROUP_LIMIT in all. Once
# REGROUP_MEMORY batches in a row were lone calls, a lone call never waits.
REGROUP_GAP = 0.003
REGROUP_LIMIT = 0.010
REGROUP_MEMORY = 4
# A batch costs about the same whatever its size, so once batches take long (a loaded
# machine), waiting a share of the latest batch's time for more callers is cheaper than
# running another batch for them: the gap and the limit grow to REGROUP_SHARE of it, up
# to REGROUP_CAP.
REGROUP_SHARE = 0.5
REGROUP_CAP = 0.050

RunCreations = Callable[[Sequence[CreateRequest]], Sequence[Created]]


class CreateBatcher(LeaderQueue[CreateRequest, str]):
    """Runs concurrent creations of one process in batches, one batch at a time."""

    leader_name = "secondbox-create-leader"

    def __init__(self, run: RunCreations, *, size: int = DEFAULT_CREATE_BATCH_SIZE) -> None:
        if size < 1:
            raise ValueError("the batch size must be at least 1")
        super().__init__(size)
        self._run = run
        self._last_sizes: deque[int] = deque(maxlen=REGROUP_MEMORY)  # the latest batches'
        self._last_seconds = 0.0  # how long the latest batch took to decide and commit
        self.batch_sizes: Counter[int] = Counter()  # batches run, by size

    def create(self, request: CreateRequest) -> str:
        """The answer to ``request`` (its home runner's id), or its error raised."""
        return self._call(Slot(request, request.actor))

    async def create_async(self, request: CreateRequest) -> str:
        """:meth:`create` for a coroutine: queued the same way, awaited on its loop."""
        return await self._call_async(Slot(request, request.actor))

    def _run_batch(
        self, batch: Sequence[Slot[CreateRequest, str]]
    ) -> Sequence[Created | BaseException]:
        return self._run([s.request for s in batch])

    def _take(self) -> list[Slot[CreateRequest, str]]:
        """(Holding ``self._lock``.) The queued calls in order, up to the batch size, but
        for a second call of a sandbox id already taken (it stays first in line)."""
        batch: list[Slot[CreateRequest, str]] = []
        kept: list[Slot[CreateRequest, str]] = []
        taken: set[str] = set()
        for slot in self._queue:
            sandbox_id = slot.request.sandbox_id
            if len(batch) < self.size and sandbox_id not in taken:
                batch.append(slot)
                taken.add(sandbox_id)
            else:
                kept.append(slot)
        self._queue = deque(kept)
        return batch

    def _regroup(self) -> None:
        """(Holding ``self._lock``, released while waiting.) After batches of several,
        wait for as many calls to queue while they keep arriving (the constants above)."""
        wanted = min(self.size, max(self._last_sizes, default=0))
        if wanted < 2:
            return
        gap = max(REGROUP_GAP, self._last_seconds * REGROUP_SHARE)
        self._wait_for(wanted, gap, gap, max(REGROUP_LIMIT, self._last_seconds * REGROUP_SHARE))

    def _took(self, batch: Sequence[Slot[CreateRequest, str]]) -> None:
        self._last_sizes.append(len(batch))
        self.batch_sizes[len(batch)] += 1

    def _ran(self, seconds: float) -> None:
        self._last_seconds = min(REGROUP_CAP / REGROUP_SHARE, seconds)


def create_batcher_from_settings(env: Mapping[str, str], run: RunCreations) -> CreateBatcher | None:
    """The creation batcher the settings ask for (``SECONDBOX_BATCHING``,
    ``SECONDBOX_BATCH_SIZE``), or None with batching off."""
    if not strtobool(env.get(BATCHING) or "on"):
        return None
    size = int(batch_setting(env.get(BATCH_SIZE), DEFAULT_CREATE_BATCH_SIZE, BATCH_SIZE))
    return CreateBatcher(run, size=size)

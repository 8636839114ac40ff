"""``load_many`` takes the repository's fast-forward locks for what it may touch in the
cache (infrastructure/store/fast_forward.py): every id when it caches what it reads;
without caching (``cache_new=False``, a batch's sandboxes) only the ids in the cache,
whose cached instances it brings up to date in place."""

from __future__ import annotations

from typing import Any
from uuid import UUID

import pytest

from secondbox_scheduler.domain.ids import sandbox_uuid
from secondbox_scheduler.infrastructure import SchedulerApplication
from tests.conftest import Clock, Store
from tests.factories import create_sandbox, register, schedule_request


def _count_locks(app: SchedulerApplication, monkeypatch: pytest.MonkeyPatch) -> list[UUID]:
    locked: list[UUID] = []
    repository: Any = app.repository
    use = repository._use_fastforward_lock

    def counting(aggregate_id: UUID) -> Any:
        locked.append(aggregate_id)
        return use(aggregate_id)

    monkeypatch.setattr(repository, "_use_fastforward_lock", counting)
    return locked


def test_uncached_reads_lock_only_what_the_cache_holds(
    store: Store, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    app, rival = store.open(), store.open()
    register(app, "r1", at=clock())
    create_sandbox(app, "cached")
    create_sandbox(app, "fresh")
    cached, fresh = sandbox_uuid("cached"), sandbox_uuid("fresh")
    app.forget_cached()
    app.repository.get(cached)  # in the cache, then placed by another replica
    rival.schedule(schedule_request("cached", clock()))
    assert app.repository.cache is not None
    locked = _count_locks(app, monkeypatch)

    loaded = app.load_many([cached, fresh], cache_new=False)

    assert locked == [cached]
    stored, stored_fresh = rival.load_stored(cached), rival.load_stored(fresh)
    assert stored is not None
    assert stored_fresh is not None
    assert stored.version == 2  # created, then fenced by the rival
    assert loaded[cached].version == stored.version  # fast-forwarded
    assert app.repository.cache.get(cached).version == stored.version  # in place
    assert loaded[fresh].version == stored_fresh.version
    assert fresh not in app.repository.cache.cache  # read, not cached

    locked.clear()
    app.load_many([cached, fresh])  # caching what it reads: every id locked
    assert sorted(locked, key=lambda u: u.bytes) == sorted([cached, fresh], key=lambda u: u.bytes)
    assert fresh in app.repository.cache.cache

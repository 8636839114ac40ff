"""What the service answers differently when it serves a cell router (docs/api.md,
"Cells"): the runner list over every cell, each row naming its ``cell`` and the cells
that did not answer in ``unavailable_cells``; the ``Secondbox-Cell`` header on a
sandbox's or runner's assignment list, whose rows name their ``cell`` too; readiness
per cell; ``/metrics`` of every cell,
each series labelled with its ``cell``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from starlette.responses import Response

from secondbox_scheduler.domain.errors import InvalidRequestError
from secondbox_scheduler.domain.values import DurableAssignment
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.cells.router import CellRouter
from secondbox_scheduler.infrastructure.feed.lists import Page
from secondbox_scheduler.infrastructure.feed.reading import page_limit
from secondbox_scheduler.infrastructure.http.common import respond
from secondbox_scheduler.infrastructure.http.models import AssignmentList, AssignmentOut
from secondbox_scheduler.infrastructure.metrics import NAMESPACE
from secondbox_scheduler.infrastructure.prometheus_export import PrometheusMetrics
from secondbox_scheduler.infrastructure.store.cell_unavailable import CellUnavailableError

CELL_HEADER = "Secondbox-Cell"
CELL_CURSOR = "~"  # a list's cursor over cells: <cell>~<the cell's own cursor>
T = TypeVar("T")


def page_over_cells(
    router: CellRouter,
    key: str,
    cursor: str | None,
    limit: int | None,
    fetch: Callable[[SchedulerApplication, str | None, int], Page[T]],
    dump: Callable[[T], dict[str, Any]],
) -> Response:
    """One page of a list over every cell, in the cells file's order and each cell's
    own list order: ``key`` (the items, each naming its ``cell``), ``next`` (the cell
    and that cell's cursor: paging to the end returns each item once, as in one cell)
    and ``unavailable_cells`` (cell: why) for the cells this page passed without an
    answer (their items are not on it: ask again once the cell is back)."""
    names = list(router.names)
    start, inner = names[0], None
    if cursor is not None:
        cell, separator, rest = cursor.partition(CELL_CURSOR)
        if not separator or cell not in names:
            raise InvalidRequestError("cursor", "must be the next of this list", cursor)
        start, inner = cell, rest or None
    wanted = page_limit(limit)
    items: list[dict[str, Any]] = []
    unavailable: dict[str, str] = {}
    following: str | None = None
    remaining = names[names.index(start) :]
    for index, name in enumerate(remaining):
        try:
            page = fetch(router.application(name), inner, wanted - len(items))
        except CellUnavailableError as error:
            unavailable[name] = str(error)
            inner = None
            continue
        items.extend({"cell": name, **dump(item)} for item in page.items)
        inner = None
        if page.next is not None:
            following = f"{name}{CELL_CURSOR}{page.next}"
            break
        if len(items) >= wanted:
            after = remaining[index + 1 :]
            following = f"{after[0]}{CELL_CURSOR}" if after else None
            break
    body = {key: items, "next": following, "unavailable_cells": unavailable}
    return Response(json.dumps(body, default=str), media_type="application/json")


def assignment_list(
    app: SchedulerApplication | CellRouter,
    found: list[DurableAssignment],
    *,
    sandbox_id: str | None = None,
    runner_id: str | None = None,
) -> Response:
    """An assignment list; over cells each row also names its ``cell`` (that of the
    sandbox or runner asked about), and so does the ``Secondbox-Cell`` header."""
    listed = AssignmentList(assignments=[AssignmentOut.of(a) for a in found])
    if not isinstance(app, CellRouter) or app.single:
        return respond(listed)
    cell = app.cell_of_sandbox(sandbox_id) if sandbox_id is not None else None
    if cell is None:
        assert runner_id is not None
        cell = app.cell_of_runner(runner_id)
    rows = listed.model_dump(mode="json")["assignments"]
    body = {"assignments": [{"cell": cell, **row} for row in rows]}
    return Response(json.dumps(body), media_type="application/json", headers={CELL_HEADER: cell})


def cells_readiness(router: CellRouter) -> dict[str, str]:
    """Each cell: ``ok``, or why its store did not answer (one probe each, at once)."""

    def probe(app: SchedulerApplication) -> str:
        app.probe_store()
        return "ok"

    found = router.across(probe)
    states = {row.cell: row.value for row in found.rows}
    states.update(
        {name: f"unavailable: {error.detail}" for name, error in found.unavailable.items()}
    )
    return {name: states[name] for name in router.names}


class CellsCollector(Collector):
    """Every cell's metrics (each cell's application exports to a registry of its own),
    each series with a ``cell`` label, and ``secondbox_scheduler_cell_up`` per cell (0:
    its store did not answer the scrape)."""

    def __init__(self, router: CellRouter) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        found = self.router.across(_families)
        merged: dict[str, Metric] = {}
        for row in found.rows:
            for family in row.value:
                target = merged.get(family.name)
                if target is None:
                    target = Metric(family.name, family.documentation, family.type, family.unit)
                    merged[family.name] = target
                target.samples.extend(
                    Sample(s.name, {**s.labels, "cell": row.cell}, s.value, s.timestamp, s.exemplar)
                    for s in family.samples
                )
        up = Metric(
            f"{NAMESPACE}_cell_up", "Whether the cell's store answered (1) or not.", "gauge"
        )
        answered = {row.cell for row in found.rows}
        for name in self.router.names:
            up.add_sample(f"{NAMESPACE}_cell_up", {"cell": name}, 1.0 if name in answered else 0.0)
        yield up
        yield from merged.values()


def export_metrics(cell: str, app: SchedulerApplication) -> None:
    """Export ``app``'s metrics to a registry of its own (once), which the
    :class:`CellsCollector` reads with the cell's label."""
    if not isinstance(app.metrics.sink, PrometheusMetrics):
        app.attach_metrics()


def _families(app: SchedulerApplication) -> list[Metric]:
    sink: Any = app.metrics.sink
    if not isinstance(sink, PrometheusMetrics):  # built before the service: now
        export_metrics("", app)
        sink = app.metrics.sink
    return list(sink.registry.collect())

"""What the service answers differently when it serves a cell router (docs/api.md,
"Cells"): the runner list over every cell, each row naming its ``cell`` and the cells
that did not answer in ``unavailable_cells``; the ``Secondbox-Cell`` header on a
sandbox's or runner's assignment list, whose rows name their ``cell`` too; readiness
per cell; ``/metrics`` of every cell,
each series labelled with its ``cell``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from starlette.responses import Response

from secondbox_scheduler.domain.values import DurableAssignment
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.cells.router import CellRouter
from secondbox_scheduler.infrastructure.http.common import respond
from secondbox_scheduler.infrastructure.http.models import AssignmentList, AssignmentOut
from secondbox_scheduler.infrastructure.metrics import NAMESPACE
from secondbox_scheduler.infrastructure.prometheus_export import PrometheusMetrics

CELL_HEADER = "Secondbox-Cell"


def runner_list_over_cells(router: CellRouter, pool_name: str | None) -> Response:
    """``GET /v1/runners`` over cells: ``runners`` (each with its ``cell``), by cell then
    id, and ``unavailable_cells`` (cell: why) for the cells that did not answer."""
    found = router.runner_snapshots_across(pool_name)
    body = {
        "runners": [
            {"cell": row.cell, **snapshot.model_dump(mode="json")}
            for row in found.rows
            for snapshot in row.value
        ],
        "unavailable_cells": {name: str(error) for name, error in found.unavailable.items()},
    }
    return Response(json.dumps(body), media_type="application/json")


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

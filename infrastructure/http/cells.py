"""What the service answers differently when it serves a cell router (docs/api.md,
"Cells"): the runner list over every cell, each row naming its ``cell`` and the cells
that did not answer in ``unavailable_cells``; the ``Secondbox-Cell`` header on a
sandbox's or runner's assignment list; readiness per cell; ``/metrics`` of every cell,
each series labelled with its ``cell``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from starlette.responses import Response

from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.cells.router import CellRouter
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


def cell_of_sandbox(app: SchedulerApplication | CellRouter, sandbox_id: str) -> dict[str, str]:
    """The ``Secondbox-Cell`` header of an answer about ``sandbox_id`` (none: one store)."""
    if isinstance(app, CellRouter) and not app.single:
        return {CELL_HEADER: app.cell_of_sandbox(sandbox_id)}
    return {}


def cell_of_runner(app: SchedulerApplication | CellRouter, runner_id: str) -> dict[str, str]:
    if isinstance(app, CellRouter) and not app.single:
        return {CELL_HEADER: app.cell_of_runner(runner_id)}
    return {}


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


_attaching = threading.Lock()


def _families(app: SchedulerApplication) -> list[Metric]:
    with _attaching:
        sink: Any = app.metrics.sink
        if not isinstance(sink, PrometheusMetrics):
            sink = app.attach_metrics()  # a registry of the cell's own
    return list(sink.registry.collect())

"""Look-alike ids are refused (docs/spec.md, "Limits"): an id that prints like another
one, or not at all, is an ``InvalidRequestError`` naming the field and the rule, and
nothing is written; through the application on both stores and over HTTP (422)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from secondbox_scheduler.domain import InvalidRequestError
from secondbox_scheduler.domain.values import require_text
from secondbox_scheduler.infrastructure import SchedulerApplication
from tests.conftest import Clock, Store
from tests.factories import create_sandbox, register, requirements, schedule_request
from tests.http_helpers import api_client, error_of, heartbeat_body, runner_body, sandbox_body

# (label, a look-alike id, a fragment of the rule that refuses it)
LOOKALIKES = [
    ("Cc control", "r\x07x", "control"),
    ("Cf right-to-left override", "r\u202ex", "format"),
    ("Cf zero-width joiner", "r\u200dx", "format"),
    ("Cf byte-order mark", "\ufeffr", "format"),
    ("Zl line separator", "r\u2028x", "separator"),
    ("Zp paragraph separator", "r\u2029x", "separator"),
    ("Co private use", "r\ue000x", "private-use"),
    ("Cn noncharacter U+FFFE", "r\ufffex", "unassigned"),
    ("Cn noncharacter U+FFFF", "r\uffffx", "unassigned"),
    ("Cn unassigned", "r\U000e0fffx", "unassigned"),
    ("Cs surrogate", "r\ud800x", "surrogate"),
    ("a lone space", " ", "whitespace"),
    ("trailing space", "a ", "whitespace"),
    ("leading space", " a", "whitespace"),
    ("trailing no-break space", "a\u00a0", "whitespace"),
]
IDS = [label for label, _, _ in LOOKALIKES]
FIELDS = [
    "runner_id", "pool_name", "architecture", "sandbox_id", "workspace_id",
    "profile_revision_id", "assignment_id", "instance_id", "start_mutation_id",
]  # fmt: skip


def _call(app: SchedulerApplication, clock: Clock, field: str, value: str) -> Callable[[], Any]:
    now = clock()
    if field in ("runner_id", "pool_name", "architecture"):
        overrides = {} if field == "runner_id" else {field: value}
        runner_id = value if field == "runner_id" else "r9"
        return lambda: register(app, runner_id, at=now, heartbeat=False, **overrides)
    if field in ("sandbox_id", "workspace_id", "profile_revision_id"):
        ids = {"sandbox_id": "s9", "workspace_id": "w9", "profile_revision_id": "p9", field: value}
        return lambda: app.create_sandbox(
            requirements=requirements(), heartbeat_timeout=timedelta(seconds=30), **ids
        )
    return lambda: app.schedule(schedule_request("s1", now, **{field: value}))


@pytest.mark.parametrize(("label", "value", "rule"), LOOKALIKES, ids=IDS)
def test_require_text_refuses_lookalike_ids_naming_field_and_rule(
    label: str, value: str, rule: str
) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        require_text("runner_id", value)
    assert refused.value.field == "runner_id", label
    assert rule in refused.value.rule, (label, refused.value.rule)


@pytest.mark.parametrize(("label", "value", "rule"), LOOKALIKES, ids=IDS)
def test_lookalike_ids_are_refused_by_the_application_and_write_nothing(
    app: SchedulerApplication, clock: Clock, label: str, value: str, rule: str
) -> None:
    register(app, "r1", at=clock())
    create_sandbox(app, "s1")
    before = app.event_count()
    for field in FIELDS:
        with pytest.raises(InvalidRequestError) as refused:
            _call(app, clock, field, value)()
        assert refused.value.field.split(".")[-1] == field, (label, str(refused.value))
        assert rule in refused.value.rule, (label, field, refused.value.rule)
        assert app.event_count() == before, (label, field)


@pytest.mark.parametrize(
    "value", ["r1", "runner één", "сервер-1", "ランナー", "a b", "x" * 200], ids=repr
)
def test_ordinary_unicode_ids_and_inner_spaces_are_still_accepted(
    app: SchedulerApplication, clock: Clock, value: str
) -> None:
    register(app, value, at=clock())
    create_sandbox(app, value)
    assert app.runner_snapshots("pool-a")


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/runners", runner_body("r\u202ex"), "runner_id"),
        ("/v1/runners", runner_body("r2", pool_name="pool\u202e-a"), "pool_name"),
        ("/v1/sandboxes", sandbox_body("s2", workspace_id="w\u202ex"), "workspace_id"),
        ("/v1/sandboxes", sandbox_body("s2", profile_revision_id="p\u200d1"),
         "profile_revision_id"),
        ("/v1/sandboxes", sandbox_body("s2", workspace_id="w "), "workspace_id"),
    ],
    ids=["runner_id RLO", "pool_name RLO", "workspace_id RLO", "profile ZWJ", "trailing space"],
)  # fmt: skip
def test_lookalike_ids_over_http_are_a_422_naming_the_field_and_write_nothing(
    store: Store, clock: Clock, path: str, body: dict[str, Any], field: str
) -> None:
    app = store.open()
    with api_client(app) as client:
        assert client.post("/v1/runners", json=runner_body("r1")).status_code == 201
        beat = client.post("/v1/runners/r1/heartbeat", json=heartbeat_body(clock()))
        assert beat.status_code == 200, beat.text
        before = app.event_count()
        detail = error_of(client.post(path, json=body), 422, "invalid_request")
        assert detail["field"] == field, detail
        assert detail["rule"], detail
        assert app.event_count() == before

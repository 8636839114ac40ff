"""Which role may call which route: the one table of the service (docs/operations.md,
"Access").

Every operation of the OpenAPI document has an entry in :data:`ROUTE_ACCESS`, by its
method and path template; ``tests/test_http_access.py`` generates its checks from the
document and fails for an operation that has none. A route missing from the table is
refused to every token (403), never open. The roles (``domain/access_tokens.py``):

- ``runner``: register, heartbeat and the reports on an assignment (running, release,
  fail), only for the runner ids its token names: the body's ``runner_id`` (register),
  the path's (heartbeat), or the runner the path's sandbox generation is assigned to
  (reports);
- ``control-plane``: every sandbox command, the runner commands but drains and
  deregistration, every read;
- ``auditor``: every read (queries, explanations, timelines), nothing that writes;
- ``admin``: tokens, drains, deregistration, allocatable changes, every read.

``/healthz`` and ``/readyz`` are open; ``/metrics`` needs a token of a reading role
unless the service leaves it open (``serve --open-metrics``); the OpenAPI document
and its pages (``/openapi.json``, ``/docs``, ``/redoc``) take any valid token. With no
token issued yet, every route is open (the service refuses to listen beyond loopback
then, unless ``serve --insecure``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from secondbox_scheduler.domain.access_tokens import (
    ROLE_ADMIN,
    ROLE_AUDITOR,
    ROLE_CONTROL_PLANE,
    ROLE_RUNNER,
    ROLES,
)

# How a runner token's request names the runner it acts for.
RUNNER_IN_PATH = "path"  # the path's {runner_id}
RUNNER_IN_BODY = "body"  # the JSON body's "runner_id"
RUNNER_OF_ASSIGNMENT = "assignment"  # the runner of the path's sandbox generation
NO_RUNNER = "none"  # the route acts for no runner (the OpenAPI document)


@dataclass(frozen=True)
class Access:
    """Who may call one route."""

    roles: frozenset[str] = frozenset()
    runner: str | None = None  # where a runner token's runner is (set iff runner in roles)
    public: bool = False  # no token needed, ever

    def __post_init__(self) -> None:
        assert self.roles <= set(ROLES)
        assert (self.runner is not None) == (ROLE_RUNNER in self.roles)


PUBLIC = Access(public=True)
READ = Access(frozenset({ROLE_CONTROL_PLANE, ROLE_AUDITOR, ROLE_ADMIN}))
CONTROL = Access(frozenset({ROLE_CONTROL_PLANE}))
OPERATE = Access(frozenset({ROLE_ADMIN}))
CONTROL_OR_OPERATE = Access(frozenset({ROLE_CONTROL_PLANE, ROLE_ADMIN}))
ANY_ROLE = Access(frozenset(ROLES), runner=NO_RUNNER)  # the document (not checked here)


def runner_or_control(where: str) -> Access:
    return Access(frozenset({ROLE_RUNNER, ROLE_CONTROL_PLANE}), runner=where)


METRICS = "/metrics"
RUNNER = "/v1/runners/{runner_id}"
SANDBOX = "/v1/sandboxes/{sandbox_id}"
GENERATION = f"{SANDBOX}/generations/{{generation}}"

# (method, path template) -> who may call it. New routes join here.
ROUTE_ACCESS: Mapping[tuple[str, str], Access] = MappingProxyType(
    {
        # operations
        ("GET", "/healthz"): PUBLIC,
        ("GET", "/readyz"): PUBLIC,
        ("GET", METRICS): READ,  # open with serve --open-metrics (public_paths)
        # runners
        ("POST", "/v1/runners"): runner_or_control(RUNNER_IN_BODY),
        ("GET", "/v1/runners"): READ,
        ("GET", RUNNER): READ,
        ("DELETE", RUNNER): OPERATE,
        ("POST", f"{RUNNER}/heartbeat"): runner_or_control(RUNNER_IN_PATH),
        ("POST", f"{RUNNER}/drain"): OPERATE,
        ("POST", f"{RUNNER}/cancel-drain"): OPERATE,
        ("PUT", f"{RUNNER}/allocatable"): CONTROL_OR_OPERATE,
        ("GET", f"{RUNNER}/assignments"): READ,
        ("GET", f"{RUNNER}/timeline"): READ,
        # sandboxes
        ("POST", "/v1/sandboxes"): CONTROL,
        ("GET", SANDBOX): READ,
        ("POST", f"{SANDBOX}/schedule"): CONTROL,
        ("GET", f"{SANDBOX}/assignment"): READ,
        ("GET", f"{SANDBOX}/assignments"): READ,
        ("POST", f"{GENERATION}/running"): runner_or_control(RUNNER_OF_ASSIGNMENT),
        ("POST", f"{GENERATION}/release"): runner_or_control(RUNNER_OF_ASSIGNMENT),
        ("POST", f"{GENERATION}/fail"): runner_or_control(RUNNER_OF_ASSIGNMENT),
        ("POST", f"{GENERATION}/advance"): CONTROL,
        ("POST", f"{GENERATION}/reconcile-claim"): CONTROL,
        ("POST", f"{GENERATION}/reconcile-claim/release"): CONTROL,
        ("POST", f"{GENERATION}/reconcile"): CONTROL,
        ("GET", f"{SANDBOX}/explain"): READ,
        ("GET", f"{SANDBOX}/timeline"): READ,
        # the log as a Merkle tree (audit routes: auditor, control-plane, admin)
        ("GET", "/v1/audit/checkpoint"): READ,
        ("GET", "/v1/audit/proofs/inclusion"): READ,
        ("GET", "/v1/audit/proofs/consistency"): READ,
        # lists and the event feed (infrastructure/http/lists.py, events.py)
        ("GET", "/v1/sandboxes"): READ,
        ("GET", "/v1/assignments"): READ,
        ("GET", "/v1/events"): READ,
        ("GET", "/v1/events/stream"): READ,
        # access tokens
        ("GET", "/v1/tokens"): OPERATE,
        ("POST", "/v1/tokens"): OPERATE,
        ("DELETE", "/v1/tokens/{token_id}"): OPERATE,
    }
)

# FastAPI's own routes, outside the OpenAPI document.
DOCUMENT_ACCESS: Mapping[tuple[str, str], Access] = MappingProxyType(
    {
        ("GET", "/openapi.json"): ANY_ROLE,
        ("GET", "/docs"): ANY_ROLE,
        ("GET", "/docs/oauth2-redirect"): ANY_ROLE,
        ("GET", "/redoc"): ANY_ROLE,
    }
)


def access_of(method: str, template: str) -> Access | None:
    """Who may call the route (None: it is in no table, so no token may)."""
    if method == "HEAD":
        method = "GET"
    key = (method, template)
    return ROUTE_ACCESS.get(key) or DOCUMENT_ACCESS.get(key)


def public_paths(*, open_metrics: bool = False) -> frozenset[str]:
    """The paths that need no token, ever (the open routes: templates without
    parameters), and ``/metrics`` when left open."""
    found = {template for (_, template), access in ROUTE_ACCESS.items() if access.public}
    assert not any("{" in template for template in found)
    if open_metrics:
        found.add(METRICS)
    return frozenset(found)

"""The deployment files of deploy/ (docs/deploy.md) agree with the code they run.

No Docker engine runs here, so what can be checked without one is: every metric the
Grafana dashboard queries exists in the ``/metrics`` of a real ``serve`` (with the labels
it groups by); the commands of the compose file and the Dockerfile are ones the command
line accepts (parsed by the command line itself, options and values checked, nothing
run); every setting they pass is one the scheduler reads; Prometheus scrapes the port
each replica serves, at the route of the metrics; Grafana's data source is the one the
dashboard names, mounted where its provisioning looks.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
import typer.main
import yaml
from eventsourcing.application import Application
from eventsourcing.postgres import BasePostgresFactory

from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.cli import cli
from tests.http_helpers import heartbeat_body, runner_body, sandbox_body, schedule_body

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DASHBOARD = json.loads((DEPLOY / "grafana" / "dashboards" / "secondbox-scheduler.json").read_text())
COMPOSE = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
PROMETHEUS = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
SCHEDULER_IMAGE = "secondbox-scheduler:local"
METRICS_PATH = "/metrics"
PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "rate", "irate", "increase", "histogram_quantile",
    "by", "without", "on", "ignoring", "and", "or", "unless", "offset",
}  # fmt: skip
PROMETHEUS_LABELS = {"instance", "job"}  # added by the scrape, not by the service


# -- the dashboard against a real /metrics ---------------------------------------------


@pytest.fixture(scope="module")
def scrape(tmp_path_factory: pytest.TempPathFactory) -> str:
    """``/metrics`` of a real ``serve`` after a placement, a refusal and a heartbeat."""

    def clock() -> datetime:  # the served scheduler's clock is the real one
        return datetime.now(UTC)

    url = f"sqlite:///{tmp_path_factory.mktemp('deploy') / 'metrics.db'}"
    server = subprocess.Popen(
        [sys.executable, "-m", "secondbox_scheduler", "serve", "--port", "0", "--json",
         "--database-url", url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        base = json.loads(server.stdout.readline())["url"]
        with httpx.Client(base_url=base, timeout=60) as client:
            assert client.post("/v1/runners", json=runner_body("r1")).status_code == 201
            client.post("/v1/runners/r1/heartbeat", json=heartbeat_body(clock()))
            assert client.post("/v1/sandboxes", json=sandbox_body("s1")).status_code == 201
            refused = sandbox_body("s2", requirements={**sandbox_body("s2")["requirements"],
                                                       "architecture": "riscv64"})  # fmt: skip
            assert client.post("/v1/sandboxes", json=refused).status_code == 409
            placed = client.post("/v1/sandboxes/s1/schedule", json=schedule_body("s1", clock()))
            assert placed.status_code == 201, placed.text
            return client.get(METRICS_PATH).text
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=60)


def exposition(text: str) -> dict[str, set[str]]:
    """Every metric name of a scrape (samples, and the families without samples yet),
    with the label names its samples carry."""
    found: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name = line.split()[2]
            found.setdefault(name, set())
            for suffix in ("_total", "_bucket", "_count", "_sum"):
                found.setdefault(name + suffix, set())
        elif line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            name = name.split()[0]
            labels = set(re.findall(r'(\w+)="', rest.split("}")[0])) if rest else set()
            found.setdefault(name, set()).update(labels)
    return found


def queried(expr: str) -> tuple[set[str], set[str]]:
    """The metric names and the grouping labels of a PromQL expression."""
    groups = set()
    for labels in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        groups |= {label.strip() for label in labels.split(",") if label.strip()}
    bare = re.sub(r'"[^"]*"', "", expr)
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", bare)
    bare = re.sub(r"\b(?:by|without)\s*\([^)]*\)", "", bare)
    names = set(re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b", bare)) - PROMQL_WORDS
    return names, groups


def expressions() -> Iterator[tuple[str, str]]:
    for panel in DASHBOARD["panels"]:
        for target in panel["targets"]:
            yield panel["title"], target["expr"]


def test_every_metric_the_dashboard_queries_is_served(scrape: str) -> None:
    served = exposition(scrape)
    seen = set()
    for title, expr in expressions():
        names, groups = queried(expr)
        assert names, (title, expr)
        for name in names:
            assert name in served, f"panel {title!r} queries {name}, not in /metrics"
            seen.add(name)
            labels = served[name]
            if labels:  # samples seen: the labels the panel groups by must be theirs
                assert groups - PROMETHEUS_LABELS - {"le"} <= labels, (title, name, labels)
    ours = {n for n in served if n.startswith("secondbox_scheduler_") and served[n]}
    assert len(seen) >= 15
    assert {n.removesuffix("_total") for n in seen} & {n.removesuffix("_total") for n in ours}, (
        "the dashboard shows the scheduler's own metrics"
    )


def test_the_dashboard_reads_the_provisioned_data_source() -> None:
    provisioned = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    )
    (source,) = provisioned["datasources"]
    assert source["url"] == "http://prometheus:9090"
    for panel in DASHBOARD["panels"]:
        assert panel["datasource"]["uid"] == source["uid"]
        assert all(t["datasource"]["uid"] == source["uid"] for t in panel["targets"])
    providers = yaml.safe_load(
        (
            DEPLOY / "grafana" / "provisioning" / "dashboards" / "secondbox-scheduler.yaml"
        ).read_text()
    )
    mounts = {v.split(":")[1] for v in COMPOSE["services"]["grafana"]["volumes"]}
    assert providers["providers"][0]["options"]["path"] in mounts
    assert len({p["id"] for p in DASHBOARD["panels"]}) == len(DASHBOARD["panels"])


# -- the commands and settings of compose.yaml and the Dockerfile ----------------------


def parse_command(args: list[str]) -> Any:
    """The command line's own parsing of ``args`` (options, types, ranges), without
    running the command: its context (typer's click)."""
    group: Any = typer.main.get_command(cli)
    root = group.make_context("secondbox-scheduler", list(args))
    protected = getattr(root, "_protected_args", None) or getattr(root, "protected_args", [])
    pending = [*protected, *root.args]
    name, command, rest = group.resolve_command(root, pending)
    assert command is not None, args
    return command.make_context(name, rest, parent=root)


def known_settings() -> set[str]:
    """Every environment setting the scheduler reads: named in its code, an option's
    ``envvar``, or one of eventsourcing's (the application's and PostgreSQL's)."""
    found = set()
    for path in [*(ROOT / "infrastructure").rglob("*.py"), *(ROOT / "projections").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            text = node.value if isinstance(node, ast.Constant) else None
            if isinstance(text, str) and re.fullmatch(r"(SECONDBOX|POSTGRES)_[A-Z_]+", text):
                found.add(text)
    group: Any = typer.main.get_command(cli)

    def walk(command: Any) -> Iterator[Any]:
        yield command
        for sub in getattr(command, "commands", {}).values():
            yield from walk(sub)

    for command in walk(group):
        for param in command.params:
            envvar = getattr(param, "envvar", None)
            if isinstance(envvar, str):
                found.add(envvar)
    for holder in (BasePostgresFactory, Application, SchedulerApplication):
        found |= {v for k, v in vars(holder).items() if k.isupper() and isinstance(v, str)}
    found |= set(SchedulerApplication.env)
    return found


def scheduler_services() -> dict[str, dict[str, Any]]:
    services = COMPOSE["services"]
    found = {
        name: service
        for name, service in services.items()
        if service.get("image") == SCHEDULER_IMAGE or "build" in service
    }
    assert set(found) == {"scheduler", "scheduler-replica"}
    return found


def serve_port(args: list[str]) -> int:
    context = parse_command(args)
    assert context.command.name == "serve"
    return int(context.params["port"])


@pytest.mark.parametrize("service", ["scheduler", "scheduler-replica"])
def test_the_compose_commands_and_settings_are_the_command_lines(service: str) -> None:
    spec = scheduler_services()[service]
    context = parse_command(spec["command"])
    assert context.params["host"] == "0.0.0.0"
    assert context.params["access_log"] is True
    unknown = set(spec["environment"]) - known_settings()
    assert not unknown, f"{service} sets what the scheduler never reads: {sorted(unknown)}"
    url = spec["environment"]["SECONDBOX_DATABASE_URL"]
    assert url.startswith("postgresql://")
    assert "@postgres:5432/" in url
    user, password = url.removeprefix("postgresql://").split("@")[0].split(":")
    database = COMPOSE["services"]["postgres"]["environment"]
    assert (user, password) == (database["POSTGRES_USER"], database["POSTGRES_PASSWORD"])
    assert url.rsplit("/", 1)[1] == database["POSTGRES_DB"]


def test_a_wrong_option_would_be_caught() -> None:
    with pytest.raises(Exception, match="No such option"):
        parse_command(["serve", "--hots", "0.0.0.0"])
    with pytest.raises(typer.BadParameter):
        parse_command(["serve", "--port", "70000"])


def test_prometheus_scrapes_each_replica_where_it_serves_its_metrics(scrape: str) -> None:
    (job,) = PROMETHEUS["scrape_configs"]
    assert job["metrics_path"] == METRICS_PATH  # where the real serve answered the scrape
    assert "# TYPE secondbox_scheduler_placements_total counter" in scrape
    (static,) = job["static_configs"]
    services = scheduler_services()
    targets = {host: int(port) for host, port in (t.split(":") for t in static["targets"])}
    assert set(targets) == set(services)
    for host, port in targets.items():
        assert serve_port(services[host]["command"]) == port


def dockerfile() -> tuple[list[str], dict[str, str], list[str], str]:
    """The Dockerfile's ENTRYPOINT + CMD, its ENV settings, its COPY sources, its text."""
    text = (DEPLOY / "Dockerfile").read_text()
    joined = re.sub(r"\\\n\s*", " ", text)
    instructions = [line.split(None, 1) for line in joined.splitlines() if line and line[0] != "#"]
    command: list[str] = []
    env: dict[str, str] = {}
    sources: list[str] = []
    for keyword, rest in instructions:
        if keyword in ("ENTRYPOINT", "CMD"):
            command += json.loads(rest)
        elif keyword == "ENV":
            env.update(dict(pair.split("=", 1) for pair in rest.split()))
        elif keyword == "COPY" and not rest.startswith("--from"):
            sources += rest.split()[:-1]
    return command, env, sources, joined


def test_the_dockerfile_runs_serve_as_the_command_line_accepts_it() -> None:
    command, env, sources, text = dockerfile()
    assert command[0] == "secondbox-scheduler"
    port = serve_port(command[1:])
    assert f"EXPOSE {port}" in text
    assert f"127.0.0.1:{port}/healthz" in text
    unknown = set(env) - known_settings() - {"PYTHONUNBUFFERED"}
    assert not unknown, sorted(unknown)
    for source in sources:
        assert (ROOT / source).exists(), source
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"])  # fmt: skip
    for wanted in re.findall(r"secondbox-scheduler\[(\w+)\]|\"\.\[(\w+)\]\"", text):
        assert {w for w in wanted if w} <= extras
    ignored = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    for source in sources:
        assert f"!{source.rstrip('/')}" in {line.rstrip("/") for line in ignored}, source


def test_the_settings_check_knows_a_setting_from_a_typo() -> None:
    known = known_settings()
    assert {
        "SECONDBOX_DATABASE_URL",
        "POSTGRES_POOL_SIZE",
        "SECONDBOX_HTTP_MAX_BODY_BYTES",
    } <= known
    assert "SECONDBOX_DATABSE_URL" not in known
    assert os.environ.get("SECONDBOX_DATABSE_URL") is None

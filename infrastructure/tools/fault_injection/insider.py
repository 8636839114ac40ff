"""The insider phase of ``verify --profile adversarial`` (PostgreSQL): what the
request-serving application role can do to the store once it is inside.

After the workers are done and the run's checks have passed, the phase creates an
application role in the run's own database with ``db grant``
(:func:`~secondbox_scheduler.infrastructure.store.roles.grant`: SELECT on every table,
EXECUTE on the save functions only), connects as it and tries, one after another:

- a hidden event: an INSERT into the events table at ``notification_id`` 0;
- a forged snapshot: an INSERT into the snapshots table and into the seals table; a
  snapshot passed to ``<events>_append_with_snapshots`` at no event of the call; and one
  at an event of the call whose state is not the fold of the events (the server seals
  what it is given: only ``audit verify`` can tell, rule ``snapshot``);
- a future heartbeat through ``<events>_append``: a ``RunnerLease.LivenessRenewed`` with
  ``at`` a year ahead, once with an honest event time (``audit verify``: rule ``clock``)
  and once with the event time a year ahead too, followed by an honest write (only a
  check of the times along the log can see it);
- a held lock: ``<events>_lock()``; and a transaction left idle after an append, while
  another application of the same role writes (it must get the typed
  ``SerializationContentionError`` within its write lock timeout, not stall), then
  ended by the server (``idle_in_transaction_session_timeout``);
- a tampered read model row and a tampered tracking position: UPDATE and DELETE on
  every read-model table, cross-checked with ``projections verify``.

And one thing only a role with write access to the tables can do, as the owner: a
forged snapshot row (nothing reserved) with no valid seal, which every load must refuse
(the runner loads as the fold of its events) and ``audit verify`` must report.

Each attempt ends ``refused`` (the database or the application refused it: privilege,
check, a raised exception, a typed error in time), ``reported`` (``audit verify`` or
``projections verify`` names it) or ``missed``; a ``missed`` one is a violation of the
run. :mod:`.insider_writes` holds the forged writes themselves.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
from psycopg import errors
from psycopg.sql import SQL, Identifier, Literal

from secondbox_scheduler.domain.errors import SchedulerError, SerializationContentionError
from secondbox_scheduler.domain.values import Capacity
from secondbox_scheduler.infrastructure.application import SchedulerApplication
from secondbox_scheduler.infrastructure.audit.verify import verify as audit_verify
from secondbox_scheduler.infrastructure.read_model_verify import verify_read_models
from secondbox_scheduler.infrastructure.retrying import TIMEOUT_RETRY_LIMIT
from secondbox_scheduler.infrastructure.store.roles import HISTORY, PREFIX, grant
from secondbox_scheduler.infrastructure.tools.fault_injection.insider_writes import (
    WRITER,
    Forger,
    OwnerForgery,
)

REFUSED, REPORTED, MISSED = "refused", "reported", "missed"
LOCK_TIMEOUT_MS = 300  # the other writer's write lock timeout during the held lock
IDLE_TIMEOUT_SECONDS = 2.0  # the role's idle_in_transaction_session_timeout (db grant)
STATEMENT_SLACK_SECONDS = 5.0  # backoff, reads, a loaded machine
# why a forged future heartbeat with a future event time is missed, if it ever is: the
# times along the log (audit rule time-order) must report it
TIMES_ALONG_THE_LOG_GAP = (
    "missed: audit verify reported no time-order finding at the forged event (an event "
    "time a year ahead, then an honest one)"
)


@dataclass
class Attempt:
    name: str
    outcome: str  # refused, reported or missed
    detail: str = ""
    # ``reported`` attempts: the positions at which audit verify must name it
    positions: tuple[int, ...] = ()

    def to_record(self) -> dict[str, Any]:
        return {"name": self.name, "outcome": self.outcome, "detail": self.detail}


def _role_url(url: str, role: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{quote(role)}:{quote(password)}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def refused_statement(
    connection: psycopg.Connection[Any], name: str, statement: Any, args: Any = None
) -> Attempt:
    """``statement`` as the role must fail in the server (privilege, check, exception)."""
    try:
        with connection.transaction():
            connection.execute(statement, args)
    except (errors.InsufficientPrivilege, errors.CheckViolation, errors.RaiseException) as error:
        return Attempt(name, REFUSED, f"{type(error).__name__}: {str(error).splitlines()[0]}")
    except psycopg.Error as error:  # refused, but not by a rule of the store
        return Attempt(name, MISSED, f"failed with {type(error).__name__}: {error}")
    return Attempt(name, MISSED, "the server accepted it")


class InsiderPhase:
    """The attempts, as the application role of the run's database ``url``."""

    def __init__(self, url: str, runner_ids: list[str]) -> None:
        self.url = url
        self.runner_ids = runner_ids
        self.owner_app = SchedulerApplication(
            env={"SECONDBOX_DATABASE_URL": url, "SECONDBOX_READ_MODELS": "external"}
        )
        self.role = f"secondbox_insider_{secrets.token_hex(4)}"
        self.password = secrets.token_hex(16)
        self.role_url = _role_url(url, self.role, self.password)
        self.attempts: list[Attempt] = []

    # -- the role ---------------------------------------------------------------------------

    def _admin(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url, autocommit=True)

    def create_role(self) -> None:
        with self._admin() as admin:
            admin.execute(
                SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                    Identifier(self.role), Literal(self.password)
                )
            )
            owner = str(admin.execute("SELECT current_user").fetchone()[0])  # type: ignore[index]
            grant(
                admin, "public", owner, self.role,
                idle_in_transaction_timeout=IDLE_TIMEOUT_SECONDS,
            )  # fmt: skip

    def drop_role(self) -> None:
        with self._admin() as admin:
            admin.execute(SQL("DROP OWNED BY {}").format(Identifier(self.role)))
            admin.execute(SQL("DROP ROLE IF EXISTS {}").format(Identifier(self.role)))

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.role_url, autocommit=True)

    # -- the attempts -------------------------------------------------------------------

    def run(self) -> list[Attempt]:
        self.create_role()
        try:
            with self.connect() as conn:
                forger = Forger(self.owner_app, conn, self.runner_ids)
                self.table_writes(conn, forger)
                self.snapshot_through_functions(forger)
                self.future_heartbeats(forger)
                self.held_lock(conn, forger)
            self.owner_forged_snapshot()
            self.judge()
        finally:
            try:
                self.drop_role()
            finally:
                self.owner_app.close()
        return self.attempts

    def table_writes(self, conn: psycopg.Connection[Any], forger: Forger) -> None:
        events = Identifier(PREFIX + "events")
        hidden = forger.stored_heartbeat(forger.runner_ids[0], timedelta(0))
        self.attempts.append(refused_statement(
            conn, "hidden event (INSERT at notification_id 0)",
            SQL("INSERT INTO {} (notification_id, originator_id, originator_version, topic, "
                "state) VALUES (0, %s, %s, %s, %s)").format(events),
            (hidden.originator_id, hidden.originator_version, hidden.topic, hidden.state),
        ))  # fmt: skip
        snapshot = forger.forged_runner_snapshot(forger.runner_ids[0])
        self.attempts.append(refused_statement(
            conn, "forged snapshot (INSERT into the snapshots table)",
            SQL("INSERT INTO {} (originator_id, originator_version, topic, state) "
                "VALUES (%s, %s, %s, %s)").format(Identifier(PREFIX + "snapshots")),
            (snapshot.originator_id, snapshot.originator_version, snapshot.topic, snapshot.state),
        ))  # fmt: skip
        self.attempts.append(refused_statement(
            conn, "forged snapshot (INSERT into the seals table)",
            SQL("INSERT INTO {} (originator_id, originator_version, seal) "
                "VALUES (%s, %s, %s)").format(Identifier(PREFIX + "snapshots_seal")),
            (snapshot.originator_id, snapshot.originator_version, b"\0" * 32),
        ))  # fmt: skip
        self.attempts.append(refused_statement(
            conn, "held lock (<events>_lock())",
            SQL("SELECT {}()").format(Identifier(PREFIX + "events_lock")),
        ))  # fmt: skip
        read_models = [
            str(row[0]) for row in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1"
            ).fetchall()
            if row[0] not in {PREFIX + suffix for suffix in HISTORY}
        ]  # fmt: skip
        for table in read_models:
            kind = "tracking position" if "tracking" in table else "read model row"
            column = str(conn.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_schema = "
                "'public' AND table_name = %s ORDER BY ordinal_position LIMIT 1", (table,),
            ).fetchone()[0])  # type: ignore[index]  # fmt: skip
            t, c = Identifier(table), Identifier(column)
            self.attempts.append(refused_statement(
                conn, f"tampered {kind} (UPDATE {table})",
                SQL("UPDATE {} SET {} = {}").format(t, c, c),
            ))  # fmt: skip
            self.attempts.append(
                refused_statement(
                    conn, f"tampered {kind} (DELETE FROM {table})", SQL("DELETE FROM {}").format(t)
                )
            )
        self._read_models_verified()

    def _read_models_verified(self) -> None:
        """A tampering the server let through must be named by ``projections verify``."""
        tampered = [a for a in self.attempts if "tampered" in a.name and a.outcome != REFUSED]
        if not tampered:
            return
        read_models = self.owner_app.read_models
        assert read_models is not None
        report = verify_read_models(self.owner_app, read_models)
        for attempt in tampered:
            if not report.equal:
                attempt.outcome = REPORTED
                attempt.detail += f"; projections verify: {len(report.differences)} differences"

    def snapshot_through_functions(self, forger: Forger) -> None:
        runner_id = forger.runner_ids[1 % len(forger.runner_ids)]
        name = "forged snapshot (append function, at no event of the call)"
        try:
            forger.append_drain_round_trip(runner_id, snapshot_at_event=False)
        except (errors.RaiseException, errors.InsufficientPrivilege) as error:
            self.attempts.append(Attempt(name, REFUSED, str(error).splitlines()[0]))
        else:
            self.attempts.append(Attempt(name, MISSED, "the server stored it"))
        name = "forged snapshot (append function, at an event of the call, false state)"
        positions = forger.append_drain_round_trip(runner_id, snapshot_at_event=True)
        self.attempts.append(Attempt(name, REPORTED, "", (max(positions),)))

    def future_heartbeats(self, forger: Forger) -> None:
        year = timedelta(days=365)
        naive = forger.append_heartbeat(forger.runner_ids[0], year, event_time_ahead=False)
        self.attempts.append(Attempt(
            "future heartbeat (append function, at a year ahead)", REPORTED, "", (naive,)
        ))  # fmt: skip
        runner_id = forger.runner_ids[1 % len(forger.runner_ids)]
        forged = forger.append_heartbeat(runner_id, year, event_time_ahead=True)
        honest = forger.append_heartbeat(forger.runner_ids[-1], timedelta(0), False)
        self.attempts.append(Attempt(
            "future heartbeat (append function, at and event time a year ahead)", REPORTED,
            "", tuple(range(forged, honest + 1)),
        ))  # fmt: skip

    def held_lock(self, conn: psycopg.Connection[Any], forger: Forger) -> None:
        env = {
            "SECONDBOX_DATABASE_URL": self.role_url,
            "SECONDBOX_READ_MODELS": "external",
            "SECONDBOX_WRITE_LOCK_TIMEOUT_MS": str(LOCK_TIMEOUT_MS),
            "CREATE_TABLE": "n",
        }
        writer = SchedulerApplication(env=env)
        runner_id = WRITER
        self.owner_app.register_runner(
            runner_id=WRITER, pool_name="insider", backend_kind="firecracker",
            architecture="x86_64", capabilities=["compute"], allocatable=Capacity(instances=1),
            guest_protocol_minimum=1, guest_protocol_maximum=1,
        )  # fmt: skip
        bound = (TIMEOUT_RETRY_LIMIT + 1) * LOCK_TIMEOUT_MS / 1000 + STATEMENT_SLACK_SECONDS
        name = "held lock (a transaction left idle after an append)"
        try:
            with psycopg.connect(self.role_url) as hold:  # not autocommit: the lock stays
                forger.append_heartbeat(runner_id, timedelta(0), False, connection=hold)
                started = time.monotonic()
                answer: list[BaseException | None] = []
                thread = threading.Thread(target=lambda: answer.append(_drain(writer, runner_id)))
                thread.start()
                thread.join(bound)
                seconds = time.monotonic() - started
                if thread.is_alive():
                    self.attempts.append(Attempt(name, MISSED, f"the writer stalled {bound:g}s"))
                    hold.rollback()
                    thread.join()
                elif isinstance(answer[0], SerializationContentionError):
                    self.attempts.append(Attempt(
                        name, REFUSED, f"the other writer got SerializationContentionError "
                        f"after {seconds:.1f}s (bound {bound:g}s)",
                    ))  # fmt: skip
                else:
                    self.attempts.append(
                        Attempt(name, MISSED, f"the other writer got {answer[0]!r}")
                    )
                time.sleep(IDLE_TIMEOUT_SECONDS + 1.0)
                ended = "idle transaction ended by the server"
                try:
                    hold.execute("SELECT 1")
                    self.attempts.append(Attempt(ended, MISSED, "still open"))
                except psycopg.Error as error:
                    self.attempts.append(Attempt(ended, REFUSED, type(error).__name__))
        finally:
            writer.close()
        if _drain(self.owner_app, runner_id) is not None:  # the lock is free again
            self.attempts.append(Attempt("a write after the hold", MISSED, "still refused"))

    def owner_forged_snapshot(self) -> None:
        forgery = OwnerForgery(self.url, self.owner_app, self.runner_ids)
        name = "forged snapshot row with no valid seal (owner's write access)"
        position, loaded_honestly, runner_id = forgery.plant()
        if not loaded_honestly:
            self.attempts.append(Attempt(
                name, MISSED, f"a fresh application loaded {runner_id}'s forged state (nothing "
                "reserved): the seal was not checked on load", (position,),
            ))  # fmt: skip
            return
        self.attempts.append(Attempt(
            name, REPORTED, f"on {runner_id}: refused on load", (position,)
        ))  # fmt: skip

    # -- audit verify names each reported one -------------------------------------------------

    def judge(self) -> None:
        report = audit_verify(self.owner_app, measure_raw=False)
        claimed: set[int] = set()
        for attempt in self.attempts:
            if attempt.outcome != REPORTED or not attempt.positions:
                continue
            found = [v for v in report.violations if v.position in attempt.positions]
            claimed.update(attempt.positions)
            if found:
                attempt.detail = "; ".join(
                    [*([attempt.detail] if attempt.detail else []),
                     *(f"audit verify: {v.rule} at {v.position}" for v in found)]
                )  # fmt: skip
            else:
                attempt.outcome = MISSED
                attempt.detail = (
                    TIMES_ALONG_THE_LOG_GAP
                    if "event time a year ahead" in attempt.name
                    else f"audit verify named nothing at positions {list(attempt.positions)}"
                )
        for violation in report.violations:
            if violation.position not in claimed:
                self.attempts.append(Attempt(
                    f"unexpected audit finding at {violation.position}", MISSED, str(violation)
                ))  # fmt: skip


def _drain(app: SchedulerApplication, runner_id: str) -> BaseException | None:
    """A write on ``runner_id`` (a drain started and cancelled): None, or what it raised."""
    try:
        app.start_drain(runner_id)
        app.cancel_drain(runner_id)
    except SchedulerError as error:
        return error
    return None


def insider_phase(url: str, runner_ids: list[str]) -> list[Attempt]:
    return InsiderPhase(url, runner_ids).run()

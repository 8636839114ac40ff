"""What the PostgreSQL recorders that save through a function of :mod:`.server_append`
share (:class:`SavesInServer`): the chained recorder (:mod:`.chained_postgres`) and the
sealed snapshots (:mod:`.sealed_postgres`)."""

from __future__ import annotations

from eventsourcing.persistence import ProgrammingError
from eventsourcing.postgres import PostgresDatastore
from psycopg.errors import InsufficientPrivilege, UndefinedFunction

from secondbox_scheduler.domain.audit.chain import Chain
from secondbox_scheduler.infrastructure.store.server_append import (
    usable_in_server,
    writes_tables_itself,
)


class SavesInServer:
    """What the two recorders that save through a function of :mod:`.server_append`
    share: whether they may (looked up once) and what a failed call of it means."""

    chain: Chain
    datastore: PostgresDatastore
    events_table_name: str
    append_signature: str
    _appends_in_server: bool | None
    links_keyed_in_server = False  # whether a keyed chain saves through functions too
    keyed_signatures: tuple[str, ...] = ()  # the functions of a keyed chain's save

    def appends_in_server(self) -> bool:
        """Whether a save goes through the function of ``append_signature`` (an
        unkeyed chain) or those of ``keyed_signatures`` (a keyed chain, whose key never
        goes to the server: :mod:`.keyed_append`): UUID ids, a UTF8 database and the
        functions present and this role's to run (:func:`usable_in_server`). Looked up
        once; a save that finds them gone or forbidden saves without them from then on
        (which needs INSERT on the tables: the schema owner's role)."""
        if self._appends_in_server is None:
            keyed = self.chain.keyed
            signatures = self.keyed_signatures if keyed else (self.append_signature,)
            usable = (
                (not keyed or self.links_keyed_in_server)
                and self.datastore.originator_id_type == "uuid"
                and all(usable_in_server(self.datastore, s) for s in signatures)
            )
            if usable or writes_tables_itself(self.datastore, self.events_table_name):
                self._appends_in_server = usable
            else:  # this role's saves fail either way: looked up again at the next save
                return False
        return self._appends_in_server

    def gone_from_server(self, error: ProgrammingError) -> bool:
        """After a call of the function failed (nothing was stored): whether the
        function is gone or no longer this role's (then the client links or seals, for
        this save and the next), rather than an error of the save itself. Found by
        review: a table the role may not write fails with the same
        ``InsufficientPrivilege``, and the server's saves stayed off after the grant was
        mended; so the function is looked up again."""
        if not isinstance(error.__cause__, UndefinedFunction | InsufficientPrivilege):
            return False
        self._appends_in_server = None
        if self.appends_in_server():
            return False
        # a role that may not write the tables itself (the request-serving role) fails
        # here: its saves go through the functions again once they are its to run
        return self._appends_in_server is not None

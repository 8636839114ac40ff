"""A replication link that the failover run can partition: a TCP relay in front of a
PostgreSQL node, the address its standbys stream from.

Each node of ``verify --profile failover`` is reached by its standbys (and by Patroni's
``pg_rewind`` and ``pg_basebackup``) through a :class:`Link` on a port of its own, while
the clients reach the node directly (the cell's multi-host URL). Before the leader is
lost, the run partitions its link for a few seconds (:meth:`Link.partition`: nothing more
crosses it, what was sent waits in the kernel's buffers) and, at the kill, cuts it
(:meth:`Link.cut`: every relayed connection is closed, what waited is dropped, as the
packets of a dead host are). So the standby lags the leader by those seconds when the
leader dies, as a standby over a slow or congested network does: with asynchronous
replication the commits of those seconds were acknowledged and are lost; with
synchronous replication none of them was acknowledged (each waited for the standby).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading

from secondbox_scheduler.infrastructure.tools.fault_injection.clusters import free_port

CHUNK = 1 << 16
PAUSE_SECONDS = 0.02  # how often a partitioned relay looks whether it flows again


class Link:
    """Relays every connection to ``127.0.0.1:port`` from ``127.0.0.1:self.port``."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._server.settimeout(0.2)
        threading.Thread(target=self._accept, daemon=True, name=f"link-{self.port}").start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            with self._lock:
                self._pairs.append((client, upstream))
            threading.Thread(target=self._relay, args=(client, upstream), daemon=True).start()

    def _relay(self, client: socket.socket, upstream: socket.socket) -> None:
        peer = {client: upstream, upstream: client}
        with selectors.DefaultSelector() as selector:
            for end in peer:
                selector.register(end, selectors.EVENT_READ)
            try:
                while not self._closed.is_set() and min(client.fileno(), upstream.fileno()) >= 0:
                    if not self._flowing.wait(PAUSE_SECONDS):
                        continue  # partitioned: read nothing, send nothing
                    for key, _ in selector.select(timeout=0.2):
                        source = key.fileobj
                        assert isinstance(source, socket.socket)
                        data = source.recv(CHUNK)
                        if not data:
                            return
                        peer[source].sendall(data)
            except (OSError, ValueError):
                return
            finally:
                self._drop(client, upstream)

    def _drop(self, client: socket.socket, upstream: socket.socket) -> None:
        with self._lock:
            if (client, upstream) in self._pairs:
                self._pairs.remove((client, upstream))
        for end in (client, upstream):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()

    def partition(self) -> None:
        """Nothing crosses the link until :meth:`cut` (or :meth:`heal`)."""
        self._flowing.clear()

    def heal(self) -> None:
        self._flowing.set()

    def cut(self) -> None:
        """Close every relayed connection (what waited in them is lost) and let new ones
        flow: the far end of each finds its peer gone."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for client, upstream in pairs:
            for end in (client, upstream):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    end.close()
        self._flowing.set()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._server.close()
        self.cut()

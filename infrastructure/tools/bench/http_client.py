"""A minimal HTTP/1.1 keep-alive client on asyncio streams, for the bench's ``http``
section: many concurrent connections per client process at little CPU each.

A general client (httpx) costs the client process about as much CPU per request as the
service spends answering it, and on a machine of 2 cores the clients then measure
themselves. This one writes a request's bytes and reads the status line, the headers
and a ``Content-Length`` (or chunked) body, nothing more: enough for the scheduler's own
answers, which it checks (a malformed answer is a :class:`HttpClientError`, never a
guess). A connection the server closes (``Connection: close``, or an answer cut short)
is opened again for the next request.
"""

from __future__ import annotations

import asyncio
import contextlib


class HttpClientError(Exception):
    """An answer the client cannot read as HTTP/1.1."""


class KeepAliveConnection:
    """One keep-alive connection to ``host:port``; one request at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self.opened = 0  # connections opened (1 for a connection kept alive throughout)

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._reader is None or self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
            self.opened += 1
        return self._reader, self._writer

    async def post(self, path: str, body: bytes, headers: bytes = b"") -> tuple[int, bytes]:
        """POST ``body`` (JSON) to ``path``: the answer's status and body. ``headers``:
        more header lines, each ending in CRLF."""
        return await self.request(b"POST", path, body, headers)

    async def request(
        self, method: bytes, path: str, body: bytes = b"", headers: bytes = b""
    ) -> tuple[int, bytes]:
        reader, writer = await self._open()
        head = (
            method + b" " + path.encode("ascii") + b" HTTP/1.1\r\nHost: "
            + self.host.encode("ascii") + b"\r\nContent-Type: application/json\r\n"
            + b"Content-Length: " + str(len(body)).encode("ascii") + b"\r\n" + headers + b"\r\n"
        )  # fmt: skip
        writer.write(head + body)
        try:
            status, answer, close = await _read_response(reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            await self.close()
            raise
        if close:
            await self.close()
        return status, answer

    async def close(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """(status, body, whether the server closes the connection)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head[:-4].split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise HttpClientError(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
    status = int(parts[1])
    length: int | None = None
    chunked = close = False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        value = value.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value
        elif name == b"connection":
            close = value == b"close"
    if chunked:
        return status, await _read_chunked(reader), close
    if length is None:
        raise HttpClientError("an answer with neither Content-Length nor chunks")
    return status, await reader.readexactly(length), close


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip(), 16)
        if size == 0:
            await reader.readuntil(b"\r\n")  # no trailers from this service
            return bytes(body)
        body += await reader.readexactly(size)
        await reader.readexactly(2)

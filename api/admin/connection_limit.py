"""A listening site that holds at most `max_connections` open client connections.

aiohttp accepts every connection it is offered; each holds a socket, a parser and buffers, so
thousands of idle or stalled clients (or one client opening sockets in a loop) exhaust file
descriptors and memory. Past the limit a new connection is answered `503` with
`Connection: close` and closed at once, before any of its bytes are parsed: the sidecar's
existing clients keep their service, the new one knows to retry.
"""
from __future__ import annotations

import asyncio
import socket
from typing import Callable, cast

from aiohttp import web

from kvstore.api.admin.context import FAST_PATH
from kvstore.api.server.connection import Connection
from kvstore.api.server.fast_path import FastPath

_BODY = b'{"error": {"code": "too_many_connections", "message": "server connection limit reached; retry"}}'
REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
           b"Retry-After: 1\r\nContent-Length: %d\r\n\r\n%s" % (len(_BODY), _BODY))


class _Refuse(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not asserted to be an asyncio.Transport: other loops' transports (uvloop's) are not its subclasses.
        cast(asyncio.Transport, transport).write(REFUSAL)
        transport.close()


class _Counted(asyncio.Protocol):
    """A counted connection: every read goes to the data plane (api/server/connection.py `Connection`),
    which hands admin requests to aiohttp's protocol for the connection (`inner`); tells the site
    when the connection is gone.

    Counted here, not from `web.Server.connections`: a burst of connections is accepted (and
    the factory called for each) before any handler's `connection_made` has run."""

    def __init__(self, inner: asyncio.Protocol, site: "ConnectionLimitedSite", fast: FastPath):
        self._inner = inner
        self._site = site
        self._fast = fast
        self._connection: Connection | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._connection = self._fast.connection(transport, self._inner)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._connection.data_received(data)  # type: ignore[union-attr]  # asyncio calls connection_made first

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._site.live -= 1
        if self._connection is not None:
            self._fast.drop(self._connection.transport)
        self._inner.connection_lost(exc)


class ConnectionLimitedSite(web.SockSite):
    """`web.SockSite` whose protocol factory refuses connections past `max_connections`."""

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, *, max_connections: int, backlog: int = 1024):
        super().__init__(runner, sock, backlog=backlog)
        self._max_connections = max_connections
        self.live = 0
        self.refused = 0

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with the runner (SockSite.start would also listen)
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self._factory(server), sock=self._sock, backlog=self._backlog)

    def _factory(self, server: web.Server) -> Callable[[], asyncio.BaseProtocol]:
        assert isinstance(self._runner, web.AppRunner)
        fast = self._runner.app[FAST_PATH]

        def make() -> asyncio.BaseProtocol:
            if self.live >= self._max_connections:
                self.refused += 1
                return _Refuse()
            self.live += 1
            return _Counted(server(), self, fast)
        return make

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

from kvstore.api.fast_path import FAST_PATH, FastPath, Lane

_BODY = b'{"error": {"code": "too_many_connections", "message": "server connection limit reached; retry"}}'
REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
           b"Retry-After: 1\r\nContent-Length: %d\r\n\r\n%s" % (len(_BODY), _BODY))


class _Refuse(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not asserted to be an asyncio.Transport: other loops' transports (uvloop's) are not its subclasses.
        cast(asyncio.Transport, transport).write(REFUSAL)
        transport.close()


class _Counted(asyncio.Protocol):
    """Delegates to aiohttp's handler, after offering each read to the app's fast path (if it
    has one); tells the site when the connection is gone.

    Counted here, not from `web.Server.connections`: a burst of connections is accepted (and
    the factory called for each) before any handler's `connection_made` has run."""

    def __init__(self, inner: asyncio.Protocol, site: "ConnectionLimitedSite", fast: FastPath | None):
        self._inner = inner
        self._site = site
        self._fast = fast
        self._lane: Lane | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._fast is not None:
            self._lane = self._fast.lane(transport, self._inner)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        lane = self._lane
        if lane is not None:  # the data routes' fast path (api/fast_path.py), else aiohttp's
            lane.received(data)
        else:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._site.live -= 1
        if self._lane is not None:
            self._fast.drop(self._lane.transport)  # type: ignore[union-attr]
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
        fast = self._runner.app.get(FAST_PATH) if isinstance(self._runner, web.AppRunner) else None

        def make() -> asyncio.BaseProtocol:
            if self.live >= self._max_connections:
                self.refused += 1
                return _Refuse()
            self.live += 1
            return _Counted(server(), self, fast)
        return make

"""The data plane: the HTTP/1.1 server that reads every request of every connection and answers
every data route itself (handlers.py `DATA_ROUTES`: lookup, fetch, store, chunks/store, blend,
shm), before and without aiohttp's request machinery. Here: the app's `FastPath` (its
connections and caches); a connection's reading half is connection.py (steps 1-3 below), its
answering half answering.py (steps 4-5).

Why: once KV moves through shared memory, much of a small request's time was aiohttp's: request
and response objects, the middleware chain, the handler task and the loop iterations between
them (docs/performance.md has the measurements). And one reader per connection is what keeps a
request on one path: nothing here hands a data request to aiohttp, nor the other way round.

A request, from the socket (`Connection.data_received`) to its answer:
1. Its head is read whole (`_next`; a head split across reads waits in `pending`) and parsed
   once per distinct head bytes (request_head.py; what cannot be framed is answered 400 and the
   connection closed).
2. A data route's checks run in aiohttp's order, before its body is read: the method (405),
   Expect (100 Continue is sent, anything else 417), the bearer token (401), the Content-Type
   (415), Content-Encoding (400), the announced size (413, and the connection closed). A request
   refused there is answered at once and its body skipped.
3. Its body is gathered, from as many reads as it takes, into one buffer (request_body.py; chunked
   bodies too, bounded by max_body_bytes), within body_timeout_s of its head (408, and
   the connection closed).
4. The body is decoded (msgpack, or JSON) and the route's handler runs on the loop: it answers,
   or returns a `Later`, which runs on the app's pool and is answered from its completion.
   Failures are answered as aiohttp's error middleware answers the admin routes'
   (failures.py `error_of`), in msgpack or JSON as the request asked.
5. The answer is written (head and kv in one vectored write where the loop has one), counted in
   the metrics, and the eviction policy catches up behind it (catch_up.py).
A plain request, whole in one read (the clients' way), skips the machinery of 1-3: its head
was seen before and passed every check (`FastPath.plain`).

Admin routes (anything that is not a data route: models, stats, metrics, openapi, healthz,
404/405) are handed whole to the connection's aiohttp protocol, head and body as they arrive,
one request at a time: the next request of the connection waits until aiohttp has written the
answer (`answered_by_aiohttp`, called by the `count_answers` middleware). So a connection's
answers leave in request order, however its requests are pipelined, and while a `Later` runs
what arrives is held (reading paused past HELD_BYTES).

Keep-alive is this server's: a connection with no request under way for keepalive_timeout_s is
closed (aiohttp, which sees only the admin requests, is told never to time one out). On shutdown
(`drain`) requests under way are finished and then each connection is closed.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from kvstore.api.server.answering import Answering, Answers
from kvstore.api.server.auth import PROTECTED_PREFIX, bearer_tenant
from kvstore.api.server.connection import Connection, Plain
from kvstore.api.server.request_head import RequestHead, parse_head
from kvstore.api.server.state import SidecarState

HEAD_CACHE_ENTRIES = 256  # distinct heads kept (emptied when full): clients' heads differ by Content-Length


class FastPath:
    """The app's data plane: its connections, the heads it has parsed, and its answers' encoding
    and per-route metrics (`answers`)."""

    def __init__(self, state: SidecarState, keepalive_timeout_s: float = 75.0):
        self.state = state
        self.config = state.config
        self.keepalive_timeout_s = keepalive_timeout_s
        self.connections: dict[Any, Connection] = {}  # by transport, from connection_made to connection_lost
        self.under_way: set[Answering] = set()  # connections with a data request past its first read
        self.closing = False  # shutting down: no new request is started
        self.plain: dict[bytes, Plain] = {}  # plain data heads by their bytes (without the empty line)
        self._heads: dict[bytes, RequestHead] = {}  # every head parsed, by its bytes
        self.answers = Answers(state.metrics)

    # ---- connections ----------------------------------------------------------------------

    def connection(self, transport: Any, inner: asyncio.Protocol) -> "Connection":
        connection = self.connections[transport] = Connection(self, transport, inner)
        return connection

    def drop(self, transport: Any) -> None:
        connection = self.connections.pop(transport, None)
        if connection is not None:
            connection.lost()
            self.under_way.discard(connection)

    def answered_by_aiohttp(self, transport: Any) -> None:
        """aiohttp has written its answer to an admin request of this connection."""
        connection = self.connections.get(transport)
        if connection is not None:
            connection.aiohttp_answered()

    async def drain(self, timeout_s: float) -> None:
        """Start no new request, and wait (up to `timeout_s`) for the data requests under way to
        be answered; each connection closes once its answer is out (aiohttp then closes the
        idle ones)."""
        self.closing = True
        deadline = time.monotonic() + timeout_s
        while self.under_way and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    def head(self, head: bytes) -> RequestHead:
        parsed = self._heads.get(head)
        if parsed is None:
            parsed = parse_head(head)  # BadRequest: not cached, refused each time
            if len(self._heads) >= HEAD_CACHE_ENTRIES:
                self._heads.clear()
            self._heads[head] = parsed
        return parsed

    def remember(self, head: bytes, plain: Plain) -> None:
        if len(self.plain) >= HEAD_CACHE_ENTRIES:
            self.plain.clear()
        self.plain[head] = plain

    def tenant(self, head: RequestHead) -> str | None:
        """The bearer token's tenant; Unauthorized (401) for a missing or unknown one."""
        table = self.state.auth
        if not table or not head.path.startswith(PROTECTED_PREFIX):
            return None
        return bearer_tenant(table, head.authorization)

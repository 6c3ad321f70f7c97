"""The data routes answered as their bytes arrive, before aiohttp's request machinery.

Why: once KV moves through shared memory, much of a small request's time is aiohttp's: request
and response objects, the middleware chain, the handler task and the loop iterations between
them (docs/performance.md has the measurements).

What is answered here, all of it or nothing:
- a received chunk that is exactly one complete HTTP/1.1 request, head and Content-Length body
  (within max_body_bytes) with nothing after it, for POST /v1/lookup, /v1/fetch, /v1/store or
  /v1/chunks/store;
- msgpack both ways: no JSON Content-Type or Accept; no Transfer-Encoding, Content-Encoding,
  Expect, Upgrade or `Connection: close`;
- whose work needs no I/O and finds the store free, decided and done by the handlers' own
  functions (api/handlers.py `*_inline`), so an answer here carries what the handler's would;
- with a known bearer token when the sidecar has an auth file.
Everything else goes to aiohttp unchanged, and so does a request whose processing raises (a bad
field, an unknown model, a refused region): aiohttp then answers it, errors included, exactly as
without this path. Doing the work twice is harmless: the routes are idempotent (storing the same
pages again changes nothing), as the clients' retry already assumes.

A fetch that turns out to need I/O (a page on disk) is planned here (matched and pinned) and
its plan goes to aiohttp with the request: the lane keeps it for the request it hands on next,
`count_answers` gives it to that request (handlers.HANDED_PLAN), and the handler runs it on a
pool thread without matching the prompt again. A plan that no handler takes (the request was
answered otherwise, the connection closed) is released.

Invariant: a connection's answers leave in request order. A request is answered here only when
aiohttp holds no part of an earlier one and has answered every request it was handed on the
connection. `Lane` follows the request boundaries of the bytes it hands on (Content-Length
framing; anything it cannot follow turns the lane off for the connection, which is always safe)
and counts aiohttp's answers through the `count_answers` middleware.

Not done here: keep-alive bookkeeping. aiohttp closes a connection it has seen idle for its
keep-alive timeout even if this path served requests meanwhile; the clients open a new one (and
register their shared memory again) when a kept-alive connection turns out closed.
"""
from __future__ import annotations

import asyncio
import email.utils
import re
import sys
import time
from typing import Any, Awaitable, Callable

import msgpack
from aiohttp import web

from kvstore.api import handlers, wire
from kvstore.api.auth import PROTECTED_PREFIX, bearer_tenant
from kvstore.api.catch_up import CATCH_UP
from kvstore.api.context import AUTH, CONFIG
from kvstore.api.event_loop import loop_name
from kvstore.api.framing import SMALL_BODY_BYTES, pack_map_prefix
from kvstore.api.metrics import METRICS
from kvstore.fetch_plan import FetchPlan

Answer = tuple[dict, Any]  # (fields, kv bytes or None)
Answered = tuple[list[Any], bytes, float]  # (the answer's bytes, its route's path, seconds it took)
# A route's outcome: its answer, a fetch plan for aiohttp's handler to run, or None (aiohttp's).
Route = Callable[[web.Application, Any, dict, "str | None"], "Answer | FetchPlan | None"]

_HEAD_END = b"\r\n\r\n"
MAX_HEAD_BYTES = 8190  # aiohttp's default line limit; a whole head past it is never ours
HEAD_CACHE_ENTRIES = 256  # distinct heads kept (emptied when full): clients' heads differ by Content-Length
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9a-z-]+")  # an HTTP header name (RFC 9110 token), lowercased
_REFUSED_HEADERS = frozenset({b"transfer-encoding", b"content-encoding", b"expect", b"upgrade"})
_ANSWER_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: " + wire.MSGPACK.encode()
                + b"\r\nContent-Length: %d\r\nDate: %s\r\n\r\n")  # with its length and date


def _lookup(app: web.Application, transport: Any, body: dict, tenant: str | None) -> Answer | None:
    answer = handlers.lookup_inline(app, wire.lookup_request(body), tenant)
    return None if answer is None else (answer, None)


def _fetch(app: web.Application, transport: Any, body: dict, tenant: str | None) -> Answer | FetchPlan | None:
    req = wire.fetch_request(body)
    return handlers.fetch_inline(app, req, tenant, handlers.shm_region(app, transport, req))


def _storing(parse: Callable[[dict], wire.StoreRequest],
             put_kv: Callable[[wire.StoreRequest, "str | None"], handlers.PutKV]) -> Route:
    """A store route (its body parser, its store method), as `handlers._store` runs it."""
    def route(app: web.Application, transport: Any, body: dict, tenant: str | None) -> Answer | None:
        req = parse(body)
        answer = handlers.store_inline(app, handlers.StoreJob(app, transport, req, put_kv(req, tenant), tenant))
        return None if answer is None else (answer, None)
    return route


ROUTES: dict[bytes, Route] = {b"/v1/lookup": _lookup, b"/v1/fetch": _fetch,
                              b"/v1/store": _storing(wire.store_request, handlers.put_pages),
                              b"/v1/chunks/store": _storing(wire.chunk_store_request, handlers.put_chunk)}


class FastPath:
    """The app's fast path: its lanes (one per connection) and its per-route metrics."""

    def __init__(self, app: web.Application):
        self.app = app
        self.lanes: dict[Any, Lane] = {}  # by transport, from connection_made to connection_lost
        metrics = app[METRICS]
        self._counted = {path: (metrics.requests.labels(path.decode(), "POST", "200"),
                                metrics.latency.labels(path.decode(), "POST")) for path in ROUTES}
        self._date = (0, b"")
        self.catch_up = app[CATCH_UP]
        # Heads this path took, by their bytes (`_take_head`); only taken ones, so a refused
        # token is checked again every time.
        self._heads: dict[bytes, tuple[bytes, Route, int, str | None]] = {}
        self._vectored: bool | None = None  # known once a loop runs (`vectored_writes`)
        # One packer for every answer (msgpack.packb makes one per call): answers are packed on
        # the event loop's thread only. autoreset: pack() returns the bytes and starts over.
        self._packer = msgpack.Packer(use_bin_type=True)

    def vectored_writes(self) -> bool:
        """Whether the loop's `writelines` sends its parts in one vectored write without joining
        them (uvloop, and asyncio from 3.12); else an answer's head and kv go as two writes, and
        the client may wake for the head alone."""
        if self._vectored is None:
            self._vectored = sys.version_info >= (3, 12) or loop_name(asyncio.get_running_loop()) == "uvloop"
        return self._vectored

    def lane(self, transport: Any) -> "Lane":
        lane = self.lanes[transport] = Lane(self, transport)
        return lane

    def drop(self, transport: Any) -> None:
        lane = self.lanes.pop(transport, None)
        if lane is not None and lane.planned is not None:
            handlers.release_plan(self.app, lane.planned[1])

    def answer(self, transport: Any, data: bytes) -> Answered | FetchPlan | None:
        """The bytes answering `data` when it is one request this path takes (module docstring),
        with its path and time for `count`; a fetch plan when it is a fetch that needs a thread;
        else None. With a plan or None, nothing was answered and `data` is aiohttp's."""
        if not data.startswith(b"POST /"):
            return None
        began = time.perf_counter()
        head_end = data.find(_HEAD_END)
        if not 0 < head_end <= MAX_HEAD_BYTES:  # longer heads: aiohttp's own limits apply
            return None
        head = data[:head_end]
        taken = self._heads.get(head)
        if taken is None:
            try:
                taken = self._take_head(head)
            except Exception:  # a bad token (aiohttp answers 401), a bug: aiohttp's
                return None
            if taken is None:
                return None
            if len(self._heads) >= HEAD_CACHE_ENTRIES:
                self._heads.clear()
            self._heads[head] = taken
        path, route, length, tenant = taken
        body_at = head_end + len(_HEAD_END)
        if len(data) - body_at != length:
            return None
        try:
            # A small body is decoded straight from the read (its bins come back as copies); a
            # large one from a writable copy, since its bins are views (a store's kv).
            body = memoryview(data)[body_at:] if length <= SMALL_BODY_BYTES else bytearray(memoryview(data)[body_at:])
            answer = route(self.app, transport, wire.decode_msgpack(body), tenant)
        except Exception:  # aiohttp answers it (the same error, or a logged 500 for a bug)
            return None
        if answer is None or isinstance(answer, FetchPlan):
            return answer
        return self._encode(*answer), path, time.perf_counter() - began

    def count(self, path: bytes, seconds: float) -> None:
        """Count an answer of this path in the route's metrics. `Lane.take` calls it once the
        answer is written, off the answer's way: a client on another core reads it meanwhile (on
        the same core, as one client and the sidecar often are on a 2-core host, it saves nothing)."""
        requests, latency = self._counted[path]
        requests.inc()
        latency.observe(seconds)

    def _take_head(self, head: bytes) -> tuple[bytes, Route, int, "str | None"] | None:
        """(path, route, Content-Length, tenant) of a request head this path takes, else None.
        Depends on nothing but the head's bytes and the app's fixed config and auth table, so
        `answer` keeps it by head: a client's heads repeat byte for byte."""
        lines = head.split(b"\r\n")
        _, _, rest = lines[0].partition(b" ")  # the method is POST (checked by `answer`)
        path, _, version = rest.partition(b" ")
        route = ROUTES.get(path)
        if route is None or version != b"HTTP/1.1":
            return None
        headers = _headers(lines[1:])
        if headers is None or not _plain(headers):
            return None
        length = _content_length(headers)
        if length is None or length > self.app[CONFIG].max_body_bytes:  # aiohttp answers 413
            return None
        content_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower().decode("latin-1")
        if content_type not in wire.MSGPACK_TYPES and content_type not in wire.DEFAULT_TYPES:
            return None
        if wire.answer_in_json(headers.get(b"accept", b"").decode("latin-1"), content_type, "POST"):
            return None
        return path, route, length, self._tenant(path, headers)

    def _tenant(self, path: bytes, headers: dict[bytes, bytes]) -> str | None:
        table = self.app[AUTH]
        if not table or not path.decode().startswith(PROTECTED_PREFIX):
            return None
        return bearer_tenant(table, headers.get(b"authorization", b"").decode("latin-1"))

    def _encode(self, fields: dict, raw: Any) -> list[Any]:
        if raw is None:
            body = self._packer.pack(fields)
            return [self._head(len(body)) + body]
        prefix = pack_map_prefix(fields, "kv", raw.nbytes)
        return [self._head(len(prefix) + raw.nbytes) + prefix, memoryview(raw)]

    def _head(self, content_length: int) -> bytes:
        second = int(time.time())
        if self._date[0] != second:  # formatted once a second, as aiohttp does
            self._date = (second, email.utils.formatdate(second, usegmt=True).encode())
        return _ANSWER_HEAD % (content_length, self._date[1])


class Lane:
    """One connection's view of what aiohttp holds: requests handed on (counted at their head),
    requests answered, and how much of a handed-on body aiohttp has yet to receive.

    Invariant: `idle` is true only when every byte handed on so far formed complete requests and
    aiohttp has answered each of them; `following` turns false for good on anything the
    Content-Length framing below cannot follow."""

    __slots__ = ("fast", "transport", "loop", "handed", "answered", "body_left", "following", "planned")

    def __init__(self, fast: FastPath, transport: Any):
        self.fast = fast
        self.transport = transport
        self.loop: asyncio.AbstractEventLoop | None = None  # the connection's, once it has answered here
        self.handed = 0
        self.answered = 0
        self.body_left = 0
        self.following = True
        # (number of the handed-on request it is for, its fetch plan), until count_answers gives it
        # to that request's handler.
        self.planned: tuple[int, FetchPlan] | None = None

    @property
    def idle(self) -> bool:
        return self.following and not self.body_left and self.handed == self.answered

    def take(self, data: bytes) -> bool:
        """Answer `data` here if this path takes it; False: hand it to aiohttp (and `follow` it)."""
        if not self.idle or self.transport.is_closing():
            return False
        if self.planned is not None:  # idle: the request it was for was answered without it
            handlers.release_plan(self.fast.app, self.planned[1])
            self.planned = None
        answered = self.fast.answer(self.transport, data)
        if isinstance(answered, FetchPlan):
            self.planned = (self.handed + 1, answered)  # `follow` counts this request next
            return False
        if answered is None:
            return False
        answer, path, seconds = answered
        if len(answer) == 1:
            self.transport.write(answer[0])
        elif self.fast.vectored_writes():  # head and kv in one send: the client wakes once, to all of it
            self.transport.writelines(answer)
        else:  # asyncio's writelines before 3.12 joins the parts, a copy of the kv
            for part in answer:
                self.transport.write(part)
        self.fast.count(path, seconds)
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        self.fast.catch_up.soon(self.loop)  # the policy learns from it now that the answer is out
        return True

    def follow(self, data: bytes) -> None:
        """Advance the request boundaries over bytes handed to aiohttp."""
        pos = 0
        while self.following and pos < len(data):
            if self.body_left:
                step = min(self.body_left, len(data) - pos)
                self.body_left -= step
                pos += step
                continue
            head_end = data.find(_HEAD_END, pos)
            headers = _headers(data[pos:head_end].split(b"\r\n")[1:]) if head_end >= 0 else None
            length = _content_length(headers) if headers is not None and _plain(headers) else None
            if length is None:  # a head split across reads, chunked, upgraded...: stop following
                self.following = False
                return
            self.handed += 1
            self.body_left = length
            pos = head_end + len(_HEAD_END)


@web.middleware
async def count_answers(request: web.Request,
                        handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """The outermost middleware: counts a request answered once its answer has been written, so
    that a later request on the connection may be answered by the fast path without overtaking it;
    and hands the request the fetch plan the fast path made for it (released if unused)."""
    fast = request.app.get(FAST_PATH)
    lane = fast.lanes.get(request.transport) if fast is not None else None
    if lane is not None and lane.planned is not None and lane.planned[0] == lane.answered + 1:
        request[handlers.HANDED_PLAN] = lane.planned[1]
        lane.planned = None
    try:
        response = await handler(request)
    finally:
        unused = request.pop(handlers.HANDED_PLAN, None)
        if unused is not None:
            handlers.release_plan(request.app, unused)
    if lane is not None:
        await response.prepare(request)  # aiohttp would write it after we return; it skips a written one
        await response.write_eof()
        lane.answered += 1
    return response


FAST_PATH: web.AppKey[FastPath] = web.AppKey("fast_path", FastPath)


def _headers(lines: list[bytes]) -> dict[bytes, bytes] | None:
    """Header lines -> {lowercased name: value}; None for a repeated or malformed one (a name
    that is not an HTTP token, a folded line), which aiohttp then answers."""
    headers: dict[bytes, bytes] = {}
    for line in lines:
        name, colon, value = line.partition(b":")
        name = name.lower()
        if not colon or not _TOKEN.fullmatch(name) or name in headers:
            return None
        headers[name] = value.strip()
    return headers


def _plain(headers: dict[bytes, bytes]) -> bool:
    """No header that changes the framing or the connection (chunked, 100-continue, upgrade, close)."""
    if not _REFUSED_HEADERS.isdisjoint(headers):
        return False
    return headers.get(b"connection", b"keep-alive").lower() == b"keep-alive"


def _content_length(headers: dict[bytes, bytes]) -> int | None:
    value = headers.get(b"content-length", b"0")
    return int(value) if value.isdigit() and len(value) < 19 else None

"""The data routes answered as their bytes arrive, before aiohttp's request machinery.

Why: once KV moves through shared memory, much of a small request's time is aiohttp's: request
and response objects, the middleware chain, the handler task and the loop iterations between
them (docs/performance.md has the measurements).

What is taken here, all of it or nothing:
- a received chunk that is exactly one complete HTTP/1.1 request, head and Content-Length body
  (within max_body_bytes) with nothing after it, for a data route (api/routes.py DATA_ROUTES:
  lookup, fetch, store, chunks/store, blend);
- msgpack both ways: no JSON Content-Type or Accept; no Transfer-Encoding, Content-Encoding,
  Expect, Upgrade or `Connection: close`;
- with a known bearer token when the sidecar has an auth file.
Everything else goes to aiohttp unchanged, and aiohttp answers it through the same handler.

A request taken here is answered here, whole: its route's handler (api/handlers.py) runs on the
loop and either answers or returns a `Later`, which runs on the app's pool thread and is
answered from its completion (a fetch that needs the disk, a large store, a blend). Failures
are answered here too, with aiohttp's error bodies and statuses (api/middleware.py `error_of`).
Nothing taken here is handed to aiohttp, nor the other way round.

Invariant: a connection's answers leave in request order. A request is taken here only when
aiohttp holds no part of an earlier one and has answered every request it was handed on the
connection, and no `Later` of this path is running for it: while one runs, what arrives on the
connection is held (reading paused past HELD_BYTES) and taken up once its answer is written.
`Lane` follows the request boundaries of the bytes it hands on (Content-Length framing;
anything it cannot follow turns the lane off for the connection, which is always safe) and
counts aiohttp's answers through the `count_answers` middleware.

Not done here: keep-alive bookkeeping. aiohttp closes a connection it has seen idle for its
keep-alive timeout even if this path served requests meanwhile; the clients open a new one (and
register their shared memory again) when a kept-alive connection turns out closed.
"""
from __future__ import annotations

import asyncio
import email.utils
import http
import re
import sys
import time
from typing import Any, Awaitable, Callable

import msgpack
from aiohttp import web

from kvstore.api import handlers, wire
from kvstore.api.auth import PROTECTED_PREFIX, bearer_tenant
from kvstore.api.catch_up import CATCH_UP
from kvstore.api.context import AUTH, CONFIG, EXECUTOR
from kvstore.api.event_loop import loop_name
from kvstore.api.framing import SMALL_BODY_BYTES, pack_map_prefix
from kvstore.api.metrics import METRICS
from kvstore.api.middleware import error_of
from kvstore.api.routes import DATA_ROUTES

Written = tuple[list[Any], int]  # (the answer's bytes, its status)

_HEAD_END = b"\r\n\r\n"
MAX_HEAD_BYTES = 8190  # aiohttp's default line limit; a whole head past it is never ours
HEAD_CACHE_ENTRIES = 256  # distinct heads kept (emptied when full): clients' heads differ by Content-Length
# Bytes a connection may send while a `Later` of it runs before its reads are paused.
HELD_BYTES = 1 << 20
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9a-z-]+")  # an HTTP header name (RFC 9110 token), lowercased
_REFUSED_HEADERS = frozenset({b"transfer-encoding", b"content-encoding", b"expect", b"upgrade"})
_ANSWER_HEAD = (b"HTTP/1.1 %d %s\r\nContent-Type: " + wire.MSGPACK.encode()
                + b"\r\nContent-Length: %d\r\nDate: %s\r\n\r\n")  # with its status, length and date
ROUTES: dict[bytes, handlers.Handler] = {path.encode(): handler for path, handler in DATA_ROUTES.items()}


class FastPath:
    """The app's fast path: its lanes (one per connection) and its per-route metrics."""

    def __init__(self, app: web.Application):
        self.app = app
        self.lanes: dict[Any, Lane] = {}  # by transport, from connection_made to connection_lost
        self._metrics = app[METRICS]
        self._counted: dict[tuple[bytes, int], tuple[Any, Any]] = {}  # (path, status) -> its two metrics
        self._date = (0, b"")
        self.catch_up = app[CATCH_UP]
        # Heads this path took, by their bytes (`_take_head`); only taken ones, so a refused
        # token is checked again every time.
        self._heads: dict[bytes, tuple[bytes, handlers.Handler, int, str | None]] = {}
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

    def lane(self, transport: Any, inner: asyncio.Protocol) -> "Lane":
        lane = self.lanes[transport] = Lane(self, transport, inner)
        return lane

    def drop(self, transport: Any) -> None:
        lane = self.lanes.pop(transport, None)
        if lane is not None:
            lane.held = None

    def take(self, transport: Any, data: bytes) -> tuple[bytes, Written | handlers.Later] | None:
        """(path, the answer's bytes and status) when `data` is one request this path takes
        (module docstring) and its handler answered on the loop; (path, its `Later`) when the
        handler left the work for a pool thread; None when `data` is aiohttp's (nothing done)."""
        if not data.startswith(b"POST /"):
            return None
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
        path, handler, length, tenant = taken
        body_at = head_end + len(_HEAD_END)
        if len(data) - body_at != length:
            return None
        try:
            # A small body is decoded straight from the read (its bins come back as copies); a
            # large one from a writable copy, since its bins are views (a store's kv).
            body = memoryview(data)[body_at:] if length <= SMALL_BODY_BYTES else bytearray(memoryview(data)[body_at:])
            outcome = handler(self.app, transport, wire.decode_msgpack(body), tenant)
        except Exception as exc:  # answered as aiohttp's error middleware would
            return path, self.failed(path, exc)
        if isinstance(outcome, handlers.Later):
            return path, outcome
        return path, (self._encode(*outcome), 200)

    def failed(self, path: bytes, exc: BaseException) -> Written:
        status, code, message = error_of(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)), "POST",
                                         path.decode())
        return self._encode({"error": {"code": code, "message": message}}, None, status), status

    def count(self, path: bytes, status: int, seconds: float) -> None:
        """Count an answer of this path in the route's metrics. `Lane` calls it once the answer is
        written, off the answer's way: a client on another core reads it meanwhile (on the same
        core, as one client and the sidecar often are on a 2-core host, it saves nothing)."""
        counted = self._counted.get((path, status))
        if counted is None:
            route = path.decode()
            counted = self._counted[path, status] = (self._metrics.requests.labels(route, "POST", str(status)),
                                                     self._metrics.latency.labels(route, "POST"))
        requests, latency = counted
        requests.inc()
        latency.observe(seconds)

    def _take_head(self, head: bytes) -> tuple[bytes, handlers.Handler, int, "str | None"] | None:
        """(path, handler, Content-Length, tenant) of a request head this path takes, else None.
        Depends on nothing but the head's bytes and the app's fixed config and auth table, so
        `take` keeps it by head: a client's heads repeat byte for byte."""
        lines = head.split(b"\r\n")
        _, _, rest = lines[0].partition(b" ")  # the method is POST (checked by `take`)
        path, _, version = rest.partition(b" ")
        handler = ROUTES.get(path)
        if handler is None or version != b"HTTP/1.1":
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
        return path, handler, length, self._tenant(path, headers)

    def _tenant(self, path: bytes, headers: dict[bytes, bytes]) -> str | None:
        table = self.app[AUTH]
        if not table or not path.decode().startswith(PROTECTED_PREFIX):
            return None
        return bearer_tenant(table, headers.get(b"authorization", b"").decode("latin-1"))

    def _encode(self, fields: dict, raw: Any, status: int = 200) -> list[Any]:
        if raw is None:
            body = self._packer.pack(fields)
            return [self._head(status, len(body)) + body]
        prefix = pack_map_prefix(fields, "kv", raw.nbytes)
        return [self._head(status, len(prefix) + raw.nbytes) + prefix, memoryview(raw)]

    def _head(self, status: int, content_length: int) -> bytes:
        second = int(time.time())
        if self._date[0] != second:  # formatted once a second, as aiohttp does
            self._date = (second, email.utils.formatdate(second, usegmt=True).encode())
        return _ANSWER_HEAD % (status, _REASONS[status], content_length, self._date[1])


class _Reasons(dict):
    def __missing__(self, status: int) -> bytes:
        reason = self[status] = http.HTTPStatus(status).phrase.encode()
        return reason


_REASONS: dict[int, bytes] = _Reasons()


class Lane:
    """One connection: what aiohttp holds of it (requests handed on, counted at their head;
    requests answered; how much of a handed-on body it has yet to receive), and what arrived
    while a `Later` of this path runs (`held`, None when none runs).

    Invariant: `idle` is true only when every byte handed on so far formed complete requests,
    aiohttp has answered each of them and no `Later` runs; `following` turns false for good on
    anything the Content-Length framing below cannot follow."""

    __slots__ = ("fast", "transport", "inner", "loop", "handed", "answered", "body_left", "following", "held",
                 "paused")

    def __init__(self, fast: FastPath, transport: Any, inner: asyncio.Protocol):
        self.fast = fast
        self.transport = transport
        self.inner = inner  # aiohttp's protocol for the connection
        self.loop: asyncio.AbstractEventLoop | None = None  # the connection's, once it has answered here
        self.handed = 0
        self.answered = 0
        self.body_left = 0
        self.following = True
        self.held: bytearray | None = None
        self.paused = False

    @property
    def idle(self) -> bool:
        return self.following and not self.body_left and self.handed == self.answered

    def received(self, data: bytes) -> None:
        """A read of the connection: held while a `Later` runs, taken here, or aiohttp's."""
        if self.held is not None:
            self.held += data
            if len(self.held) > HELD_BYTES and not self.paused:
                self.paused = True
                self.transport.pause_reading()
            return
        if not self.take(data):
            self.follow(data)
            self.inner.data_received(data)

    def take(self, data: bytes) -> bool:
        """Answer `data` here (now, or from a pool thread) if this path takes it; False: hand it
        to aiohttp (and `follow` it)."""
        if not self.idle or self.transport.is_closing():
            return False
        began = time.perf_counter()
        taken = self.fast.take(self.transport, data)
        if taken is None:
            return False
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        path, outcome = taken
        if isinstance(outcome, handlers.Later):
            self._later(path, outcome, began)
        else:
            self._write(path, outcome, began)
        return True

    def _later(self, path: bytes, later: handlers.Later, began: float) -> None:
        self.held = bytearray()
        loop = self.loop
        assert loop is not None
        try:
            future = loop.run_in_executor(self.fast.app[EXECUTOR], later.run)
        except RuntimeError:  # the pool is shut down: the app is closing
            later.drop()
            self.held = None
            self.transport.close()
            return

        def done(future: asyncio.Future) -> None:
            later.drop()
            if future.cancelled():  # the loop is closing
                return
            exc = future.exception()
            self._write(path, self.fast.failed(path, exc) if exc is not None
                        else (self.fast._encode(*future.result()), 200), began)
            held, self.held = self.held, None
            if self.paused:
                self.paused = False
                if not self.transport.is_closing():
                    self.transport.resume_reading()
            if held and not self.transport.is_closing():
                self.received(bytes(held))
        future.add_done_callback(done)

    def _write(self, path: bytes, written: Written, began: float) -> None:
        answer, status = written
        if self.transport.is_closing():  # the client left while its answer was on a pool thread
            return
        if len(answer) == 1:
            self.transport.write(answer[0])
        elif self.fast.vectored_writes():  # head and kv in one send: the client wakes once, to all of it
            self.transport.writelines(answer)
        else:  # asyncio's writelines before 3.12 joins the parts, a copy of the kv
            for part in answer:
                self.transport.write(part)
        self.fast.count(path, status, time.perf_counter() - began)
        self.fast.catch_up.soon(self.loop)  # the policy learns from it now that the answer is out

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
    that a later request on the connection may be taken by the fast path without overtaking it."""
    fast = request.app.get(FAST_PATH)
    lane = fast.lanes.get(request.transport) if fast is not None else None
    response = await handler(request)
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

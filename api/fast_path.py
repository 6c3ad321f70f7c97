"""The data plane: the HTTP/1.1 server that reads every request of every connection and answers
every data route itself (api/handlers.py `DATA_ROUTES`: lookup, fetch, store, chunks/store,
blend, shm), before and without aiohttp's request machinery.

Why: once KV moves through shared memory, much of a small request's time was aiohttp's: request
and response objects, the middleware chain, the handler task and the loop iterations between
them (docs/performance.md has the measurements). And one reader per connection is what keeps a
request on one path: nothing here hands a data request to aiohttp, nor the other way round.

A request, from the socket (`Connection.data_received`) to its answer:
1. Its head is read whole (`_next`; a head split across reads waits in `pending`) and parsed
   once per distinct head bytes (api/request_head.py; what cannot be framed is answered 400 and
   the connection closed).
2. A data route's checks run in aiohttp's order, before its body is read: the method (405),
   Expect (100 Continue is sent, anything else 417), the bearer token (401), the Content-Type
   (415), Content-Encoding (400), the announced size (413, and the connection closed). A request
   refused there is answered at once and its body skipped.
3. Its body is gathered, from as many reads as it takes, into one buffer (api/request_body.py;
   chunked bodies too, bounded by max_body_bytes), within body_timeout_s of its head (408, and
   the connection closed).
4. The body is decoded (msgpack, or JSON) and the route's handler runs on the loop: it answers,
   or returns a `Later`, which runs on the app's pool and is answered from its completion.
   Failures are answered as aiohttp's error middleware answers the admin routes'
   (api/failures.py `error_of`), in msgpack or JSON as the request asked.
5. The answer is written (head and kv in one vectored write where the loop has one), counted in
   the metrics, and the eviction policy catches up behind it (api/catch_up.py).
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
import base64
import email.utils
import http
import json
import sys
import time
from typing import Any

import msgpack

from kvstore.api import handlers, wire
from kvstore.api.auth import PROTECTED_PREFIX, bearer_tenant
from kvstore.api.event_loop import loop_name
from kvstore.api.failures import error_of
from kvstore.api.framing import SMALL_BODY_BYTES, pack_map_prefix
from kvstore.api.metrics import UNMATCHED
from kvstore.api.request_body import BodyBuffer
from kvstore.api.request_head import MAX_HEAD_BYTES, BadRequest, ChunkedBody, RequestHead, parse_head
from kvstore.api.state import SidecarState
from kvstore.errors import InvalidRequest, KVStoreError, PayloadTooLarge, RequestTimeout, UnsupportedMediaType

Parts = list[Any]  # an answer's bytes: its head (and small body), then the kv's memory if any
Refusal = tuple[int, str, str]  # (status, code, message) of an HTTP error that is no KVStoreError (405)

_HEAD_END = b"\r\n\r\n"
HEAD_CACHE_ENTRIES = 256  # distinct heads kept (emptied when full): clients' heads differ by Content-Length
# Bytes a connection may send while its answer is being made before its reads are paused.
HELD_BYTES = 1 << 20
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_ANSWER_HEAD = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nDate: %s\r\n%s\r\n"
_MSGPACK = wire.MSGPACK.encode()
_JSON = b"application/json; charset=utf-8"  # as aiohttp's json_response
_TEXT = b"text/plain; charset=utf-8"
_CLOSE = b"Connection: close\r\n"
_KEEP_ALIVE = b"Connection: keep-alive\r\n"  # said to an HTTP/1.0 client that asked for it
_UNAUTHORIZED = b'WWW-Authenticate: Bearer realm="kvstore"\r\n'
_ALLOW_POST = b"Allow: POST\r\n"
ROUTES: dict[str, handlers.Handler] = handlers.DATA_ROUTES


class Plain:
    """A data request's head that passed every check of step 2 (module docstring), with what its
    answer needs: a later request with the same head bytes is taken straight from its read."""

    __slots__ = ("path", "method", "handler", "length", "tenant", "json_body", "json_answer", "keep_alive", "extra")

    def __init__(self, head: RequestHead, handler: handlers.Handler, tenant: str | None):
        self.path, self.method, self.handler = head.path, head.method, handler
        self.length = head.content_length
        self.tenant = tenant
        self.json_body = head.content_type == wire.JSON
        self.json_answer = wire.answer_in_json(head.accept, head.content_type, head.method)
        self.keep_alive = head.keep_alive
        self.extra = b"" if head.http11 or not head.keep_alive else _KEEP_ALIVE


class FastPath:
    """The app's data plane: its connections, the heads it has parsed, its answers' encoding and
    its per-route metrics."""

    def __init__(self, state: SidecarState, keepalive_timeout_s: float = 75.0):
        self.state = state
        self.config = state.config
        self.keepalive_timeout_s = keepalive_timeout_s
        self.connections: dict[Any, Connection] = {}  # by transport, from connection_made to connection_lost
        self.under_way: set[Connection] = set()  # connections with a data request past its first read
        self.closing = False  # shutting down: no new request is started
        self.plain: dict[bytes, Plain] = {}  # plain data heads by their bytes (without the empty line)
        self._heads: dict[bytes, RequestHead] = {}  # every head parsed, by its bytes
        self._metrics = state.metrics
        self._counted: dict[tuple[str, str, int], tuple[Any, Any]] = {}  # (route, method, status) -> its metrics
        self._date = (0, b"")
        self._vectored: bool | None = None  # known once a loop runs (`vectored_writes`)
        # One packer for every answer (msgpack.packb makes one per call): answers are packed on
        # the event loop's thread only. autoreset: pack() returns the bytes and starts over.
        self._packer = msgpack.Packer(use_bin_type=True)

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

    # ---- answers ------------------------------------------------------------------------

    def vectored_writes(self) -> bool:
        """Whether the loop's `writelines` sends its parts in one vectored write without joining
        them (uvloop, and asyncio from 3.12); else an answer's head and kv go as two writes, and
        the client may wake for the head alone."""
        if self._vectored is None:
            self._vectored = sys.version_info >= (3, 12) or loop_name(asyncio.get_running_loop()) == "uvloop"
        return self._vectored

    def encode(self, fields: dict, raw: Any, *, json_answer: bool, status: int = 200, extra: bytes = b"",
               head_only: bool = False) -> Parts:
        """An answer's parts: `fields`, with `kv` holding raw's bytes when there are some (in
        msgpack, the tensor's memory is sent as it is after a hand-built prefix: framing.py)."""
        if json_answer:
            if raw is not None:
                fields = {**fields, "kv": base64.b64encode(raw).decode()}
            return self._whole(status, _JSON, json.dumps(fields).encode(), extra, head_only)
        if raw is None:
            return self._whole(status, _MSGPACK, self._packer.pack(fields), extra, head_only)
        prefix = pack_map_prefix(fields, "kv", raw.nbytes)
        return [self._head(status, _MSGPACK, len(prefix) + raw.nbytes, extra) + prefix, memoryview(raw)]

    def failure(self, exc: BaseException | Refusal, method: str, path: str, *, json_answer: bool, extra: bytes = b"",
                head_only: bool = False) -> tuple[Parts, int]:
        """A failure's answer, as aiohttp's error middleware gives it, and its status."""
        status, code, message = exc if isinstance(exc, tuple) else error_of(exc, method, path)
        if status == 401:
            extra += _UNAUTHORIZED
        return self.encode({"error": {"code": code, "message": message}}, None, json_answer=json_answer,
                           status=status, extra=extra, head_only=head_only), status

    def text(self, status: int, message: str, extra: bytes = b"") -> Parts:
        return self._whole(status, _TEXT, message.encode(), extra, False)

    def _whole(self, status: int, content_type: bytes, body: bytes, extra: bytes, head_only: bool) -> Parts:
        head = self._head(status, content_type, len(body), extra)
        return [head if head_only else head + body]

    def _head(self, status: int, content_type: bytes, content_length: int, extra: bytes) -> bytes:
        second = int(time.time())
        if self._date[0] != second:  # formatted once a second, as aiohttp does
            self._date = (second, email.utils.formatdate(second, usegmt=True).encode())
        return _ANSWER_HEAD % (status, _REASONS[status], content_type, content_length, self._date[1], extra)

    def count(self, route: str, method: str, status: int, seconds: float) -> None:
        """Count an answer in the route's metrics, as aiohttp's `measure` middleware counts the
        admin routes'. Called once the answer is written, off the answer's way."""
        counted = self._counted.get((route, method, status))
        if counted is None:
            counted = self._counted[route, method, status] = (
                self._metrics.requests.labels(route, method, str(status)), self._metrics.latency.labels(route, method))
        requests, latency = counted
        requests.inc()
        latency.observe(seconds)


class _Reasons(dict):
    def __missing__(self, status: int) -> bytes:
        reason = self[status] = http.HTTPStatus(status).phrase.encode()
        return reason


_REASONS: dict[int, bytes] = _Reasons()


class Reading:
    """A data request between its head and its answer: its body as it arrives (`body` for a
    Content-Length, `chunks` for a chunked one), then its handler's work."""

    __slots__ = ("head", "key", "handler", "tenant", "began", "body", "chunks")

    def __init__(self, head: RequestHead, key: bytes, handler: handlers.Handler, tenant: str | None,
                 began: float, max_body_bytes: int):
        self.head, self.key, self.handler, self.tenant, self.began = head, key, handler, tenant, began
        length = head.content_length
        self.body = BodyBuffer(length) if length is not None else None
        self.chunks = ChunkedBody(keep=True, max_bytes=max_body_bytes) if length is None else None

    @property
    def done(self) -> bool:
        return self.body.done if self.body is not None else self.chunks.done  # type: ignore[union-attr]

    def add(self, data: bytes | bytearray | memoryview) -> int:
        """Take what `data` holds of the body -> how many of its bytes were the body's."""
        return self.body.add(data) if self.body is not None else self.chunks.feed(data)  # type: ignore[union-attr]

    def payload(self) -> bytearray | memoryview:
        return self.body.body() if self.body is not None else self.chunks.body  # type: ignore[union-attr]

    def received(self) -> int:
        return self.body.got if self.body is not None else self.chunks.total  # type: ignore[union-attr]


class Connection:
    """One client connection, from its first byte to its close.

    Invariants: requests are taken one at a time, in order; `pending` holds what arrived and
    belongs to no request taken yet. At most one of these is under way: a data request's body
    being read (`reading`), its answer being made (`busy`), an admin request handed to aiohttp
    (`aiohttp_owes`, with `passing` bytes of its body still to hand on), an answered request's
    body being skipped (`skipping`)."""

    __slots__ = ("fast", "transport", "inner", "loop", "pending", "reading", "busy", "aiohttp_owes", "passing",
                 "skipping", "paused", "closed", "quiet_since", "idle_timer", "body_timer")

    def __init__(self, fast: FastPath, transport: Any, inner: asyncio.Protocol):
        self.fast = fast
        self.transport = transport
        self.inner = inner  # aiohttp's protocol for the connection: the admin routes' server
        self.loop = asyncio.get_running_loop()
        self.pending = bytearray()
        self.reading: Reading | None = None
        self.busy = False  # a `Later` of this connection runs on the pool
        self.aiohttp_owes = 0  # admin requests handed to aiohttp and not yet answered (0 or 1)
        self.passing: int | ChunkedBody = 0  # what is left of an admin request's body: bytes, or its chunks
        self.skipping: int | ChunkedBody = 0  # the same, of a refused request's body, dropped
        self.paused = False
        self.closed = False
        self.quiet_since = self.loop.time()
        self.idle_timer = self.loop.call_at(self.quiet_since + fast.keepalive_timeout_s, self._idle)
        self.body_timer: asyncio.TimerHandle | None = None

    # ---- reads ---------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if self.passing:
            data = self._pass(data)
        elif self.reading is not None and not self.pending:  # a body's next read: straight into its buffer
            used = self._fill(data)
            if used is None:
                return
            data = data[used:]
            if self.reading.done:
                self._read()
        elif not self.pending and self._idle_now() and self._plain(data):
            return
        if data:
            self.pending += data
            if len(self.pending) > HELD_BYTES and not self.paused and (self.busy or self.aiohttp_owes):
                self.paused = True
                self.transport.pause_reading()
        self._next()

    def _idle_now(self) -> bool:
        return not (self.busy or self.aiohttp_owes or self.skipping or self.reading is not None)

    def _plain(self, data: bytes) -> bool:
        """Answer `data` if it is exactly one whole request with a head known to be plain."""
        head_end = data.find(_HEAD_END)
        if head_end < 0:
            return False
        plain = self.fast.plain.get(data[:head_end])
        if plain is None or len(data) - head_end - 4 != plain.length or self.fast.closing \
                or self.transport.is_closing():
            return False
        began = time.perf_counter()
        body_at = head_end + 4
        # A small body is decoded straight from the read (its bins come back as copies); a large
        # one from a writable copy, since its bins are views (a store's kv).
        body = memoryview(data)[body_at:] if plain.length <= SMALL_BODY_BYTES else bytearray(memoryview(data)[body_at:])
        self._run(plain.handler, body, plain.json_body, plain.tenant, plain.path, plain.method, plain.json_answer,
                  plain.extra, plain.keep_alive, began)
        return True

    def _next(self) -> None:
        """Take the requests `pending` holds, in order, until one must wait (for its body, its
        answer, aiohttp's answer) or nothing is left."""
        while not self.closed:
            if self.passing or self.busy or self.aiohttp_owes:
                return
            if self.skipping:
                self._skip()
                if self.skipping:
                    return
                continue
            if self.reading is not None:
                if not self.pending:
                    return
                used = self._fill(self.pending)
                if used is None:
                    return
                del self.pending[:used]
                if not self.reading.done:
                    return
                self._read()
                continue
            if not self.pending:
                return
            if self.fast.closing or self.transport.is_closing():
                self._close()
                return
            head_end = self.pending.find(_HEAD_END)
            if head_end < 0:
                if len(self.pending) > MAX_HEAD_BYTES:
                    self._bad(BadRequest(f"request head longer than {MAX_HEAD_BYTES} bytes"))
                elif b"\n\n" in self.pending:  # a head whose lines end in bare LF never ends here
                    self._bad(BadRequest("request head lines must end with CRLF"))
                return
            key = bytes(self.pending[:head_end])
            del self.pending[:head_end + 4]
            try:
                self._head(key, self.fast.head(key))
            except BadRequest as exc:
                self._bad(exc)

    def _head(self, key: bytes, head: RequestHead) -> None:
        """Step 2 of the module docstring: route a parsed head and check it; a data request then
        has its body read (`reading`), an admin one goes to aiohttp."""
        handler = ROUTES.get(head.path)
        if handler is None:
            self._to_aiohttp(key, head)
            return
        began = time.perf_counter()
        json_answer = wire.answer_in_json(head.accept, head.content_type, head.method)
        if head.method != "POST":
            refusal = (405, "method_not_allowed", f"{head.method} {head.path}: Method Not Allowed")
            self._refuse(head, UNMATCHED, refusal, json_answer, began, _ALLOW_POST)
            return
        if head.expect is not None:
            if head.expect != b"100-continue":  # answered before any middleware, so never counted
                self._write(self.fast.text(417, f"Unknown Expect: {head.expect.decode('latin-1')}"))
                self._skip_body(head)
                return
            if head.http11:
                self.transport.write(_CONTINUE)
        try:
            tenant = self.fast.tenant(head)
            _check_body(head, self.fast.config.max_body_bytes)
        except (KVStoreError, BadRequest) as exc:
            self._refuse(head, head.path, exc, json_answer, began)
            return
        if head.expect is None and not head.chunked:
            self.fast.remember(key, Plain(head, handler, tenant))
        self.reading = Reading(head, key, handler, tenant, began, self.fast.config.max_body_bytes)
        if head.content_length == 0:
            self._read()
            return
        self.fast.under_way.add(self)
        self.body_timer = self.loop.call_later(self.fast.config.body_timeout_s, self._body_timed_out)

    def _fill(self, data: bytes | bytearray) -> int | None:
        """Add what `data` holds of the body being read -> how many of its bytes that was; None
        when the body is refused (past max_body_bytes, or chunks that cannot be framed): it is
        answered, and the connection closes."""
        reading = self.reading
        assert reading is not None
        try:
            return reading.add(data)
        except BadRequest as exc:
            self._bad(exc)
        except PayloadTooLarge as exc:
            self.reading = None
            head = reading.head
            self._refuse(head, head.path, exc, wire.answer_in_json(head.accept, head.content_type, head.method),
                         reading.began)
        return None

    def _read(self) -> None:
        """The body is in: decode it and run the handler (step 4)."""
        reading, self.reading = self.reading, None
        assert reading is not None
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None
        head = reading.head
        self._run(reading.handler, reading.payload(), head.content_type == wire.JSON, reading.tenant, head.path,
                  head.method, wire.answer_in_json(head.accept, head.content_type, head.method),
                  b"" if head.http11 or not head.keep_alive else _KEEP_ALIVE, head.keep_alive, reading.began)

    def _run(self, handler: handlers.Handler, body: Any, json_body: bool, tenant: str | None, path: str, method: str,
             json_answer: bool, extra: bytes, keep_alive: bool, began: float) -> None:
        fast = self.fast
        try:
            outcome = handler(fast.state, self.transport, wire.decode_json(body) if json_body
                              else wire.decode_msgpack(body), tenant)
        except Exception as exc:  # answered as aiohttp's error middleware would
            parts, status = fast.failure(exc, method, path, json_answer=json_answer, extra=extra)
            self._answer(parts, path, method, status, keep_alive, began)
            return
        if isinstance(outcome, handlers.Later):
            self._later(outcome, path, method, json_answer, extra, keep_alive, began)
            return
        self._answer(fast.encode(*outcome, json_answer=json_answer, extra=extra), path, method, 200, keep_alive, began)

    def _later(self, later: handlers.Later, path: str, method: str, json_answer: bool, extra: bytes,
               keep_alive: bool, began: float) -> None:
        fast = self.fast
        try:
            future = self.loop.run_in_executor(fast.state.executor, later.run)
        except RuntimeError:  # the pool is shut down: the app is closing
            later.drop()
            self._close()
            return
        self.busy = True
        fast.under_way.add(self)

        def done(future: asyncio.Future) -> None:
            later.drop()
            if future.cancelled():  # the loop is closing
                return
            exc = future.exception()
            if exc is None:
                answer = future.result()
                try:
                    if later.then is not None:
                        answer = later.then(answer)
                    parts, status = fast.encode(*answer, json_answer=json_answer, extra=extra), 200
                except Exception as failed:
                    exc = failed
            if exc is not None:
                parts, status = fast.failure(exc, method, path, json_answer=json_answer, extra=extra)
            self.busy = False
            fast.under_way.discard(self)
            self._answer(parts, path, method, status, keep_alive, began)
            if self.paused and not self.closed:
                self.paused = False
                self.transport.resume_reading()
            self._next()
        future.add_done_callback(done)

    # ---- answers ------------------------------------------------------------------------

    def _answer(self, parts: Parts, route: str, method: str, status: int, keep_alive: bool, began: float,
                close: bool = False) -> None:
        """Write a data request's answer (step 5); the connection closes after it when the client
        asked, the request's body cannot be skipped, or the server is shutting down."""
        if self.closed or self.transport.is_closing():  # the client left while its answer was being made
            return
        if close or not keep_alive or self.fast.closing:
            parts[0] = parts[0].replace(b"\r\n\r\n", b"\r\n" + _CLOSE + b"\r\n", 1)
            self._write(parts)
            self._close()
        else:
            self._write(parts)
        self.fast.under_way.discard(self)
        self.fast.count(route, method, status, time.perf_counter() - began)
        self.fast.state.catch_up.soon(self.loop)  # the policy learns from it now that the answer is out

    def _write(self, parts: Parts) -> None:
        if len(parts) == 1:
            self.transport.write(parts[0])
        elif self.fast.vectored_writes():  # head and kv in one send: the client wakes once, to all of it
            self.transport.writelines(parts)
        else:  # asyncio's writelines before 3.12 joins the parts, a copy of the kv
            for part in parts:
                self.transport.write(part)
        self.quiet_since = self.loop.time()

    def _refuse(self, head: RequestHead, route: str, exc: Exception | Refusal, json_answer: bool, began: float,
                extra: bytes = b"") -> None:
        """Answer a data request refused at its head; its body, if any, is skipped (a body too
        large to read is not: the connection closes)."""
        if isinstance(exc, BadRequest):
            self._bad(exc)
            return
        if not head.http11 and head.keep_alive:
            extra += _KEEP_ALIVE
        parts, status = self.fast.failure(exc, head.method, head.path, json_answer=json_answer, extra=extra,
                                          head_only=head.method == "HEAD")
        too_large = isinstance(exc, PayloadTooLarge)
        self._answer(parts, route, head.method, status, head.keep_alive, began, close=too_large)
        if not too_large:
            self._skip_body(head)

    def _bad(self, exc: BadRequest) -> None:
        """A request that cannot be framed: 400, and the connection closes (as aiohttp did)."""
        self._write(self.fast.text(400, f"Bad Request: {exc.message}", _CLOSE))
        self._close()

    def _body_timed_out(self) -> None:
        self.body_timer = None
        reading, self.reading = self.reading, None
        if reading is None:
            return
        head = reading.head
        exc = RequestTimeout(f"body: not received in time ({reading.received()} bytes arrived); "
                             "the server's --body-timeout-s bounds a whole body", field="body")
        parts, status = self.fast.failure(exc, head.method, head.path,
                                          json_answer=wire.answer_in_json(head.accept, head.content_type, head.method))
        self._answer(parts, head.path, head.method, status, head.keep_alive, reading.began, close=True)

    # ---- bodies that are not read here ---------------------------------------------------

    def _skip_body(self, head: RequestHead) -> None:
        self.skipping = ChunkedBody(keep=False) if head.chunked else head.content_length or 0
        self._skip()

    def _skip(self) -> None:
        try:
            used = _through(self.skipping, self.pending)
        except BadRequest as exc:
            self.skipping = 0
            self._bad(exc)
            return
        del self.pending[:used]
        self.skipping = _left(self.skipping, used)

    def _to_aiohttp(self, key: bytes, head: RequestHead) -> None:
        """Hand an admin request to aiohttp, head and what is here of its body; the rest of its
        body follows as it arrives (`_pass`), and the next request waits for aiohttp's answer."""
        if head.expect is not None:
            if head.expect != b"100-continue":
                self._write(self.fast.text(417, f"Unknown Expect: {head.expect.decode('latin-1')}"))
                self._skip_body(head)
                return
            # Answered here, and the header dropped: aiohttp would send a second 100 Continue.
            key = b"\r\n".join(line for line in key.split(b"\r\n") if not line.lower().startswith(b"expect:"))
            if head.http11:
                self.transport.write(_CONTINUE)
        self.aiohttp_owes += 1
        self.passing = ChunkedBody(keep=False) if head.chunked else head.content_length or 0
        try:
            used = _through(self.passing, self.pending) if self.passing else 0
        except BadRequest:  # aiohttp's parser refuses it too, and closes the connection
            used = len(self.pending)
        body = bytes(self.pending[:used])
        del self.pending[:used]
        self.passing = _left(self.passing, used)
        self.inner.data_received(key + _HEAD_END + body)

    def _pass(self, data: bytes) -> bytes:
        """Hand on what `data` holds of the admin request's body -> the rest of `data`."""
        if self.pending:  # a chunk-size line that arrived in part
            data = bytes(self.pending) + data
            self.pending = bytearray()
        try:
            used = _through(self.passing, data)
        except BadRequest:
            used = len(data)
            self.passing = 0
        if used:
            self.inner.data_received(data[:used] if used < len(data) else data)
        self.passing = _left(self.passing, used)
        return data[used:]

    def aiohttp_answered(self) -> None:
        self.aiohttp_owes -= 1
        self.quiet_since = self.loop.time()
        if self.paused and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        # Not from inside aiohttp's handler task, which called this: the next request is this
        # server's business, on a loop iteration of its own.
        self.loop.call_soon(self._next)

    # ---- the connection's end -------------------------------------------------------------

    def _idle(self) -> None:
        """Keep-alive: close a connection that had no request under way for the timeout."""
        self.idle_timer = None
        if self.closed:
            return
        now = self.loop.time()
        timeout = self.fast.keepalive_timeout_s
        if self.busy or self.aiohttp_owes or self.reading is not None:  # a body or an answer under way
            self.quiet_since = now
        elif now >= self.quiet_since + timeout:
            self._close()
            return
        self.idle_timer = self.loop.call_at(self.quiet_since + timeout, self._idle)

    def _close(self) -> None:
        self.closed = True
        self.transport.close()

    def lost(self) -> None:
        """The connection is gone: nothing more is read or written."""
        self.closed = True
        self.reading = None
        self.pending = bytearray()
        for timer in (self.idle_timer, self.body_timer):
            if timer is not None:
                timer.cancel()


def _check_body(head: RequestHead, max_body_bytes: int) -> None:
    """What aiohttp's read of a data request checked before its body: its type, its encoding,
    its announced size."""
    ctype = head.content_type
    if ctype not in wire.MSGPACK_TYPES and ctype not in wire.DEFAULT_TYPES and ctype != wire.JSON:
        raise UnsupportedMediaType(f"Content-Type: expected {wire.MSGPACK} or {wire.JSON}, got {ctype!r}",
                                   field="Content-Type")
    encoding = head.headers.get(b"content-encoding", b"identity").lower()
    if encoding != b"identity":
        raise InvalidRequest(f"Content-Encoding: {encoding[:40].decode('latin-1')!r} is not accepted; "
                             "send the body as it is", field="Content-Encoding")
    length = head.content_length
    if length is not None and length > max_body_bytes:
        raise PayloadTooLarge(f"body: {length} bytes exceeds the limit of {max_body_bytes} bytes", field="body")


def _through(left: int | ChunkedBody, data: bytes | bytearray | memoryview) -> int:
    """How many bytes of `data` belong to a body of which `left` remains (a count, or its chunks)."""
    if isinstance(left, ChunkedBody):
        return left.feed(data)
    return min(left, len(data))


def _left(left: int | ChunkedBody, used: int) -> int | ChunkedBody:
    if isinstance(left, ChunkedBody):
        return 0 if left.done else left
    return left - used


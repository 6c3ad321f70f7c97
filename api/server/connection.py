"""One client connection of the data plane, from its first byte to its close: the reading half
of api/server/fast_path.py (steps 1 to 3 of its docstring: heads, checks, bodies), and what is
handed to aiohttp. Answering, steps 4 and 5, is api/server/answering.py (`Answering`, which
`Connection` is).
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from kvstore.api.framing import SMALL_BODY_BYTES
from kvstore.api.protocol import JSON, MSGPACK
from kvstore.api.server import handlers, wire
from kvstore.api.server.answering import KEEP_ALIVE, Answering
from kvstore.api.server.metrics import UNMATCHED
from kvstore.api.server.request_body import BodyBuffer
from kvstore.api.server.request_head import MAX_HEAD_BYTES, BadRequest, ChunkedBody, RequestHead
from kvstore.errors import InvalidRequest, KVStoreError, PayloadTooLarge, UnsupportedMediaType

if TYPE_CHECKING:
    from kvstore.api.server.fast_path import FastPath

_HEAD_END = b"\r\n\r\n"
# Bytes a connection may send while its answer is being made before its reads are paused.
HELD_BYTES = 1 << 20
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
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
        self.json_body = head.content_type == JSON
        self.json_answer = wire.answer_in_json(head.accept, head.content_type, head.method)
        self.keep_alive = head.keep_alive
        self.extra = b"" if head.http11 or not head.keep_alive else KEEP_ALIVE


class Reading:
    """A data request between its head and its answer: its body as it arrives (`body`: a
    `BodyBuffer` for a Content-Length, a `ChunkedBody` for a chunked one), then its handler's work."""

    __slots__ = ("head", "key", "handler", "tenant", "began", "body")

    def __init__(self, head: RequestHead, key: bytes, handler: handlers.Handler, tenant: str | None,
                 began: float, max_body_bytes: int):
        self.head, self.key, self.handler, self.tenant, self.began = head, key, handler, tenant, began
        length = head.content_length
        self.body: BodyBuffer | ChunkedBody = BodyBuffer(length) if length is not None \
            else ChunkedBody(keep=True, max_bytes=max_body_bytes)

    @property
    def done(self) -> bool:
        return self.body.done

    def add(self, data: bytes | bytearray | memoryview) -> int:
        """Take what `data` holds of the body -> how many of its bytes were the body's."""
        body = self.body
        return body.add(data) if isinstance(body, BodyBuffer) else body.feed(data)

    def payload(self) -> bytearray | memoryview:
        body = self.body
        return body.body() if isinstance(body, BodyBuffer) else body.body

    def received(self) -> int:
        body = self.body
        return body.got if isinstance(body, BodyBuffer) else body.total


class Connection(Answering):
    """One client connection, from its first byte to its close.

    Invariants: requests are taken one at a time, in order; `pending` holds what arrived and
    belongs to no request taken yet. At most one of these is under way: a data request's body
    being read (`reading`), its answer being made (`busy`), an admin request handed to aiohttp
    (`aiohttp_owes`, with `passing` bytes of its body still to hand on), an answered request's
    body being skipped (`skipping`)."""

    # With Answering's: reading, busy, paused, quiet_since, body_timer.
    __slots__ = ("fast", "answers", "transport", "inner", "loop", "pending", "aiohttp_owes", "passing", "skipping",
                 "closed", "idle_timer")

    def __init__(self, fast: FastPath, transport: Any, inner: asyncio.Protocol):
        self.fast = fast
        self.answers = fast.answers
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
        self.idle_timer: asyncio.TimerHandle | None = self.loop.call_at(
            self.quiet_since + fast.keepalive_timeout_s, self._idle)
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
                self._write(self.answers.text(417, f"Unknown Expect: {head.expect.decode('latin-1')}"))
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
        self._run(reading.handler, reading.payload(), head.content_type == JSON, reading.tenant, head.path,
                  head.method, wire.answer_in_json(head.accept, head.content_type, head.method),
                  b"" if head.http11 or not head.keep_alive else KEEP_ALIVE, head.keep_alive, reading.began)

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
                self._write(self.answers.text(417, f"Unknown Expect: {head.expect.decode('latin-1')}"))
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
    if ctype not in wire.MSGPACK_TYPES and ctype not in wire.DEFAULT_TYPES and ctype != JSON:
        raise UnsupportedMediaType(f"Content-Type: expected {MSGPACK} or {JSON}, got {ctype!r}",
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


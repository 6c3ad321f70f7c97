"""Answering a data request: its answer's bytes (`Answers`: msgpack or JSON, a fetch's kv after a
hand-built prefix, failures as aiohttp's error middleware gives them, the metrics) and the
connection's half that runs a handler and writes what it answers (`Answering`: steps 4 and 5
of api/server/fast_path.py's docstring, which has the whole way of a request). Reading the
request, steps 1 to 3, is api/server/connection.py's `Connection`, which is an `Answering`.
"""
from __future__ import annotations

import asyncio
import base64
import email.utils
import http
import json
import sys
import time
from typing import TYPE_CHECKING, Any

import msgpack

from kvstore.api.framing import pack_map_prefix
from kvstore.api.protocol import MSGPACK
from kvstore.api.server import handlers, wire
from kvstore.api.server.event_loop import loop_name
from kvstore.api.server.failures import error_of
from kvstore.api.server.metrics import Metrics
from kvstore.api.server.request_head import BadRequest, RequestHead
from kvstore.errors import PayloadTooLarge, RequestTimeout

if TYPE_CHECKING:
    from kvstore.api.server.fast_path import FastPath
    from kvstore.api.server.connection import Reading

Parts = list[Any]  # an answer's bytes: its head (and small body), then the kv's memory if any
Refusal = tuple[int, str, str]  # (status, code, message) of an HTTP error that is no KVStoreError (405)

_ANSWER_HEAD = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nDate: %s\r\n%s\r\n"
_MSGPACK = MSGPACK.encode()
_JSON = b"application/json; charset=utf-8"  # as aiohttp's json_response
_TEXT = b"text/plain; charset=utf-8"
CLOSE = b"Connection: close\r\n"
KEEP_ALIVE = b"Connection: keep-alive\r\n"  # said to an HTTP/1.0 client that asked for it
_UNAUTHORIZED = b'WWW-Authenticate: Bearer realm="kvstore"\r\n'


class Answers:
    """The bytes of one app's data answers, and their count in its per-route metrics."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics
        self._counted: dict[tuple[str, str, int], tuple[Any, Any]] = {}  # (route, method, status) -> its metrics
        self._date = (0, b"")
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


class Answering:
    """A connection's answering half: what `Connection` (api/server/connection.py) does once a
    data request's body is in, or once the request is refused. Its slots are the connection's
    state it sets; `Connection` declares the rest, and sets up all of the attributes below."""

    __slots__ = ("reading", "busy", "paused", "quiet_since", "body_timer")
    fast: FastPath
    answers: Answers
    transport: Any
    loop: asyncio.AbstractEventLoop
    reading: Reading | None
    busy: bool
    paused: bool
    closed: bool
    quiet_since: float
    body_timer: asyncio.TimerHandle | None

    def _next(self) -> None:  # the reading half's: take the next request
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError

    def _skip_body(self, head: RequestHead) -> None:
        raise NotImplementedError

    def _run(self, handler: handlers.Handler, body: Any, json_body: bool, tenant: str | None, path: str, method: str,
             json_answer: bool, extra: bytes, keep_alive: bool, began: float) -> None:
        fast, answers = self.fast, self.answers
        try:
            outcome = handler(fast.state, self.transport, wire.decode_json(body) if json_body
                              else wire.decode_msgpack(body), tenant)
        except Exception as exc:  # answered as aiohttp's error middleware would
            parts, status = answers.failure(exc, method, path, json_answer=json_answer, extra=extra)
            self._answer(parts, path, method, status, keep_alive, began)
            return
        if isinstance(outcome, handlers.Later):
            self._later(outcome, path, method, json_answer, extra, keep_alive, began)
            return
        parts = answers.encode(*outcome, json_answer=json_answer, extra=extra)
        self._answer(parts, path, method, 200, keep_alive, began)

    def _later(self, later: handlers.Later, path: str, method: str, json_answer: bool, extra: bytes,
               keep_alive: bool, began: float) -> None:
        fast, answers = self.fast, self.answers
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
                    parts, status = answers.encode(*answer, json_answer=json_answer, extra=extra), 200
                except Exception as failed:
                    exc = failed
            if exc is not None:
                parts, status = answers.failure(exc, method, path, json_answer=json_answer, extra=extra)
            self.busy = False
            fast.under_way.discard(self)
            self._answer(parts, path, method, status, keep_alive, began)
            if self.paused and not self.closed:
                self.paused = False
                self.transport.resume_reading()
            self._next()
        future.add_done_callback(done)

    def _answer(self, parts: Parts, route: str, method: str, status: int, keep_alive: bool, began: float,
                close: bool = False) -> None:
        """Write a data request's answer (step 5); the connection closes after it when the client
        asked, the request's body cannot be skipped, or the server is shutting down."""
        if self.closed or self.transport.is_closing():  # the client left while its answer was being made
            return
        if close or not keep_alive or self.fast.closing:
            parts[0] = parts[0].replace(b"\r\n\r\n", b"\r\n" + CLOSE + b"\r\n", 1)
            self._write(parts)
            self._close()
        else:
            self._write(parts)
        self.fast.under_way.discard(self)
        self.answers.count(route, method, status, time.perf_counter() - began)
        self.fast.state.catch_up.soon(self.loop)  # the policy learns from it now that the answer is out

    def _write(self, parts: Parts) -> None:
        if len(parts) == 1:
            self.transport.write(parts[0])
        elif self.answers.vectored_writes():  # head and kv in one send: the client wakes once, to all of it
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
            extra += KEEP_ALIVE
        parts, status = self.answers.failure(exc, head.method, head.path, json_answer=json_answer, extra=extra,
                                             head_only=head.method == "HEAD")
        too_large = isinstance(exc, PayloadTooLarge)
        self._answer(parts, route, head.method, status, head.keep_alive, began, close=too_large)
        if not too_large:
            self._skip_body(head)

    def _bad(self, exc: BadRequest) -> None:
        """A request that cannot be framed: 400, and the connection closes (as aiohttp did)."""
        self._write(self.answers.text(400, f"Bad Request: {exc.message}", CLOSE))
        self._close()

    def _body_timed_out(self) -> None:
        self.body_timer = None
        reading, self.reading = self.reading, None
        if reading is None:
            return
        head = reading.head
        exc = RequestTimeout(f"body: not received in time ({reading.received()} bytes arrived); "
                             "the server's --body-timeout-s bounds a whole body", field="body")
        json_answer = wire.answer_in_json(head.accept, head.content_type, head.method)
        parts, status = self.answers.failure(exc, head.method, head.path, json_answer=json_answer)
        self._answer(parts, head.path, head.method, status, head.keep_alive, reading.began, close=True)


"""A minimal persistent HTTP/1.1 connection for the sync client.

Why not http.client: it sends the request head and the body in separate syscalls, parses
headers with the email package, and has no scatter-gather send. Here a request (head, small
fields and the tensor's memory) goes out in one `sendmsg` without joining, and the answer is
read with as few syscalls as it allows: one `recv_into` a reused buffer usually holds a small
answer whole (head and body), and a large body goes straight from the socket into one
preallocated buffer. Why not a buffered file over the socket: its `readline` per header line
cost more than the rest of the client's work on a small answer. It speaks only what the sidecar
answers: Content-Length or chunked bodies, keep-alive unless the server says close.

The socket is blocking and the kernel times each send and receive out (SO_SNDTIMEO,
SO_RCVTIMEO): a socket with a Python timeout polls before every send and every receive, two
syscalls more per request than the send and the receive themselves.
"""
from __future__ import annotations

import socket
import struct
from typing import Any, Sequence

import numpy as np

from kvstore.host_memory import empty_host_bytes

_MAX_HEAD_BYTES = 64 << 10  # a whole answer head; the sidecar's are far smaller
_MAX_HEADERS = 100
_SMALL_BODY_BYTES = 64 << 10
_READ_BYTES = 128 << 10  # the reused read buffer: a small answer and the head of a large one
# Parsed heads kept per connection, by their text: the sidecar's answers to one kind of request
# repeat byte for byte but for Content-Length and a Date that changes once a second.
_HEAD_CACHE_ENTRIES = 64


class ProtocolError(OSError):
    """The server's answer is not HTTP/1.1 as expected, or the connection broke mid-answer."""


class Connection:
    """Invariant: `_buf[_pos:_end]` holds the bytes received and not yet consumed (the start of
    the next answer, or nothing); everything before `_pos` is consumed."""

    def __init__(self, host: str, port: int, *, timeout_s: float, socket_buffer_bytes: int = 0):
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if socket_buffer_bytes:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, socket_buffer_bytes)
            if timeout_s is not None and timeout_s > 0:
                _kernel_timeouts(self.sock, timeout_s)
        except OSError:
            self.sock.close()
            raise
        self._buf = bytearray(_READ_BYTES)
        self._view = memoryview(self._buf)
        self._pos = self._end = 0
        self._heads: dict[str, tuple[int, dict[str, str]]] = {}
        self.served = 0  # requests answered on this connection (a reused one may be stale)
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()

    def request(self, head: bytes, parts: Sequence[Any], *, body_bytes: int | None = None,
                into: np.ndarray | None = None) -> tuple[int, str, bytes | bytearray | memoryview]:
        """Send `head` (request line and headers, blank line included) then `parts` (of
        `body_bytes` bytes together, when the caller knows); read the answer -> (status, content
        type, body). `into`: a flat uint8 array a large answer body is received into when it
        fits (the body then views its first bytes), instead of fresh memory. TimeoutError when a
        send or a receive waits longer than the connection's timeout."""
        if body_bytes is None:
            body_bytes = sum(memoryview(p).nbytes for p in parts)
        delimited_by_close = False
        try:
            _send_all(self.sock, [head, *parts], len(head) + body_bytes)
            status, headers = self._read_head()
            if headers.get("transfer-encoding", "").lower() == "chunked":
                body: bytes | bytearray | memoryview = self._read_chunked()
            elif "content-length" in headers:
                length = headers["content-length"]
                if not length.isdigit():
                    raise ProtocolError(f"bad Content-Length {length[:40]!r}")
                body = self._read_exact(int(length), into)
            else:  # delimited by close
                body = self._read_to_close()
                delimited_by_close = True
        except BlockingIOError:  # SO_SNDTIMEO/SO_RCVTIMEO ran out: what a Python timeout raises
            raise TimeoutError("timed out") from None
        self.served += 1
        if delimited_by_close or headers.get("connection", "").lower() == "close":
            self.close()
        return status, headers.get("content-type", ""), body

    # ---- the read buffer ----------------------------------------------------------------------

    def _fill(self) -> None:
        """Receive more bytes after `_end` (moving the unconsumed ones to the front first when
        the buffer's tail is full); ProtocolError if the server closed."""
        if self._end == len(self._buf):
            if self._pos == 0:
                raise ProtocolError(f"answer head longer than {_MAX_HEAD_BYTES} bytes")
            self._buf[:self._end - self._pos] = self._buf[self._pos:self._end]
            self._pos, self._end = 0, self._end - self._pos
        n = self.sock.recv_into(self._view[self._end:])
        if not n:
            raise ProtocolError("connection closed while reading the response")
        self._end += n

    def _take(self, nbytes: int) -> bytes:
        """The next `nbytes` buffered bytes (the caller made sure they are there)."""
        out = bytes(self._view[self._pos:self._pos + nbytes])
        self._pos += nbytes
        if self._pos == self._end:
            self._pos = self._end = 0
        return out

    def _read_head(self) -> tuple[int, dict[str, str]]:
        """(status, {lowercased name: value}) of the next answer's head; the dict is shared by
        answers with the same head bytes (`_heads`): read it, never change it."""
        # The head ends at the first empty line, CRLF or bare LF ("\n\r\n" or "\n\n").
        scanned = self._pos
        if self._pos == self._end:  # nothing buffered: nothing to scan before the first read
            self._fill()
        while True:
            crlf = self._buf.find(b"\n\r\n", scanned, self._end)
            # Only before a CRLF end can a bare-LF one come first: never scan a body behind the head.
            lf = self._buf.find(b"\n\n", scanned, crlf + 1 if crlf >= 0 else self._end)
            if crlf >= 0 or lf >= 0:
                end = min(crlf + 3 if crlf >= 0 else 1 << 62, lf + 2 if lf >= 0 else 1 << 62)
                break
            if self._end - self._pos > _MAX_HEAD_BYTES:
                raise ProtocolError(f"answer head longer than {_MAX_HEAD_BYTES} bytes")
            scanned = max(self._pos, self._end - 2)  # an empty line may straddle two reads
            self._fill()
        # Decoded once, straight from the buffer: one copy, no per-line decode.
        text = str(self._view[self._pos:end], "latin-1")
        self._pos = end
        if self._pos == self._end:
            self._pos = self._end = 0
        parsed = self._heads.get(text)
        if parsed is None:
            parsed = _parse_head(text)
            if len(self._heads) >= _HEAD_CACHE_ENTRIES:
                self._heads.clear()
            self._heads[text] = parsed
        return parsed

    def _readline(self) -> bytes:
        while (newline := self._buf.find(b"\n", self._pos, self._end)) < 0:
            if self._end - self._pos > _MAX_HEAD_BYTES:
                raise ProtocolError(f"line longer than {_MAX_HEAD_BYTES} bytes")
            self._fill()
        return self._take(newline + 1 - self._pos)

    def _read_exact(self, nbytes: int, into: np.ndarray | None = None) -> bytes | memoryview:
        if nbytes <= _SMALL_BODY_BYTES:  # an answer without kv (or a shared-memory one): usually here already
            while self._end - self._pos < nbytes:
                self._fill()
            return self._take(nbytes)
        # A large body is always its own writable buffer (its kv is viewed in place, as a tensor):
        # the caller's, which it reuses, or new memory. New memory is unzeroed and in huge pages,
        # yet the kernel still clears every page at its first write, which a reused buffer skips.
        buffered = self._end - self._pos
        view = into[:nbytes].data if into is not None and into.nbytes >= nbytes else empty_host_bytes(nbytes).data
        view[:buffered] = self._view[self._pos:self._end]
        self._pos = self._end = 0
        got = buffered
        while got < nbytes:  # straight from the socket into the answer's buffer
            n = self.sock.recv_into(view[got:])
            if not n:
                raise ProtocolError(f"connection closed after {got} of {nbytes} body bytes")
            got += n
        return view

    def _read_chunked(self) -> bytearray:
        body = bytearray()
        while True:
            size_field = self._readline().split(b";")[0].strip()
            try:
                size = int(size_field, 16)
            except ValueError:
                raise ProtocolError(f"bad chunk size {size_field[:40]!r}") from None
            if not size:
                break
            body += self._read_exact(size)
            self._readline()
        while self._readline() not in (b"\r\n", b"\n"):  # trailers
            pass
        return body

    def _read_to_close(self) -> bytearray:
        body = bytearray(self._view[self._pos:self._end])
        self._pos = self._end = 0
        while chunk := self.sock.recv(_READ_BYTES):
            body += chunk
        return body


def _parse_head(text: str) -> tuple[int, dict[str, str]]:
    """An answer head (status line to the empty line) -> (status, {lowercased name: value})."""
    lines = text.split("\n")
    status_line = lines[0].split(None, 2)
    if len(status_line) < 2 or not status_line[0].startswith("HTTP/1.") or not status_line[1].isdigit():
        raise ProtocolError(f"not an HTTP/1.x status line: {lines[0][:80].encode('latin-1')!r}")
    if len(lines) - 3 > _MAX_HEADERS:  # the status line and the empty line's two pieces
        raise ProtocolError("too many response headers")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if colon:  # the empty line's pieces have none
            headers[name.strip().lower()] = value.strip()
    return int(status_line[1]), headers


def _kernel_timeouts(sock: socket.socket, timeout_s: float) -> None:
    """Make `sock` blocking, each send and receive timed out by the kernel after `timeout_s`
    (it then fails with EAGAIN: BlockingIOError, which `request` reports as TimeoutError)."""
    microseconds = max(1, round(timeout_s * 1e6))  # a zero timeval would mean "never time out"
    timeval = struct.pack("@ll", microseconds // 1_000_000, microseconds % 1_000_000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    sock.settimeout(None)


def _send_all(sock: socket.socket, parts: list[Any], nbytes: int) -> None:
    """sendmsg the parts, of `nbytes` together (scatter-gather: no join, no copy), resuming
    after partial sends."""
    sent = sock.sendmsg(parts)
    if sent == nbytes:  # the usual case: all of it at once, no views made
        return
    views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
    while True:
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if not views:
            return
        if sent:
            views[0] = views[0][sent:]
        sent = sock.sendmsg(views)

"""A minimal persistent HTTP/1.1 connection for the sync client.

Why not http.client: it sends the request head and the body in separate syscalls, parses
headers with the email package, and has no scatter-gather send. Here a request (head, small
fields and the tensor's memory) goes out in one `sendmsg` without joining, and a response body
of known length is read straight into one preallocated buffer. It speaks only what the sidecar
answers: Content-Length or chunked bodies, keep-alive unless the server says close.
"""
from __future__ import annotations

import socket
from typing import Any, Sequence

import torch

from kvstore.host_memory import empty_host

_MAX_HEAD_LINE = 16 << 10
_MAX_HEADERS = 100
_SMALL_BODY_BYTES = 64 << 10


class ProtocolError(OSError):
    """The server's answer is not HTTP/1.1 as expected, or the connection broke mid-answer."""


class Connection:
    def __init__(self, host: str, port: int, *, timeout_s: float, socket_buffer_bytes: int = 0):
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if socket_buffer_bytes:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, socket_buffer_bytes)
        self._reader = self.sock.makefile("rb", buffering=256 << 10)
        self.served = 0  # requests answered on this connection (a reused one may be stale)
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._reader.close()
            self.sock.close()

    def request(self, head: bytes, parts: Sequence[Any]) -> tuple[int, str, bytearray | memoryview]:
        """Send `head` (request line and headers, blank line included) then `parts`; read the
        answer -> (status, content type, body)."""
        _send_all(self.sock, [head, *parts])
        status, headers = self._read_head()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = self._read_chunked()
        elif "content-length" in headers:
            body = self._read_exact(int(headers["content-length"]))
        else:  # delimited by close
            body = bytearray(self._reader.read())
            headers["connection"] = "close"
        self.served += 1
        if headers.get("connection", "").lower() == "close":
            self.close()
        return status, headers.get("content-type", ""), body

    def _readline(self) -> bytes:
        line = self._reader.readline(_MAX_HEAD_LINE)
        if not line.endswith(b"\n"):
            raise ProtocolError("connection closed while reading the response head")
        return line

    def _read_head(self) -> tuple[int, dict[str, str]]:
        status_line = self._readline().split(None, 2)
        if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/1."):
            raise ProtocolError(f"not an HTTP/1.x status line: {b' '.join(status_line)[:80]!r}")
        headers: dict[str, str] = {}
        for _ in range(_MAX_HEADERS):
            line = self._readline()
            if line in (b"\r\n", b"\n"):
                return int(status_line[1]), headers
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        raise ProtocolError("too many response headers")

    def _read_exact(self, nbytes: int) -> bytes | memoryview:
        if nbytes <= _SMALL_BODY_BYTES:  # an answer without kv (or a shared-memory one)
            data = self._reader.read(nbytes)
            if len(data) != nbytes:
                raise ProtocolError(f"connection closed after {len(data)} of {nbytes} body bytes")
            return data
        # Unzeroed (and in huge pages when large): a zero-filled bytearray page-faulted once per
        # 4 KiB before the first byte arrived, a third of a 2 MiB fetch's time on loopback.
        view = empty_host((nbytes,), torch.uint8).numpy().data
        got = 0
        while got < nbytes:
            n = self._reader.readinto(view[got:])
            if not n:
                raise ProtocolError(f"connection closed after {got} of {nbytes} body bytes")
            got += n
        return view

    def _read_chunked(self) -> bytearray:
        body = bytearray()
        while size := int(self._readline().split(b";")[0], 16):
            body += self._read_exact(size)
            self._readline()
        while self._readline() not in (b"\r\n", b"\n"):  # trailers
            pass
        return body


def _send_all(sock: socket.socket, parts: list[Any]) -> None:
    """sendmsg the parts (scatter-gather: no join, no copy), resuming after partial sends."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]

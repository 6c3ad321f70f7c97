"""The sync client's HTTP/1.1 connection reads an answer's head whether it arrives in one piece
(the sidecar's way) or split across reads, with CRLF or bare LF line ends, and refuses what is
not HTTP."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from kvstore.api.http1 import Connection, ProtocolError


def _serve_once(pieces: list[bytes]) -> tuple[str, int]:
    """A one-connection server that reads a request, then sends `pieces` with a pause between."""
    listener = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            for piece in pieces:
                conn.sendall(piece)
                time.sleep(0.02)  # the client's read returns what has come so far
        listener.close()

    threading.Thread(target=run, daemon=True).start()
    return listener.getsockname()


@pytest.mark.parametrize("pieces, body", [
    ([b"HTTP/1.1 200 OK\r\nContent-Type: application/msgpack\r\nContent-Length: 3\r\n\r\nabc"], b"abc"),
    ([b"HTTP/1.1 200 OK\r\nContent-Ty", b"pe: application/msgpack\r\nContent-Length: 3\r\n", b"\r\nabc"], b"abc"),
    ([b"HTTP/1.1 200 OK\nContent-Type: application/msgpack\nContent-Length: 3\n\nabc"], b"abc"),
    ([b"HTTP/1.1 200 OK\r\nContent-Type: application/msgpack\r\nContent-Length: 3\r\n\r", b"\nabc"], b"abc"),
    ([b"HTTP/1.1 200 OK\r\nContent-Type: application/msgpack\r\nContent-Length: 7\r\n\r\na\n\nb\r\n\r"],
     b"a\n\nb\r\n\r"),
], ids=["one-piece", "split", "bare-lf", "split-in-the-empty-line", "body-with-empty-lines"])
def test_an_answer_head_is_read_however_it_arrives(pieces: list[bytes], body: bytes) -> None:
    host, port = _serve_once(pieces)
    conn = Connection(host, port, timeout_s=5)
    try:
        status, content_type, got = conn.request(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", [])
        assert (status, content_type, bytes(got)) == (200, "application/msgpack", body)
    finally:
        conn.close()


def test_an_answer_that_is_not_http_is_a_protocol_error() -> None:
    host, port = _serve_once([b"SSH-2.0-OpenSSH\r\n\r\n"])
    conn = Connection(host, port, timeout_s=5)
    try:
        with pytest.raises(ProtocolError, match="not an HTTP/1.x status line"):
            conn.request(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", [])
    finally:
        conn.close()

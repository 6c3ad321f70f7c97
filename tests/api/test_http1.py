"""The sync client's HTTP/1.1 connection reads an answer's head whether it arrives in one piece
(the sidecar's way) or split across reads, with CRLF or bare LF line ends, and refuses what is
not HTTP."""
from __future__ import annotations

import socket
import threading
import time

import pytest

import numpy as np

from kvstore.api.client.http1 import Connection, ProtocolError, _send_all


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


def _serve_answers(answers: list[bytes], close_after: bool = False) -> tuple[str, int]:
    """A one-connection server that answers each request it reads with the next of `answers`."""
    listener = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        conn, _ = listener.accept()
        with conn:
            for answer in answers:
                conn.recv(65536)
                conn.sendall(answer)
            if not close_after:
                conn.recv(65536)  # until the client closes
        listener.close()

    threading.Thread(target=run, daemon=True).start()
    return listener.getsockname()


def test_answers_with_the_same_head_bytes_are_each_read_whole() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/msgpack\r\nContent-Length: 3\r\n\r\n"
    other = b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: 5\r\n\r\n"
    host, port = _serve_answers([head + b"abc", head + b"def", other + b"gone!", head + b"ghi"])
    conn = Connection(host, port, timeout_s=5)
    try:
        got = [conn.request(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", []) for _ in range(4)]
        assert [(status, ctype, bytes(body)) for status, ctype, body in got] == [
            (200, "application/msgpack", b"abc"), (200, "application/msgpack", b"def"),
            (404, "application/json", b"gone!"), (200, "application/msgpack", b"ghi")]
        assert conn.served == 4 and not conn.closed
    finally:
        conn.close()


def test_an_answer_without_a_length_is_read_to_the_close_and_closes_the_connection() -> None:
    host, port = _serve_answers([b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it"], close_after=True)
    conn = Connection(host, port, timeout_s=5)
    status, ctype, body = conn.request(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", [])
    assert (status, ctype, bytes(body)) == (200, "text/plain", b"all of it") and conn.closed


def test_an_answer_that_never_comes_times_out() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:  # accepts (in the backlog), never answers
        conn = Connection(*listener.getsockname()[:2], timeout_s=0.2)
        try:
            began = time.monotonic()
            with pytest.raises(TimeoutError, match="timed out"):
                conn.request(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", [])
            assert 0.15 < time.monotonic() - began < 5
        finally:
            conn.close()


class _TrickleSocket:
    """Takes at most `step` bytes per sendmsg, as a full socket buffer does."""

    def __init__(self, step: int):
        self.step, self.got = step, bytearray()

    def sendmsg(self, buffers: list) -> int:
        joined = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)[:self.step]
        self.got += joined
        return len(joined)


@pytest.mark.parametrize("step", [1, 5, 7, 1 << 20])
def test_every_byte_of_every_part_is_sent_once_however_little_each_send_takes(step: int) -> None:
    kv = np.arange(24, dtype=np.float16).reshape(2, 3, 4)  # a multi-byte, multi-dimensional part
    parts = [b"head\r\n\r\n", b"", memoryview(kv), b"tail"]
    sock = _TrickleSocket(step)
    _send_all(sock, parts, sum(memoryview(p).nbytes for p in parts))  # type: ignore[arg-type]
    assert bytes(sock.got) == b"head\r\n\r\n" + kv.tobytes() + b"tail"

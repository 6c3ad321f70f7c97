"""The Redis tier's read path: GET (or GETEX) replies received straight into one fresh buffer
per value, or into buffers the caller gives, pipelined in batches on one connection.

Why not redis-py's own parser: it receives a reply in 64 KiB socket reads, copies each into
hiredis' buffer and then the whole value into a new bytes object, with three Python calls per
64 KiB; a 2 MiB value costs three copies and a hundred-odd calls, and a pipeline of many such
values ran slower than as many single GETs (docs/redis.md). Here the value's bytes go from the socket
into the buffer they are decoded from, in as few `recv_into` calls as the kernel allows.

- `pipelined_gets(pool, batches, ttl_s, ahead)` borrows one connection from a redis-py
  connection pool (so AUTH, SELECT, TLS and unix sockets are redis-py's), sends the GETs of up
  to `ahead` batches before reading the first, and yields each batch's values in order: the
  next batch's replies are on the wire while the caller decodes this one. Outstanding replies
  stay bounded (Redis builds a pipeline's whole reply in memory first, so a deep pipeline of big
  values is slower than a few in flight).
- A value is a uint8 tensor (value bytes,) the caller may keep; a missing key is None; a
  per-key error reply (WRONGTYPE) is a `redis.ResponseError`, as in redis-py's pipelines.
- A key may come with a `Receiver` instead, which reads its value from the reader in its own
  way (`fill`, `fill_chunks`: scattered over many buffers with one `recvmsg_into`, each piece
  handed on as it lands; `read_bulk` for the rest) and returns what stands for it
  (tiers/redis_landing.py: a page's payload straight into its place in a fetch answer).
- A connection left with unread replies (the caller stopped early, a timeout, a malformed
  reply) is disconnected before it goes back to the pool, so no later command reads them.

What it does not do: commands other than GET / GETEX, RESP3 push messages (the tier's client
speaks RESP2, tiers/redis_conn.py), Redis Cluster (the tier uses
redis-py for those), retries (the tier's breaker decides what a failure means).
"""
from __future__ import annotations

import ssl
from typing import Any, Callable, Iterator, Sequence, Union

import redis
import torch

LINE_BUFFER_BYTES = 1 << 16  # reply headers, nil replies and small values are read through this
MAX_LINE_BYTES = 1 << 12  # a reply header is "$<length>\r\n" or a short error line
CRLF = b"\r\n"
MAX_IOV = 256  # buffers per recvmsg_into call (Linux allows 1024)

Value = Union[torch.Tensor, None, redis.exceptions.ResponseError]
# Receives one bulk value of the given length from the reader in its own way (into buffers the
# caller gave, tiers/redis_landing.py) and returns what stands for it in the batch's values.
Receiver = Callable[["ReplyReader", int], Any]


class ReplyReader:
    """RESP2 replies to GET from one socket: headers through a small buffer, each value's
    bytes received into a buffer allocated for it."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._buf = bytearray(LINE_BUFFER_BYTES)
        self._view = memoryview(self._buf)
        self._start = 0  # unread bytes are self._buf[self._start:self._end]
        self._end = 0
        # TLS sockets have no recvmsg_into (fill_chunks needs it).
        self.scatters = hasattr(sock, "recvmsg_into") and not isinstance(sock, ssl.SSLSocket)

    @property
    def drained(self) -> bool:
        """Nothing received beyond the replies read (the connection is clean to reuse)."""
        return self._start == self._end

    def read_value(self, receive: Receiver | None = None) -> Value | Any:
        """The next reply; a bulk value goes to `receive` when given (a fresh tensor if not)."""
        line = self._line()
        kind = line[:1]
        if kind == b"$":
            nbytes = int(line[1:])
            if nbytes < 0:
                return None
            return self.read_bulk(nbytes) if receive is None else receive(self, nbytes)
        if kind == b"-":
            return redis.exceptions.ResponseError(line[1:].decode("utf-8", "replace"))
        if kind == b"_":  # RESP3's null, should a URL ask for protocol=3
            return None
        raise redis.exceptions.InvalidResponse(f"unexpected reply to GET: {line[:64]!r}")

    def read_bulk(self, nbytes: int, head: bytes | bytearray = b"") -> torch.Tensor:
        """The rest of a bulk value of `nbytes` whose first bytes `head` the caller has read
        already, as one fresh uint8 tensor (value bytes,)."""
        # torch.empty: no zero fill (a bytearray would write every byte once more). The CRLF
        # after the value lands in the buffer too, so the last recv needs no second call.
        value = torch.empty(nbytes + len(CRLF), dtype=torch.uint8)  # (value bytes + 2,)
        dest = value.numpy().data
        dest[:len(head)] = head
        have = len(head) + self._take(dest[len(head):])
        while have < len(dest):
            got = self._sock.recv_into(dest[have:])
            if not got:
                raise redis.exceptions.ConnectionError("Redis closed the connection mid-reply")
            have += got
        if dest[nbytes:] != CRLF:
            raise redis.exceptions.InvalidResponse("bulk reply not terminated by CRLF")
        return value[:nbytes]

    def read_exact(self, nbytes: int) -> bytes:
        """The next `nbytes` of the reply being read (a value's header: usually buffered already)."""
        start = self._start
        if self._end - start >= nbytes:
            self._start = start + nbytes
            return bytes(self._view[start:start + nbytes])
        dest = bytearray(nbytes)
        self.fill(memoryview(dest))
        return bytes(dest)

    def fill(self, dest: memoryview) -> None:
        """Fill `dest` with the next bytes of the reply being read."""
        have = self._take(dest)
        while have < len(dest):
            got = self._sock.recv_into(dest[have:])
            if not got:
                raise redis.exceptions.ConnectionError("Redis closed the connection mid-reply")
            have += got

    def fill_chunks(self, chunks: Sequence[memoryview], on_piece: Callable[[memoryview], Any]) -> None:
        """Fill `chunks` in turn with the next bytes of the reply, calling `on_piece` on each
        piece in order as it lands (a checksum computed while the bytes are in cache).
        One `recvmsg_into` fills as many chunks as the kernel has bytes for: a 2 MiB page in
        64 slices of 32 KiB takes a few calls, not one or more per slice. Needs `scatters`."""
        assert self.scatters, "fill_chunks needs a socket with recvmsg_into"
        i, off = 0, 0  # the next byte goes to chunks[i][off]
        view, start, buffered = self._view, self._start, self._end - self._start
        while buffered and i < len(chunks):  # first what came with the reply header
            chunk = chunks[i]
            take = min(len(chunk), buffered)
            chunk[:take] = view[start:start + take]
            on_piece(chunk if take == len(chunk) else chunk[:take])
            start += take
            buffered -= take
            if take == len(chunk):
                i += 1
            else:
                off = take
        self._start = start
        left = sum(map(len, chunks[i:])) - off  # bytes still to come from the socket
        while left:
            chunk = chunks[i]
            if off == len(chunk):  # filled (or empty)
                i, off = i + 1, 0
                continue
            iov = [chunk[off:] if off else chunk, *chunks[i + 1:i + MAX_IOV]]
            tail = i + MAX_IOV >= len(chunks)
            if tail:
                # What follows the value (its CRLF, the next replies) goes to the reply buffer
                # in the same call: a small page costs one recv, not three.
                self._start = self._end = 0
                iov.append(self._view)
            got = self._sock.recvmsg_into(iov)[0]
            if tail and got > left:
                self._end = got - left
                got = left
            if not got:
                raise redis.exceptions.ConnectionError("Redis closed the connection mid-reply")
            left -= got
            while got:  # hand each filled piece on, chunk by chunk
                chunk = chunks[i]
                room = len(chunk) - off
                if room <= got:
                    on_piece(chunk[off:] if off else chunk)
                    got -= room
                    i, off = i + 1, 0
                else:
                    on_piece(chunk[off:off + got])
                    off += got
                    got = 0

    def end_bulk(self) -> None:
        """Read the CRLF that ends a bulk value whose bytes the caller has read."""
        if self.read_exact(len(CRLF)) != CRLF:
            raise redis.exceptions.InvalidResponse("bulk reply not terminated by CRLF")

    def _take(self, dest: memoryview) -> int:
        """Copy into `dest` what is buffered already (up to its length); bytes copied."""
        have = min(self._end - self._start, len(dest))
        dest[:have] = self._view[self._start:self._start + have]
        self._start += have
        return have

    def _line(self) -> bytes:
        while True:
            end = self._buf.find(CRLF, self._start, self._end)
            if end >= 0:
                line = bytes(self._view[self._start:end])
                self._start = end + len(CRLF)
                return line
            if self._end - self._start > MAX_LINE_BYTES:
                raise redis.exceptions.InvalidResponse("reply header too long")
            self._fill()

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):  # keep the partial line, make room after it
            unread = self._end - self._start
            self._view[:unread] = self._view[self._start:self._end]
            self._start, self._end = 0, unread
        got = self._sock.recv_into(self._view[self._end:])
        if not got:
            raise redis.exceptions.ConnectionError("Redis closed the connection")
        self._end += got


def pipelined_gets(pool: redis.ConnectionPool, batches: list[list[bytes]], ttl_s: int | None,
                   ahead: int, receivers: list[list[Receiver | None]] | None = None) -> Iterator[list[Value | Any]]:
    """The values of each batch of Redis keys, one list per batch in order, with the GETs of up
    to `ahead` batches (>= 1) on the wire at once. GETEX refreshes a TTL of `ttl_s` seconds on
    every read (a page in use stays alive). `receivers`, shaped as `batches`: who receives each
    key's value (None: a fresh tensor). Raises redis-py's connection errors and OSError
    (socket timeouts included) when Redis is unreachable or slow."""
    assert ahead >= 1
    if not batches:
        return
    conn = pool.get_connection()
    released = False
    try:
        reader: ReplyReader | None = None
        sent = 0
        for i, batch in enumerate(batches):
            while sent < min(len(batches), i + ahead):
                _send(conn, batches[sent], ttl_s)
                sent += 1
            if reader is None:
                reader = ReplyReader(conn._sock)  # after a send: that connects a dropped connection
            if receivers is None:
                values = [reader.read_value() for _ in batch]
            else:
                values = [reader.read_value(receive) for receive in receivers[i]]
            if i == len(batches) - 1:
                # Give the connection back before the last yield: a caller that has what it
                # asked for need not resume this generator.
                _release(pool, conn, clean=reader.drained)
                released = True
            yield values
    finally:
        if not released:  # stopped early or failed: replies may be left unread
            _release(pool, conn, clean=False)


def _release(pool: redis.ConnectionPool, conn: Any, *, clean: bool) -> None:
    if not clean:  # unread (or partly read) replies: no later command may read them as its own
        conn.disconnect()
    pool.release(conn)


def _send(conn: Any, keys: list[bytes], ttl_s: int | None) -> None:
    if keys:
        conn.send_packed_command([pack_gets(keys, ttl_s)], check_health=False)  # a list: it sends each item


def pack_gets(keys: list[bytes], ttl_s: int | None) -> bytes:
    """GET (GETEX ... EX ttl_s) of each key in RESP, the bytes redis-py's `pack_commands` makes,
    formatted here in one expression per key: redis-py's generic packer is much slower, a share
    of a small page's read that pipelining cannot hide."""
    if ttl_s:
        tail = b"\r\n$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(ttl_s)), ttl_s)
        return b"".join(b"*4\r\n$5\r\nGETEX\r\n$%d\r\n%b%b" % (len(key), key, tail) for key in keys)
    return b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(key), key) for key in keys)

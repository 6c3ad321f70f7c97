"""An HTTP/1.1 request as the data plane (api/server/fast_path.py) reads it: its head, parsed once per
distinct head bytes (`parse_head`), and a chunked body as it arrives (`ChunkedBody`).

What a head may be is what aiohttp's parser accepted before the data plane read every request,
and what it refused is refused here (`BadRequest`, answered 400 and the connection closed):
a request line that is not `METHOD target HTTP/1.0|1.1`, a header name that is not a token
(a space before the colon, a folded line), a bare LF, a line past MAX_LINE_BYTES, a repeated or
non-numeric Content-Length, Transfer-Encoding beside Content-Length or other than chunked.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote

from kvstore.errors import PayloadTooLarge

MAX_LINE_BYTES = 8190  # aiohttp's limit on a request or header line
MAX_HEAD_BYTES = 64 << 10  # a whole head; the clients' are a few hundred bytes
_METHOD = re.compile(rb"[A-Z]{1,20}")  # aiohttp (llhttp) refused lowercase methods
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9a-z-]+")  # an HTTP header name (RFC 9110 token), lowercased
_UNSAFE = re.compile(rb"[\x00\r\n]")  # never inside a line: NUL, or a CR or LF that is not a line end


class BadRequest(Exception):
    """A request the data plane cannot frame: answered 400 in plain text, then the connection is
    closed (what follows it cannot be trusted to start a request)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@dataclass(frozen=True, slots=True)
class RequestHead:
    method: str
    path: str  # decoded, without the query: what routes match
    http11: bool  # HTTP/1.1 (else 1.0)
    headers: dict[bytes, bytes]  # lowercased name -> value (the first, when a name repeats)
    content_length: int | None  # None: chunked
    keep_alive: bool  # the connection stays open after the answer
    expect: bytes | None  # lowercased; aiohttp's rule: 100-continue is answered, anything else 417
    content_type: str  # the media type, lowercased, without parameters ("" when absent)
    accept: str
    authorization: str

    @property
    def chunked(self) -> bool:
        return self.content_length is None


def parse_head(head: bytes) -> RequestHead:
    """`head`: the request line and header lines, CRLF-separated, without the empty line."""
    request_line, *lines = head.split(b"\r\n")
    if len(request_line) > MAX_LINE_BYTES:
        raise BadRequest(f"Got more than {MAX_LINE_BYTES} bytes when reading the request line")
    parts = request_line.split(b" ")
    if len(parts) != 3 or _UNSAFE.search(request_line):
        raise BadRequest(f"Bad request line: {request_line[:100]!r}")
    method, target, version = parts
    if not _METHOD.fullmatch(method):
        raise BadRequest(f"Invalid method encountered: {method[:40]!r}")
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise BadRequest(f"Bad HTTP version: {version[:40]!r}")
    headers: dict[bytes, bytes] = {}
    for line in lines:
        if len(line) > MAX_LINE_BYTES:
            raise BadRequest(f"Got more than {MAX_LINE_BYTES} bytes when reading a header line")
        name, colon, value = line.partition(b":")
        name = name.lower()
        if not colon or not _TOKEN.fullmatch(name) or _UNSAFE.search(value):
            raise BadRequest(f"Invalid header line: {line[:100]!r}")
        value = value.strip(b" \t")
        if name in headers:
            if name == b"content-length":
                raise BadRequest("Duplicate Content-Length")
            if name == b"transfer-encoding":
                headers[name] += b", " + value
            continue
        headers[name] = value
    http11 = version == b"HTTP/1.1"
    connection = {token.strip() for token in headers.get(b"connection", b"").lower().split(b",")}
    expect = headers.get(b"expect")
    return RequestHead(
        method=method.decode(), path=_path(target), http11=http11, headers=headers,
        content_length=_content_length(headers),
        keep_alive=b"close" not in connection if http11 else b"keep-alive" in connection,
        expect=expect.lower() if expect is not None else None,
        content_type=headers.get(b"content-type", b"").split(b";")[0].strip().lower().decode("latin-1"),
        accept=headers.get(b"accept", b"").decode("latin-1"),
        authorization=headers.get(b"authorization", b"").decode("latin-1"))


def _path(target: bytes) -> str:
    """The path a request target names: origin form (`/v1/lookup?x=1`) or absolute form
    (`http://host/v1/lookup`), its query dropped and its %-escapes decoded, as aiohttp routed it."""
    if target.startswith((b"http://", b"https://")):
        slash = target.find(b"/", target.index(b"//") + 2)
        target = target[slash:] if slash >= 0 else b"/"
    elif not target.startswith(b"/"):
        raise BadRequest(f"Invalid request target: {target[:100]!r}")
    path = target.split(b"?", 1)[0].split(b"#", 1)[0].decode("latin-1")
    return unquote(path) if "%" in path else path


def _content_length(headers: dict[bytes, bytes]) -> int | None:
    """The body's length; None for a chunked body; 0 without either header."""
    encoding = headers.get(b"transfer-encoding")
    length = headers.get(b"content-length")
    if encoding is not None:
        if length is not None:
            raise BadRequest("Transfer-Encoding can't be present with Content-Length")
        if encoding.lower() != b"chunked":
            raise BadRequest(f"Unsupported Transfer-Encoding: {encoding[:40]!r} (only chunked)")
        return None
    if length is None:
        return 0
    if not length.isdigit() or len(length) > 18:
        raise BadRequest(f"Invalid character in Content-Length: {length[:40]!r}")
    return int(length)


class ChunkedBody:
    """A chunked body read as its bytes arrive. `feed(buf)` uses what it can of `buf` and says
    how much (a chunk-size line split across reads waits, unused, for the rest); `done` once the
    last chunk and the trailers are in. `keep`: collect the payload in `body` (a data request's),
    else only find where the body ends (an admin request's, which aiohttp reads).
    `max_bytes`: PayloadTooLarge as soon as the chunks announce more (None: no limit)."""

    __slots__ = ("keep", "max_bytes", "body", "total", "left", "state")

    def __init__(self, *, keep: bool, max_bytes: int | None = None):
        self.keep, self.max_bytes = keep, max_bytes
        self.body = bytearray()
        self.total = 0  # payload bytes announced so far
        self.left = 0  # of the current chunk
        self.state = "size"  # size -> data -> data-end -> size ... -> trailer -> done

    @property
    def done(self) -> bool:
        return self.state == "done"

    def feed(self, buf: bytes | bytearray | memoryview) -> int:
        pos, size = 0, len(buf)
        while pos < size and self.state != "done":
            if self.state == "data":
                step = min(self.left, size - pos)
                if self.keep:
                    self.body += buf[pos:pos + step]
                self.left -= step
                pos += step
                if not self.left:
                    self.state = "data-end"
                continue
            end = bytes(buf[pos:pos + MAX_LINE_BYTES + 2]).find(b"\r\n")
            if end < 0:
                if size - pos > MAX_LINE_BYTES:
                    raise BadRequest("chunked body: a line longer than the limit")
                break  # the rest of the line is still on its way
            line = bytes(buf[pos:pos + end])
            pos += end + 2
            if self.state == "data-end":
                if line:
                    raise BadRequest("chunked body: expected CRLF after a chunk's data")
                self.state = "size"
            elif self.state == "size":
                self._size(line)
            elif not line:  # trailer: an empty line ends the body
                self.state = "done"
        return pos

    def _size(self, line: bytes) -> None:
        digits = line.split(b";", 1)[0].strip()
        if not digits or len(digits) > 16 or digits.strip(b"0123456789abcdefABCDEF"):
            raise BadRequest(f"chunked body: bad chunk size {line[:40]!r}")
        self.left = int(digits, 16)
        self.total += self.left
        if self.max_bytes is not None and self.total > self.max_bytes:
            raise PayloadTooLarge(f"body: exceeds the limit of {self.max_bytes} bytes", field="body")
        self.state = "data" if self.left else "trailer"

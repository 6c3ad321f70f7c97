"""Same-host shared memory between the sidecar and a client: KV bytes without the socket.

On loopback a 2 MiB page costs two kernel copies through TCP (client -> kernel -> server) plus
the server's copy into its tier; a client on the same host can instead hand the sidecar a memory
region once and let KV move by one user-space copy each way. This is the sidecar's half:

    client: memfd (sealed against shrinking) + a 32-byte secret written at its start
            POST /v1/shm {"pid", "fd", "nbytes", "secret"}       on each connection, once
    server: opens /proc/<pid>/fd/<fd>, checks size, seals and secret, maps it (this module)
    fetch:  {"shm": {"offset", "nbytes"}} -> the answer's KV is written into that region,
            the reply says {"shm": {"offset", "nbytes"}} instead of carrying `kv`
    store:  {"shm": {"offset", "nbytes"}} instead of `kv`: the KV is read from that region

Why each check:
- /proc/<pid>/fd: the kernel lets us open another process's memfd only if we may ptrace it
  (same user), so a client cannot make the sidecar map memory of a process it does not own...
- ...but the sidecar itself may be able to, so the secret proves the caller can read the
  memory it names (a process of another user cannot), or it could make the sidecar write its
  KV into a stranger's buffer.
- F_SEAL_SHRINK: a mapped file that shrinks turns the sidecar's next copy into SIGBUS (a crash
  for every client); a sealed memfd cannot shrink.
- A registration belongs to its connection (the transport): another connection cannot name it,
  and it is unmapped when the connection is gone and the last view of it is dropped.

The region is the client's memory: the sidecar never keeps a view past the request, and KV
read from it is copied into the tiers before the answer is sent (the store does not keep
references to its input).
"""
from __future__ import annotations

import asyncio
import fcntl
import hmac
import mmap
import os
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.api.protocol import HEADER_BYTES, SECRET_BYTES
from kvstore.config import check_int
from kvstore.errors import InvalidRequest, SharedMemoryRefused

MIN_ARENA_BYTES = HEADER_BYTES + (64 << 10)
MAX_ARENA_BYTES = 1 << 40


@dataclass(frozen=True)
class Registration:
    pid: int
    fd: int
    nbytes: int
    secret: bytes

    def __post_init__(self) -> None:
        check_int("pid", self.pid, 1, (1 << 31) - 1)
        check_int("fd", self.fd, 0, (1 << 31) - 1)
        check_int("nbytes", self.nbytes, MIN_ARENA_BYTES, MAX_ARENA_BYTES)
        if not isinstance(self.secret, (bytes, bytearray, memoryview)) or len(self.secret) != SECRET_BYTES:
            raise ValueError(f"secret: expected a bin of {SECRET_BYTES} bytes")


class Arena:
    """One client's mapped region, as a flat uint8 array over the whole mapping."""

    def __init__(self, registration: Registration):
        self.nbytes = registration.nbytes
        self._map = _open_and_map(registration)
        self.bytes = np.frombuffer(self._map, dtype=np.uint8)  # keeps the mapping alive

    def region_array(self, offset: int, nbytes: int, *, field: str) -> np.ndarray:
        """Bytes [offset, offset + nbytes) as a flat uint8 array (a view, no copy)."""
        if offset < HEADER_BYTES or nbytes < 0 or offset + nbytes > self.nbytes:
            raise InvalidRequest(f"{field}: region [{offset}, {offset + nbytes}) is outside the shared memory's "
                                 f"usable bytes [{HEADER_BYTES}, {self.nbytes})", field=field)
        return self.bytes[offset:offset + nbytes]

    def region(self, offset: int, nbytes: int, *, field: str) -> torch.Tensor:
        """The same bytes as a flat uint8 tensor (sliced by numpy: a torch slice costs several times more)."""
        return torch.from_numpy(self.region_array(offset, nbytes, field=field))


def _open_and_map(reg: Registration) -> mmap.mmap:
    path = f"/proc/{reg.pid}/fd/{reg.fd}"
    try:
        # Only memfds: opening whatever else a descriptor names (a device, a FIFO) can have side
        # effects of its own.
        if not os.readlink(path).startswith("/memfd:"):
            raise SharedMemoryRefused(f"shm: {path} is not a memfd", field="shm")
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise SharedMemoryRefused(f"shm: cannot open the client's memory ({path}: {exc.strerror}); the client "
                                  "must run on the sidecar's host, as the sidecar's user", field="shm") from None
    try:
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            raise SharedMemoryRefused("shm: the descriptor is not a sealable memfd", field="shm") from None
        if not seals & fcntl.F_SEAL_SHRINK:
            raise SharedMemoryRefused("shm: the memfd must be sealed against shrinking (F_SEAL_SHRINK)", field="shm")
        size = os.fstat(fd).st_size
        if size != reg.nbytes:
            raise SharedMemoryRefused(f"shm: the memfd holds {size} bytes, the request says {reg.nbytes}", field="shm")
        mapping = mmap.mmap(fd, reg.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping keeps the memory; the descriptor is not needed
    if not hmac.compare_digest(mapping[:SECRET_BYTES], bytes(reg.secret)):
        mapping.close()
        raise SharedMemoryRefused("shm: the secret does not match the memory's first bytes", field="shm")
    return mapping


class SharedMemoryArenas:
    """Registrations by connection. A transport is a weak key: a closed connection's arena goes
    with it (the mapping is unmapped once no request still views it)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._by_transport: weakref.WeakKeyDictionary[asyncio.BaseTransport, Arena] = weakref.WeakKeyDictionary()

    def open(self, registration: Registration) -> Arena:
        """Blocking (opens and maps the client's memfd): call it off the event loop."""
        if not self.enabled:
            raise SharedMemoryRefused("shm: shared memory is disabled on this sidecar (--no-shared-memory)",
                                      field="shm")
        return Arena(registration)

    def bind(self, transport: asyncio.BaseTransport | None, arena: Arena) -> None:
        """On the event loop (the table is the loop's): `arena` serves this connection from now on,
        replacing an earlier registration of it."""
        if transport is None or transport.is_closing():
            raise SharedMemoryRefused("shm: the connection is closing", field="shm")
        self._by_transport[transport] = arena

    def arena(self, transport: asyncio.BaseTransport | None) -> Arena:
        arena = self._by_transport.get(transport) if transport is not None else None
        if arena is None:
            raise SharedMemoryRefused("shm: no shared memory is registered on this connection (POST /v1/shm first)",
                                      field="shm")
        return arena

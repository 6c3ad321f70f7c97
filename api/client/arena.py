"""The client's half of same-host shared memory (the sidecar's half: api/server/shared_memory.py).

One `ClientArena` per `KVStoreClient`: a memfd of `nbytes`, sealed so it can neither shrink nor
grow, whose first 32 bytes hold a random secret. Each of the client's connections registers it
with the sidecar once (POST /v1/shm). After that a store copies its KV into a region and sends
the region's place instead of the bytes; a fetch names a free region and the sidecar writes the
answer there.

Regions are handed out first-fit from a sorted free list (lowest offset first, so a steady
workload keeps reusing the same, already-faulted pages). Invariants of the free list:
  - `_free` holds disjoint (offset, nbytes) runs sorted by offset, never two adjacent runs (they
    are merged on release), all inside [HEADER_BYTES, nbytes);
  - every byte of the usable range is either in one free run or in exactly one live region.

A fetch answer stays in its region for as long as the tensor viewing it lives: the region goes
back to the free list when the last view of it is garbage (a weak reference's callback on the
numpy array the tensor was built from). A callback that fires while the arena's lock is held
(the collector can run inside any allocation, on the thread holding it) never waits for it: the
region is queued and the next call that takes the lock gives it back. A tensor kept forever
therefore keeps its region; when no free run is large enough the client simply uses the socket
for that call.
"""
from __future__ import annotations

import bisect
import fcntl
import mmap
import os
import secrets
import threading
import weakref
from typing import Callable

import numpy as np

from kvstore.api.protocol import HEADER_BYTES, SECRET_BYTES, SHM_REGISTRATION_FIELDS

ALIGN_BYTES = 4096  # regions start on page boundaries: copies into them stay aligned


class ClientArena:
    def __init__(self, nbytes: int):
        if nbytes < HEADER_BYTES + ALIGN_BYTES:
            raise ValueError(f"shared_memory_bytes: must be 0 (off) or >= {HEADER_BYTES + ALIGN_BYTES}, got {nbytes}")
        self.nbytes = nbytes
        self.fd = os.memfd_create("kvstore-client", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._map = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(self.fd)
            raise
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self._map[:SECRET_BYTES] = self.secret
        self._array = np.frombuffer(self._map, dtype=np.uint8)
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(HEADER_BYTES, nbytes - HEADER_BYTES)]
        # id(weak reference) -> (it, offset, allocated bytes) of each adopted region: keeps the
        # reference alive until its array dies and its callback releases the region.
        self._adopted: dict[int, tuple[weakref.ref, int, int]] = {}
        # (offset, allocated bytes) of adopted regions whose array died while the lock was held
        # (the collector runs inside any allocation, on the thread that holds the lock); the
        # next locked call gives them back. Appended without the lock: list.append is atomic.
        self._died: list[tuple[int, int]] = []

    def registration(self) -> dict[str, object]:
        """The body of POST /v1/shm."""
        return dict(zip(SHM_REGISTRATION_FIELDS, (os.getpid(), self.fd, self.nbytes, self.secret)))

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a free region of `nbytes` (rounded up to ALIGN_BYTES), or None if none fits."""
        size = max(ALIGN_BYTES, -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES)
        with self._lock:
            if self._died:
                self._release_died()
            for i, (offset, run) in enumerate(self._free):
                if run >= size:
                    if run == size:
                        del self._free[i]
                    else:
                        self._free[i] = (offset + size, run - size)
                    return offset
        return None

    def release(self, offset: int, nbytes: int) -> None:
        with self._lock:
            self._release(offset, nbytes)
            if self._died:
                self._release_died()

    def _release(self, offset: int, nbytes: int) -> None:
        """`release`, under the lock."""
        size = max(ALIGN_BYTES, -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES)
        i = bisect.bisect(self._free, (offset, 0))
        if i < len(self._free) and offset + size == self._free[i][0]:  # merge with the next run
            size += self._free.pop(i)[1]
        if i and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # and with the previous one
            offset, size = self._free[i - 1][0], self._free[i - 1][1] + size
            i -= 1
            del self._free[i]
        self._free.insert(i, (offset, size))

    def _release_died(self) -> None:
        died = self._died
        while died:
            self._release(*died.pop())

    def free_bytes(self) -> int:
        with self._lock:
            if self._died:
                self._release_died()
            return sum(run for _, run in self._free)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """Bytes [offset, offset + nbytes) as a uint8 array viewing the shared memory."""
        return self._array[offset:offset + nbytes]

    def adopt(self, offset: int, allocated: int, nbytes: int,
              typed: Callable[[np.ndarray], np.ndarray] = lambda array: array) -> np.ndarray:
        """`typed(uint8 array over the first nbytes of a region allocated with allocated bytes)`;
        the region is released when the last view of the array returned (a tensor made from it) is
        gone. The finalizer sits on that very array: numpy points a view's `base` at the memory's
        owner, not at the view it was made from, so a finalizer on an intermediate view would
        release the region while the tensor still reads it."""
        try:
            array = typed(self._array[offset:offset + nbytes])  # a fresh array object: only its tensor holds it
        except BaseException:  # an answer whose shape does not fit its bytes
            self.release(offset, allocated)
            raise
        # A weak reference's callback, not weakref.finalize: the same release when the array
        # dies, for a tenth of the cost (finalize keeps a registry and an exit hook per object).
        ref = weakref.ref(array, self._adopted_died)
        self._adopted[id(ref)] = (ref, offset, allocated)
        return array

    def _adopted_died(self, ref: weakref.ref) -> None:
        _, offset, allocated = self._adopted.pop(id(ref))
        # Never wait for the lock here: this thread may be the one holding it (see `_died`).
        self._died.append((offset, allocated))
        if self._lock.acquire(blocking=False):
            try:
                self._release_died()
            finally:
                self._lock.release()

    def close(self) -> None:
        """Unmap and close the memfd; the sidecar's mappings keep the memory until it drops them.
        Tensors still viewing the arena keep the mapping alive (it is unmapped when they die)."""
        try:
            self._array = np.empty(0, dtype=np.uint8)
            self._map.close()
        except BufferError:  # tensors still view it: the mapping lives until they are gone
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

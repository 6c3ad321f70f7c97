"""GPU tier: one preallocated CUDA buffer carved into page slots, plus demotion's copy across
PCIe (`copy_out`, to host memory), run on the tier's own CUDA stream so it overlaps the engine's
compute on the default stream.

Slots work like the CPU tier's: sized by class (rounded up to `SLOT_ALIGN_BYTES`), a deleted slot
is reused by the next page of its size, fresh slots are cut from the buffer's untouched end.
Pages here are raw KV (codec `none`): the store encodes into the slot `allocate` returns and
decodes from the one `get` returns (through `view`), on the caller's current stream.

The tier knows nothing of policy. `copy_out` takes the lower tier's codec because quantizing
*before* the device->host copy is what halves the PCIe bytes (int8); the store decides when to
call it, and hands a record tier (disk, Redis) the host bytes it made. Promotion needs nothing
of the tier: the store decodes a hit into a slot `allocate` returns, as it does a new page.
This module imports without CUDA or CuPy; constructing a tier on a machine without a usable GPU
raises `GPUUnavailable`.
"""
from __future__ import annotations

import torch

from kvstore.codecs import Codec, as_kv
from kvstore.config import ModelSpec, StoreConfig
from kvstore.tiers.base import Slot
from kvstore.tiers.slots import SlotBufferTier

SLOT_ALIGN_BYTES = 256  # every slot starts 256-byte aligned: 16-byte vector loads in the kernels


class GPUUnavailable(ValueError):
    """`gpu_bytes > 0` on a machine (or device) where CUDA cannot be used. A configuration error."""


def _unavailable_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"device must be a CUDA device, got {device}"
    try:
        if not torch.cuda.is_available():
            return f"torch {torch.__version__} sees no CUDA device"
        count = torch.cuda.device_count()
    except Exception as exc:  # a broken driver must be a clear message, not a traceback
        return f"CUDA failed to initialise ({type(exc).__name__}: {exc})"
    index = 0 if device.index is None else device.index
    if index >= count:
        return f"device cuda:{index} does not exist ({count} CUDA device(s))"
    return None


class GPUTier(SlotBufferTier):
    name = "gpu"
    align_bytes = SLOT_ALIGN_BYTES
    encodes_on_device = True  # copy_out quantizes before the device->host copy

    def __init__(self, capacity_bytes: int, *, device: str | int | torch.device = "cuda"):
        if isinstance(device, int):
            device = torch.device("cuda", device)
        device = torch.device(device)
        reason = _unavailable_reason(device)
        if reason is not None:
            raise GPUUnavailable(f"gpu_bytes: {capacity_bytes} > 0 needs a usable CUDA GPU, but {reason}; "
                                 f"set gpu_bytes=0 to run with the CPU tier on top")
        if capacity_bytes <= 0:
            raise ValueError(f"gpu_bytes: must be > 0 for a GPU tier, got {capacity_bytes}")
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        try:
            self.buffer = torch.empty(capacity_bytes, dtype=torch.uint8, device=self.device)  # the slots
        except torch.cuda.OutOfMemoryError as exc:
            free, total = torch.cuda.mem_get_info(self.device)
            raise GPUUnavailable(f"gpu_bytes: {capacity_bytes} does not fit on {self.device} "
                                 f"({free} of {total} bytes free)") from exc
        self.stream = torch.cuda.Stream(self.device)  # demotion/promotion copies, off the compute stream
        self._pending: dict[bytes, torch.cuda.Event] = {}  # key -> last copy on self.stream touching it
        super().__init__(capacity_bytes)

    @classmethod
    def from_config(cls, config: StoreConfig) -> "GPUTier | None":
        """Raises GPUUnavailable (a clear message) where gpu_bytes asks for a GPU there is not."""
        return cls(config.gpu_bytes) if config.gpu_bytes else None

    # -- slot interface (tiers.base.SlotTier): get/delete/close wait on copies in flight --------
    def get(self, key: bytes) -> Slot | None:
        """The slot; work queued on the caller's current stream sees a promotion's result."""
        slot = self._slots.get(key)
        if slot is None:
            return None
        event = self._pending.get(key)
        if event is not None:
            if event.query():
                del self._pending[key]
            else:
                torch.cuda.current_stream(self.device).wait_event(event)  # a GPU-side wait, no host sync
        return slot

    def delete(self, key: bytes) -> bool:
        event = self._pending.pop(key, None)
        if event is not None:
            event.synchronize()  # a copy still reading/writing the slot must finish before reuse
        return super().delete(key)

    def close(self) -> None:
        self.stream.synchronize()
        self._pending.clear()
        super().close()

    # -- demotion across PCIe, on self.stream ----------------------------------------------------
    def _page_bytes(self, key: bytes, spec: ModelSpec, num_tokens: int) -> torch.Tensor:
        """The raw KV bytes of page `key` (n tokens) in its slot, uint8 on the device."""
        slot = self._slots.get(key)
        if slot is None:
            raise KeyError(f"gpu tier: no slot for key {key.hex()}")
        offset, size = slot
        nbytes = spec.bytes_per_token * num_tokens
        assert nbytes <= size, (nbytes, size)
        return self.buffer[offset:offset + nbytes]

    def copy_out(self, key: bytes, spec: ModelSpec, num_tokens: int, codec: Codec,
                 dst: torch.Tensor) -> torch.cuda.Event:
        """Demotion (tiers/base.py `SlotTier.copy_out`): encode page `key` (n tokens of raw KV) with
        `codec` *on this GPU*, then copy the encoded bytes into `dst` (host uint8,
        `codec.encoded_bytes(spec, n)`; pinned for an async copy). Returns the event after which
        `dst` holds the page; `delete(key)` waits for it."""
        raw = self._page_bytes(key, spec, num_tokens)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the page's writes come first
        with torch.cuda.stream(self.stream):
            if codec.name == "none":  # raw KV is its own encoding: straight from the slot, no staging
                staged = raw
            else:
                staged = torch.empty(codec.encoded_bytes(spec, num_tokens), dtype=torch.uint8, device=self.device)
                codec.encode(spec, as_kv(spec, raw, num_tokens), staged)
            dst.copy_(staged, non_blocking=dst.is_pinned())
            event = torch.cuda.Event()
            event.record(self.stream)
        self._pending[key] = event
        return event

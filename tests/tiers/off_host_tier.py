"""A stand-in for the GPU tier on a machine without CUDA: a slot tier whose buffer is memory the
host may not read directly, as device memory is to the store.

`DeviceBytes` is a tensor subclass over host memory that refuses what a CUDA tensor refuses:
`.numpy()`, `__array__` (so numpy, xxhash, zstandard and the disk writer cannot read it), and
ops that mix it with a host tensor of one or more dimensions (CUDA's "expected all tensors to be
on the same device"); copies across (`copy_`, slice assignment, `.cpu()`, `.to("cpu")`) work and
`.cpu()` returns a host copy. It reports `is_cpu` False, so the store's host fast paths
(kvstore/host_copy.py) take the device path as they would for a CUDA tensor; its `device` stays
"cpu", so what it allocates "on its device" is host memory wrapped again as DeviceBytes by the
ops that make it.

`OffHostTier` has the GPU tier's interface (tiers/gpu.py): no `buffer_array`, `encodes_on_device`,
a `copy_out` that encodes on the device and then copies the encoded bytes to the host.
"""
from __future__ import annotations

from typing import Any

import torch

from kvstore.codecs import Codec, as_kv
from kvstore.config import ModelSpec, StoreConfig
from kvstore.tiers.cpu import CPUTier

_HOST_READS = {torch.Tensor.numpy, torch.Tensor.__array__}
# Copies between the device and the host, which CUDA allows with tensors on either side.
_CROSS_DEVICE = {torch.Tensor.copy_, torch.Tensor.__setitem__, torch.Tensor.__getitem__, torch.Tensor.to,
                 torch.Tensor.cpu}


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def _to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a `.to(...)` / `.cpu()` call asks for the host (a copy on CUDA)."""
    if func is torch.Tensor.cpu:
        return True
    if func is not torch.Tensor.to:
        return False
    for target in (*args[1:], kwargs.get("device")):
        if isinstance(target, (str, torch.device)):
            return torch.device(target).type == "cpu"
        if isinstance(target, torch.Tensor):
            return not isinstance(target, DeviceBytes)
    return False


class DeviceBytes(torch.Tensor):
    """Memory on the stand-in device: the host may copy it, never read it in place."""

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS:
            raise TypeError("can't convert a device tensor to numpy: copy it to the host first "
                            "(the stand-in device of tests/tiers/off_host_tier.py)")
        if _to_host(func, args, kwargs):
            with torch._C.DisableTorchFunctionSubclass():
                return args[0].clone() if func is torch.Tensor.cpu else func(*args, **kwargs).clone()
        tensors = _tensors(args) + _tensors(kwargs)
        if func not in _CROSS_DEVICE and any(not isinstance(t, DeviceBytes) and t.dim() > 0 for t in tensors):
            raise RuntimeError(f"Expected all tensors to be on the same device ({getattr(func, '__name__', func)} "
                               f"mixes the stand-in device with host tensors)")
        if func is torch.Tensor.copy_ and not isinstance(args[0], DeviceBytes):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)  # a copy down to the host: the host tensor stays one
        return super().__torch_function__(func, types, args, kwargs)


def on_device(t: torch.Tensor) -> DeviceBytes:
    """`t`'s memory as the stand-in device's (no copy)."""
    return t.as_subclass(DeviceBytes)


class OffHostTier(CPUTier):
    """The GPU tier's interface over memory the store may only reach through copies."""

    name = "gpu"
    encodes_on_device = True
    made: list["OffHostTier"] = []  # every one built, so a test can ask it what it did

    def __init__(self, capacity_bytes: int):
        super().__init__(capacity_bytes, pin_memory=False)
        self.buffer = on_device(self.buffer)
        self.buffer_array = None
        self.copies_out = 0
        OffHostTier.made.append(self)

    @classmethod
    def from_config(cls, config: StoreConfig) -> "OffHostTier | None":
        return cls(config.gpu_bytes) if config.gpu_bytes else None

    def copy_out(self, key: bytes, spec: ModelSpec, num_tokens: int, codec: Codec, dst: torch.Tensor) -> "_Done":
        """As the GPU tier does it: encode on the device, then copy the encoded bytes down."""
        slot = self.get(key)
        assert slot is not None, f"off-host tier: no slot for key {key.hex()}"
        kv = as_kv(spec, self.view(slot, spec.bytes_per_token * num_tokens), num_tokens)
        staged = on_device(torch.empty(codec.encoded_bytes(spec, num_tokens), dtype=torch.uint8))
        codec.encode(spec, kv, staged)
        dst.copy_(staged)
        self.copies_out += 1
        return _Done()


class _Done:
    """The event of a copy that is already complete."""

    def synchronize(self) -> None:
        pass

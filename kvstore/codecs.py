"""Page codecs: how a page's KV is laid out as bytes in a tier.

A codec turns the KV of `n` tokens, a tensor (L, 2, n, H, D) in the spec's dtype, into exactly
`encoded_bytes(spec, n)` bytes and back. The encoded form of `n` tokens is compact (no padding
to a full page), so a tail page and its full-page slot share one format: a slot sized for
`encoded_bytes(spec, P)` holds any page of up to P tokens in its first `encoded_bytes(spec, n)`.

`none` is a plain copy (bit-exact). Quantizing codecs (int8, fp8) live beside it in
`kvstore/quant_codecs.py` and register themselves in `CODECS`; each states its error bound.
"""
from __future__ import annotations

from typing import Protocol

import torch

from kvstore.config import ModelSpec
from kvstore.host_copy import copy_into
from kvstore.gpu.dtypes import KV_DTYPES


class Codec(Protocol):
    name: str

    def encoded_bytes(self, spec: ModelSpec, num_tokens: int) -> int: ...

    def encode(self, spec: ModelSpec, kv: torch.Tensor, out: torch.Tensor) -> None:
        """kv: (L, 2, n, H, D) in spec dtype, any strides; out: uint8 (encoded_bytes(spec, n),)."""

    def decode(self, spec: ModelSpec, data: torch.Tensor, num_tokens: int, out: torch.Tensor) -> None:
        """data: uint8 (encoded_bytes(spec, n),); out: (L, 2, n, H, D) in spec dtype, any strides."""


def as_kv(spec: ModelSpec, data: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """View raw bytes as KV (L, 2, n, H, D) without copying."""
    return data.view(KV_DTYPES[spec.dtype]).view(spec.kv_shape(num_tokens))


class NoneCodec:
    """Raw KV bytes: bit-exact, one copy each way."""

    name = "none"

    def encoded_bytes(self, spec: ModelSpec, num_tokens: int) -> int:
        return spec.bytes_per_token * num_tokens

    def encode(self, spec: ModelSpec, kv: torch.Tensor, out: torch.Tensor) -> None:
        copy_into(as_kv(spec, out, kv.shape[2]), kv)

    def decode(self, spec: ModelSpec, data: torch.Tensor, num_tokens: int, out: torch.Tensor) -> None:
        copy_into(out, as_kv(spec, data, num_tokens))


CODECS: dict[str, Codec] = {"none": NoneCodec()}


def get_codec(name: str) -> Codec:
    if name not in CODECS:
        # Quantizing codecs register on import; importing here keeps kvstore.codecs light.
        import kvstore.quant_codecs  # noqa: F401
    return CODECS[name]

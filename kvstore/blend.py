"""CacheBlend's read side: chunks' stored KV laid end to end at new positions.

A chunk (a retrieved passage, a tool output) is stored once, computed standalone at positions
0..n-1, under a position-independent chunk key (`keys.chunk_key`): each chunk is a prefix tree
of its own, with its own root. `blend` fetches each chunk whole and re-rotates its K to where
the chunk sits in the new prompt (kvstore/rerotate.py); the caller recomputes what it must
(decode/blend.py). A chunk hits only if the store holds all of it: its KV is all or nothing,
and a missed chunk's KV is zeros for the caller to compute and `store_chunk`.

Why the answer is bounded by more than the hits: misses cost the store nothing but zeros in
the answer, so a request naming huge chunks it never stored would allocate without limit.
"""
from __future__ import annotations

from typing import Callable

import torch

from kvstore.gpu.dtypes import KV_DTYPES
from kvstore.config import ModelSpec, StoreConfig
from kvstore.errors import PayloadTooLarge
from kvstore.index import TOKEN_BYTES
from kvstore.keys import chunk_key
from kvstore.rerotate import rerotate_into
from kvstore.results import BlendResult, FetchResult

MIN_BLEND_LIMIT_BYTES = 1 << 30  # a blend answer may hold this much KV, or the memory tiers' capacity if more

FetchChunk = Callable[[bytes, ModelSpec, bytes, torch.device], FetchResult]  # (chunk key, spec, tokens, device)


def blend_limit_bytes(config: StoreConfig) -> int:
    return max(MIN_BLEND_LIMIT_BYTES, config.cpu_bytes + config.gpu_bytes)


def blend_chunks(fetch: FetchChunk, config: StoreConfig, namespace: bytes, spec: ModelSpec, tbs: list[bytes],
                 start_pos: int, dev: torch.device) -> BlendResult:
    """The chunks `tbs` (int32 LE token bytes each) of the model `namespace`, from `start_pos`."""
    lengths = [len(tb) // TOKEN_BYTES for tb in tbs]
    limit = blend_limit_bytes(config)
    if sum(lengths) * spec.bytes_per_token > limit:
        raise PayloadTooLarge(f"chunks: {sum(lengths)} tokens of KV are {sum(lengths) * spec.bytes_per_token} "
                              f"bytes, over the blend limit of {limit} bytes (the memory tiers' capacity)",
                              field="chunks")
    kv = torch.empty(spec.kv_shape(sum(lengths)), dtype=KV_DTYPES[spec.dtype], device=dev)  # (L, 2, T, H, D)
    hits, positions, offset = [], [], 0
    for tb, n in zip(tbs, lengths):
        found = fetch(chunk_key(namespace, tb), spec, tb, dev)
        hits.append(found.matched_tokens == n)  # a partial chunk is a miss: its KV is all or nothing
        if hits[-1]:
            rerotate_into(kv[:, :, offset:offset + n], found.kv, spec, start_pos + offset)
        else:
            kv[:, :, offset:offset + n].zero_()
        positions.append((start_pos + offset, start_pos + offset + n))
        offset += n
    return BlendResult(hits, kv, positions)

"""Attention over the paged KV cache, driven by an explicit `AttentionContext`.

The context says where the new tokens' K/V are written (`write_slots`), which cached slots they
attend to (`read_slots`, in sequence order) and under which mask. Prefix reuse builds the usual
causal context; CacheBlend builds its own (recompute a subset of tokens at chosen positions,
attend with a custom mask) and calls the same code. RoPE is applied by the caller, so the slots
here hold K exactly as the store holds it: rotated at its original positions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvstore.decode.paged_cache import BlockTable, PagedKVCache


@dataclass(frozen=True)
class AttentionContext:
    write_slots: torch.Tensor  # (T,) cache slots of the T new tokens
    read_slots: torch.Tensor  # (S,) cache slots the new tokens attend to, in key order
    read_span: slice | None = None  # the same slots as one slice, when they are consecutive
    mask: torch.Tensor | None = None  # (T, S) bool, True = may attend; None = see `causal`
    causal: bool = False  # with mask None: True = lower-triangular (T == S), False = attend everything

    @classmethod
    def for_span(cls, cache: PagedKVCache, table: BlockTable, start: int, end: int) -> "AttentionContext":
        """New tokens at sequence positions start..end-1 attending causally to 0..end-1."""
        write = cache.slots(table, start, end)  # (T,)
        span = cache.slot_range(table, 0, end)
        if start == 0:
            return cls(write_slots=write, read_slots=write, read_span=span, causal=end > 1)
        read = cache.slots(table, 0, end)  # (S,)
        if end - start == 1:
            return cls(write_slots=write, read_slots=read, read_span=span)  # one query sees every key: no mask
        query_pos = torch.arange(start, end, device=write.device)  # (T,)
        key_pos = torch.arange(0, end, device=write.device)  # (S,)
        return cls(write_slots=write, read_slots=read, read_span=span,
                   mask=key_pos[None, :] <= query_pos[:, None])  # (T, S)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                    v_pool: torch.Tensor, ctx: AttentionContext, scale: float) -> torch.Tensor:
    """q (T, Hq, D), k/v (T, H, D) of the new tokens -> attention output (T, Hq, D).

    Writes k/v into the pools (N * P, H, D) at `ctx.write_slots` first, so the new tokens see
    themselves through the same read path as cached tokens.
    """
    k_pool.index_copy_(0, ctx.write_slots, k)
    v_pool.index_copy_(0, ctx.write_slots, v)
    if ctx.read_span is not None:  # consecutive pages: attend to a view of the pool, no copy
        keys, values = k_pool[ctx.read_span], v_pool[ctx.read_span]  # (S, H, D)
    else:
        keys, values = k_pool.index_select(0, ctx.read_slots), v_pool.index_select(0, ctx.read_slots)  # (S, H, D)
    keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]  # (1, H, S, D)
    # 4-D inputs on purpose: torch's CPU flash-attention kernel only takes batched input; 3-D
    # falls back to the math path, which materialises (Hq, T, S) scores (2 GiB at 8k tokens).
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=ctx.mask,
                                         is_causal=ctx.causal and ctx.mask is None, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])  # (1, Hq, T, D)
    return out[0].transpose(0, 1)

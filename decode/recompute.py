"""CacheBlend's selective recompute: fix the reused KV of chunk tokens where it matters most.

The paged cache holds, for sequence positions [start, end), the chunks' standalone KV moved to
their new positions; what it lacks is cross-chunk attention (each chunk was computed alone).
Following CacheBlend (Yao et al., EuroSys 2025, §4.2-4.3), layer by layer:

    layer 0   every chunk token is computed (its input, the embedding, is exact), so its output,
              the input of layer 1, is exact too; so are the layers before the selection's
              `select_layer`, when it is later
    layer l   the candidate tokens' fresh K/V replace the cached ones; of the candidates, only
              `keep[l]` go on through this layer's attention and MLP to layer l + 1, picked by
              the selection rule (decode/blend_selection.py) from how far their K/V deviated
              from the cached K/V, the chunks' openings and the question's attention (gradual
              filtering: by default 4r at layer 1, 2r at 2, 1.5r at 3, r from 4 on)

Attention of a recomputed token reads the cache as it is (fresh K/V where computed, reused
elsewhere) under a causal mask by true positions. With `ratio = 1` every token is recomputed
at every layer: exactly a full prefill. With `ratio = 0` nothing runs at all (full KV reuse).

The question (the tokens after the last chunk) runs along through the narrowing layers when the
rule reads its attention; it is computed again in full after the recompute, by the caller.
This module knows nothing of the store.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from kvstore.decode.attention import AttentionContext, paged_attention
from kvstore.decode.blend_selection import TokenSelection
from kvstore.decode.model import LlamaModel
from kvstore.decode.paged_cache import BlockTable, PagedKVCache

SEGMENT_TOKENS = 1024  # recomputed queries attend in groups reading keys up to their group's end


def recompute_sizes(num_tokens: int, ratio: float, num_layers: int,
                    selection: TokenSelection = TokenSelection()) -> list[int]:
    """Tokens that go through attention + MLP at each layer (the rest only get fresh K/V there)."""
    return selection.keep_sizes(num_tokens, ratio, num_layers)


@torch.inference_mode()
def selective_recompute(model: LlamaModel, input_ids: torch.Tensor, cache: PagedKVCache, table: BlockTable,
                        start: int, ratio: float, segment_ends: Sequence[int] = (),
                        prefix_ids: torch.Tensor | None = None,
                        selection: TokenSelection = TokenSelection(),
                        question_ids: torch.Tensor | None = None) -> int:
    """Recompute the KV of tokens `input_ids` (T,) at positions start..start+T-1 (already in the
    cache, with every position before `start` exact: the tokens `prefix_ids` (start,)).
    `segment_ends` (the chunks' end positions) let a recomputed token's attention read only up
    to its segment's end instead of all T: a causal mask cannot skip work, a shorter key range
    does. `selection` picks the tokens that go on at each narrowing layer (decode/blend_selection.py);
    `question_ids` (Q,), the tokens right after the chunks, whose slots `table` holds, give it the
    question's attention where it reads that. Returns how many tokens went through the last layer that ran attention."""
    T = input_ids.shape[0]
    sizes = recompute_sizes(T, ratio, len(model.layers), selection)
    if T == 0 or sizes[0] == 0:
        return 0
    end = start + T
    device = model.device
    positions = torch.arange(start, end, device=device)  # (T,) true positions of the chunk tokens
    slots = cache.slots(table, start, end)  # (T,)
    # Segment ends: the chunks' ends and every SEGMENT_TOKENS, so that a query reads keys at most
    # SEGMENT_TOKENS past its own position (close to causal work when every token is recomputed).
    ends = sorted({min(max(e, start + 1), end) for e in segment_ends} | {end}
                  | set(range(start + SEGMENT_TOKENS, end, SEGMENT_TOKENS)))
    reads = [(e, cache.slot_range(table, 0, e), cache.slots(table, 0, e)) for e in ends]  # keys 0..e-1 per segment
    cos_all, sin_all = model.rotary.cos_sin(positions, model.dtype)  # (T, 1, D) each
    if prefix_ids is None:
        prefix_ids = torch.empty(0, dtype=torch.long, device=device)
    assert prefix_ids.shape == (start,), (prefix_ids.shape, start)
    cos_p, sin_p = model.rotary.cos_sin(torch.arange(0, start, device=device), model.dtype)  # (start, 1, D) each
    x_p = model.embed_tokens(prefix_ids)  # (start, hidden)
    chosen = torch.arange(T, device=device)  # (C,) indices (into the T tokens) of the candidates
    chunk_position, chunk_length = _chunk_positions(start, end, segment_ends, device)  # (T,) each
    x = model.embed_tokens(input_ids)  # (C, hidden)
    question = (_Question(model, question_ids, cache, table, end) if selection.needs_attention
                and question_ids is not None and question_ids.numel() else None)
    ran = 0
    for index, layer in enumerate(model.layers):
        attn = layer.self_attn
        q, k, v = attn.qkv(layer.input_layernorm(x), cos_all[chosen], sin_all[chosen])  # (C, Hq|H, D)
        k_pool, v_pool = cache.layer(index)
        keep, last = sizes[index], index == len(model.layers) - 1
        narrows = keep < chosen.shape[0] and not last
        # Deviation compares with the reused K/V: read before the fresh K/V overwrite it.
        cached = ((k_pool.index_select(0, slots[chosen]), v_pool.index_select(0, slots[chosen]))
                  if narrows and selection.needs_deviation else None)  # (C, H, D) each
        k_pool.index_copy_(0, slots[chosen], k)  # every candidate's fresh K/V is kept, selected or not
        v_pool.index_copy_(0, slots[chosen], v)
        attention = None
        if question is not None and index <= selection.last_narrowing:
            attention = question.step(index, layer)[start:end][chosen]  # (C,) read at this layer's K/V
        top = selection.pick(keep, layer=index, fresh=(k, v), cached=cached, chunk_position=chunk_position[chosen],
                             chunk_length=chunk_length[chosen], attention=attention) if narrows else None
        if last:
            break  # the last layer's output feeds nothing but the LM head: K/V is all we need
        if top is not None:
            chosen, x, q, k, v = chosen[top], x[top], q[top], k[top], v[top]
        if index == 0:
            # Layer 0 computes every token: one causal pass from position 0, the flash kernel's fast
            # path (queries starting past 0 need an explicit mask, which costs more). The prefix
            # rides along as queries whose output is dropped; its K/V are rewritten unchanged.
            q_p, k_p, v_p = attn.qkv(layer.input_layernorm(x_p), cos_p, sin_p)  # (start, Hq|H, D)
            out = paged_attention(torch.cat([q_p, q]), torch.cat([k_p, k]), torch.cat([v_p, v]), k_pool, v_pool,
                                  AttentionContext.for_span(cache, table, 0, end), attn.scale)[start:]  # (T, Hq, D)
        else:
            out = _attend(q, k, v, positions[chosen], slots[chosen], reads, k_pool, v_pool, attn.scale)  # (C, Hq, D)
        x = x + attn.o_proj(out.reshape(x.shape[0], -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        ran = chosen.shape[0]
    return ran


class _Question:
    """The question riding along the narrowing layers: its hidden state layer by layer and, at
    each, its attention over every key before and in it (causal), summed over its tokens and heads."""

    def __init__(self, model: LlamaModel, ids: torch.Tensor, cache: PagedKVCache, table: BlockTable, start: int):
        self.model = model
        end = start + ids.shape[0]
        self.positions = torch.arange(start, end, device=model.device)  # (Q,)
        self.cos, self.sin = model.rotary.cos_sin(self.positions, model.dtype)  # (Q, 1, D) each
        self.write = cache.slots(table, start, end)  # (Q,)
        self.read = cache.slots(table, 0, end)  # (S,) every key up to the question's end
        self.cache = cache
        self.x = model.embed_tokens(ids)  # (Q, hidden)

    def step(self, index: int, layer) -> torch.Tensor:
        """Run layer `index` for the question; return (S,) its attention mass on each key."""
        attn = layer.self_attn
        q, k, v = attn.qkv(layer.input_layernorm(self.x), self.cos, self.sin)  # (Q, Hq|H, D)
        k_pool, v_pool = self.cache.layer(index)
        k_pool.index_copy_(0, self.write, k)
        v_pool.index_copy_(0, self.write, v)
        keys, values = k_pool.index_select(0, self.read), v_pool.index_select(0, self.read)  # (S, H, D)
        count, heads, dim = q.shape
        groups = heads // keys.shape[1]
        scores = torch.einsum("qhgd,shd->hgqs", q.float().view(count, -1, groups, dim), keys.float()) * attn.scale
        key_pos = torch.arange(keys.shape[0], device=q.device)  # (S,)
        scores.masked_fill_(key_pos[None, :] > self.positions[:, None], -math.inf)  # causal by true positions
        probs = scores.softmax(-1)  # (H, G, Q, S)
        out = torch.einsum("hgqs,shd->qhgd", probs, values.float()).reshape(count, heads, dim).to(q.dtype)
        self.x = self.x + attn.o_proj(out.reshape(count, -1))
        self.x = self.x + layer.mlp(layer.post_attention_layernorm(self.x))
        return probs.sum((0, 1, 2))  # (S,)


def _chunk_positions(start: int, end: int, segment_ends: Sequence[int],
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(T,) each token's index in its chunk, and (T,) that chunk's length (`segment_ends` bound the chunks)."""
    bounds = sorted({start, end} | {e for e in segment_ends if start < e < end})
    spans = list(zip(bounds, bounds[1:]))
    position = torch.cat([torch.arange(b - a, device=device) for a, b in spans])
    length = torch.cat([torch.full((b - a,), b - a, device=device) for a, b in spans])
    return position, length


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_pos: torch.Tensor, write_slots: torch.Tensor,
            reads: list[tuple[int, slice | None, torch.Tensor]], k_pool: torch.Tensor, v_pool: torch.Tensor,
            scale: float) -> torch.Tensor:
    """Attention of the recomputed tokens (q (C, Hq, D), positions ascending), each group of them
    reading the keys of positions 0..e-1 for the first segment end e past them, causal by true
    position. Their own K/V are already in the pools; paged_attention writes them again."""
    out = torch.empty_like(q)  # (C, Hq, D)
    lo = 0
    for e, span, read_slots in reads:
        hi = int(torch.searchsorted(query_pos, e))  # queries at positions < e
        if hi > lo:
            key_pos = torch.arange(0, e, device=q.device)  # (S,)
            mask = key_pos[None, :] <= query_pos[lo:hi, None]  # (c, S): causal by true positions
            ctx = AttentionContext(write_slots=write_slots[lo:hi], read_slots=read_slots, read_span=span, mask=mask)
            out[lo:hi] = paged_attention(q[lo:hi], k[lo:hi], v[lo:hi], k_pool, v_pool, ctx, scale)
        lo = hi
    return out

"""Audited reuse of CacheBlend's chunks: check a chunk hit's stored KV against what this engine
computes for the chunk alone.

Blended KV is approximate by design (decode/blend.py), so it cannot be the reference. What the
store holds for a chunk is its standalone KV (computed alone, kvstore/blend.py), and that can be
checked exactly: in a scratch table, the chunk's KV as `blend` answered it for its pages before
its last full page, then that last full page prefilled here, attending only to them, and its K
and V compared with the stored page (kvstore/reuse_audit.py `compare_page`).

At which positions: 0..n-1, where the store keeps the chunk. The KV `blend` answered (K moved to
the chunk's positions in this prompt) is rotated back by that position, so a store that
re-rotated to the wrong positions, or kept K without its rotary embedding, fails as surely as one
that served wrong bytes or another checkpoint's KV. Rotating back by the same angles is exact to
a few roundings; auditing at the new positions instead would compare against the engine's own
RoPE there, and float32 rotation angles at thousands of positions differ by more than the
float32 tolerance between two correct computations (docs/reliability.md, "CacheBlend chunks").
Nothing is withheld from the blend: the chunk's KV is placed as it came, or, after a failure,
the chunk is computed standalone here instead (the caller's choice). The cost is one page of
prefill attending to the chunk's earlier pages, in a scratch table beside the request's, and
rotating the chunk's full pages back.
"""
from __future__ import annotations

import torch

from kvstore.decode.attention import AttentionContext
from kvstore.decode.model import LlamaModel
from kvstore.decode.paged_cache import PagedKVCache
from kvstore.rerotate import rerotate_into
from kvstore.reuse_audit import AuditOutcome, compare_page


def audit_chunk(model: LlamaModel, chunk: list[int], kv: torch.Tensor, position: int,
                cache: PagedKVCache) -> AuditOutcome:
    """Audit the chunk hit `chunk` (at least one page) whose KV `blend` answered as `kv`
    (L, 2, n, H, D), K at positions position..position+n-1. `cache` needs room for the chunk's
    full pages beside what it already holds."""
    page = model.spec.page_size
    full = len(chunk) // page * page
    assert full >= page, f"a chunk of {len(chunk)} tokens has no full page to audit"
    start = full - page  # the compared page: [start, full) of the chunk
    stored = torch.empty_like(kv[:, :, :full])  # (L, 2, full, H, D): K back at positions 0..full-1
    rerotate_into(stored, kv[:, :, :full], model.spec, -position)
    scratch = cache.new_table()
    cache.reserve(scratch, full)
    try:
        if start:
            cache.scatter(scratch, stored[:, :, :start], start=0)
        ids = torch.tensor(chunk[start:full], dtype=torch.long, device=model.device)  # (P,)
        positions = torch.arange(start, full, device=model.device)  # (P,)
        model(ids, positions, cache, AttentionContext.for_span(cache, scratch, start, full), logits="none")
        scratch.num_tokens = full
        computed = cache.gather(scratch, start, full)  # (L, 2, P, H, D)
    finally:
        cache.release(scratch)
    return compare_page(computed, stored[:, :, start:], model.dtype)

"""The KV the decode loop computes for a prompt, to hold an engine's stored pages against."""
from __future__ import annotations

import torch

from kvstore.decode.attention import AttentionContext


def decode_kv(model, tokens: list[int]) -> torch.Tensor:
    """The KV our decode loop computes for `tokens`: (L, 2, T, H, D)."""
    cache = model.new_cache(len(tokens))
    table = cache.new_table()
    cache.reserve(table, len(tokens))
    context = AttentionContext.for_span(cache, table, 0, len(tokens))
    model(torch.tensor(tokens), torch.arange(len(tokens)), cache, context, logits="none")
    table.num_tokens = len(tokens)
    return cache.gather(table, 0, len(tokens))

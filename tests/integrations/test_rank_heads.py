"""Which KV heads a tensor-parallel rank holds and stores (vllm_model.rank_heads): vLLM's split,
so each rank's part lands in the right heads of the store's pages."""
from __future__ import annotations

import pytest

from kvstore.integrations.vllm_model import RankHeads, rank_heads


@pytest.mark.parametrize("kv_heads,tp,expected", [
    (3, 1, [RankHeads(None, True)]),
    (3, 3, [RankHeads((0, 1), True), RankHeads((1, 2), True), RankHeads((2, 3), True)]),
    (8, 4, [RankHeads((0, 2), True), RankHeads((2, 4), True), RankHeads((4, 6), True), RankHeads((6, 8), True)]),
    # More ranks than KV heads: each head on tp / H consecutive ranks, stored by the first.
    (2, 4, [RankHeads((0, 1), True), RankHeads((0, 1), False), RankHeads((1, 2), True), RankHeads((1, 2), False)]),
    (1, 2, [RankHeads((0, 1), True), RankHeads((0, 1), False)]),
])
def test_every_head_is_held_and_stored_once(kv_heads, tp, expected):
    ranks = [rank_heads(kv_heads, tp, r) for r in range(tp)]
    assert ranks == expected
    stored = sorted(h for r in ranks if r.stores for h in range(*(r.heads or (0, kv_heads))))
    assert stored == list(range(kv_heads))


@pytest.mark.parametrize("kv_heads,tp", [(3, 2), (2, 3), (4, 6)])
def test_a_split_vllm_would_refuse_is_refused(kv_heads, tp):
    with pytest.raises(ValueError, match="tensor_parallel_size|KV heads"):
        rank_heads(kv_heads, tp, 0)

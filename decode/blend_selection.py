"""Which chunk tokens CacheBlend recomputes: the selection rule and its two controls.

At each layer that narrows the recompute (decode/recompute.py), `TokenSelection.pick` chooses
`keep` of the current candidates:

    deviation  half of `keep` to the first tokens of every chunk (the same fraction of each),
               the other half to the tokens whose fresh K/V differ most from the reused
               (standalone) K/V, by the squared distance of K and V summed over heads: the rule
               decode/blend.py uses. `first_share` sets the half (0: deviation alone, the
               CacheBlend paper's rule, which on the real model left needles lost that the
               openings bring back: docs/cacheblend.md); `score="per_head"` divides each KV
               head's distances by that head's mean first (measured no better)
    random     `keep` candidates drawn at random (seeded): a control
    first      the first tokens of every chunk, the same fraction of each: a control, since a
               standalone chunk's opening tokens are where it differs most from a full prefill
               (they attended to nothing before them)

Controls recompute exactly as many tokens per layer as the rule does, so quality against the
recomputed fraction compares rules, not budgets.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SELECTION_RULES = ("deviation", "random", "first")
DEVIATION_SCORES = ("pooled", "per_head")


@dataclass(frozen=True)
class TokenSelection:
    rule: str = "deviation"
    seed: int = 0  # the random control's draw
    score: str = "pooled"  # deviation: "pooled" (plain squared distance) or "per_head" (each head over its mean)
    first_share: float = 0.5  # deviation: this share of `keep` goes to each chunk's first tokens, the rest by deviation

    def __post_init__(self) -> None:
        if self.rule not in SELECTION_RULES:
            raise ValueError(f"selection rule: must be one of {', '.join(SELECTION_RULES)}, got {self.rule!r}")
        if self.score not in DEVIATION_SCORES:
            raise ValueError(f"selection score: must be one of {', '.join(DEVIATION_SCORES)}, got {self.score!r}")
        if not 0.0 <= self.first_share <= 1.0:
            raise ValueError(f"selection first_share: must be in [0, 1], got {self.first_share!r}")

    @property
    def needs_deviation(self) -> bool:
        return self.rule == "deviation"

    def pick(self, keep: int, *, layer: int, fresh: tuple[torch.Tensor, torch.Tensor] | None = None,
             cached: tuple[torch.Tensor, torch.Tensor] | None = None,
             chunk_position: torch.Tensor | None = None, chunk_length: torch.Tensor | None = None) -> torch.Tensor:
        """Indices (keep,), ascending, into the C candidates.

        fresh, cached: (K, V) of the candidates, each (C, H, D), for `deviation`;
        chunk_position, chunk_length: (C,) each candidate's index in its chunk and that chunk's length."""
        if self.rule == "deviation":
            assert fresh is not None and cached is not None
            score = deviation_score(fresh, cached, per_head=self.score == "per_head")  # (C,)
            first = int(keep * self.first_share)
            if first:
                assert chunk_position is not None and chunk_length is not None
                opening = (-(chunk_position.float() / chunk_length.float())).topk(first).indices  # (first,)
                score = score.clone()
                score[opening] = float("inf")
        elif self.rule == "first":
            assert chunk_position is not None and chunk_length is not None
            score = -(chunk_position.float() / chunk_length.float())  # (C,) the same fraction of each chunk
        else:
            assert chunk_position is not None
            count = chunk_position.shape[0]
            gen = torch.Generator().manual_seed(self.seed * 1009 + layer)
            score = torch.rand(count, generator=gen)  # (C,)
        return score.topk(keep).indices.sort().values


def deviation_score(fresh: tuple[torch.Tensor, torch.Tensor], cached: tuple[torch.Tensor, torch.Tensor], *,
                    per_head: bool = False) -> torch.Tensor:
    """(C,) how far each candidate's reused K/V is from its fresh K/V: the squared distance of K
    and of V, summed over KV heads; with `per_head`, each head's distances over their mean first."""
    total = None
    for new, old in zip(fresh, cached):  # K, then V
        heads = (new.float() - old.float()).square().sum(-1)  # (C, H)
        if per_head:
            heads = heads / heads.mean(0, keepdim=True).clamp_min(1e-12)
        total = heads.sum(-1) if total is None else total + heads.sum(-1)  # (C,)
    assert total is not None
    return total

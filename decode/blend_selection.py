"""Which chunk tokens CacheBlend recomputes, at which layers: the selection rule and its controls.

decode/recompute.py runs every chunk token through the layers before `select_layer`; from there
on, each layer keeps `keep_sizes` of the current candidates, chosen by `TokenSelection.pick`:

    deviation  the decode loop's rule. The budget `keep` is filled by three signals in turn:
               `first_share` of it goes to the first tokens of every chunk (the same fraction
               of each), `query_share` to the tokens the question attends to most at this layer,
               and the rest to the tokens with the largest deviation score: by default
               (`score="impact"`) the squared distance between their fresh and reused
               (standalone) K and V, summed over heads, times the question's attention to them;
               `score="pooled"` is the distance alone (the CacheBlend paper's signal),
               `score="per_head"` divides each KV head's distances by that head's mean first
    random     `keep` candidates drawn at random (seeded): a control
    first      the first tokens of every chunk, the same fraction of each: a control, since a
               standalone chunk's opening tokens are where it differs most from a full prefill
               (they attended to nothing before them)

Why each signal (docs/cacheblend.md has the measurements): a chunk computed alone opens at
position 0, so its first tokens became attention sinks and the tokens after them saw the least
context; deviation (the CacheBlend paper's signal) finds tokens whose K/V the missing context
changed, but not whether anything reads them; the question's attention says which of them the
answer reads (its first tokens attend to the question and to a few places in the documents), so
a wrong K/V the question reads costs more than a wrong K/V it does not.

The schedule (`select_layer`, `narrowing`) is the same for a rule and its controls, so a
comparison at one ratio compares which tokens, not how many.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SELECTION_RULES = ("deviation", "random", "first")
DEVIATION_SCORES = ("pooled", "per_head", "impact")


@dataclass(frozen=True)
class TokenSelection:
    rule: str = "deviation"
    seed: int = 0  # the random control's draw
    # deviation: "impact" (the squared distance times the question's attention: a deviation matters as much
    # as it is read), "pooled" (the squared distance alone) or "per_head" (each head's over its mean)
    score: str = "impact"
    first_share: float = 0.5  # deviation: this share of `keep` goes to each chunk's first tokens
    query_share: float = 0.0  # deviation: this share to the question's attention; the rest by deviation
    select_layer: int = 1  # the first layer that narrows the candidates; every token runs the layers before it
    # keep factor * ratio at select_layer, select_layer + 1, ...: the candidates narrow over four layers, so a
    # token the first pick would drop gets three more looks, at layers whose deviation and question's attention
    # already reflect the fresh K/V of the tokens kept before (docs/cacheblend.md: it beat picking 2r then r on
    # both workloads, at the same final r and at the same total work)
    narrowing: tuple[float, ...] = (4.0, 2.0, 1.5, 1.0)

    def __post_init__(self) -> None:
        if self.rule not in SELECTION_RULES:
            raise ValueError(f"selection rule: must be one of {', '.join(SELECTION_RULES)}, got {self.rule!r}")
        if self.score not in DEVIATION_SCORES:
            raise ValueError(f"selection score: must be one of {', '.join(DEVIATION_SCORES)}, got {self.score!r}")
        for name in ("first_share", "query_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"selection {name}: must be in [0, 1], got {getattr(self, name)!r}")
        if self.first_share + self.query_share > 1.0:
            raise ValueError(f"selection first_share + query_share: must be <= 1, got "
                             f"{self.first_share} + {self.query_share}")
        if self.select_layer < 1:
            raise ValueError(f"selection select_layer: must be >= 1 (layer 0's input is exact), "
                             f"got {self.select_layer!r}")
        factors = self.narrowing
        if not factors or any(f <= 0 for f in factors) or list(factors) != sorted(factors, reverse=True):
            raise ValueError(f"selection narrowing: must be non-increasing factors > 0 (a token left out at "
                             f"one layer has no input to the next), got {factors!r}")

    @property
    def needs_deviation(self) -> bool:
        return self.rule == "deviation" and self.first_share + self.query_share < 1.0

    @property
    def needs_attention(self) -> bool:
        return self.rule == "deviation" and (self.query_share > 0.0 or self.score == "impact")

    def keep_sizes(self, num_tokens: int, ratio: float, num_layers: int) -> list[int]:
        """Tokens that go through attention + MLP at each layer (the others only get fresh K/V there)."""
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"blend_ratio: must be in [0, 1], got {ratio!r}")
        if ratio == 0.0:
            return [0] * num_layers
        sizes: list[int] = []
        for layer in range(num_layers):
            step = layer - self.select_layer
            factor = 1.0 / ratio if step < 0 else self.narrowing[min(step, len(self.narrowing) - 1)]
            sizes.append(min(num_tokens, math.ceil(num_tokens * min(1.0, factor * ratio)), *sizes[-1:]))
        return sizes

    @property
    def last_narrowing(self) -> int:
        """The last layer at which the candidates can shrink (the factors stop changing after it)."""
        return self.select_layer + len(self.narrowing) - 1

    def pick(self, keep: int, *, layer: int, fresh: tuple[torch.Tensor, torch.Tensor] | None = None,
             cached: tuple[torch.Tensor, torch.Tensor] | None = None,
             chunk_position: torch.Tensor | None = None, chunk_length: torch.Tensor | None = None,
             attention: torch.Tensor | None = None) -> torch.Tensor:
        """Indices (keep,), ascending, into the C candidates.

        fresh, cached: (K, V) of the candidates, each (C, H, D), for the deviation share;
        chunk_position, chunk_length: (C,) each candidate's index in its chunk and that chunk's length;
        attention: (C,) the question's attention to each candidate at this layer, for the query share."""
        if self.rule == "random":
            assert chunk_position is not None
            gen = torch.Generator().manual_seed(self.seed * 1009 + layer)
            return torch.rand(chunk_position.shape[0], generator=gen).topk(keep).indices.sort().values
        assert chunk_position is not None and chunk_length is not None
        opening = -(chunk_position.float() / chunk_length.float())  # (C,) the same fraction of each chunk
        if self.rule == "first":
            return opening.topk(keep).indices.sort().values
        shares = [(self.first_share, lambda: opening), (self.query_share, lambda: attention)]
        taken = torch.zeros(opening.shape[0], dtype=torch.bool)  # (C,)
        for share, signal in shares:
            count = int(keep * share)
            if count:
                score = signal()
                assert score is not None, "query_share needs the question's attention"
                taken[score.float().cpu().masked_fill(taken, -math.inf).topk(count).indices] = True
        rest = keep - int(taken.sum())
        if rest:
            assert fresh is not None and cached is not None
            score = deviation_score(fresh, cached, per_head=self.score == "per_head").cpu()  # (C,)
            if self.score == "impact":
                assert attention is not None, "score='impact' needs the question's attention"
                score = score * attention.float().cpu()
            taken[score.masked_fill(taken, -math.inf).topk(rest).indices] = True
        return taken.nonzero().squeeze(1).to(chunk_position.device)


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

"""Next-token choice: greedy, or temperature + top-p (nucleus) sampling from a seeded generator.

Sampling is reproducible: the same `SamplingParams` (seed included) and the same logits give the
same tokens, so a run with cache reuse can be compared token for token with one without.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    seed: int | None = None  # None = a fresh random seed

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature: must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        """logits (V,) float -> the next token id."""
        if self.params.greedy:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float().cpu() / self.params.temperature, dim=-1)  # (V,)
        if self.params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)  # (V,)
            # Drop a token when the mass before it already reaches top_p; the top token always stays.
            drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= self.params.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))

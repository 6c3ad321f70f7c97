"""Audited reuse: an engine checks, on a sampled hit, that the KV it reuses is what it computes.

An audited hit loads every matched page but the last full one, the engine prefills that page
itself (attending to the loaded prefix), and its K and V are compared, layer by layer, with the
page the store served. Wrong KV anywhere in the prefix reaches the page through attention from
layer 1 on; wrong KV in the page itself shows at once. The cost is one page of prefill.

The measure is per layer and per K/V: the largest absolute difference, relative to the largest
magnitude of what the engine computed in that layer (so a layer whose K is large by nature is not
held to a tighter bound than one whose K is small). Floating-point noise between two correct
computations of the same page (another kernel, another batch shape, another engine) is a few
units of the dtype's rounding error; a wrong page is off by its own size. The tolerance is a
multiple of the dtype's machine epsilon (`torch.finfo(dtype).eps`); the multiple and the clean
measurements behind it are in docs/reliability.md. Anything not finite fails.

This module only compares; the decode loop (decode/reuse.py) and the vLLM connector
(kvstore/integrations/vllm_audit.py) decide what to audit and act on the outcome, and the store
(`KVStore.report_audit`) drops a failed path and counts.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import torch

# Tolerance = EPS_MULTIPLE * machine epsilon of the KV dtype. Clean hits deviate by at most
# a few epsilons (docs/reliability.md, "Audited reuse"); 16 leaves headroom for other engines'
# kernels without letting a wrong page through (those are off by tens of percent).
EPS_MULTIPLE = 16.0
# A float32 page is still compared at this floor: engines that compute in float32 but reduce
# in another order differ by more than float32's own epsilon in deep layers.
FLOAT32_FLOOR = 1e-4
DEFAULT_AUDIT_RATE = 0.0  # off unless asked for: an audit costs a page of prefill
PARTS = ("k", "v")


def check_audit_rate(rate: object, field: str = "audit_rate") -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= float(rate) <= 1.0:
        raise ValueError(f"{field}: must be a number in [0, 1] (a probability; 0 = off), got {rate!r}")
    return float(rate)


def tolerance_for(dtype: torch.dtype) -> float:
    """The largest relative deviation a clean page of `dtype` KV may show."""
    return max(EPS_MULTIPLE * torch.finfo(dtype).eps, FLOAT32_FLOOR)


def sampled(rate: float, rng: random.Random | None = None) -> bool:
    """Whether this hit is audited: with probability `rate` (1 always, 0 never, no draw)."""
    if rate <= 0.0:
        return False
    return rate >= 1.0 or (rng or random).random() < rate


def deviation(computed: torch.Tensor, stored: torch.Tensor) -> float:
    """max |computed - stored| / max |computed| over one layer's K (or V) of the page; inf when
    either holds a value that is not finite or the shapes differ."""
    if computed.shape != stored.shape:
        return float("inf")
    c = computed.detach().to(torch.float32)
    s = stored.detach().to(device=c.device, dtype=torch.float32)
    diff = (c - s).abs().max()
    scale = c.abs().max()
    if not (torch.isfinite(diff) and torch.isfinite(scale)):
        return float("inf")
    if float(scale) == 0.0:
        return 0.0 if float(diff) == 0.0 else float("inf")
    return float(diff / scale)


@dataclass(frozen=True)
class AuditOutcome:
    """One audited page: per layer the K and V deviations, against `tolerance`."""

    tolerance: float
    deviations: tuple[tuple[float, float], ...]  # per layer: (K, V)

    @property
    def passed(self) -> bool:
        return self.first_failure is None

    @property
    def first_failure(self) -> tuple[int, str] | None:
        """(layer, "k" or "v") of the first deviation over the tolerance, or None."""
        for layer, pair in enumerate(self.deviations):
            for part, value in zip(PARTS, pair):
                if not value <= self.tolerance:  # NaN fails too
                    return layer, part
        return None

    @property
    def worst(self) -> float:
        return max((max(pair) for pair in self.deviations), default=0.0)

    def describe(self) -> str:
        failure = self.first_failure
        where = "passed" if failure is None else f"first failing layer {failure[0]} ({failure[1].upper()})"
        return f"{where}; worst deviation {self.worst:.3g}, tolerance {self.tolerance:.3g}"


def compare_layer(computed_k: torch.Tensor, computed_v: torch.Tensor, stored_k: torch.Tensor,
                  stored_v: torch.Tensor) -> tuple[float, float]:
    """One layer's (K, V) deviations of a page, in whatever layout both sides share."""
    return deviation(computed_k, stored_k), deviation(computed_v, stored_v)


def compare_page(computed: torch.Tensor, stored: torch.Tensor, dtype: torch.dtype | None = None) -> AuditOutcome:
    """Compare a page the engine computed with the page the store served, both (L, 2, T, H, D)."""
    if computed.shape != stored.shape:
        layers = computed.shape[0] if computed.dim() else 1
        return AuditOutcome(tolerance_for(dtype or computed.dtype), tuple((float("inf"),) * 2 for _ in range(layers)))
    pairs = tuple(compare_layer(computed[i, 0], computed[i, 1], stored[i, 0], stored[i, 1])
                  for i in range(computed.shape[0]))
    return AuditOutcome(tolerance_for(dtype or computed.dtype), pairs)


def outcome_of(deviations: Sequence[tuple[float, float]], dtype: torch.dtype) -> AuditOutcome:
    """An outcome from per-layer deviations gathered one layer at a time (the vLLM connector's)."""
    return AuditOutcome(tolerance_for(dtype), tuple((float(k), float(v)) for k, v in deviations))


def audited_span(matched_tokens: int, page_size: int, prompt_tokens: int) -> tuple[int, int] | None:
    """[start, end) of the page an audited hit withholds: the last full page of the match, which
    must end before the prompt's last token (that one is always computed). None: nothing to audit
    (the match is shorter than one page)."""
    full = min(matched_tokens, prompt_tokens - 1) // page_size * page_size
    if full < page_size:
        return None
    return full - page_size, full


def tier_at(tiers: dict[str, int], position: int) -> str:
    """The tier serving token `position` of a match, from a lookup's tier -> tokens (in the
    order of the matched path; a tier met twice along it counts where it first appears)."""
    done = 0
    for tier, tokens in tiers.items():
        done += tokens
        if position < done:
            return tier
    return next(reversed(tiers), "cpu")

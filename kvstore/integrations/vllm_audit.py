"""Audited reuse in the vLLM connector (`audit_rate` in kv_connector_extra_config; kvstore/reuse_audit.py).

    scheduler  a sampled hit reports `audit_tokens` tokens fewer to vLLM: the last tokens of
               its last full matched block are withheld, so vLLM computes them in the step that
               loads the rest, the block's earlier tokens included (SchedulerAudits)
    worker     start_load_kv: the store's copy of that block is fetched (and which tier serves it);
               save_kv_layer of layer i: the tokens vLLM just computed are compared with the
               store's, K and V (WorkerAudits.on_layer); wait_for_save: the outcome is reported
               to the store, which counts it and, on a failure, drops the matched path in every
               tier; the request's loaded blocks become load errors, so vLLM recomputes it from
               its first loaded block (kv_load_failure_policy "recompute", which the connector
               sets), and its save of this step is not stored (it would send wrong blocks back)

Why a few tokens and not the whole block: an audit costs the prefill of what it withholds, and
on hardware where a step's time grows with its tokens (a CPU) a whole block doubles a hit's
step, which computes one block anyway. Wrong KV anywhere before the withheld tokens reaches them
through attention; wrong KV in the withheld tokens shows at once. The whole block
(`audit_tokens` = block_size) also sees a damaged value in the block's last layer, which no
later layer reads.

Only synchronous loads are audited: an asynchronous load's request computes its blocks in a
later step, after the load was reported done. A hit of a single block is not audited (nothing
would be loaded). The store logs each failure once, naming the model, the tenant, the tier and
the first layer that failed (kvstore/store_audit.py).
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.reuse_audit import compare_layer, outcome_of, sampled

log = logging.getLogger("kvstore.audit")


@dataclass(frozen=True)
class AuditSpec:
    req_id: str
    salt: str | None
    tokens: list[int]  # the prompt's first `start + block_size` tokens: the matched prefix with the block
    start: int  # the audited block's first token
    first: int  # the first withheld token: vLLM computes [first, start + block_size) in this step
    block_id: int  # the vLLM block holding tokens [start, start + block_size)
    loaded_block_ids: list[int]  # the blocks this request's load fills (load errors on a failure)


class SchedulerAudits:
    """Which hits are audited, and the audit of each until the step that computes its block."""

    def __init__(self, rate: float, block_size: int, rng: random.Random | None = None, withheld_tokens: int = 0):
        self.rate, self.block_size, self.rng = rate, block_size, rng
        self.withheld_tokens = withheld_tokens or block_size  # tokens of the block vLLM computes
        assert 1 <= self.withheld_tokens <= block_size, (withheld_tokens, block_size)
        self._withheld: dict[str, int] = {}  # req -> its first withheld token
        self._ready: dict[str, AuditSpec] = {}  # allocated: goes into the next step's metadata

    def withhold(self, req_id: str, num_computed_tokens: int, hit: int, load_async: bool) -> int:
        """The hit to report to vLLM: `hit` (whole blocks), or, for a sampled, audited hit, its
        last block's last `withheld_tokens` fewer."""
        self._withheld.pop(req_id, None)
        if load_async or hit - self.block_size <= num_computed_tokens or not sampled(self.rate, self.rng):
            return hit
        first = hit - self.withheld_tokens
        self._withheld[req_id] = first
        return first

    def allocated(self, req_id: str, salt: str | None, prompt: list[int], block_ids: list[int],
                  load_start: int, load_end: int) -> None:
        first = self._withheld.pop(req_id, None)
        B = self.block_size
        if first is None or first != load_end or len(block_ids) <= first // B:
            return
        start = first // B * B
        self._ready[req_id] = AuditSpec(req_id, salt, prompt[:start + B], start, first, block_ids[first // B],
                                        list(block_ids[load_start // B:-(-load_end // B)]))

    def take(self, scheduler_output: Any) -> list[AuditSpec]:
        """The audits whose block this step computes (their request is new in it, scheduled past
        the block's end)."""
        if not self._ready:
            return []
        scheduled = scheduler_output.num_scheduled_tokens
        audits = []
        for new in scheduler_output.scheduled_new_reqs:
            spec = self._ready.pop(new.req_id, None)
            if spec is not None and new.num_computed_tokens + scheduled.get(new.req_id, 0) >= spec.start + \
                    self.block_size and new.num_computed_tokens == spec.first:
                audits.append(spec)
        return audits

    def forget(self, req_id: str) -> None:
        self._withheld.pop(req_id, None)
        self._ready.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._withheld) + len(self._ready)


@dataclass
class _Pending:
    spec: AuditSpec
    stored: torch.Tensor  # (L, 2, B, H, D): the store's copy of the block
    tier: str
    block: torch.Tensor  # (1,) the block id, on the cache's device
    deviations: dict[int, tuple[float, float]] = field(default_factory=dict)  # layer -> (K, V)


class WorkerAudits:
    """The worker's part: fetch each audited block's stored copy, compare per layer, report."""

    def __init__(self, num_layers: int, dtype: torch.dtype):
        self.num_layers, self.dtype = num_layers, dtype
        self._pending: list[_Pending] = []
        self.stats = {"passes": 0, "failures": 0}

    def start(self, link: Any, audits: list[AuditSpec], device: torch.device) -> None:
        """The stored copy of every audited block of the step (an audit the store cannot serve
        any more is dropped: the block was computed, nothing wrong was loaded from it)."""
        self._pending = []
        for spec in audits:
            found = link.audit_source(spec.tokens, spec.start, spec.salt)
            if found is None:
                continue
            tier, kv = found
            self._pending.append(_Pending(spec, kv, tier, torch.tensor([spec.block_id], device=device)))

    def on_layer(self, layout: Any, layer: torch.Tensor, index: int) -> None:
        """Right after layer `index`'s attention wrote the step's K/V: compare each audited block."""
        for pending in self._pending:
            withheld = pending.spec.first - pending.spec.start  # the block's tokens that were loaded
            computed = layout.gather(layer, pending.block)[:, withheld:]  # (2, W, H, D)
            stored = pending.stored[index][:, withheld:]
            pending.deviations[index] = _pair(computed, stored)

    def finish(self, link: Any) -> tuple[set[int], set[str]]:
        """Report the step's audits. (blocks to report as load errors, requests whose save of
        this step must not be stored.)"""
        failed_blocks: set[int] = set()
        spoiled: set[str] = set()
        if not self._pending:
            return failed_blocks, spoiled
        pending, self._pending = self._pending, []
        for audit in pending:
            if len(audit.deviations) != self.num_layers:
                continue  # a layer without the save hook: nothing to judge by
            outcome = outcome_of([audit.deviations[i] for i in range(self.num_layers)], self.dtype)
            spec = audit.spec
            failure = outcome.first_failure
            if failure is None:
                self.stats["passes"] += 1
            else:
                self.stats["failures"] += 1
                log.warning("kvstore audit of %s: %s; vLLM recomputes it", spec.req_id, outcome.describe())
                failed_blocks.update(spec.loaded_block_ids)
                spoiled.add(spec.req_id)
            # The store logs a failure (model, tenant, tier, layer) and drops the matched path.
            link.report_audit(spec.tokens, spec.salt, passed=outcome.passed, tier=audit.tier,
                              layer=None if failure is None else failure[0])
        return failed_blocks, spoiled


def _pair(computed: torch.Tensor, stored: torch.Tensor) -> tuple[float, float]:
    return compare_layer(computed[0], computed[1], stored[0].to(computed.device), stored[1].to(computed.device))

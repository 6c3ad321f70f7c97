"""The scheduler side of `KVStoreConnector`: which blocks to load from the store, which to store.

Per step vLLM asks, for each new (or resumed) request, how many tokens beyond its own prefix
cache the store can supply (`matched_tokens`), allocates blocks for them (`after_alloc`), then
asks for the step's metadata (`build_meta`), which the worker side executes around the forward:

    load  (req, tokens[:end], start, block ids of [start, end))  fetched into those blocks
    save  (req, tokens[:end], start, block ids of [0, end))      blocks [start, end) stored

Invariants:
- A hit is whole vLLM blocks and never the whole prompt: at least its last token is computed,
  so the step that follows has logits to sample from.
- Only prompt tokens are stored, each block once, in the step that completes it (so chunked
  prefill stores chunk by chunk); `saved_tokens` is where the next save starts. Blocks before
  the first save (vLLM's own prefix hit, the store's hit) are not sent again unless the store
  turns out to have lost them (the worker then sends the gap; it still has the blocks).
- A request's state lives from `on_new_request` to `request_finished` (finished, aborted,
  rejected alike). A preempted request keeps it: its stored blocks stay stored; when it is
  resumed its block ids are replaced and the store is asked again.
- Saves are synchronous within the step (the worker stores the blocks before the step ends),
  so no block outlives its request on the connector's account, and `request_finished` never
  delays freeing: once vLLM calls it, every whole prompt block is in the store, and the next
  lookup of any engine finds it.
- Loads are synchronous by default: fetched and scattered layer by layer inside the step of
  the batch the request joins. With `load_async`, a hit's request waits outside the batch
  (vLLM's WAITING_FOR_REMOTE_KVS) while the worker loads its blocks beside the forward of the
  others, and joins a later batch with those tokens computed; vLLM holds the blocks until the
  worker reports the load finished (`get_finished`), aborted requests included.
- Roles (vLLM's kv_role, docs/disaggregation.md): a producer stores and never loads (its
  prefills are the ones a decode engine reuses, so they are computed from the prompt alone);
  a consumer loads and never stores prompt blocks (a producer already did); kv_both does both.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvstore.integrations.store_link import StoreLink
from kvstore.integrations.vllm_audit import AuditSpec, SchedulerAudits


@dataclass
class LoadSpec:
    req_id: str
    salt: str | None
    tokens: list[int]  # the prompt up to the end of the last block loaded: the store's key for the pages
    start: int  # first token to load (a block boundary: where vLLM's own prefix hit ends)
    block_ids: list[int]  # vLLM blocks receiving tokens from start to the end of `tokens`
    load_async: bool = False  # loaded outside the step's forward; reported by the worker when done
    # Where vLLM starts computing: inside the last block for an audited hit (its withheld
    # tokens, which the load must leave as vLLM writes them), else the end of the last block.
    computed_from: int = 0


@dataclass
class SaveSpec:
    req_id: str
    salt: str | None
    tokens: list[int]  # the prompt's first `end` tokens
    start: int  # first token to store (a block boundary)
    block_ids: list[int]  # vLLM blocks holding tokens [0, end), for a gap the store lost


@dataclass
class StepMeta:
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    audits: list[AuditSpec] = field(default_factory=list)  # audited hits whose withheld block this step computes


@dataclass
class _Tracked:
    salt: str | None
    prompt: list[int]
    block_ids: list[int] = field(default_factory=list)
    saved_tokens: int = 0
    request: Any = None  # vLLM's request: its block hashes name the blocks in KV events
    loading: frozenset = frozenset()  # blocks of its last load
    loads_off: bool = False  # a load of it failed: it is computed from then on, never loaded again


ROLES = ("kv_producer", "kv_consumer", "kv_both")


class SchedulerSide:
    def __init__(self, link: StoreLink, block_size: int, events: Any = None, role: str = "kv_both",
                 load_async: bool = False, audit_rate: float = 0.0, audit_tokens: int = 0):
        if role not in ROLES:
            raise ValueError(f"kv_role: must be one of {', '.join(ROLES)}, got {role!r}")
        self.link, self.block_size, self.role, self.load_async = link, block_size, role, load_async
        self.loads, self.saves = role != "kv_producer", role != "kv_consumer"
        self.events = events  # ConnectorEvents (vllm_kv_events.py) when vLLM publishes KV events, else None
        self._requests: dict[str, _Tracked] = {}
        self._hits: dict[str, tuple[int, int]] = {}  # req -> (local tokens, store hit end), last answer
        self.stats = {"lookups": 0, "lookup_s": 0.0}  # for bench/vllm_ttft.py's breakdown of a request
        self._loads: dict[str, LoadSpec] = {}  # allocated, to be loaded in the next step
        # Sampled hits withhold their last block's last tokens (vllm_audit.py); 0: the whole block.
        self.audits = SchedulerAudits(audit_rate, block_size, withheld_tokens=audit_tokens)

    @staticmethod
    def usable(request: Any) -> bool:
        """Requests whose KV is a function of their token ids alone: no LoRA adapter, no
        multimodal inputs, no prompt embeddings (their pages would collide with plain text's)."""
        return (request.prompt_token_ids is not None and not getattr(request, "mm_features", None)
                and getattr(request, "lora_request", None) is None and getattr(request, "prompt_embeds", None) is None)

    def on_new_request(self, request: Any) -> None:
        salt = request.cache_salt or None  # vLLM hashes an empty salt as none
        if self.usable(request) and self.link.usable(salt):
            self._requests[request.request_id] = _Tracked(salt, list(request.prompt_token_ids),
                                                          request=request if self.events is not None else None)

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond `num_computed_tokens` (vLLM's block-aligned local hit) the store can load."""
        tracked = self._requests.get(request.request_id)
        if tracked is None or not self.loads or tracked.loads_off:
            return 0
        B = self.block_size
        limit = (len(tracked.prompt) - 1) // B * B  # whole blocks, never the last prompt token
        if limit <= num_computed_tokens:
            return 0
        started = time.perf_counter()
        matched = self.link.lookup(tracked.prompt[:limit], tracked.salt)
        self.stats["lookup_s"] += time.perf_counter() - started
        self.stats["lookups"] += 1
        hit = self.audits.withhold(request.request_id, num_computed_tokens, min(matched, limit) // B * B,
                                   self.load_async)
        if hit <= num_computed_tokens:
            self._hits.pop(request.request_id, None)
            return 0
        self._hits[request.request_id] = (num_computed_tokens, hit)
        return hit - num_computed_tokens

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        hit = self._hits.pop(request.request_id, None)
        tracked = self._requests.get(request.request_id)
        if num_external_tokens <= 0 or hit is None or tracked is None:
            return
        start = hit[0]
        end = start + num_external_tokens
        B = self.block_size
        # Whole blocks: an audited hit ends inside its last block, whose earlier tokens are loaded
        # and whose withheld ones vLLM then computes over the loaded copy.
        whole_end = -(-end // B) * B
        spec = LoadSpec(request.request_id, tracked.salt, tracked.prompt[:whole_end], start,
                        list(block_ids[start // B:whole_end // B]), self.load_async, computed_from=end)
        self._loads[request.request_id] = spec
        tracked.loading = frozenset(spec.block_ids)
        self.audits.allocated(request.request_id, tracked.salt, tracked.prompt, list(block_ids), start, end)

    def load_errors(self, block_ids: set[int]) -> None:
        """Blocks a load could not fill (the worker's report, through vLLM): their requests are
        computed from now on. An asynchronous load's request is otherwise asked again when vLLM
        reschedules it, and a store that answers lookups but fails fetches would loop it."""
        for tracked in self._requests.values():
            if tracked.loading & block_ids:
                tracked.loads_off = True

    def build_meta(self, scheduler_output: Any) -> StepMeta:
        meta = StepMeta(loads=list(self._loads.values()), audits=self.audits.take(scheduler_output))
        self._loads.clear()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            computed = new.num_computed_tokens // self.block_size * self.block_size
            tracked.saved_tokens = max(tracked.saved_tokens, computed)
            self._plan_save(meta, new.req_id, tracked, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # after preemption: these are all of its blocks
                tracked.block_ids = list(new_blocks[0]) if new_blocks is not None else []
            elif new_blocks is not None:
                tracked.block_ids.extend(new_blocks[0])
            self._plan_save(meta, req_id, tracked, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _plan_save(self, meta: StepMeta, req_id: str, tracked: _Tracked, computed_after_step: int) -> None:
        end = min(computed_after_step, len(tracked.prompt)) // self.block_size * self.block_size
        if not self.saves or end <= tracked.saved_tokens or end // self.block_size > len(tracked.block_ids):
            return
        meta.saves.append(SaveSpec(req_id, tracked.salt, tracked.prompt[:end], tracked.saved_tokens,
                                   tracked.block_ids[:end // self.block_size]))
        if self.events is not None and tracked.request is not None:
            self.events.expect(tracked.salt, tracked.prompt[:end], tracked.request.block_hashes)
        tracked.saved_tokens = end

    def request_finished(self, request: Any) -> int | None:
        """Forget the request; the prompt tokens its saves put in the store (None: not tracked)."""
        tracked = self._requests.pop(request.request_id, None)
        self._hits.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        self.audits.forget(request.request_id)
        return tracked.saved_tokens if tracked is not None else None

    @property
    def num_tracked(self) -> int:
        """Requests with state here (0 once every request finished: nothing leaks)."""
        return len(self._requests) + len(self._hits) + len(self._loads) + len(self.audits)

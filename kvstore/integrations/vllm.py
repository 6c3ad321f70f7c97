"""`KVStoreConnector`: kvstore as a vLLM KV connector (vLLM's `KVConnectorBase_V1`).

    LLM(model, kv_transfer_config=KVTransferConfig(
        kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
        kv_role="kv_both", kv_connector_extra_config={"url": "http://127.0.0.1:8100"}))

A prompt's prefix that any engine (or kvstore's own decode loop) computed before is loaded from
the store into the blocks vLLM allocated instead of being computed; every prompt block vLLM
computes is stored, in kvstore's canonical `(L, 2, T, H, D)` layout, so the same pages serve
every client of the store. `kv_connector_extra_config` is documented in connector_config.py;
docs/vllm.md has the set-up and the measured figures.

vLLM makes two connectors per engine, one per role: the scheduler side decides what to load
and store (vllm_scheduler.py), the worker side moves the blocks (vllm_worker.py). This class
routes vLLM's calls to them and decides where the store is:

- `url` given: both sides are clients of that sidecar.
- in-process, scheduler and worker in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0, or any
  executor that keeps the worker with the scheduler): both use this process's `KVStore`.
- in-process, worker in its own process (vLLM's CPU backend always does this when
  multiprocessing is on): the scheduler side opens the store and serves it to its worker on a
  loopback port (kvstore.api.server.in_process; KV moves through shared memory). The worker learns the
  URL from the first step's metadata.

A request's cache_salt keeps its pages apart in every case: it is the store's salt
(store_link.py), never shared with another salt or with unsalted requests.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

from kvstore.integrations.connector_config import ConnectorConfig
from kvstore.integrations.store_link import StoreLink
from kvstore.integrations.vllm_model import RankHeads, rank_heads, spec_from_vllm, store_model_name
from kvstore.integrations.vllm_scheduler import SchedulerSide, StepMeta
from kvstore.integrations.vllm_worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["KVStoreConnector", "KVStoreConnectorMetadata"]
log = logging.getLogger("kvstore.vllm")


class KVStoreConnectorMetadata(KVConnectorMetadata):
    """One step's loads and saves, scheduler -> worker, and where the scheduler's store is
    (`store_url` None: a sidecar named in the config, or a store in this very process)."""

    def __init__(self, step: StepMeta, store_url: str | None):
        self.step, self.store_url = step, store_url


class KVStoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra_config(transfer.kv_connector_extra_config)
        self.block_size = vllm_config.cache_config.block_size
        self.spec = spec = spec_from_vllm(vllm_config, self.config.page_size)
        self.model = model = store_model_name(vllm_config.model_config.served_model_name, self.config.model)
        self.link: StoreLink | None = None
        self.scheduler: SchedulerSide | None = None
        self.events: Any = None  # ConnectorEvents: what take_events reports (vllm_kv_events.py)
        self.worker: WorkerSide | None = None
        self.rank = RankHeads(None, True)  # the worker's tensor-parallel rank's KV heads (vllm_model.py)
        self._sidecar: Any = None  # the loopback sidecar an in-process store is served to a worker process by
        self._store_url: str | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.link = self._scheduler_link(vllm_config)
            # A cache miss must cost a recompute, never a failed request (vLLM's default, "fail",
            # suits disaggregated prefill, where the KV has no other source). The scheduler reads
            # this right after constructing its connector.
            if transfer.kv_load_failure_policy != "recompute":
                log.info("KVStoreConnector: kv_load_failure_policy set to 'recompute' (a store miss is recomputed)")
                transfer.kv_load_failure_policy = "recompute"
            self.events = self._scheduler_events(vllm_config)
            if self.config.audit_tokens > self.block_size:
                raise ValueError(f"kv_connector_extra_config.audit_tokens: must be in [1, {self.block_size}] "
                                 f"(vLLM's block_size), got {self.config.audit_tokens}")
            self.scheduler = SchedulerSide(self.link, self.block_size, self.events, role=transfer.kv_role or "kv_both",
                                           load_async=self.config.load_async, audit_rate=self.config.audit_rate,
                                           audit_tokens=self.config.audit_tokens)
        else:
            self.rank = rank = _rank_heads(vllm_config, spec)
            if self.config.url is not None:
                self.link = StoreLink(self.config, model, spec, heads=rank.heads)
            rank_spec = spec if rank.heads is None else dataclasses.replace(
                spec, num_kv_heads=rank.heads[1] - rank.heads[0])
            # An in-process store: linked at the first step.
            self.worker = WorkerSide(self.link, rank_spec, self.block_size, stores=rank.stores)
        log.info("KVStoreConnector (%s): model %r, %s, page_size %d, block_size %d", role.name.lower(), model,
                 self.config.url or "in-process store", spec.page_size, self.block_size)

    def _scheduler_link(self, vllm_config: "VllmConfig") -> StoreLink:
        if self.config.url is not None:
            return StoreLink(self.config, self.model, self.spec)
        executor = vllm_config.parallel_config.distributed_executor_backend
        if executor in ("uni", None):
            return StoreLink(self.config, self.model, self.spec)
        if executor != "mp":
            raise ValueError(f"KVStoreConnector: an in-process store needs its worker on this host (executor "
                             f"{executor!r}); run `kvstore serve` and set url in kv_connector_extra_config")
        from kvstore.api.server.in_process import InProcessSidecar

        assert self.config.store is not None  # the config holds one of url and store; url is None here
        self._sidecar = InProcessSidecar(self.config.store)
        self._store_url = self._sidecar.__enter__()
        log.info("KVStoreConnector: serving the in-process store to the worker process at %s", self._store_url)
        return StoreLink(self.config, self.model, self.spec, url=self._store_url)

    def _scheduler_events(self, vllm_config: "VllmConfig") -> Any:
        """KV events of the store's copies of this engine's blocks, when vLLM publishes KV events
        (`--kv-events-config`): from this process's store, or from a sidecar's stream."""
        events_config = vllm_config.kv_events_config
        if events_config is None or not events_config.enable_kv_cache_events:
            return None
        from kvstore.integrations.vllm_kv_events import ConnectorEvents, StoreEventSource

        store = self.link.in_process_store if self.link is not None else None
        if store is None and self._sidecar is not None:  # this process's store, served to the worker process
            store = self._sidecar.store
        if store is not None:
            return ConnectorEvents(StoreEventSource(store), self.model, self.spec, self.block_size)
        if self.config.kv_events_endpoint is None:
            log.info("KVStoreConnector: no kv_events_endpoint for the sidecar's KV events "
                     "(kvstore serve --kv-events-endpoint); take_events reports none")
            return None
        from kvstore.kv_events.subscriber import SidecarEventSource

        source = SidecarEventSource(self.config.kv_events_endpoint, self.config.kv_events_replay_endpoint)
        return ConnectorEvents(source, self.model, self.spec, self.block_size)

    def take_events(self):
        """vLLM's events for the store's copies of this engine's blocks (BlockStored with the
        medium of the tier that holds them, BlockRemoved when it no longer does), published by
        vLLM's scheduler with its own."""
        return self.events.take() if self.events is not None else ()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss, never a wrong answer

    # -- worker side ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention.attention import Attention

        assert self.worker is not None
        layers = get_layers_from_vllm_config(self._vllm_config, Attention, list(kv_caches))
        backends = {name: layers[name].attn_backend.get_name() for name in kv_caches}
        isa: set[Any] = {getattr(layers[name], "isa", None) for name in kv_caches}

        def cpu_writer():
            # vLLM's own CPU cache write, as CPUAttentionBackendImpl.do_kv_cache_update calls it.
            from vllm import _custom_ops as ops

            if len(isa) != 1 or None in isa:
                raise ValueError(f"KVStoreConnector: CPU attention layers report ISAs {sorted(map(str, isa))}")
            chosen = next(iter(isa))

            def write(block: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
                n, h, b, _ = block.shape
                key_cache, value_cache = block.view(n, h, 2 * b, -1).chunk(2, dim=2)
                ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, chosen)

            return write

        self.worker.register(kv_caches, backends, cpu_writer, self._vllm_config.cache_config.kv_cache_layout,
                             self._vllm_config.scheduler_config.max_num_batched_tokens)
        assert self.worker.layout is not None  # register() chose it
        log.info("KVStoreConnector: %d layers, paged layout %s", len(kv_caches), self.worker.layout.name)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.start_load(self._step())

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self.worker is not None
        self.worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.save_layer(self._step(), layer_name, kv_layer)

    def wait_for_save(self) -> None:
        assert self.worker is not None
        self.worker.finish_step(self._step() if self.has_connector_metadata() else None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_error_blocks() if self.worker is not None else set()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """No saves outlive their step; the asynchronous loads finished since the last call."""
        return None, (self.worker.finished_loads() or None) if self.worker is not None else None

    def _step(self) -> StepMeta:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata) and self.worker is not None
        if self.link is None:  # an in-process store: the scheduler's, here or behind its loopback sidecar
            self.link = StoreLink(self.config, self.model, self.spec, url=meta.store_url, heads=self.rank.heads)
            self.worker.link = self.link
        return meta.step

    # -- scheduler side ---------------------------------------------------------------------------
    def on_new_request(self, request: "Request") -> None:
        assert self.scheduler is not None
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        tokens = self.scheduler.matched_tokens(request, num_computed_tokens)
        return tokens, self.scheduler.load_async and tokens > 0

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def update_connector_output(self, connector_output: Any) -> None:
        if self.scheduler is not None and connector_output.invalid_block_ids:
            self.scheduler.load_errors(set(connector_output.invalid_block_ids))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self.scheduler is not None
        return KVStoreConnectorMetadata(self.scheduler.build_meta(scheduler_output), self._store_url)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Never delays freeing (saves finish within their step). A producer's answer carries
        kv_transfer_params naming what it stored, for the decode engine and the proxy."""
        if self.scheduler is None:
            return False, None
        saved = self.scheduler.request_finished(request)
        if self.scheduler.role != "kv_producer" or saved is None:
            return False, None
        return False, {"kvstore_model": self.model, "kvstore_tokens": saved}

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.events is not None:
            self.events.close()
            self.events = None
        if self.link is not None:
            self.link.close()
        if self._sidecar is not None:
            self._sidecar.__exit__(None, None, None)
            self._sidecar = None


def _rank_heads(vllm_config: "VllmConfig", spec: Any) -> RankHeads:
    """This worker's KV heads: its tensor-parallel rank's share of the model's (vllm_model.py)."""
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    if tp_size == 1:
        return RankHeads(None, True)
    from vllm.distributed import get_tensor_model_parallel_rank

    return rank_heads(spec.num_kv_heads, tp_size, get_tensor_model_parallel_rank())

"""The worker side of `KVStoreConnector`: moves the step's blocks between vLLM's paged cache and the store.

    start_load_kv        fetch every load of the step (one call per request: the store answers
                         all layers at once); blocks the store no longer holds are load errors
    wait_for_layer_load  scatter this layer's slice of the fetched KV into its blocks, just
                         before the layer's attention reads them
    save_kv_layer        right after a layer's attention: copy this layer's blocks to be saved
                         out of the paged cache, into the request's (L, 2, T, H, D) buffer
    wait_for_save        store the buffers (the blocks are no longer needed once copied out)

Layer-wise, the first layer's attention waits only for its own copy, and the copies out happen
as each layer finishes instead of in one pass after the last.

An asynchronous load (LoadSpec.load_async) belongs to a request outside this step's batch: one
background thread fetches it and scatters every layer into its blocks while the forward runs
on other blocks, and `finished_loads` (vLLM's get_finished) reports the request once that is
done. Its blocks are vLLM's until then (the scheduler neither frees nor reuses them), so the
thread's writes never race a reader.

A load that fails in any way (fetch error, fewer tokens than promised, a layer never loaded)
reports the blocks it could not fill through `load_error_blocks`; vLLM then recomputes them
(kv_load_failure_policy "recompute", which the connector sets). Wrong KV is never written: a
fetch answer of the wrong shape or dtype is a failure (store_link.py).
"""
from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from kvstore import ModelSpec
from kvstore.host_memory import empty_host
from kvstore.integrations.backend_layouts import layer_index, layout_for
from kvstore.integrations.paged_layout import ContentSplitLayout, PagedLayout, UnsupportedLayout
from kvstore.integrations.store_link import StoreLink
from kvstore.integrations.vllm_audit import WorkerAudits
from kvstore.integrations.vllm_scheduler import LoadSpec, SaveSpec, StepMeta
from kvstore.pinned_fetch import PinnedFetch

# A sidecar's fetch answer over TCP is received whole (its fields, a few hundred bytes, then the
# KV) into a load's staging buffer: room for the fields on top of the KV.
ANSWER_FIELDS_BYTES = 4096
log = logging.getLogger("kvstore.vllm")


class _Load:
    """One request's fetched KV: an answer `kv` (L, 2, T, H, D), or an in-process store's pages
    where they lie (`pinned.runs`, pinned until `release`)."""

    def __init__(self, spec: LoadSpec, block_ids: torch.Tensor, num_layers: int, kv: torch.Tensor | None = None,
                 pinned: PinnedFetch | None = None):
        self.spec, self.block_ids, self.kv, self.pinned = spec, block_ids, kv, pinned
        self.pending_layers: set[int] = set(range(num_layers))

    def scatter(self, layout: PagedLayout, layer: torch.Tensor, i: int) -> None:
        """Write layer `i` of this load into its blocks of `layer`, except the tokens vLLM computes
        in this step at the end of the last block (an audited hit's withheld tokens)."""
        computed = self._computed_tail(layout, layer)
        self._scatter_blocks(layout, layer, i)
        if computed is not None:  # put vLLM's own tokens back over the stored copy
            block, offset, kv = computed
            whole = layout.gather(layer, block)  # (2, B, H, D)
            whole[:, offset:] = kv
            layout.scatter(layer, block, whole)

    def _computed_tail(self, layout: PagedLayout, layer: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor] | None:
        """(the last block, the first token vLLM computes in it, those tokens' KV as the cache holds
        them now) when this load ends inside a block, else None. vLLM may write a step's new KV
        into the cache before the layer's load (wait_for_layer_load) runs; whole-block loads
        would overwrite it, and the audit would compare the store's copy with itself."""
        first = self.spec.computed_from
        B = layout.block_size
        if not first % B or self.block_ids.numel() * B + self.spec.start < first:
            return None  # the load ends on a block boundary, or its last block was not served
        block = self.block_ids[-1:]
        return block, first % B, layout.gather(layer, block)[:, first % B:].clone()  # (2, W, H, D)

    def _scatter_blocks(self, layout: PagedLayout, layer: torch.Tensor, i: int) -> None:
        if self.pinned is not None:
            runs = self.pinned.runs
            assert runs is not None  # a load keeps a pinned fetch only with its runs (StoreLink.fetch_in_place)
            layout.scatter_runs(layer, self.block_ids, [(run.first, run.pages[:, i]) for run in runs])
        else:
            assert self.kv is not None
            layout.scatter(layer, self.block_ids, self.kv[i].to(layer.device))

    def release(self) -> None:
        if self.pinned is not None:
            self.pinned.release()


class _Save:
    def __init__(self, spec: SaveSpec, buffer: torch.Tensor, block_ids: torch.Tensor):
        self.spec, self.buffer, self.block_ids = spec, buffer, block_ids  # buffer: (L, 2, T, H, D)
        self.pending_layers: set[int] = set(range(buffer.shape[0]))


class WorkerSide:
    def __init__(self, link: StoreLink | None, spec: ModelSpec, block_size: int, *, stores: bool = True):
        """`spec`: the KV this worker's paged cache holds, its tensor-parallel rank's KV heads
        only (the link fetches and stores those heads of the store's pages). `stores`: False for
        a rank whose heads another rank stores (a replica, when tp > the model's KV heads)."""
        self.link, self.spec, self.block_size, self.stores = link, spec, block_size, stores
        self.layers: dict[str, torch.Tensor] = {}  # vLLM layer name -> its paged cache
        self.index: dict[str, int] = {}  # vLLM layer name -> store layer index
        self.layout: PagedLayout | None = None
        self._loads: list[_Load] = []
        self._saves: list[_Save] = []
        self._failed_blocks: set[int] = set()
        # Per position in a step's loads, the buffer an in-process store answers into, or a
        # sidecar's answer over TCP is received into: a step's answers are consumed within it,
        # and a reused buffer costs no page faults (a fresh one of a long prompt's KV does, on
        # every hit, in the kernel clearing each page).
        self._staging: list[torch.Tensor] = []
        self._save_arena = torch.empty(0)  # where the step's saves gather their blocks (_new_saves)
        self._async_loads: dict[str, Future] = {}  # req id -> its load's blocks that failed
        self._loader: ThreadPoolExecutor | None = None  # one thread, made at the first async load
        self._stats_lock = threading.Lock()  # the loader thread counts too
        # Counters and seconds spent, for tests and bench/vllm_ttft.py's breakdown of a step.
        self.stats = {"loaded_tokens": 0, "in_place_tokens": 0, "failed_blocks": 0, "saved_tokens": 0,
                      "fetch_s": 0.0, "scatter_s": 0.0, "gather_s": 0.0, "store_s": 0.0}
        self.audits = WorkerAudits(spec.num_layers, getattr(torch, spec.dtype))  # audited hits (vllm_audit.py)

    def register(self, kv_caches: dict[str, torch.Tensor], backends: dict[str, str],
                 cpu_writer: Callable[[], Callable[..., None]] | None, kv_cache_layout: str | None,
                 step_tokens: int | None = None) -> None:
        """Take vLLM's per-layer caches; refuse (at start) anything the store's spec cannot describe.
        `step_tokens` (the scheduler's token budget of a step, which bounds a step's saves): on
        the CPU the save arena is made that large and its pages faulted in now, at start-up,
        instead of during the first long prompt's prefill."""
        names = sorted(kv_caches, key=layer_index)
        indices = [layer_index(n) for n in names]
        if indices != list(range(self.spec.num_layers)):
            raise UnsupportedLayout(f"KVStoreConnector: expected KV caches of layers 0..{self.spec.num_layers - 1}, "
                                    f"got layers {indices}")
        kinds = set(backends.values())
        if len(kinds) != 1:
            raise UnsupportedLayout(f"KVStoreConnector: layers use several attention backends {sorted(kinds)}")
        first = kv_caches[names[0]]
        dtype_name = str(first.dtype).removeprefix("torch.")
        if dtype_name != self.spec.dtype:
            raise UnsupportedLayout(f"KVStoreConnector: KV cache dtype {dtype_name} differs from the model's "
                                    f"{self.spec.dtype}")
        self.layout = layout_for(kinds.pop(), block_size=self.block_size, num_kv_heads=self.spec.num_kv_heads,
                                 head_dim=self.spec.head_dim, dtype=first.dtype, cpu_writer=cpu_writer,
                                 kv_cache_layout=kv_cache_layout)
        for name in names:
            layer = kv_caches[name]
            if isinstance(self.layout, ContentSplitLayout):
                self.layout.check(layer)
            self.layers[name], self.index[name] = layer, layer_index(name)
        if first.is_cpu and step_tokens:
            blocks = -(-step_tokens // self.block_size) + 1  # a request's partial first block
            self._save_arena_for(blocks * self.block_size * self.spec.bytes_per_token // first.element_size(),
                                 first.dtype).zero_()

    # -- loads ----------------------------------------------------------------------------------
    def start_load(self, meta: StepMeta) -> None:
        self._release_loads()  # a step that never reached finish_step leaves none pinned
        if meta.audits and self.stores:  # a replica's heads are audited by the rank that stores them
            self.audits.start(self.link, meta.audits, next(iter(self.layers.values())).device)
        for spec in meta.loads:
            if spec.load_async:
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvstore-load")
                self._async_loads[spec.req_id] = self._loader.submit(self._load_whole, spec)
                continue
            load = self._fetch(spec, self._failed_blocks, self._staging_for(len(self._loads), spec), in_place=True)
            if load is not None:
                self._loads.append(load)

    def _staging_for(self, position: int, spec: LoadSpec) -> torch.Tensor | None:
        """The staging buffer of the step's `position`-th load, grown to fit `spec`'s answer."""
        if self.link is None or not next(iter(self.layers.values())).is_cpu:
            return None
        nbytes = (len(spec.tokens) - spec.start) * self.spec.bytes_per_token + ANSWER_FIELDS_BYTES
        while len(self._staging) <= position:
            self._staging.append(torch.empty(0, dtype=torch.uint8))
        if self._staging[position].numel() < nbytes:
            self._staging[position] = torch.empty(nbytes, dtype=torch.uint8)
        return self._staging[position]

    def _fetch(self, spec: LoadSpec, failed: set[int], into: torch.Tensor | None = None,
               in_place: bool = False) -> _Load | None:
        """The store's KV for a load, as whole blocks; the blocks it cannot fill go to `failed`.
        `in_place`: an in-process store's pages are read where they lie when they all are in its
        CPU tier (one copy, into the blocks, instead of two: docs/design.md §7.4)."""
        link = self.link
        assert link is not None  # a worker without a link has no loads
        B = self.block_size
        started = time.perf_counter()
        pinned = None
        if in_place and link.in_process_store is not None and link.heads is None \
                and next(iter(self.layers.values())).is_cpu:
            matched, kv, pinned = link.fetch_in_place(spec.tokens, spec.start, spec.salt, into)
        else:
            matched, kv = link.fetch(spec.tokens, spec.start, spec.salt, into)
        usable = max(0, (min(matched, len(spec.tokens)) - spec.start) // B)  # whole blocks the store still had
        failed.update(spec.block_ids[usable:])
        found = kv is not None or pinned is not None
        with self._stats_lock:
            self.stats["fetch_s"] += time.perf_counter() - started
            self.stats["failed_blocks"] += len(spec.block_ids) - usable
            if usable and found:
                self.stats["loaded_tokens"] += usable * B
                if pinned is not None:
                    self.stats["in_place_tokens"] += usable * B
        if usable == 0 or not found:
            if pinned is not None:
                pinned.release()
            return None
        device = next(iter(self.layers.values())).device
        block_ids = torch.tensor(spec.block_ids[:usable], dtype=torch.long, device=device)
        return _Load(spec, block_ids, self.spec.num_layers, kv=None if kv is None else kv[:, :, :usable * B],
                     pinned=pinned)

    def _load_whole(self, spec: LoadSpec) -> set[int]:
        """An asynchronous load, on the loader thread: every layer at once. The blocks it could
        not fill (all of them if anything went wrong: they are recomputed, never trusted)."""
        failed: set[int] = set()
        load = None
        try:
            load = self._fetch(spec, failed, in_place=True)
            if load is not None:
                assert self.layout is not None
                for name, layer in self.layers.items():
                    load.scatter(self.layout, layer, self.index[name])
        except Exception as exc:  # a miss, as with a failed sync load: vLLM recomputes the blocks
            log.warning("kvstore async load of %s failed (%s: %s); recomputing", spec.req_id, type(exc).__name__, exc)
            failed.update(spec.block_ids)
        finally:
            if load is not None:
                load.release()
        return failed

    def finished_loads(self) -> set[str]:
        """Requests whose asynchronous load is done since the last call; their unfilled blocks are
        in the next `load_error_blocks` (vLLM reads both from the same step's output)."""
        done = {req_id for req_id, job in self._async_loads.items() if job.done()}
        for req_id in done:
            self._failed_blocks.update(self._async_loads.pop(req_id).result())
        return done

    def wait_for_layer(self, layer_name: str) -> None:
        i = self.index.get(layer_name)
        if i is None or not self._loads:
            return
        layer = self.layers[layer_name]
        assert self.layout is not None
        started = time.perf_counter()
        for load in self._loads:
            if i in load.pending_layers:
                try:
                    load.scatter(self.layout, layer, i)
                except Exception as exc:  # the layer stays pending: its blocks are load errors, recomputed
                    log.warning("kvstore load of %s failed at layer %d (%s: %s); recomputing", load.spec.req_id, i,
                                type(exc).__name__, exc)
                    continue
                load.pending_layers.discard(i)
        self.stats["scatter_s"] += time.perf_counter() - started

    # -- saves ----------------------------------------------------------------------------------
    def save_layer(self, meta: StepMeta, layer_name: str, layer: torch.Tensor) -> None:
        i = self.index.get(layer_name)
        if i is None:
            return
        self.audits.on_layer(self.layout, layer, i)
        if not self._saves and meta.saves:
            self._saves = self._new_saves(meta.saves)
        assert self.layout is not None
        started = time.perf_counter()
        for save in self._saves:
            if i in save.pending_layers:
                self.layout.gather(layer, save.block_ids, out=save.buffer[i])
                save.pending_layers.discard(i)
        self.stats["gather_s"] += time.perf_counter() - started

    def _new_saves(self, specs: list[SaveSpec]) -> list[_Save]:
        """The step's saves, each with its buffer (L, 2, T, H, D) for the blocks it saves. On the
        CPU the buffers are slices of one arena reused from step to step (a store has copied or
        sent a buffer by the time it returns), grown when a step needs more: a fresh buffer of a
        long prompt's KV faults in every page of it, which cost more than the copy into it."""
        B = self.block_size
        first = next(iter(self.layers.values()))
        blocks = [spec.block_ids[spec.start // B:] for spec in specs]
        shapes = [self.spec.kv_shape(len(ids) * B) for ids in blocks]
        buffers = []
        if first.is_cpu:
            arena = self._save_arena_for(sum(math.prod(shape) for shape in shapes), first.dtype)
            offset = 0
            for shape in shapes:
                buffers.append(arena[offset:offset + math.prod(shape)].view(shape))
                offset += math.prod(shape)
        else:
            buffers = [torch.empty(shape, dtype=first.dtype, device=first.device) for shape in shapes]
        return [_Save(spec, buffer, torch.tensor(ids, dtype=torch.long, device=first.device))
                for spec, buffer, ids in zip(specs, buffers, blocks)]

    def _save_arena_for(self, elements: int, dtype: torch.dtype) -> torch.Tensor:
        if self._save_arena.numel() < elements or self._save_arena.dtype != dtype:
            self._save_arena = empty_host((elements,), dtype)
        return self._save_arena

    def _gather_all(self, block_ids: list[int], out: torch.Tensor | None = None, layers: Any = None) -> torch.Tensor:
        """KV of `block_ids` from every layer (or `layers`) of the paged cache: (L, 2, T, H, D)."""
        assert self.layout is not None
        names = list(self.layers)
        device = self.layers[names[0]].device
        ids = torch.tensor(block_ids, dtype=torch.long, device=device)
        if out is None:
            out = torch.empty(self.spec.kv_shape(len(block_ids) * self.block_size), dtype=self.layers[names[0]].dtype,
                              device=device)
        for name in names:
            i = self.index[name]
            if layers is None or i in layers:
                self.layout.gather(self.layers[name], ids, out=out[i])
        return out

    def finish_step(self, meta: StepMeta | None) -> None:
        """End of the step: layers never loaded are load errors; audits are judged (a failed
        one's loaded blocks are load errors, and its request's save is not stored); store every save."""
        for load in self._loads:
            if load.pending_layers:  # the forward never asked for these layers: do not trust the blocks
                self._failed_blocks.update(load.block_ids.tolist())
                self.stats["failed_blocks"] += load.block_ids.numel()
        self._release_loads()  # before the audits: a failed one drops pages these loads pinned
        failed, spoiled = self.audits.finish(self.link)
        self._failed_blocks |= failed
        if meta is not None and meta.saves and not self._saves:
            self._saves = self._new_saves(meta.saves)
        saves, self._saves = self._saves, []
        started = time.perf_counter()
        for save in saves:
            if save.spec.req_id in spoiled:
                continue
            if save.pending_layers:  # a layer without the save hook: copy it now, its blocks are intact
                self._gather_all(save.block_ids.tolist(), out=save.buffer, layers=save.pending_layers)
            self._store(save)
        self.stats["store_s"] += time.perf_counter() - started

    def _store(self, save: _Save) -> None:
        if not self.stores:
            return  # a replica of heads another rank stores
        link = self.link
        assert link is not None  # a worker without a link has no saves
        spec, B = save.spec, self.block_size
        held = link.store(spec.tokens, save.buffer, spec.start, spec.salt)
        if held is not None and held < spec.start:
            # The store lost (or never had) the blocks before this save: send them too, from here.
            first = held // B * B
            gap = self._gather_all(spec.block_ids[first // B:spec.start // B])
            held = link.store(spec.tokens, torch.cat([gap, save.buffer], dim=2), first, spec.salt)
        if held is not None:
            self.stats["saved_tokens"] += max(0, min(held, len(spec.tokens)) - spec.start)

    def _release_loads(self) -> None:
        loads, self._loads = self._loads, []
        for load in loads:
            load.release()

    def load_error_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def close(self) -> None:
        """Wait for the asynchronous loads in flight (they write into vLLM's cache)."""
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        self._release_loads()

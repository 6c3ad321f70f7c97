"""Audited reuse in vLLM (kvstore/integrations/vllm_audit.py) on the real model, one engine per run:
`run_vllm_audit(dtype, path, clean_hits)` audits clean hits of the decode loop's pages and of vLLM's
own, then plants each fault vLLM can meet. The cases and checks: docs/reliability.md, "Audited reuse".
"""
from __future__ import annotations

import os
import random
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from bench.engines import BLOCK, greedy, make_engine
from bench.reliability.audit import full_kv, plant, real_model, real_text
from kvstore.config import StoreConfig

NEW_TOKENS = 8
VLLM_FAULTS = ("slot-bytes", "weights-1.01", "k-no-rope", "scatter-heads-permuted", "collision")


@dataclass
class VllmFaultCase:
    fault: str
    detected: bool
    left_tokens: int
    answer_ok: bool
    next_answer_ok: bool
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.detected and self.left_tokens == 0 and self.answer_ok and self.next_answer_ok


@dataclass
class VllmAuditReport:
    dtype: str
    path: str
    cross_engine_hits: int = 0
    same_engine_hits: int = 0
    failures: int = 0  # false alarms among the clean hits
    faults: list[VllmFaultCase] = field(default_factory=list)
    seconds: float = 0.0


@contextmanager
def _engine(dtype: str, extra: dict[str, Any]) -> Iterator[Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from kvstore.decode.model_pull import pull

    per_token = 30 * 2 * 3 * 64 * (4 if dtype == "float32" else 2)
    job = dict(model=str(pull("smollm2")), max_model_len=1024, kv_cache_bytes=96 * BLOCK * per_token, extra=extra)
    llm = make_engine(job, dtype=dtype, enable_prefix_caching=False)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def _ask(llm: Any, ids: list[int]) -> list[int]:
    return list(greedy(llm, [ids], NEW_TOKENS)[0].outputs[0].token_ids)


@contextmanager
def _scatter_heads_permuted() -> Iterator[None]:
    """The worker's loads write each layer's KV heads one place off (a scatter's layout bug)."""
    from kvstore.integrations import vllm_worker

    original = vllm_worker._Load.scatter

    def scatter(self: Any, layout: Any, layer: Any, i: int) -> None:
        if self.pinned is not None:
            layout.scatter_runs(layer, self.block_ids,
                                [(run.first, run.pages[:, i].roll(1, dims=-2)) for run in self.pinned.runs])
        else:
            layout.scatter(layer, self.block_ids, self.kv[i].roll(1, dims=-2).to(layer.device))

    vllm_worker._Load.scatter = scatter
    try:
        yield
    finally:
        vllm_worker._Load.scatter = original


def _counts(backend: Any, model: str) -> tuple[int, int]:
    tiers = backend.stats()["audits"].get(model, {})
    return sum(c["passes"] for c in tiers.values()), sum(c["failures"] for c in tiers.values())


def run_vllm_audit(dtype: str, path: str, clean_hits: int, *, faults: tuple[str, ...] = VLLM_FAULTS,
                   documents: int = 6, document_tokens: int = 480, seed: int = 42,
                   audit_tokens: int | None = None) -> VllmAuditReport:
    began = time.perf_counter()
    report = VllmAuditReport(dtype, path)
    model = real_model(dtype)
    name = "smollm2"  # the store's name for the model, as vLLM serves the checkpoint directory
    model.name = name
    text = real_text(model)
    rng = random.Random(seed)
    with ExitStack() as stack:
        config = StoreConfig(data_dir=None, cpu_bytes=256 << 20, disk_bytes=0)
        if path == "sidecar":
            from kvstore.api.client import KVStoreClient
            from kvstore.api.server.in_process import InProcessSidecar

            sidecar = InProcessSidecar(config)
            url = stack.enter_context(sidecar)
            backend: Any = stack.enter_context(KVStoreClient(url))
            target = sidecar._store  # the sidecar's own store, for faults written behind its back
            extra: dict[str, Any] = {"url": url, "audit_rate": 1.0, "timeout_s": 60}
        else:
            from kvstore.integrations.connector_config import ConnectorConfig
            from kvstore.integrations.store_link import release_store, shared_store

            extra = {"cpu_bytes": "256MiB", "disk_bytes": 0, "audit_rate": 1.0, "timeout_s": 60}
            store_config = ConnectorConfig.from_extra_config(extra).store
            backend = target = shared_store(store_config)  # the very store the engine opens
            stack.callback(release_store, store_config)
        if audit_tokens is not None:  # else the connector's default
            extra["audit_tokens"] = audit_tokens
        llm = stack.enter_context(_engine(dtype, extra))
        backend.register_model(name, model.spec)
        from kvstore.decode import generate

        def hits(n: int, store_docs: Any) -> int:
            docs = []
            for _ in range(documents):
                at = rng.randrange(0, len(text) - document_tokens)
                docs.append(text[at:at + document_tokens])
                store_docs(docs[-1])
            done = 0
            for i in range(n):
                doc = docs[i % documents]
                m = rng.randrange(2 * BLOCK + 1, document_tokens)
                tail = rng.randrange(0, len(text) - 16)
                passes, failures = _counts(backend, name)
                _ask(llm, doc[:m] + text[tail:tail + rng.randrange(1, 12)])
                after = _counts(backend, name)
                done += after[0] - passes
                report.failures += after[1] - failures
            return done

        report.cross_engine_hits = hits(clean_hits // 2, lambda doc: generate(model, doc, 1, backend=backend))
        report.same_engine_hits = hits(clean_hits - clean_hits // 2, lambda doc: _ask(llm, doc))
        for fault in faults:
            report.faults.append(_fault_case(llm, model, backend, target, text, fault, rng))
    report.seconds = time.perf_counter() - began
    return report


def _fault_case(llm: Any, model: Any, backend: Any, target: Any, text: list[int], fault: str,
                rng: random.Random) -> VllmFaultCase:
    """`backend`: how the engine reaches the store (the store, or a client of the sidecar);
    `target`: the store itself, whose slots a fault may write behind its back."""
    began = time.perf_counter()
    at = rng.randrange(0, len(text) - 1000)
    prompt = text[at:at + 5 * BLOCK]
    other = text[at + 300:at + 300 + 5 * BLOCK]
    request = prompt + text[at + 500:at + 509]
    follow_up = prompt + text[at + 600:at + 611]

    def empty() -> None:
        backend.drop_model(model.name)
        backend.register_model(model.name, model.spec)

    empty()
    expected = _ask(llm, request)  # the engine's own full prefill (nothing stored yet)
    empty()
    expected_next = _ask(llm, follow_up)
    empty()
    # The page holding the withheld tokens: the last page of the match's last whole block.
    audited = len(prompt) // model.spec.page_size - 1
    with ExitStack() as stack:
        if fault == "scatter-heads-permuted":
            backend.store(model.name, prompt, full_kv(model, prompt))
            stack.enter_context(_scatter_heads_permuted())
        else:
            plant(fault, model, target, prompt, other, audited, rng)
        failures = _counts(backend, model.name)[1]
        answer = _ask(llm, request)
        detected = _counts(backend, model.name)[1] == failures + 1
        left = backend.lookup(model.name, prompt).matched_tokens
    next_answer = _ask(llm, follow_up)
    return VllmFaultCase(fault, detected, left, answer == expected, next_answer == expected_next,
                         time.perf_counter() - began)


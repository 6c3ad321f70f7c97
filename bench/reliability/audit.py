"""Audited reuse on the real model (SmolLM2-135M-Instruct): the faults it must catch (prefix hits
and CacheBlend chunks) and the clean hits it must pass, with each deviation recorded.

    python -m bench.reliability.audit --chunks --dtype float32 --hits 100 [--faults]
    python -m bench.reliability.audit --dtype bfloat16 --hits 80 [--faults]   # prefix hits

The faults, the checks a case must hold and the figures: docs/reliability.md, "Audited reuse".
"""
from __future__ import annotations

import copy
import functools
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from bench.prompts import documentation_sections
from kvstore.config import StoreConfig
from kvstore.decode import LlamaModel, generate, load_model
from kvstore.decode.attention import AttentionContext
from kvstore.reuse_audit import tolerance_for
from kvstore.store import KVStore

NEW_TOKENS = 12
FAULTS = ("slot-bytes", "weights-1.01", "k-no-rope", "k-wrong-pos", "heads-permuted", "pages-swapped", "collision")
WHERE = ("audited page", "earlier page")


def real_model(dtype: str) -> LlamaModel:
    return load_model("smollm2", dtype=dtype)


def real_text(model: LlamaModel, max_chars: int | None = None) -> list[int]:
    """Python's language reference as token ids: real English prose and code (its first
    `max_chars` characters: tokenizing all of it takes a while)."""
    assert model.tokenizer is not None
    return model.tokenizer.encode("\n\n".join(s.strip() for s in documentation_sections())[:max_chars])


def text_piece(text: list[int], rng: random.Random, low: int, high: int) -> list[int]:
    """A run of `low`..`high` tokens (both included) from a random place in `text`."""
    n = rng.randrange(low, high + 1)
    at = rng.randrange(0, len(text) - n)
    return text[at:at + n]


def scenario(dtype: str, model: LlamaModel | None, seed: int) -> tuple[LlamaModel, list[int], random.Random]:
    """A run's model (the one given, or the real one loaded in `dtype`), its text and its seeded draws."""
    model = model or real_model(dtype)
    return model, real_text(model), random.Random(seed)


def new_store() -> KVStore:
    return KVStore(StoreConfig(data_dir=None, cpu_bytes=256 << 20, disk_bytes=0))


def full_kv(model: LlamaModel, tokens: list[int]) -> torch.Tensor:
    """(L, 2, T, H, D): the KV a full prefill of `tokens` computes."""
    cache = model.new_cache(len(tokens))
    table = cache.new_table()
    cache.reserve(table, len(tokens))
    ids = torch.tensor(tokens, dtype=torch.long)
    model(ids, torch.arange(len(tokens)), cache, AttentionContext.for_span(cache, table, 0, len(tokens)), logits="none")
    table.num_tokens = len(tokens)
    return cache.gather(table, 0, len(tokens))


def rotate_k(model: LlamaModel, kv: torch.Tensor, by: torch.Tensor) -> torch.Tensor:
    """kv with K rotated by `by` (T,) more positions (negative: back), in float32 then cast back."""
    out = kv.clone()
    cos, sin = model.rotary.cos_sin(by, torch.float32)  # (T, 1, D)
    k = out[:, 0].to(torch.float32)  # (L, T, H, D)
    half = k.shape[-1] // 2
    rotated = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
    out[:, 0] = (k * cos + rotated * sin).to(kv.dtype)
    return out


def cpu_slot(store: KVStore, model: LlamaModel, tokens: list[int], page_index: int, *,
             chunk: bool = False) -> torch.Tensor:
    """The CPU-tier bytes of page `page_index` of `tokens`' stored path (`chunk`: of the chunk
    `tokens` stored with store_chunk; a view: writes go behind the store's back)."""
    from kvstore.keys import chunk_key
    from kvstore.limits import MAX_TOKENS
    from kvstore.validation import token_bytes

    state = store._state
    tb = token_bytes(tokens, max_tokens=MAX_TOKENS)
    with state.lock:
        namespace = store._registry.get(model.name, None).namespace
        root = chunk_key(namespace, tb) if chunk else namespace
        path = state.index.match(root, tb, model.spec.page_size).path
        node = path[page_index]
        offset, _ = state.tiers.slot_tiers["cpu"].get(node.key)
        nbytes = node.tiers["cpu"]
        return state.tiers.tiers["cpu"].buffer[offset:offset + nbytes]


@dataclass
class FaultCase:
    fault: str
    where: str
    dtype: str
    detected: bool  # the first audited hit failed its audit
    first_layer: int | None  # the first layer over the tolerance
    worst: float  # the largest deviation of the first audited hit
    tolerance: float
    left_tokens: int  # tokens of the prompt the store still matched after the failed audit (0: dropped)
    audited_answer_ok: bool  # the audited request answered as its own full prefill
    next_recomputed: bool  # the next request found nothing to reuse and prefilled everything
    next_answer_ok: bool  # and answered as its own full prefill
    later_passed: bool  # a later hit on the pages that request stored passed its audit
    later_answer_ok: bool  # and answered as its own full prefill
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.detected and self.left_tokens == 0 and self.audited_answer_ok and self.next_recomputed \
            and self.next_answer_ok and self.later_passed and self.later_answer_ok


def _reference(model: LlamaModel, prompt: list[int], new_tokens: int) -> list[int]:
    return generate(model, prompt, new_tokens, stop_token_ids=()).tokens


def plant(fault: str, model: LlamaModel, store: KVStore, prompt: list[int], other: list[int], page: int,
          rng: random.Random, *, shift: int = 1, chunk: bool = False) -> None:
    """Store `prompt`'s pages in `store` with `fault` placed in page `page` (`chunk`: `prompt` and
    `other` stored as CacheBlend chunks, with store_chunk; their KV is computed alone either way)."""
    p = model.spec.page_size
    span = slice(page * p, (page + 1) * p)

    def put(tokens: list[int], kv: torch.Tensor) -> None:
        (store.store_chunk if chunk else store.store)(model.name, tokens, kv)

    if fault == "weights-1.01":
        scaled = copy.deepcopy(model)
        layer = scaled.layers[len(scaled.layers) // 2]  # a middle layer: its K/V and everything after it move
        with torch.no_grad():
            for param in layer.parameters():
                param.mul_(1.01)
        put(prompt, full_kv(scaled, prompt))
        return
    kv = full_kv(model, prompt)
    if fault in ("slot-bytes", "collision"):
        put(prompt, kv)
        slot = cpu_slot(store, model, prompt, page, chunk=chunk)
        if fault == "slot-bytes":  # 256 random bytes at a random place in the page's slot
            at = rng.randrange(0, slot.numel() - 256)
            slot[at:at + 256] = torch.randint(0, 256, (256,), dtype=torch.uint8,
                                              generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        else:  # the same page of another prompt, under this prompt's key
            put(other, full_kv(model, other))
            slot.copy_(cpu_slot(store, model, other, page, chunk=chunk))
        return
    bad = kv.clone()
    positions = torch.arange(span.start, span.stop)
    if fault == "k-no-rope":
        bad[:, :, span] = rotate_k(model, kv[:, :, span], -positions)
    elif fault == "k-wrong-pos":
        bad[:, :, span] = rotate_k(model, kv[:, :, span], torch.full_like(positions, shift))
    elif fault == "heads-permuted":
        bad[:, :, span] = kv[:, :, span].roll(1, dims=3)  # (L, 2, P, H, D): head h written where h+1 goes
    elif fault == "pages-swapped":
        other_page = page - 1 if page else page + 1
        swap = slice(other_page * p, (other_page + 1) * p)
        bad[:, :, span], bad[:, :, swap] = kv[:, :, swap], kv[:, :, span]
    else:
        raise ValueError(f"fault: expected one of {', '.join(FAULTS)}, got {fault!r}")
    put(prompt, bad)


def run_fault(model: LlamaModel, text: list[int], fault: str, where: str, rng: random.Random, *,
              prompt_tokens: int = 160, shift: int = 1, new_tokens: int = NEW_TOKENS) -> FaultCase:
    began = time.perf_counter()
    p = model.spec.page_size
    at = rng.randrange(0, len(text) - 4 * prompt_tokens)
    prompt = text[at:at + prompt_tokens]  # stored: prompt_tokens // p full pages
    other = text[at + 2 * prompt_tokens:at + 3 * prompt_tokens]
    request = prompt + text[at + 3 * prompt_tokens:at + 3 * prompt_tokens + 9]
    follow_up = prompt + text[at + 3 * prompt_tokens + 20:at + 3 * prompt_tokens + 31]
    audited = prompt_tokens // p - 1  # the last full page of the match is the one withheld
    page = audited if where == "audited page" else audited // 2
    with new_store() as store:
        store.register_model(model.name, model.spec)
        plant(fault, model, store, prompt, other, page, rng, shift=shift)
        # Not stored, so that what the failed audit left is what the store holds afterwards.
        first = generate(model, request, new_tokens, backend=store, audit_rate=1.0, stop_token_ids=(), store=False)
        left = store.lookup(model.name, prompt).matched_tokens
        after = generate(model, follow_up, new_tokens, backend=store, audit_rate=1.0, stop_token_ids=())
        later = generate(model, request, new_tokens, backend=store, audit_rate=1.0, stop_token_ids=())
    audit = first.audit
    assert audit is not None, "the first request was not audited"
    failure = audit.first_failure
    return FaultCase(fault, where, str(model.dtype).removeprefix("torch."), not audit.passed,
                     None if failure is None else failure[0], audit.worst, audit.tolerance, left,
                     first.tokens == (expected := _reference(model, request, new_tokens)), after.reused_tokens == 0,
                     after.tokens == _reference(model, follow_up, new_tokens),
                     later.audit is not None and later.audit.passed, later.tokens == expected,
                     time.perf_counter() - began)


def run_faults(dtype: str, *, faults: tuple[str, ...] = FAULTS, where: tuple[str, ...] = WHERE, seed: int = 40,
               model: LlamaModel | None = None, one: Callable[..., FaultCase] = run_fault) -> list[FaultCase]:
    """Each fault in each place, by `one` (run_fault: prefix hits; run_chunk_fault: chunks)."""
    model, text, rng = scenario(dtype, model, seed)
    # Other weights change every page alike: there is no "earlier page" to place it in.
    return [one(model, text, fault, w, rng) for fault in faults for w in where
            if not (fault == "weights-1.01" and w != WHERE[0])]


@dataclass
class CleanReport:
    path: str  # "in-process" or "sidecar"
    dtype: str
    hits: int = 0
    failures: int = 0
    tolerance: float = 0.0
    worst: list[float] = field(default_factory=list)  # per hit: the largest deviation over layers and K/V
    seconds: float = 0.0

    def add(self, outcome: Any) -> None:
        """Count one audit's outcome (anything with `passed` and `worst`)."""
        self.hits += 1
        self.failures += not outcome.passed
        self.worst.append(outcome.worst)

    @property
    def worst_in_eps(self) -> float:
        eps = torch.finfo(getattr(torch, self.dtype)).eps
        return max(self.worst, default=0.0) / eps


def run_clean(dtype: str, hits: int, *, path: str = "in-process", documents: int = 8, document_tokens: int = 640,
              seed: int = 41, model: LlamaModel | None = None,
              progress: Callable[[int], Any] | None = None) -> CleanReport:
    """`hits` audited hits of real text: `documents` stored documents, each hit a prefix of one of
    them (any length past a page) followed by a few tokens from elsewhere."""
    from contextlib import ExitStack

    model, text, rng = scenario(dtype, model, seed)
    report = CleanReport(path, dtype, tolerance=tolerance_for(model.dtype))
    began = time.perf_counter()
    with ExitStack() as stack:
        if path == "sidecar":
            from kvstore.api.client import KVStoreClient
            from kvstore.api.server.in_process import InProcessSidecar

            url = stack.enter_context(InProcessSidecar(StoreConfig(data_dir=None, cpu_bytes=256 << 20,
                                                                   disk_bytes=0)))
            backend: Any = stack.enter_context(KVStoreClient(url))
        else:
            backend = stack.enter_context(new_store())
        docs = []
        for _ in range(documents):
            at = rng.randrange(0, len(text) - document_tokens)
            docs.append(text[at:at + document_tokens])
            generate(model, docs[-1], 1, backend=backend)
        p = model.spec.page_size
        for i in range(hits):
            doc = docs[i % documents]
            m = rng.randrange(p + 1, document_tokens)
            tail_at = rng.randrange(0, len(text) - 16)
            prompt = doc[:m] + text[tail_at:tail_at + rng.randrange(1, 12)]
            result = generate(model, prompt, 1, backend=backend, audit_rate=1.0, store=False)
            if result.audit is None:
                continue  # a match shorter than a page past the prompt's last token: nothing to audit
            report.add(result.audit)
            if progress is not None:
                progress(report.hits)
        _check_counted(backend, model.name, report.hits)
    report.seconds = time.perf_counter() - began
    return report


def _check_counted(backend: Any, model: str, hits: int) -> None:
    """Every audit reached the store: its counters add up to the audits the engine made."""
    stats = backend.stats()["audits"].get(model, {})
    counted = sum(c["passes"] + c["failures"] for c in stats.values())
    assert counted == hits, f"the store counted {counted} audits of {hits}"


CHUNK_FAULTS = ("slot-bytes", "weights-1.01", "k-no-rope", "k-wrong-pos", "heads-permuted", "collision")


def _blend(model: LlamaModel, backend: Any, prefix: list[int], chunks: list[list[int]], question: list[int],
           new_tokens: int, **kwargs: Any) -> Any:
    return generate(model, question, new_tokens, backend=backend, prefix=prefix, chunks=chunks, stop_token_ids=(),
                    **kwargs)


def run_chunk_fault(model: LlamaModel, text: list[int], fault: str, where: str, rng: random.Random, *,
                    chunk_tokens: int = 160, shift: int = 1, new_tokens: int = NEW_TOKENS) -> FaultCase:
    """`fault` in a stored chunk of `chunk_tokens` (10 pages), blended after a 23-token prefix."""
    began = time.perf_counter()
    p = model.spec.page_size
    at = rng.randrange(0, len(text) - 4 * chunk_tokens)
    chunk = text[at:at + chunk_tokens]
    other = text[at + 2 * chunk_tokens:at + 3 * chunk_tokens]
    prefix, question = text[at + 3 * chunk_tokens:at + 3 * chunk_tokens + 23], text[at + chunk_tokens:][:7]
    next_prefix = text[at + 3 * chunk_tokens + 40:at + 3 * chunk_tokens + 49]  # another position
    audited = chunk_tokens // p - 1  # the chunk's last full page is the one recomputed
    page = audited if where == "audited page" else audited // 2
    reference = _blend(model, None, prefix, [chunk], question, new_tokens).tokens  # every chunk standalone
    with new_store() as store:
        store.register_model(model.name, model.spec)
        plant(fault, model, store, chunk, other, page, rng, shift=shift, chunk=True)
        first = _blend(model, store, prefix, [chunk], question, new_tokens, audit_rate=1.0, store=False)
        left = store.blend(model.name, [chunk]).hits[0]
        after = _blend(model, store, next_prefix, [chunk], question, new_tokens, audit_rate=1.0)
        later = _blend(model, store, prefix, [chunk], question, new_tokens, audit_rate=1.0)
    assert len(first.chunk_audits) == 1, "the chunk hit was not audited"
    audit = first.chunk_audits[0]
    failure = audit.first_failure
    return FaultCase(fault, where, str(model.dtype).removeprefix("torch."), not audit.passed,
                     None if failure is None else failure[0], audit.worst, audit.tolerance, chunk_tokens * left,
                     first.tokens == reference, after.chunk_hits == [False],
                     after.tokens == _blend(model, None, next_prefix, [chunk], question, new_tokens).tokens,
                     later.chunk_hits == [True] and len(later.chunk_audits) == 1 and later.chunk_audits[0].passed,
                     later.tokens == reference, time.perf_counter() - began)


def run_chunk_faults(dtype: str, *, faults: tuple[str, ...] = CHUNK_FAULTS, where: tuple[str, ...] = WHERE,
                     seed: int = 60, model: LlamaModel | None = None) -> list[FaultCase]:
    return run_faults(dtype, faults=faults, where=where, seed=seed, model=model, one=run_chunk_fault)


def run_chunk_clean(dtype: str, audits: int, *, pool: int = 12, seed: int = 61, model: LlamaModel | None = None,
                    progress: Callable[[int], Any] | None = None) -> CleanReport:
    """At least `audits` chunk audits of real text: `pool` chunks of 17-300 tokens stored once,
    then requests of a 0-40-token prefix, 1-3 of them in random order and a 1-11-token question,
    each blended with `audit_rate=1` (every chunk of a page or more is audited)."""
    model, text, rng = scenario(dtype, model, seed)
    report = CleanReport("in-process, chunks", dtype, tolerance=tolerance_for(model.dtype))
    began = time.perf_counter()

    piece = functools.partial(text_piece, text, rng)
    with new_store() as store:
        store.register_model(model.name, model.spec)
        chunks = [piece(17, 300) for _ in range(pool)]
        for chunk in chunks:  # what a blend that missed it would store: its KV computed alone
            store.store_chunk(model.name, chunk, full_kv(model, chunk))
        while report.hits < audits:
            picked = rng.sample(chunks, rng.randrange(1, 4))
            result = _blend(model, store, piece(0, 40) if rng.random() < 0.8 else [], picked, piece(1, 11), 1,
                            audit_rate=1.0, store=False)
            assert result.chunk_hits == [True] * len(picked), "a stored chunk missed"
            for outcome in result.chunk_audits:
                report.add(outcome)
            if progress is not None:
                progress(report.hits)
        _check_counted(store, model.name, report.hits)
    report.seconds = time.perf_counter() - began
    return report


def run_chunk_positions(dtype: str, positions: tuple[int, ...] = (1000, 3000, 7000), *, pool: int = 12,
                        seed: int = 62, model: LlamaModel | None = None) -> dict[int, CleanReport]:
    """Chunk audits far into a long prompt, where the re-rotation's rounding is largest: `pool`
    chunks of 17-300 tokens stored, each blended from each of `positions` (the store's answer,
    as the decode loop receives it) and audited there directly, without prefilling a prefix."""
    from kvstore.decode.chunk_audit import audit_chunk

    model, text, rng = scenario(dtype, model, seed)
    reports = {}
    with new_store() as store:
        store.register_model(model.name, model.spec)
        chunks = [text_piece(text, rng, 17, 300) for _ in range(pool)]
        for chunk in chunks:
            store.store_chunk(model.name, chunk, full_kv(model, chunk))
        cache = model.new_cache(max(map(len, chunks)))
        for position in positions:
            report = reports[position] = CleanReport(f"at position {position}", dtype,
                                                     tolerance=tolerance_for(model.dtype))
            began = time.perf_counter()
            for chunk in chunks:
                kv = torch.as_tensor(store.blend(model.name, [chunk], start_pos=position).kv)
                report.add(audit_chunk(model, chunk, kv, position, cache))
            report.seconds = time.perf_counter() - began
    return reports


def time_chunk_audits(dtype: str, repeats: int = 5, *, model: LlamaModel | None = None) -> dict[float, float]:
    """audit_rate -> best TTFT (s) over `repeats` of a blend of two stored 200-token chunks of real
    text after a 20-token prefix, with an 8-token question, audited (1) or not (0), interleaved."""
    model = model or real_model(dtype)
    text = real_text(model, max_chars=60_000)
    chunks, prefix, question = [text[1000:1200], text[3000:3200]], text[5000:5020], text[6000:6008]
    best: dict[float, float] = {}
    with new_store() as store:
        _blend(model, store, prefix, chunks, question, 1)  # stores the chunks and the prefix
        for _ in range(repeats):
            for rate in (0.0, 1.0):
                result = _blend(model, store, prefix, chunks, question, 1, audit_rate=rate, store=False)
                assert result.chunk_hits == [True, True] and len(result.chunk_audits) == 2 * rate
                best[rate] = min(best.get(rate, float("inf")), result.ttft_s)
    return best


def _print_clean(clean: CleanReport) -> None:
    zero = sum(w == 0.0 for w in clean.worst)
    print(f"clean {clean.path} {clean.dtype}: {clean.hits} audits, {clean.failures} failures, worst "
          f"{max(clean.worst, default=0.0):.3g} = {clean.worst_in_eps:.1f} eps ({zero} bit-identical), tolerance "
          f"{clean.tolerance:.3g}, {clean.seconds:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> None:
    from bench.report import parser as bench_parser

    parser = bench_parser(__doc__, with_json=False)
    parser.add_argument("--chunks", action="store_true", help="audit CacheBlend chunk hits instead of prefix hits")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--hits", type=int, default=100, help="clean audited hits (chunk audits with --chunks)")
    parser.add_argument("--seed", type=int, default=None, help="clean run's seed (default: the functions')")
    parser.add_argument("--faults", action="store_true", help="also plant every fault and report each case")
    parser.add_argument("--far", action="store_true", help="with --chunks: also audit the stored chunks blended "
                                                           "at positions 1000, 3000 and 7000")
    args = parser.parse_args(argv)
    model = real_model(args.dtype)
    seed = {} if args.seed is None else {"seed": args.seed}
    clean = (run_chunk_clean(args.dtype, args.hits, model=model, **seed) if args.chunks
             else run_clean(args.dtype, args.hits, model=model, **seed))
    _print_clean(clean)
    if args.chunks and args.far:
        for report in run_chunk_positions(args.dtype, model=model).values():
            _print_clean(report)
    if not args.faults:
        return
    for case in (run_chunk_faults if args.chunks else run_faults)(args.dtype, model=model):
        verdict = f"caught, layer {case.first_layer}, {case.worst:.3g}" if case.detected else \
            f"SLIPS ({case.worst:.3g})"
        print(f"{case.fault} in the {case.where}: {verdict}; all checks {case.ok} (left {case.left_tokens}, "
              f"audited answer ok {case.audited_answer_ok}, next recomputed {case.next_recomputed}, next answer ok "
              f"{case.next_answer_ok}, later passed {case.later_passed}, later answer ok {case.later_answer_ok}); "
              f"{case.seconds:.1f} s", flush=True)


if __name__ == "__main__":
    main()

"""CacheBlend on the real model: quality against a full prefill per selection rule and ratio, and TTFT.

    python bench/blend_quality.py [--workload langref|packages] [--prompts 100] [--ratios 0,0.15,0.3]
                                  [--time-budget-s S] [--json out.json] [--resume results.json]
                                  [--plot docs/cacheblend.png] [--ttft-lengths 2048,4096,6144]

Per prompt, the decode loop's selection `rule` and its controls `random` and `first` at each ratio
(only the rule at 0.3): mean KL to a full prefill along its answer, top-1, exact answers, greedy
agreement over 8 tokens and needles; `--resume` adds to a results file. Then TTFT at
`--ttft-lengths`. What each figure is, the workloads and the results: docs/cacheblend.md ("How the
bench measures"); other selections: bench/research/blend_levers.py.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # after PYTHONPATH: an older kvstore there wins

from bench.blend_workload import WORKLOADS, BlendPrompt, Workload, WorkloadConfig, needle_correct  # noqa: E402
from bench.report import markdown_table  # noqa: E402
from kvstore.config import StoreConfig  # noqa: E402
from kvstore.decode import LlamaModel, generate, load_model  # noqa: E402
from kvstore.decode.attention import AttentionContext  # noqa: E402
from kvstore.decode.blend_selection import TokenSelection  # noqa: E402
from kvstore.decode.paged_cache import BlockTable, PagedKVCache  # noqa: E402
from kvstore.decode.recompute import selective_recompute  # noqa: E402
from kvstore.store import KVStore  # noqa: E402

# The figures docs/cacheblend.md reports: no recompute, the rule and both controls at the target
# ratio, the rule at twice it. r = 1 (a full prefill) and other ratios run when asked for: each is
# another recompute of every prompt (tests/decode/test_decode_blend.py checks r = 1 on every rule).
RATIOS = (0.0, 0.15, 0.3)
RULES_AT: dict[float, Sequence[str]] = {0.3: ("rule",)}
TARGETS = {"kl_vs_r0": 0.15, "kl_vs_r0_at_0.3": 0.10, "kl_vs_better_control": 0.7, "greedy8": 7 / 8,
           "needle_gap_points": 3.0, "ttft_ratio_4k": 0.35}
TARGET_RATIO = 0.15
GREEDY_TOKENS = 8  # greedy agreement is judged over the answer's first tokens
NEEDLE_DECODE_TOKENS = 12  # past a disagreement: the number comes within a few tokens; more decides nothing
CONTROLS = ("random", "first")
REFERENCE_DIR = REPO / "bench" / "out" / "blend_reference"


@dataclass(frozen=True)
class Variant:
    """One (ratio, selection). A prompt's record holds its figures under `name`: kl, top1, exact,
    greedy8, needle (None off needle prompts), recomputed (the fraction of chunk tokens through the
    last layer) and layer_work (the mean over layers 1.. of the fraction through them)."""
    ratio: float
    rule: str  # the variant's label: "rule" (the decode loop's), a control, or a research variant's
    selection: TokenSelection

    @property
    def name(self) -> str:
        return f"{self.rule}@{self.ratio:g}"

    def summary(self, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Means over the prompts' records, in their order: the same however the run was split."""
        figures = {key: [r["variants"][self.name][key] for r in records if r["variants"][self.name][key] is not None]
                   for key in ("kl", "top1", "exact", "greedy8", "needle", "recomputed", "layer_work")}
        mean = {key: statistics.mean(xs) if xs else None for key, xs in figures.items()}
        return {"ratio": self.ratio, "rule": self.rule, **mean, "recomputed_fraction": mean.pop("recomputed"),
                "prompts": len(figures["kl"]), "selection": repr(self.selection), "kl_per_prompt": figures["kl"],
                "greedy8_per_prompt": figures["greedy8"]}


def variants_for(ratios: Sequence[float], rules: Sequence[str] = ("rule", *CONTROLS),
                 base: TokenSelection = TokenSelection(), extra: Sequence[tuple[str, TokenSelection]] = (),
                 rules_at: dict[float, Sequence[str]] | None = None) -> list[Variant]:
    """r = 0 and r = 1 do not depend on the selection: they run once, as 'none@0' and 'all@1'.
    The controls take the rule's schedule (select_layer, narrowing), so they recompute as many tokens.
    `rules_at` {r: labels} runs only those labels (of the rules and the extra variants) at r."""
    named = {"rule": base, **{c: replace(base, rule=c) for c in CONTROLS}}
    for rule in [*rules, *(x for labels in (rules_at or {}).values() for x in labels)]:
        if rule not in named and rule not in dict(extra):
            raise ValueError(f"--rules: each must be one of rule, {', '.join(CONTROLS)} or a --variants label, "
                             f"got {rule!r}")
    out = []
    for r in ratios:
        if r == 0.0:
            out.append(Variant(r, "none", base))
        elif r == 1.0:
            out.append(Variant(r, "all", base))
        elif rules_at and r in rules_at:
            out += [Variant(r, label, named[label] if label in named else dict(extra)[label])
                    for label in rules_at[r]]
        else:
            out += [Variant(r, rule, named[rule]) for rule in rules]
            out += [Variant(r, label, selection) for label, selection in extra]
    return out


class Evaluator:
    """Shared state for one run: the model, one paged cache, the store holding the chunks, and
    the directory of full-prefill references."""

    def __init__(self, model: LlamaModel, store: KVStore, answer_tokens: int, reference_dir: Path | None = None):
        self.model, self.store, self.answer_tokens = model, store, answer_tokens
        self.reference_dir = reference_dir
        self.cache: PagedKVCache | None = None
        self.chunks_computed = self.chunks_reused = self.references_read = 0
        store.register_model(model.name, model.spec)

    def _table(self, tokens: int) -> tuple[PagedKVCache, BlockTable]:
        if self.cache is None or self.cache.free_blocks * self.model.spec.page_size < tokens:
            self.cache = self.model.new_cache(max(tokens, 8192))
        table = self.cache.new_table()
        self.cache.reserve(table, tokens)
        return self.cache, table

    def _forward(self, ids: Sequence[int], start: int, cache: PagedKVCache, table: BlockTable,
                 logits: str) -> torch.Tensor | None:
        device = self.model.device
        end = start + len(ids)
        out = self.model(torch.tensor(list(ids), dtype=torch.long, device=device),
                         torch.arange(start, end, device=device), cache,
                         AttentionContext.for_span(cache, table, start, end), logits=logits)  # type: ignore[arg-type]
        table.num_tokens = max(table.num_tokens, end)
        return out

    def _greedy(self, first_logits: torch.Tensor, at: int, cache: PagedKVCache, table: BlockTable,
                limit: int) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy tokens from `first_logits` (the logits at position at - 1), feeding each at `at`.."""
        stops = set(self.model.eos_token_ids)
        logits, tokens, rows = first_logits, [], []
        while len(tokens) < limit:
            rows.append(logits)
            tokens.append(int(logits.argmax()))
            if tokens[-1] in stops or len(tokens) == limit:
                break
            logits = self._forward(tokens[-1:], at + len(tokens) - 1, cache, table, "last")
        return tokens, rows

    def reference(self, prompt: BlendPrompt, cache: PagedKVCache, table: BlockTable) -> tuple[list[int], torch.Tensor]:
        """The full prefill's greedy answer and its log-distributions (A, V): from the reference
        directory when it holds this prompt's, else computed (into `table`) and kept there."""
        tokens = prompt.tokens
        key = hashlib.sha256(json.dumps([self.model.name, tokens, self.answer_tokens]).encode()).hexdigest()[:32]
        path = self.reference_dir / f"{key}.pt" if self.reference_dir else None
        if path is not None and path.exists():
            try:
                saved = torch.load(path, weights_only=True)
                self.references_read += 1
                return [int(t) for t in saved["answer"]], saved["logp"]
            except Exception as exc:  # a torn or foreign file: compute it again
                print(f"reference {path}: unreadable ({exc}); computing it again", file=sys.stderr)
        last = self._forward(tokens, 0, cache, table, "last")
        answer, rows = self._greedy(last, len(tokens), cache, table, self.answer_tokens)
        logp = torch.stack(rows).float().log_softmax(-1)  # (A, V)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            scratch = path.with_suffix(f".{time.monotonic_ns()}.tmp")
            torch.save({"answer": torch.tensor(answer), "logp": logp}, scratch)
            scratch.replace(path)  # whole or absent: a run stopped mid-write leaves no torn reference
        return answer, logp

    def chunk_kv(self, prompt: BlendPrompt) -> torch.Tensor:
        """The chunks' stored standalone KV at their places in `prompt`: (L, 2, C, H, D). A chunk the
        store does not hold is computed alone at positions 0..n-1 and stored. Each chunk is read
        back as soon as it is known to be there: the store's eviction may drop an earlier chunk of
        the same prompt to make room for a later one, so asking for them all at the end can miss."""
        name, offset, parts = self.model.name, len(prompt.prefix), []
        for chunk in prompt.chunks:
            found = self.store.blend(name, [chunk], start_pos=offset)
            if found.hits[0]:
                self.chunks_reused += 1
            else:
                cache, table = self._table(len(chunk))
                try:
                    self._forward(chunk, 0, cache, table, "none")
                    self.store.store_chunk(name, chunk, cache.gather(table, 0, len(chunk)))
                finally:
                    cache.release(table)
                self.chunks_computed += 1
                found = self.store.blend(name, [chunk], start_pos=offset)
                assert found.hits[0], "the store did not keep a chunk it was just given: give it more cpu_bytes"
            parts.append(torch.as_tensor(found.kv))  # (L, 2, n, H, D), K re-rotated to `offset`
            offset += len(chunk)
        return torch.cat(parts, dim=2)

    def evaluate(self, prompt: BlendPrompt, variants: Sequence[Variant]) -> dict[str, Any]:
        model, n_prefix = self.model, len(prompt.prefix)
        tokens = prompt.tokens
        n = len(tokens)
        chunk_tokens = sum(map(len, prompt.chunks))
        q_start = n_prefix + chunk_tokens
        cache, table = self._table(n + self.answer_tokens + NEEDLE_DECODE_TOKENS + GREEDY_TOKENS)
        try:
            answer, ref_logp = self.reference(prompt, cache, table)
            full_text = model.tokenizer.decode(answer) if model.tokenizer else ""
            needle_full = needle_correct(full_text, prompt.needle_answer) if prompt.needle_answer else None
            self._forward(prompt.prefix, 0, cache, table, "none")  # the prefix alone: exact, as prefix reuse gives it
            prefix_kv = cache.gather(table, 0, n_prefix)  # (L, 2, P, H, D)
            blended = self.chunk_kv(prompt)  # (L, 2, C, H, D)
            chunk_ids = torch.tensor([t for c in prompt.chunks for t in c], dtype=torch.long, device=model.device)
            prefix_ids = torch.tensor(prompt.prefix, dtype=torch.long, device=model.device)
            question_ids = torch.tensor(prompt.question, dtype=torch.long, device=model.device)
            ends = [n_prefix + sum(map(len, prompt.chunks[:i + 1])) for i in range(len(prompt.chunks))]
            teacher = prompt.question + answer[:-1]
            answer_ids = torch.tensor(answer, device=model.device)
            r1_max_abs, figures = None, {}
            layers = len(model.layers)
            for variant in variants:
                ratio = variant.ratio
                cache.scatter(table, prefix_kv, start=0)
                cache.scatter(table, blended, start=n_prefix)
                ran = selective_recompute(model, chunk_ids, cache, table, n_prefix, ratio, ends, prefix_ids,
                                          variant.selection, question_ids)
                out = self._forward(teacher, q_start, cache, table, "all")  # (Q + A - 1, V)
                logits = out[len(prompt.question) - 1:]  # (A, V): the distributions of the answer tokens
                logp = logits.float().log_softmax(-1)
                kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)  # (A,)
                agree = logits.argmax(-1) == answer_ids  # (A,)
                if ratio == 1.0:
                    r1_max_abs = float((logp - ref_logp).abs().max())
                free = self._free_answer(prompt, answer, agree, logits, n, cache, table)
                head = answer[:GREEDY_TOKENS]
                needle = None if prompt.needle_answer is None else needle_correct(
                    model.tokenizer.decode(free) if model.tokenizer else "", prompt.needle_answer)
                sizes = variant.selection.keep_sizes(chunk_tokens, ratio, layers)
                figures[variant.name] = {
                    "kl": float(kl.mean()), "top1": float(agree.float().mean()), "exact": float(bool(agree.all())),
                    "greedy8": sum(a == b for a, b in zip(free, head)) / len(head),
                    "needle": None if needle is None else float(needle),
                    "recomputed": ran / chunk_tokens, "layer_work": sum(sizes[1:]) / (chunk_tokens * (layers - 1))}
            return {"tokens": n, "chunks": len(prompt.chunks), "answer": full_text, "answer_tokens": len(answer),
                    "needle_full": needle_full, "r1_max_abs_logprob_diff": r1_max_abs, "variants": figures}
        finally:
            cache.release(table)

    def _free_answer(self, prompt: BlendPrompt, answer: list[int], agree: torch.Tensor, logits: torch.Tensor,
                     n: int, cache: PagedKVCache, table: BlockTable) -> list[int]:
        """The blended greedy answer: the reference's tokens up to the first disagreement (the
        teacher-forced KV there is the greedy run's), then decoded on from it, to the first
        GREEDY_TOKENS and, for a needle, NEEDLE_DECODE_TOKENS past the disagreement."""
        wrong = (~agree).nonzero()
        j = int(wrong[0]) if wrong.numel() else len(answer)
        tokens = answer[:j]
        want = max(GREEDY_TOKENS, j + NEEDLE_DECODE_TOKENS if prompt.needle_answer is not None else 0)
        if j < len(answer) and j < want:
            more, _ = self._greedy(logits[j], n + j, cache, table, want - j)
            tokens = tokens + more
        return tokens


def tokens_sha256(tokens: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(tokens)).encode()).hexdigest()[:32]


def evaluate_quality(model: LlamaModel, prompts: Sequence[tuple[int, BlendPrompt]], variants: list[Variant],
                     answer_tokens: int, bar: tqdm, reference_dir: Path | None = None,
                     on_prompt: Callable[[dict[str, Any]], None] | None = None, deadline: float | None = None,
                     done: Sequence[dict[str, Any]] = ()) -> dict[str, Any] | None:
    """Every (index, prompt) through every variant, in order, starting none past `deadline` (a
    time.perf_counter() value) and none whose index has a record in `done` (an earlier run's, its
    tokens already checked); `on_prompt` gets the figures so far after each prompt. The figures
    are over `done` and the new records together; None if there are none."""
    records = {r["index"]: r for r in done}
    # Room for several prompts' chunks (6k tokens of SmolLM2 KV is ~0.3 GiB); past that, older chunks
    # are evicted and computed again when a later prompt draws them. More only costs the host memory.
    with KVStore(StoreConfig(data_dir=None, cpu_bytes=1 << 30, disk_bytes=0)) as store:
        evaluator = Evaluator(model, store, answer_tokens, reference_dir)
        for index, prompt in prompts:
            if index not in records and deadline is not None and time.perf_counter() > deadline:
                break
            if index not in records:
                started, counts = time.perf_counter(), (evaluator.chunks_computed, evaluator.references_read)
                records[index] = {"index": index, "tokens_sha256": tokens_sha256(prompt.tokens),
                                  **evaluator.evaluate(prompt, variants)}
                records[index] |= {"seconds": time.perf_counter() - started,
                                   "chunks_computed": evaluator.chunks_computed - counts[0],
                                   "reference_read": evaluator.references_read > counts[1]}
                if on_prompt is not None:
                    on_prompt(quality_summary([records[i] for i in sorted(records)], variants))
            bar.update(1)
    return quality_summary([records[i] for i in sorted(records)], variants) if records else None


def quality_summary(per_prompt: list[dict[str, Any]], variants: Sequence[Variant]) -> dict[str, Any]:
    needles = [p["needle_full"] for p in per_prompt if p["needle_full"] is not None]
    r1 = [p["r1_max_abs_logprob_diff"] for p in per_prompt if p["r1_max_abs_logprob_diff"] is not None]
    computed = sum(p["chunks_computed"] for p in per_prompt)
    return {"prompts": len(per_prompt), "mean_prompt_tokens": statistics.mean(p["tokens"] for p in per_prompt),
            "min_prompt_tokens": min(p["tokens"] for p in per_prompt),
            "max_prompt_tokens": max(p["tokens"] for p in per_prompt),
            "chunks_per_prompt": statistics.mean(p["chunks"] for p in per_prompt),
            "chunks_computed": computed, "chunks_reused": sum(p["chunks"] for p in per_prompt) - computed,
            "needle_prompts": len(needles), "needle_full": statistics.mean(needles) if needles else None,
            "r1_max_abs_logprob_diff": max(r1) if r1 else None,
            "references_read": sum(p["reference_read"] for p in per_prompt),
            "prompt_seconds": sum(p["seconds"] for p in per_prompt),
            "variants": {v.name: v.summary(per_prompt) for v in variants}, "per_prompt": per_prompt}


def ttft_prompt(workload: Workload, length: int) -> BlendPrompt:
    """A prompt of about `length` tokens: documents in the workload's order until it is long enough."""
    prefix = workload.encode(workload.opening)
    question = workload.encode(f"Question: What do these documents explain?{workload.closing}")
    chunks, total = [], len(prefix) + len(question)
    for doc in workload.documents:
        if total + len(doc.tokens) > length:
            continue
        chunks.append(list(doc.tokens))
        total += len(doc.tokens)
        if length - total < workload.config.doc_tokens[0]:
            break
    return BlendPrompt(prefix, chunks, question, [], "")


def measure_ttft(model: LlamaModel, workload: Workload, lengths: Sequence[int], ratio: float, repeats: int,
                 sidecar: bool, bar: tqdm) -> list[dict[str, Any]]:
    rows = []
    with ExitStack() as stack:
        backends: dict[str, Any] = {"cpu": stack.enter_context(KVStore(StoreConfig(data_dir=None, cpu_bytes=2 << 30,
                                                                                   disk_bytes=0)))}
        if sidecar:
            from bench.engines import Sidecar, serve_args
            from kvstore.api.client import KVStoreClient

            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvstore-blend-")))
            url = stack.enter_context(Sidecar(tmp / "sidecar", serve_args("1GiB"))).url
            backends["sidecar"] = stack.enter_context(KVStoreClient(url))
        for length in lengths:
            p = ttft_prompt(workload, length)
            cpu = backends["cpu"]  # computes and stores the chunks and the prefix: every later run is warm
            generate(model, p.question, 1, backend=cpu, prefix=p.prefix, chunks=p.chunks, blend_ratio=ratio,
                     timeout_s=None)
            for backend in backends.values():  # the same KV into the sidecar, without computing it again
                if backend is not cpu:
                    backend.register_model(model.name, model.spec)
                    backend.store(model.name, p.prefix, cpu.fetch(model.name, p.prefix).kv)
                    for chunk in p.chunks:
                        backend.store_chunk(model.name, chunk, cpu.blend(model.name, [chunk], start_pos=0).kv)
            bar.update(1)
            times: dict[str, list[float]] = {"full": [], **{name: [] for name in backends}}
            for _ in range(repeats):  # interleaved, so load on a shared host hits every side alike
                times["full"].append(generate(model, p.tokens, 1).ttft_s)
                for name, backend in backends.items():
                    got = generate(model, p.question, 1, backend=backend, prefix=p.prefix, chunks=p.chunks,
                                   blend_ratio=ratio, store=False, timeout_s=None)
                    assert all(got.chunk_hits or [False]) and got.reused_tokens >= sum(map(len, p.chunks)), \
                        (name, got.chunk_hits, got.reused_tokens)
                    times[name].append(got.ttft_s)
                bar.update(1)
            full = min(times["full"])
            for name in backends:
                rows.append({"length": len(p.tokens), "backend": name, "ratio": ratio, "full_ttft_s": full,
                             "ttft_s": min(times[name]), "ttft_vs_full": min(times[name]) / full,
                             "median_ttft_vs_full": statistics.median(times[name]) / statistics.median(times["full"])})
    return rows


def verdicts(quality: dict[str, Any] | None, ttft: list[dict[str, Any]] | None) -> dict[str, bool | None]:
    v = quality["variants"] if quality else {}
    blend, r0 = v.get(f"rule@{TARGET_RATIO:g}"), v.get("none@0")
    controls = [v[f"{c}@{TARGET_RATIO:g}"] for c in CONTROLS if f"{c}@{TARGET_RATIO:g}" in v]
    out: dict[str, bool | None] = {}
    if blend and r0:
        out["kl <= 0.15x r=0"] = blend["kl"] <= TARGETS["kl_vs_r0"] * r0["kl"]
        if "rule@0.3" in v:
            out["kl at r=0.3 <= 0.10x r=0"] = v["rule@0.3"]["kl"] <= TARGETS["kl_vs_r0_at_0.3"] * r0["kl"]
    if blend and controls:
        out["kl <= 0.7x the better control"] = blend["kl"] <= TARGETS["kl_vs_better_control"] * min(
            c["kl"] for c in controls)
    if blend:
        out["greedy agreement >= 7 of 8"] = blend["greedy8"] >= TARGETS["greedy8"]
    if blend and quality and quality["needle_full"] is not None:
        out["needle within 3 points"] = (quality["needle_full"] - blend["needle"]) * 100 <= TARGETS["needle_gap_points"]
    if "all@1" in v and quality:
        out["r=1 equals full"] = v["all@1"]["exact"] == 1.0 and v["all@1"]["kl"] <= 1e-6
    near_4k = [row for row in ttft or [] if 3500 <= row["length"] <= 4500 and row["backend"] == "cpu"]
    if near_4k:
        out["ttft <= 0.35x at 4k (CPU tier)"] = all(row["ttft_vs_full"] <= TARGETS["ttft_ratio_4k"] for row in near_4k)
    return out


LABELS = {"none": "none (stored KV as is)", "all": "all (a full prefill)", "random": "random (control)",
          "first": "first (control)"}


def print_table(quality: dict[str, Any] | None, ttft: list[dict[str, Any]] | None, workload: str) -> None:
    """The figures as docs/cacheblend.md shows them: a line on the prompts, then a Markdown table."""
    if quality:
        needles, full = quality["needle_prompts"], quality["needle_full"]
        print(f"`{workload}`: {quality['prompts']} prompts of {quality['min_prompt_tokens']:,}-"
              f"{quality['max_prompt_tokens']:,} tokens (mean {quality['mean_prompt_tokens']:,.0f}), "
              f"{quality['chunks_per_prompt']:.1f} documents each; {needles} needle prompts"
              + (f", of which the full prefill named the number in {round(full * needles)} ({full:.1%})."
                 if full is not None else "."))
        print(f"(chunks computed {quality['chunks_computed']}, reused from the store {quality['chunks_reused']}; "
              f"references read {quality['references_read']})\n")
        v = quality["variants"]
        r0 = v.get("none@0")
        controls = [v[name] for name in (f"{c}@{TARGET_RATIO:g}" for c in CONTROLS) if name in v]
        better = min(controls, key=lambda c: c["kl"]) if controls else None
        rows = []
        for s in v.values():
            bold = "**" if s["rule"] == "rule" and s["ratio"] == TARGET_RATIO else ""
            label = LABELS.get(s["rule"], s["rule"])
            rows.append([f"{s['ratio']:g}", f"{bold}{label}{bold}", f"{s['layer_work']:.3f}",
                         f"{bold}{s['kl']:.4f}{bold}",
                         f"{s['kl'] / r0['kl']:.3f}" if r0 and r0["kl"] else "–",
                         f"{s['kl'] / better['kl']:.2f}" if better and s["ratio"] == TARGET_RATIO else "–",
                         f"{s['top1']:.1%}", f"{s['greedy8'] * 8:.2f}", f"{s['exact']:.0%}",
                         "–" if s["needle"] is None else f"{s['needle']:.1%}"])
        print(markdown_table(["r", "tokens picked by", "work", "mean KL vs full", "× r = 0", "× better control",
                              "top-1 agreement", "greedy agreement, of 8", "exact answers", "needle prompts answered"],
                             rows))
        rule = f"rule@{TARGET_RATIO:g}"
        if rule in v and r0 and better:
            kls = [{name: f["kl"] for name, f in p["variants"].items()} for p in quality["per_prompt"]]
            vs_r0 = statistics.median(k[rule] / k["none@0"] for k in kls)
            below = sum(k[rule] < k[f"{better['rule']}@{TARGET_RATIO:g}"] for k in kls)
            print(f"\nper prompt, the rule's KL at r = {TARGET_RATIO:g}: median {vs_r0:.3f}× r = 0's; "
                  f"below `{better['rule']}`'s on {below} of {len(kls)} prompts")
    for row in ttft or []:
        print(f"TTFT {row['length']:>5} tokens, {row['backend']:>7}, r = {row['ratio']:g}: "
              f"{row['ttft_s'] * 1e3:8.0f} ms = {row['ttft_vs_full']:.3f}x full ({row['full_ttft_s'] * 1e3:.0f} ms)")


def plot(qualities: dict[str, dict[str, Any]], path: Path) -> None:
    """KL and greedy agreement against r, one row of panels per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(qualities), 2, figsize=(10, 4 * len(qualities)), squeeze=False)
    for (name, quality), (ax_kl, ax_g8) in zip(qualities.items(), axes):
        v = quality["variants"]
        labels = sorted({s["rule"] for s in v.values() if 0 < s["ratio"] < 1},
                        key=lambda label: (label != "rule", label))
        for label, style in zip(labels, ("o-", "s--", "^:", "v-.", "d-", "x--")):
            points = sorted((s["ratio"], s["kl"], s["greedy8"]) for s in v.values()
                            if s["rule"] in (label, "none", "all"))
            below_one = [p for p in points if p[0] < 1.0]  # r = 1 is a full prefill: KL 0, off a log axis
            ax_kl.plot([p[0] for p in below_one], [p[1] for p in below_one], style, label=label)
            ax_g8.plot([p[0] for p in points], [p[2] * 8 for p in points], style, label=label)
        ax_kl.set(xlabel="recomputed fraction r", ylabel="mean KL(full || blended), nats", yscale="log",
                  title=f"{name}: {quality['prompts']} prompts, mean {quality['mean_prompt_tokens']:.0f} tokens")
        ax_g8.set(xlabel="recomputed fraction r", ylabel="greedy agreement, of the first 8 answer tokens",
                  ylim=(0, 8.3),
                  title=f"{name}: agreement with a full prefill")
        for ax in (ax_kl, ax_g8):
            ax.grid(True, alpha=0.3)
            ax.legend()
    fig.suptitle("CacheBlend on SmolLM2-135M-Instruct: the rule against its controls at equal recompute")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def plot_with(files: str) -> dict[str, dict[str, Any]]:
    """{workload: quality} of each results file named (comma-separated)."""
    found = [(f, json.loads(Path(f).read_text())) for f in files.split(",") if f]
    return {data.get("source", {}).get("workload", f): data["quality"] for f, data in found}


def header_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Each field of `new` (this run's header) that `old` (a results file) holds otherwise, named."""
    out = []
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(old.get(key), dict):
            out += [f"{key}.{k}: file {old[key].get(k)!r}, this run {v!r}" for k, v in value.items()
                    if old[key].get(k) != v]
        elif old.get(key) != value:
            out.append(f"{key}: file {old.get(key)!r}, this run {value!r}")
    return out


def main(argv: list[str] | None = None,
         make_variants: Callable[[Sequence[float]], list[Variant]] | None = None) -> int:
    """`make_variants` (ratios -> variants) replaces the rule and its controls: a research tool's selections."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2 or a checkpoint directory with a tokenizer")
    parser.add_argument("--workload", default="langref", help=f"one of {', '.join(WORKLOADS)}")
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--skip", type=int, default=0, help="leave out the workload's first prompts")
    parser.add_argument("--time-budget-s", type=float,
                        help="start no prompt after this many seconds; the report counts the prompts that ran")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ratios", default=",".join(f"{r:g}" for r in RATIOS))
    parser.add_argument("--needle-fraction", type=float, default=WorkloadConfig.needle_fraction)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--doc-tokens", help="each document's length in tokens: lo,hi (default: the workload's)")
    parser.add_argument("--docs-per-prompt", help="lo,hi (default: the workload's)")
    parser.add_argument("--prompt-tokens", default="1000,6000", help="lo,hi")
    parser.add_argument("--reference-dir", default=str(REFERENCE_DIR),
                        help="full-prefill references kept between runs ('' for none)")
    parser.add_argument("--ttft-lengths", default="2048,4096,6144", help="comma-separated; empty: no TTFT")
    parser.add_argument("--ttft-ratio", type=float, default=TARGET_RATIO)
    parser.add_argument("--ttft-repeats", type=int, default=2)
    parser.add_argument("--no-sidecar", action="store_true", help="TTFT from the in-process store only")
    parser.add_argument("--no-quality", action="store_true", help="TTFT only")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the host is shared)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--resume", type=Path, help="the results file (--json) to add to: its prompts are not run "
                                                    "again; it must be of this model, workload, seed and variants")
    parser.add_argument("--plot", type=Path, help="draw quality against the recomputed fraction here (PNG); "
                                                  "with --plot-with, beside other runs' JSON")
    parser.add_argument("--plot-with", default="", help="other runs' JSON files (comma-separated) for --plot")
    parser.add_argument("--plot-only", action="store_true", help="run nothing: draw --plot from --plot-with")
    args = parser.parse_args(argv)
    pair = lambda s: tuple(int(x) for x in s.split(",")) if s else None  # noqa: E731
    try:
        ratios = [float(x) for x in args.ratios.split(",")]
        config = WorkloadConfig.named(args.workload, prompts=args.skip + args.prompts, seed=args.seed,
                                      doc_tokens=pair(args.doc_tokens), docs_per_prompt=pair(args.docs_per_prompt),
                                      prompt_tokens=pair(args.prompt_tokens), needle_fraction=args.needle_fraction)
        lengths = [int(x) for x in args.ttft_lengths.split(",") if x]
        variants = (make_variants or (lambda rs: variants_for(rs, rules_at=RULES_AT)))(ratios)
        if any(not 0.0 <= r <= 1.0 for r in ratios):
            raise ValueError(f"ratios: each must be in [0, 1], got {ratios}")
        if args.no_quality and not lengths:
            raise ValueError("--no-quality: nothing left to run without --ttft-lengths")
    except ValueError as exc:
        parser.error(str(exc))
    if args.resume and args.json and args.json != args.resume:
        parser.error("--resume: it is the results file; give --json the same path or leave it out")
    args.json = args.resume or args.json
    # What a resumed file must share with this run; JSON's view of it, as the file holds it.
    header = json.loads(json.dumps({
        "model": args.model, "workload": {k: v for k, v in vars(config).items() if k != "prompts"},
        "answer_tokens": args.answer_tokens, "variants": [[v.rule, v.ratio, repr(v.selection)] for v in variants]}))
    old = json.loads(args.resume.read_text()) if args.resume and args.resume.exists() else None
    if old is not None and (differ := header_differences(old, header)):
        parser.error(f"--resume {args.resume}: the file's run differs from this one: {'; '.join(differ)}")
    if args.plot_only:
        if not args.plot or not args.plot_with:
            parser.error("--plot-only: needs --plot and --plot-with")
        plot(plot_with(args.plot_with), args.plot)
        return 0
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model = load_model(args.model)
    if model.tokenizer is None:
        parser.error(f"--model: {args.model} has no tokenizer; the workload is text")
    workload = Workload(model.tokenizer, config)
    source: dict[str, Any] = {"workload": args.workload}
    if args.workload == "packages":
        from bench.blend_packages import distributions

        source["distributions"] = distributions()
    every_prompt = workload.prompts()
    prompts = [] if args.no_quality else list(enumerate(every_prompt))[args.skip:]
    done = ((old or {}).get("quality") or {}).get("per_prompt", [])
    if changed := [r["index"] for r in done if r["index"] < len(every_prompt)
                   and r["tokens_sha256"] != tokens_sha256(every_prompt[r["index"]].tokens)]:
        parser.error(f"--resume {args.resume}: prompts {changed} of the file have other tokens than this run's "
                     f"(the workload's text differs: source {(old or {}).get('source')!r}, this run {source!r})")
    steps = len(prompts) + len(lengths) * (1 + args.ttft_repeats)
    # A string, not a Path: Path("") is ".", which would keep the references in the working directory.
    reference_dir = Path(args.reference_dir) if args.reference_dir else None

    def save(report: dict[str, Any]) -> None:
        if args.json:  # whole or as it was: a run stopped mid-write leaves a file that resumes
            args.json.parent.mkdir(parents=True, exist_ok=True)
            scratch = args.json.with_suffix(f".{os.getpid()}.tmp")
            scratch.write_text(json.dumps(header | report, indent=2, default=str))
            scratch.replace(args.json)

    def progress(q: dict[str, Any]) -> None:
        # After each prompt the figures so far are saved, marked partial: a long run stopped early keeps them.
        save({"partial": True, "source": source, "quality": q})
        v = q["variants"]
        line = "  ".join(f"{name} {s['kl']:.4f}/{s['greedy8'] * 8:.1f}" for name, s in v.items())
        print(f"[{q['prompts']}/{len(prompts)} {time.perf_counter() - started:.0f}s] KL/greedy8: {line}", flush=True)

    with tqdm(total=steps, desc="blend", unit="step", file=sys.stderr, mininterval=30) as bar:
        deadline = started + args.time_budget_s if args.time_budget_s is not None else None
        quality = evaluate_quality(model, prompts, variants, args.answer_tokens, bar, reference_dir,
                                   on_prompt=progress, deadline=deadline, done=done) if prompts or done else None
        ttft = measure_ttft(model, workload, lengths, args.ttft_ratio, args.ttft_repeats, not args.no_sidecar,
                            bar) if lengths else None
    report: dict[str, Any] = {"source": source, "skip": args.skip, "prompts_asked": len(prompts),
                              "time_budget_s": args.time_budget_s, "targets": TARGETS, "quality": quality, "ttft": ttft,
                              "verdicts": verdicts(quality, ttft), "threads": torch.get_num_threads()}
    print_table(quality, ttft, args.workload)
    for what, ok in report["verdicts"].items():
        print(f"target {what}: {'met' if ok else 'not met'}")
    report["elapsed_s"] = time.perf_counter() - started
    print(f"torch threads {torch.get_num_threads()}; {report['elapsed_s']:.0f} s")
    if ttft or (quality and quality["prompts"] > len(done)):  # a complete file only printed stays as it is
        save(report)
    if args.plot and (qualities := ({args.workload: quality} if quality else {}) | plot_with(args.plot_with)):
        plot(qualities, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CacheBlend on the real model: quality against a full prefill per selection rule and ratio, and TTFT.

    python bench/blend_quality.py [--prompts 100] [--ratios 0,0.05,0.15,0.3,1] [--json out.json]
                                  [--plot docs/cacheblend.png] [--ttft-lengths 2048,4096,6144]

Model: SmolLM2-135M-Instruct (`--model smollm2`, float32, 30 layers). Workload:
bench/blend_workload.py (sections of Python's language reference, 3-8 documents of 200-600
tokens per prompt, half of the questions needle questions), built from `--seed`.

Quality. Each prompt is first prefilled in full and answered greedily (`--answer-tokens`, stopping
at the end of the turn): that answer is the reference. Then, for each ratio r and selection rule,
the prompt's chunks are laid in the cache as the store gives them (each document's standalone KV,
computed once per run and stored in an in-process `KVStore`, K re-rotated to its place),
recomputed selectively, and the question and the reference answer run through in one
teacher-forced pass. Per prompt, along the reference answer:
  kl        mean KL(full || blended) of the next-token distribution
  top1      fraction of positions where the blended argmax is the reference token
  exact     1 if every position agrees: then the blended greedy answer is the reference itself
  needle    needle prompts: the blended greedy answer names the planted number (decoded from the
            first disagreement on, where there is one)
Rules (decode/blend_selection.py), each recomputing the same number of tokens per layer:
deviation (CacheBlend's, what the decode loop uses), random, first (the first tokens of every
chunk). r = 0 is the stored chunks as they are; r = 1 recomputes everything (exactly a full
prefill). The prefix (system prompt) is exact in every run, as prefix reuse makes it.

TTFT. Prompts of `--ttft-lengths` tokens from the same documents: a full prefill against
CacheBlend at `--ttft-ratio` with every chunk and the prefix warm, from an in-process CPU tier
and from `kvstore serve` (CPU tier) over loopback; best of `--ttft-repeats` interleaved runs.

Targets at r = 0.15: mean KL <= 0.25x r = 0's and <= 0.7x random's; needle accuracy within 3
points of a full prefill; TTFT <= 0.35x a full prefill at 4k tokens. r = 1 equals a full prefill.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # after PYTHONPATH: an older kvstore there wins

from bench.blend_workload import BlendPrompt, Workload, WorkloadConfig, needle_correct  # noqa: E402
from kvstore.config import StoreConfig  # noqa: E402
from kvstore.decode import LlamaModel, generate, load_model  # noqa: E402
from kvstore.decode.attention import AttentionContext  # noqa: E402
from kvstore.decode.blend_selection import DEVIATION_SCORES, SELECTION_RULES, TokenSelection  # noqa: E402
from kvstore.decode.paged_cache import BlockTable, PagedKVCache  # noqa: E402
from kvstore.decode.recompute import selective_recompute  # noqa: E402
from kvstore.store import KVStore  # noqa: E402

RATIOS = (0.0, 0.05, 0.15, 0.3, 1.0)
TARGETS = {"kl_vs_r0": 0.25, "kl_vs_random": 0.7, "needle_gap_points": 3.0, "ttft_ratio_4k": 0.35}
TARGET_RATIO = 0.15
NEEDLE_DECODE_TOKENS = 12  # a number needs a few tokens; decoding past it decides nothing


@dataclass
class Variant:
    """One (ratio, rule) over all prompts: per-prompt figures."""
    ratio: float
    rule: str
    selection: TokenSelection
    kl: list[float] = field(default_factory=list)
    top1: list[float] = field(default_factory=list)
    exact: list[float] = field(default_factory=list)
    needle: list[float] = field(default_factory=list)
    recomputed: list[float] = field(default_factory=list)  # fraction of chunk tokens through the last layer

    @property
    def name(self) -> str:
        return f"{self.rule}@{self.ratio:g}"  # the rule's name, or a variant's label

    def summary(self) -> dict[str, Any]:
        mean = lambda xs: statistics.mean(xs) if xs else None  # noqa: E731
        return {"ratio": self.ratio, "rule": self.rule, "kl": mean(self.kl), "top1": mean(self.top1),
                "exact": mean(self.exact), "needle": mean(self.needle), "recomputed_fraction": mean(self.recomputed),
                "prompts": len(self.kl), "kl_per_prompt": self.kl}


def variants_for(ratios: Sequence[float], rules: Sequence[str], scores: Sequence[str] = ("pooled",),
                 seed: int = 0, first_share: float = TokenSelection.first_share) -> list[Variant]:
    """r = 0 and r = 1 do not depend on the rule: they run once, under the rule 'deviation'. Each
    deviation score past the first (the decode loop's) adds its own variants, named deviation-SCORE."""
    out = []
    for r in ratios:
        for rule in (rules if 0.0 < r < 1.0 else ["deviation"]):
            for i, score in enumerate(scores if rule == "deviation" and 0.0 < r < 1.0 else scores[:1]):
                out.append(Variant(r, rule if i == 0 else f"{rule}-{score}",
                                   TokenSelection(rule, seed=seed, score=score, first_share=first_share)))
    return out


class Evaluator:
    """Shared state for one run: the model, one paged cache, and the store holding the chunks."""

    def __init__(self, model: LlamaModel, store: KVStore, answer_tokens: int):
        self.model, self.store, self.answer_tokens = model, store, answer_tokens
        self.cache: PagedKVCache | None = None
        self.chunks_computed = self.chunks_reused = 0
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

    def chunk_kv(self, prompt: BlendPrompt) -> torch.Tensor:
        """The chunks' stored standalone KV at their places in `prompt`: (L, 2, C, H, D). A chunk the
        store does not hold yet is computed alone at positions 0..n-1 and stored, once per run."""
        name = self.model.name
        for chunk in prompt.chunks:
            if self.store.blend(name, [chunk], start_pos=0).hits[0]:
                self.chunks_reused += 1
                continue
            cache, table = self._table(len(chunk))
            try:
                self._forward(chunk, 0, cache, table, "none")
                self.store.store_chunk(name, chunk, cache.gather(table, 0, len(chunk)))
            finally:
                cache.release(table)
            self.chunks_computed += 1
        found = self.store.blend(name, prompt.chunks, start_pos=len(prompt.prefix))
        assert all(found.hits), "the store evicted a chunk within one prompt: give it more cpu_bytes"
        return torch.as_tensor(found.kv)

    def evaluate(self, prompt: BlendPrompt, variants: Sequence[Variant]) -> dict[str, Any]:
        model, n_prefix = self.model, len(prompt.prefix)
        tokens = prompt.tokens
        n = len(tokens)
        chunk_tokens = sum(map(len, prompt.chunks))
        q_start = n_prefix + chunk_tokens
        cache, table = self._table(n + self.answer_tokens + NEEDLE_DECODE_TOKENS)
        try:
            # Reference: a full prefill and its greedy answer.
            last = self._forward(tokens, 0, cache, table, "last")
            answer, rows = self._greedy(last, n, cache, table, self.answer_tokens)
            ref_logp = torch.stack(rows).log_softmax(-1)  # (A, V)
            full_kv = cache.gather(table, 0, n)  # (L, 2, n, H, D)
            full_text = model.tokenizer.decode(answer) if model.tokenizer else ""
            needle_full = needle_correct(full_text, prompt.needle_answer) if prompt.needle_answer else None
            blended = self.chunk_kv(prompt)  # (L, 2, C, H, D)
            chunk_ids = torch.tensor([t for c in prompt.chunks for t in c], dtype=torch.long, device=model.device)
            prefix_ids = torch.tensor(prompt.prefix, dtype=torch.long, device=model.device)
            ends = [n_prefix + sum(map(len, prompt.chunks[:i + 1])) for i in range(len(prompt.chunks))]
            teacher = prompt.question + answer[:-1]
            r1_max_abs = None
            for variant in variants:
                ratio = variant.ratio
                cache.scatter(table, full_kv[:, :, :n_prefix], start=0)  # the prefix, exact
                cache.scatter(table, blended, start=n_prefix)
                ran = selective_recompute(model, chunk_ids, cache, table, n_prefix, ratio, ends, prefix_ids,
                                          variant.selection)
                out = self._forward(teacher, q_start, cache, table, "all")  # (Q + A - 1, V)
                logits = out[len(prompt.question) - 1:]  # (A, V): the distributions of the answer tokens
                logp = logits.log_softmax(-1)
                kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)  # (A,)
                agree = logits.argmax(-1) == torch.tensor(answer, device=logits.device)  # (A,)
                variant.kl.append(float(kl.mean()))
                variant.top1.append(float(agree.float().mean()))
                variant.exact.append(float(bool(agree.all())))
                variant.recomputed.append(ran / chunk_tokens)
                if ratio == 1.0:
                    r1_max_abs = float((logits - torch.stack(rows)).abs().max())
                if prompt.needle_answer is not None:
                    variant.needle.append(float(self._needle(prompt, answer, agree, logits, n, cache, table)))
            return {"tokens": n, "chunks": len(prompt.chunks), "answer": full_text, "answer_tokens": len(answer),
                    "needle_full": needle_full, "r1_max_abs_logit_diff": r1_max_abs}
        finally:
            cache.release(table)

    def _needle(self, prompt: BlendPrompt, answer: list[int], agree: torch.Tensor, logits: torch.Tensor, n: int,
                cache: PagedKVCache, table: BlockTable) -> bool:
        """Whether the blended greedy answer names the needle: the reference's tokens up to the first
        disagreement (the teacher-forced KV there is the greedy run's), then decoded on from it."""
        assert prompt.needle_answer is not None
        wrong = (~agree).nonzero()
        j = int(wrong[0]) if wrong.numel() else len(answer)
        tokens = answer[:j]
        if j < len(answer) and j < NEEDLE_DECODE_TOKENS:
            more, _ = self._greedy(logits[j], n + j, cache, table, NEEDLE_DECODE_TOKENS - j)
            tokens = tokens + more
        text = self.model.tokenizer.decode(tokens) if self.model.tokenizer else ""
        return needle_correct(text, prompt.needle_answer)


def evaluate_quality(model: LlamaModel, prompts: list[BlendPrompt], ratios: Sequence[float], rules: Sequence[str],
                     answer_tokens: int, seed: int, bar: tqdm, variants: list[Variant] | None = None,
                     on_prompt: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every prompt through every variant; `on_prompt` gets the figures so far after each prompt."""
    if variants is None:
        variants = variants_for(ratios, rules, seed=seed)
    per_prompt = []
    with KVStore(StoreConfig(data_dir=None, cpu_bytes=3 << 30, disk_bytes=0)) as store:
        evaluator = Evaluator(model, store, answer_tokens)
        for prompt in prompts:
            per_prompt.append(evaluator.evaluate(prompt, variants))
            bar.update(1)
            if on_prompt is not None:
                on_prompt(quality_summary(per_prompt, variants, evaluator))
        return quality_summary(per_prompt, variants, evaluator)


def quality_summary(per_prompt: list[dict[str, Any]], variants: Sequence[Variant],
                    evaluator: Evaluator) -> dict[str, Any]:
    needles = [p["needle_full"] for p in per_prompt if p["needle_full"] is not None]
    r1 = [p["r1_max_abs_logit_diff"] for p in per_prompt if p["r1_max_abs_logit_diff"] is not None]
    return {"prompts": len(per_prompt), "mean_prompt_tokens": statistics.mean(p["tokens"] for p in per_prompt),
            "min_prompt_tokens": min(p["tokens"] for p in per_prompt),
            "max_prompt_tokens": max(p["tokens"] for p in per_prompt),
            "chunks_per_prompt": statistics.mean(p["chunks"] for p in per_prompt),
            "chunks_computed": evaluator.chunks_computed, "chunks_reused": evaluator.chunks_reused,
            "needle_prompts": len(needles), "needle_full": statistics.mean(needles) if needles else None,
            "r1_max_abs_logit_diff": max(r1) if r1 else None,
            "variants": {v.name: v.summary() for v in variants}, "per_prompt": per_prompt}


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
            from bench.ttft import start_sidecar
            from kvstore.api.client import KVStoreClient

            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvstore-blend-")))
            proc, url = start_sidecar(tmp)
            stack.callback(lambda: (proc.terminate(), proc.wait(timeout=30)))
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
    blend, r0 = v.get(f"deviation@{TARGET_RATIO:g}"), v.get("deviation@0")
    random_ = v.get(f"random@{TARGET_RATIO:g}")
    out: dict[str, bool | None] = {}
    if blend and r0:
        out["kl <= 0.25x r=0"] = blend["kl"] <= TARGETS["kl_vs_r0"] * r0["kl"]
    if blend and random_:
        out["kl <= 0.7x random"] = blend["kl"] <= TARGETS["kl_vs_random"] * random_["kl"]
    if blend and quality and quality["needle_full"] is not None:
        out["needle within 3 points"] = (quality["needle_full"] - blend["needle"]) * 100 <= TARGETS["needle_gap_points"]
    if "deviation@1" in v and quality:
        out["r=1 equals full"] = v["deviation@1"]["exact"] == 1.0 and v["deviation@1"]["kl"] <= 1e-6
    near_4k = [row for row in ttft or [] if 3500 <= row["length"] <= 4500]
    if near_4k:
        out["ttft <= 0.35x at 4k"] = all(row["ttft_vs_full"] <= TARGETS["ttft_ratio_4k"] for row in near_4k)
    return out


def print_table(quality: dict[str, Any] | None, ttft: list[dict[str, Any]] | None) -> None:
    if quality:
        print_quality(quality)
    for row in ttft or []:
        print(f"TTFT {row['length']:>5} tokens, {row['backend']:>7}, r = {row['ratio']:g}: "
              f"{row['ttft_s'] * 1e3:8.0f} ms = {row['ttft_vs_full']:.3f}x full ({row['full_ttft_s'] * 1e3:.0f} ms)")


def print_quality(quality: dict[str, Any]) -> None:
    print(f"{quality['prompts']} prompts, {quality['min_prompt_tokens']}-{quality['max_prompt_tokens']} tokens "
          f"(mean {quality['mean_prompt_tokens']:.0f}), {quality['chunks_per_prompt']:.1f} chunks each; chunks "
          f"computed {quality['chunks_computed']}, reused from the store {quality['chunks_reused']}")
    needle_full = quality["needle_full"]
    print(f"full prefill: needle accuracy {needle_full * 100:.1f}% of {quality['needle_prompts']}"
          if needle_full is not None else "full prefill: no needle prompts")
    print(f"{'ratio':>6} {'rule':>10} {'recomputed':>10} {'mean KL':>9} {'top-1':>7} {'exact':>7} {'needle':>7}")
    for s in quality["variants"].values():
        needle = "-" if s["needle"] is None else f"{s['needle'] * 100:.1f}%"
        print(f"{s['ratio']:>6g} {s['rule']:>10} {s['recomputed_fraction']:>10.3f} {s['kl']:>9.4f} "
              f"{s['top1'] * 100:>6.1f}% {s['exact'] * 100:>6.1f}% {needle:>7}")


def plot(quality: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    v = quality["variants"]
    fig, (ax_kl, ax_top1) = plt.subplots(1, 2, figsize=(10, 4))
    for rule, style in zip(SELECTION_RULES, ("o-", "s--", "^:")):
        points = sorted((s["ratio"], s["kl"], s["top1"]) for s in v.values()
                        if s["rule"] == rule or s["ratio"] in (0.0, 1.0))
        if not any(s["rule"] == rule for s in v.values() if 0 < s["ratio"] < 1):
            continue
        below_one = [p for p in points if p[0] < 1.0]  # r = 1 is a full prefill: KL 0, off a log axis
        ax_kl.plot([p[0] for p in below_one], [p[1] for p in below_one], style, label=rule)
        ax_top1.plot([p[0] for p in points], [p[2] * 100 for p in points], style, label=rule)
    ax_kl.set(xlabel="recomputed fraction r", ylabel="mean KL(full || blended), nats", yscale="log",
              title="divergence from a full prefill (r = 1: none)")
    ax_top1.set(xlabel="recomputed fraction r", ylabel="top-1 agreement, %", title="agreement with a full prefill")
    for ax in (ax_kl, ax_top1):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"CacheBlend on SmolLM2-135M-Instruct: {quality['prompts']} prompts of "
                 f"{quality['mean_prompt_tokens']:.0f} tokens on average")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2 or a checkpoint directory with a tokenizer")
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ratios", default=",".join(f"{r:g}" for r in RATIOS))
    parser.add_argument("--rules", default=",".join(SELECTION_RULES))
    parser.add_argument("--scores", default="pooled",
                        help=f"deviation scores, the first the rule's (of {', '.join(DEVIATION_SCORES)})")
    parser.add_argument("--first-share", type=float, default=TokenSelection.first_share,
                        help="the deviation rule's share of each chunk's first tokens (0: deviation alone)")
    parser.add_argument("--needle-fraction", type=float, default=WorkloadConfig.needle_fraction)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--doc-tokens", default="200,600", help="each document's length in tokens: lo,hi")
    parser.add_argument("--docs-per-prompt", default="3,8", help="lo,hi")
    parser.add_argument("--prompt-tokens", default="1000,6000", help="lo,hi")
    parser.add_argument("--ttft-lengths", default="2048,4096,6144", help="comma-separated; empty: no TTFT")
    parser.add_argument("--ttft-ratio", type=float, default=TARGET_RATIO)
    parser.add_argument("--ttft-repeats", type=int, default=2)
    parser.add_argument("--no-sidecar", action="store_true", help="TTFT from the in-process store only")
    parser.add_argument("--no-quality", action="store_true", help="TTFT only")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the host is shared)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plot", type=Path, help="draw quality against the recomputed fraction here (PNG)")
    args = parser.parse_args(argv)
    pair = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    try:
        ratios = [float(x) for x in args.ratios.split(",")]
        rules = [x for x in args.rules.split(",") if x]
        config = WorkloadConfig(prompts=args.prompts, seed=args.seed, doc_tokens=pair(args.doc_tokens),
                                docs_per_prompt=pair(args.docs_per_prompt), prompt_tokens=pair(args.prompt_tokens),
                                needle_fraction=args.needle_fraction)
        scores = [x for x in args.scores.split(",") if x]
        lengths = [int(x) for x in args.ttft_lengths.split(",") if x]
        for rule in rules:
            TokenSelection(rule)
        for score in scores:
            TokenSelection(score=score, first_share=args.first_share)
        if not scores:
            raise ValueError("--scores: name at least one")
        if any(not 0.0 <= r <= 1.0 for r in ratios):
            raise ValueError(f"ratios: each must be in [0, 1], got {ratios}")
        if args.no_quality and not lengths:
            raise ValueError("--no-quality: nothing left to run without --ttft-lengths")
    except ValueError as exc:
        parser.error(str(exc))
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model = load_model(args.model)
    if model.tokenizer is None:
        parser.error(f"--model: {args.model} has no tokenizer; the workload is text")
    workload = Workload(model.tokenizer, config)
    prompts = workload.prompts()
    if args.no_quality:
        prompts = []
    steps = len(prompts) + len(lengths) * (1 + args.ttft_repeats)
    def save(report: dict[str, Any]) -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2, default=str))

    # After each prompt the figures so far are saved, marked partial: a long run stopped early keeps them.
    partial = lambda q: save({"model": args.model, "partial": True, "quality": q})  # noqa: E731
    with tqdm(total=steps, desc="blend", unit="step", file=sys.stderr) as bar:
        variants = variants_for(ratios, rules, scores, args.seed, args.first_share)
        quality = evaluate_quality(model, prompts, ratios, rules, args.answer_tokens, args.seed, bar, variants,
                                   on_prompt=partial) if prompts else None
        ttft = measure_ttft(model, workload, lengths, args.ttft_ratio, args.ttft_repeats, not args.no_sidecar,
                            bar) if lengths else None
    report: dict[str, Any] = {"model": args.model, "workload": vars(config) | {"doc_tokens": list(config.doc_tokens)},
                              "targets": TARGETS, "quality": quality, "ttft": ttft,
                              "verdicts": verdicts(quality, ttft), "threads": torch.get_num_threads()}
    print_table(quality, ttft)
    for what, ok in report["verdicts"].items():
        print(f"target {what}: {'met' if ok else 'MISSED'}")
    report["elapsed_s"] = time.perf_counter() - started
    print(f"torch threads {torch.get_num_threads()}; {report['elapsed_s']:.0f} s")
    save(report)
    if args.plot and quality:
        plot(quality, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

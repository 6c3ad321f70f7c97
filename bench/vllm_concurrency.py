"""Eight concurrent requests sharing a long prefix on vLLM with and without kvstore: throughput and
time to first token, in one run, each engine a fresh process, the store `kvstore serve`.

    python bench/vllm_concurrency.py [--prefix-tokens 2048] [--requests 8] [--random-model] [--json out.json]

The rows and figures: docs/vllm.md, "Eight requests at once".
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: an older kvstore there wins
from bench.engines import REAL_MODEL, Sidecar, checkpoint, greedy, kv_bytes_per_token, make_engine, \
    model_facts, parse_or_serve_engine, run_engine, serve_args  # noqa: E402
from bench.prompts import Prompts  # noqa: E402
from bench.report import markdown_table, parser as bench_parser, write_json  # noqa: E402

SUFFIX_TOKENS = 64  # each request's own, after the shared prefix
OUTPUT_TOKENS = 32


def engine_main(job: dict[str, Any]) -> dict[str, Any]:
    llm = make_engine(job, dtype="float32", enable_prefix_caching=True)
    prompt = Prompts(job["model"], job["vocab_size"], job["has_tokenizer"])
    prefix = prompt(job["prefix_tokens"], salt=0)
    batches = iter(range(1, 1_000_000))

    def batch(max_tokens: int, fresh_salts: bool = False, empty_vllm_cache: bool = False) -> float:
        """Seconds for one batch of the requests, with suffixes no batch used before."""
        first = next(batches) * job["requests"]
        prompts = [prefix + prompt(SUFFIX_TOKENS, salt=first + i) for i in range(job["requests"])]
        salts = [f"fresh-{first + i}" for i in range(job["requests"])] if fresh_salts else None
        if empty_vllm_cache:
            llm.reset_prefix_cache()
        started = time.perf_counter()
        outs = greedy(llm, prompts, max_tokens, salts)
        elapsed = time.perf_counter() - started
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        return elapsed

    def best(**how: Any) -> dict[str, float]:
        ttft = min(batch(1, **how) for _ in range(job["repeats"]))
        whole = min(batch(OUTPUT_TOKENS, **how) for _ in range(job["repeats"]))
        return {"ttft_s": ttft, "requests_per_s": job["requests"] / whole}

    batch(1, fresh_salts=True)  # warm-up: the one-time costs of a first batch
    greedy(llm, [prefix + [prompt(4, salt=0)[-1]]], 1)  # the prefix, cached (and stored)
    result: dict[str, Any] = {}
    if job["extra"] is None:
        result["prefix_cached"] = best()
        result["nothing_cached"] = best(fresh_salts=True)
    else:
        result["prefix_in_both"] = best()
        result["prefix_in_store"] = best(empty_vllm_cache=True)
    llm.llm_engine.engine_core.shutdown()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, with_json=False)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="batches per figure (best of)")
    parser.add_argument("--random-model", action="store_true", help="a random-weight Llama (no download)")
    args = parse_or_serve_engine(parser, argv, engine_main)
    if args is None:
        return 0
    for name in ("prefix_tokens", "requests", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be at least 1")
    with tempfile.TemporaryDirectory(prefix="vllm-concurrency-") as tmp:
        root = Path(tmp)
        with tqdm(total=4, desc="vllm_concurrency", unit="engine", file=sys.stderr) as bar:
            directory = checkpoint(args.random_model, root / "model")
            facts = model_facts(directory)
            max_model_len = args.prefix_tokens + SUFFIX_TOKENS + OUTPUT_TOKENS + 64
            if max_model_len > facts["context"]:
                parser.error(f"--prefix-tokens: the prompts do not fit the model's {facts['context']}-token context")
            per_token = kv_bytes_per_token(facts, "float32")
            # vLLM's cache holds the whole batch at once (no preemption is any row's business).
            kv_cache_bytes = max(1 << 30, 2 * per_token * args.requests * max_model_len)
            base = dict(model=str(directory), vocab_size=facts["vocab"], max_model_len=max_model_len,
                        has_tokenizer=facts["has_tokenizer"] and not args.random_model,
                        kv_cache_bytes=kv_cache_bytes, prefix_tokens=args.prefix_tokens,
                        requests=args.requests, repeats=args.repeats)
            results: dict[str, Any] = {"vllm": run_engine(dict(base, extra=None), __file__)}
            bar.update()
            store_bytes = f"{max(1024, 4 * per_token * args.requests * max_model_len >> 20)}MiB"
            with Sidecar(root / "sidecar", serve_args(store_bytes)) as sidecar:
                for name, load_async in (("kvstore", False), ("kvstore_async", True)):
                    extra = {"url": sidecar.url, "timeout_s": 120, "load_async": load_async}
                    results[name] = run_engine(dict(base, extra=extra), __file__)
                    bar.update()
            bar.update()
    table = summarize(results)
    print(f"model: {'random-weight Llama' if args.random_model else REAL_MODEL}, float32; {args.requests} requests "
          f"of {args.prefix_tokens} shared + {SUFFIX_TOKENS} own tokens, {OUTPUT_TOKENS} output tokens")
    print(markdown_table(["case", "TTFT of the batch ms", "requests/s", "÷ vLLM, prefix cached", "÷ nothing cached"],
                         ([r["case"], f"{r['ttft_s'] * 1e3:,.0f}", f"{r['requests_per_s']:.2f}",
                           f"{r['throughput_vs_vllm_cached']:.2f}", f"{r['throughput_vs_nothing_cached']:.2f}"]
                          for r in table)))
    write_json(args.json, {"args": {k: v for k, v in vars(args).items() if k != "json"}, "raw": results,
                           "table": table})
    return 0


def summarize(results: dict[str, Any]) -> list[dict[str, Any]]:
    cached, nothing = results["vllm"]["prefix_cached"], results["vllm"]["nothing_cached"]
    rows = [("vLLM, prefix cached", cached), ("vLLM, nothing cached", nothing)]
    for name, label in (("kvstore", "loads in the step"), ("kvstore_async", "load_async")):
        rows.append((f"kvstore ({label}), prefix in both", results[name]["prefix_in_both"]))
        rows.append((f"kvstore ({label}), prefix in store only", results[name]["prefix_in_store"]))
    return [dict(case=case, **row, throughput_vs_vllm_cached=row["requests_per_s"] / cached["requests_per_s"],
                 throughput_vs_nothing_cached=row["requests_per_s"] / nothing["requests_per_s"])
            for case, row in rows]


if __name__ == "__main__":
    sys.exit(main())

"""vLLM's time to first token with kvstore as its KV connector (in-process CPU and disk tiers, a
sidecar over shared memory and TCP) against a full prefill and vLLM's own prefix cache, in one run.

    python bench/vllm_ttft.py [--sizes 1024,2048,4096,8191] [--json out.json] [--random-model]
                              [--audit-rate R] [--audit-tokens N]

The engines, rows, targets and figures: docs/vllm.md, "Performance".
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.engines import REAL_MODEL, RANDOM_MODEL, Sidecar, checkpoint, greedy, kv_bytes_per_token, \
    make_engine, model_facts, parse_or_serve_engine, run_engine, serve_args  # noqa: E402
from bench.prompts import Prompts  # noqa: E402
from bench.report import write_json  # noqa: E402

# A memory hit (in-process, shared memory) at every size against the same engine's own hit, and
# from 2k tokens against a full prefill; TCP at 2k; with nothing to hit, the connector's timed
# work against a prefill's TTFT and its hooks against a decode step; an audited hit at 2k.
TARGETS = {"hit_vs_own_hit": 1.2, "hit_vs_full_from_2k": 0.25, "tcp_hit_vs_own_hit_2k": 2.0,
           "miss_work_share_of_prefill": 0.03, "hooks_share_of_decode_step": 0.01,
           "audited_hit_vs_hit_2k": 1.15}
# The store's hit rows: (the engine's key in the results, its row's case).
HITS = (("inproc", "kvstore hit: in-process CPU tier"), ("shm", "kvstore hit: sidecar, shared memory"),
        ("tcp", "kvstore hit: sidecar, TCP"), ("disk", "kvstore hit: disk tier after restart"))
MEMORY_HITS = tuple(case for _, case in HITS[:2])


# -- one engine, in its own process -------------------------------------------------------------

def fastest(runs: Any) -> tuple[float, int, dict[str, float]]:
    """The run of `ttft`'s (seconds, cached tokens, connector seconds) that took the least time."""
    return min(runs, key=lambda run: run[0])


def engine_main(job: dict[str, Any]) -> dict[str, Any]:
    llm = make_engine(job, dtype=job["dtype"])
    prompt = Prompts(job["model"], job["vocab_size"], job["has_tokenizer"])

    def worker_stats() -> dict[str, float]:
        if job["extra"] is None:
            return {}
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        spent = {k: v for k, v in get_kv_transfer_group().worker.stats.items() if k.endswith("_s")}
        # The scheduler side's connector (engine core in this process): its lookups.
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler
        return {"lookup_s": scheduler.stats["lookup_s"], **spent}

    def ttft(tokens: list[int], max_tokens: int = 1) -> tuple[float, int, dict[str, float]]:
        """(seconds, num_cached_tokens, seconds the connector spent in fetch/scatter/gather/store)."""
        before = worker_stats()
        start = time.perf_counter()
        out = greedy(llm, [tokens], max_tokens)[0]
        elapsed = time.perf_counter() - start
        spent = {k: v - before[k] for k, v in worker_stats().items()}
        return elapsed, out.num_cached_tokens, spent

    def best_hit(tokens: list[int], repeats: int) -> tuple[tuple[float, int, dict[str, float]], ...]:
        """(the best store hit, the best hit in this engine's own prefix cache), taken in turns:
        each store hit (vLLM's cache emptied) is followed by the same prompt again, which vLLM's
        cache now holds, so a busy host's drift falls on both alike."""
        store_hits, own_hits = [], []
        for _ in range(repeats):
            llm.reset_prefix_cache()  # an empty vLLM cache: the hit is the store's
            store_hits.append(ttft(tokens))
            own_hits.append(ttft(tokens))
        return fastest(store_hits), fastest(own_hits)

    def audit_in_turns(tokens: list[int], repeats: int) -> dict[str, Any]:
        """This engine's store hits, audited and not, in pairs (the order alternating) by switching
        its scheduler's audit rate, then its own prefix-cache hit (why pairs: docs/reliability.md)."""
        audits = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler.audits
        rate, runs, own, ratios = audits.rate, {True: [], False: []}, [], []  # audited? -> hits
        for i in range(repeats):
            for audited in ((True, False) if i % 2 == 0 else (False, True)):
                audits.rate = rate if audited else 0.0
                llm.reset_prefix_cache()  # an empty vLLM cache: the hit is the store's
                runs[audited].append(ttft(tokens))
            ratios.append(runs[True][-1][0] / runs[False][-1][0])
            own.append(ttft(tokens))
        audits.rate = rate
        return {"hit": fastest(runs[True]), "unaudited_hit": fastest(runs[False]), "own_hit": fastest(own),
                "audited_vs_unaudited": statistics.median(ratios), "pair_ratios": ratios}

    # Warm-up, a prompt no row uses: the first batches pay one-time costs (oneDNN primitives,
    # allocations) that are no row's business.
    ttft(prompt(job["warmup"], salt=99))
    result: dict[str, Any] = {"rows": {}}
    for size in job["sizes"]:
        tokens, row = prompt(size), {}
        if job["plan"] == "baseline":
            row["full"] = ttft(tokens)
            row["vllm_hit"] = fastest(ttft(tokens) for _ in range(job["repeats"]))
        elif job["plan"] == "audit_in_turns":
            row["miss"] = ttft(tokens)
            row.update(audit_in_turns(tokens, job["repeats"]))
        elif job["plan"] == "fill_and_hit":
            row["miss"] = ttft(tokens)
            row["hit"], row["own_hit"] = best_hit(tokens, job["repeats"])
        else:  # a fresh engine: the first request is what the store's lower tier serves
            row["hit"] = ttft(tokens)
            if job["repeats"] > 1 and job["plan"] == "hit_repeat":
                again, row["own_hit"] = best_hit(tokens, job["repeats"] - 1)
                row["hit"] = fastest([row["hit"], again])
        result["rows"][str(size)] = row
    if job.get("decode_tokens"):
        runs = []
        for i in range(2):
            first = ttft(prompt(512, salt=10 + i))[0]
            whole = ttft(prompt(512, salt=20 + i), max_tokens=job["decode_tokens"])[0]
            if whole > first:  # else prefill noise hides the decode: too few --decode-tokens to time
                runs.append((job["decode_tokens"] - 1) / (whole - first))
        result["decode_tokens_per_s"] = max(runs, default=None)
        if job["extra"] is not None:
            # The connector's own time by its hooks' timers: on a shared host this resolves a
            # fraction of a per cent, where two engines' tokens/s do not.
            hooks = HookTimers(llm)
            prefill_s, prefill_hooks_s = ttft(prompt(512, salt=30))[0], hooks.take()
            whole_s, whole_hooks_s = ttft(prompt(512, salt=31), max_tokens=job["decode_tokens"])[0], hooks.take()
            steps = job["decode_tokens"] - 1
            result["connector_share_of_prefill"] = prefill_hooks_s / prefill_s
            result["connector_share_of_decode_step"] = ((whole_hooks_s - prefill_hooks_s) / (whole_s - prefill_s)
                                                        if whole_s > prefill_s else None)  # as above: unresolved
            result["connector_us_per_decode_step"] = (whole_hooks_s - prefill_hooks_s) / steps * 1e6
    if job["extra"] is not None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        result["audits"] = dict(get_kv_transfer_group().worker.audits.stats)
    llm.llm_engine.engine_core.shutdown()
    return result


class HookTimers:
    """Wraps every vLLM hook of an in-process engine's two connector sides (the scheduler's and
    the worker's) in a timer; `take()` is the seconds spent in them since the last take."""

    WORKER_HOOKS = ("bind_connector_metadata", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
                    "wait_for_save", "get_finished", "get_block_ids_with_load_errors", "clear_connector_metadata")
    SCHEDULER_HOOKS = ("on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc",
                       "build_connector_meta", "update_connector_output", "request_finished", "take_events")

    def __init__(self, llm: Any):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        self.spent = 0.0
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
        for side, names in ((get_kv_transfer_group(), self.WORKER_HOOKS), (scheduler, self.SCHEDULER_HOOKS)):
            for name in names:
                setattr(side, name, self._timed(getattr(side, name)))

    def _timed(self, hook: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - started
        return timed

    def take(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent


# -- the run ----------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1024,2048,4096,8191", help="comma-separated prompt lengths (tokens)")
    parser.add_argument("--warmup", type=int, default=2048, help="tokens of each engine's warm-up prompt")
    parser.add_argument("--repeats", type=int, default=5, help="runs per hit measurement (best of)")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--random-model", action="store_true",
                        help="a random-weight Llama and random token ids instead of SmolLM2 and documentation text")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="model and KV dtype (float32: CPUs without AVX512-BF16 emulate bf16 matmuls, ~10x slower)")
    parser.add_argument("--audit-rate", type=float, default=0.0,
                        help="also run the in-process engine with this audit_rate, on a store of its own (0: not)")
    parser.add_argument("--only-audit", action="store_true",
                        help="run only the audited engine: its hits audited and not, in turns (needs --audit-rate)")
    parser.add_argument("--audit-tokens", type=int, help="the audited engine's audit_tokens (default: the connector's)")
    args = parse_or_serve_engine(parser, argv, engine_main)
    if args is None:
        return 0
    if args.only_audit and args.audit_rate <= 0:
        parser.error("--only-audit: needs --audit-rate > 0")
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="vllm-ttft-") as tmp:
        root = Path(tmp)
        with tqdm(total=6 + (args.audit_rate > 0), desc="vllm_ttft", unit="step", file=sys.stderr) as bar:
            directory = checkpoint(args.random_model, root / "model", args.dtype)
            facts = model_facts(directory)
            # A prompt and its first token within the model's context: vLLM refuses a prompt as
            # long as max_model_len.
            max_model_len = min(max(sizes + [512 + args.decode_tokens, args.warmup]) + 256, facts["context"])
            too_long = [n for n in sizes + [args.warmup] if n >= max_model_len]
            if too_long:
                parser.error(f"--sizes/--warmup: {too_long} do not fit the model's {facts['context']}-token context "
                             f"with a first output token")
            per_token = kv_bytes_per_token(facts, args.dtype)
            # Every store holds each prompt of the run (warm-up, sizes, decode prompts) with room to
            # spare, so no row is an eviction's; the shared-memory arena holds the largest answer.
            run_tokens = sum(sizes) + args.warmup + 5 * 512
            store_bytes = f"{max(2048, 2 * per_token * run_tokens >> 20)}MiB"
            arena_bytes = f"{max(256, (per_token * max(sizes) * 5 // 4) >> 20)}MiB"
            # A fetch of an 8k prompt's KV (hundreds of MB on the real model) may outlast the default
            # 5 s on a busy host, which would turn a hit row into a recompute.
            patience = {"timeout_s": 120}
            store = {"data_dir": str(root / "store"), "cpu_bytes": store_bytes, "disk_bytes": store_bytes, **patience}
            base = dict(sizes=sizes, repeats=args.repeats, dtype=args.dtype, warmup=args.warmup, model=str(directory),
                        vocab_size=facts["vocab"], has_tokenizer=facts["has_tokenizer"] and not args.random_model,
                        max_model_len=max_model_len, kv_cache_bytes=max(1 << 30, 3 * per_token * max_model_len))
            bar.update()
            if args.only_audit:
                return audit_only(args, base, store, root)
            results: dict[str, Any] = {}
            results["baseline"] = run_engine(dict(base, extra=None, plan="baseline", decode_tokens=args.decode_tokens),
                                             __file__)
            bar.update()
            results["inproc"] = run_engine(dict(base, extra=store, plan="fill_and_hit",
                                                decode_tokens=args.decode_tokens), __file__)
            bar.update()
            results["disk"] = run_engine(dict(base, extra=store, plan="hit"), __file__)
            bar.update()
            if args.audit_rate > 0:
                results["audit"] = run_audit_engine(args, base, store, root)
                bar.update()
            with Sidecar(root / "sidecar", serve_args(store_bytes)) as sidecar:
                url = sidecar.url
                shm = {"url": url, "shared_memory_bytes": arena_bytes, **patience}
                results["shm"] = run_engine(dict(base, extra=shm, plan="fill_and_hit"), __file__)
                bar.update()
                results["tcp"] = run_engine(dict(base, extra={"url": url, "shared_memory_bytes": 0, **patience},
                                                 plan="hit_repeat"), __file__)
                bar.update()
    table = summarize(results, sizes)
    name = "random-weight Llama, random token ids" if args.random_model else f"{REAL_MODEL}, documentation text"
    print(f"model: {name} ({facts['layers']} layers, hidden {facts['hidden']}, {facts['heads']} query heads over "
          f"{facts['kv_heads']} KV heads of {facts['head_dim']}), {args.dtype}; KV {per_token} bytes a token")
    print_table(table, results)
    checks = judge_targets(table, results)
    for check in checks:
        print(f"target {check['target']} <= {check['limit']}: "
              f"{' '.join(f'{v:.3f}' for v in check['values'])} -> {'met' if check['met'] else 'NOT met'}")
    model = dict(RANDOM_MODEL, name="random") if args.random_model else dict(facts, name=REAL_MODEL)
    write_json(args.json, {"model": dict(model, dtype=args.dtype), "sizes": sizes, "raw": results, "table": table,
                           "targets": TARGETS, "checks": checks})
    return 0


def run_audit_engine(args: argparse.Namespace, base: dict[str, Any], store: dict[str, Any], root: Path) -> Any:
    """The in-process engine with `--audit-rate` (and `--audit-tokens`) on a store of its own,
    its store hits audited and not, in turns."""
    audited = dict(store, data_dir=str(root / "store-audit"), audit_rate=args.audit_rate,
                   **({} if args.audit_tokens is None else {"audit_tokens": args.audit_tokens}))
    return run_engine(dict(base, extra=audited, plan="audit_in_turns"), __file__)


def audit_only(args: argparse.Namespace, base: dict[str, Any], store: dict[str, Any], root: Path) -> int:
    """The audited engine alone: per size, its audited and unaudited store hits and their ratio."""
    result = run_audit_engine(args, base, store, root)
    print(f"{'tokens':>6} {'audited ms':>10} {'unaudited ms':>12} {'own hit ms':>10}  audited / unaudited, "
          f"median of {args.repeats} pairs (each pair's ratio)")
    for size, row in result["rows"].items():
        pairs = " ".join(f"{r:.3f}" for r in row["pair_ratios"])
        print(f"{size:>6} {row['hit'][0] * 1e3:>10.1f} {row['unaudited_hit'][0] * 1e3:>12.1f} "
              f"{row['own_hit'][0] * 1e3:>10.1f}  {row['audited_vs_unaudited']:.3f} ({pairs})")
    print(f"audits: {result['audits']}")
    write_json(args.json, {"sizes": args.sizes, "audit_tokens": args.audit_tokens, "raw": {"audit": result}})
    return 0


def summarize(results: dict[str, Any], sizes: list[int]) -> list[dict[str, Any]]:
    rows = []
    for size in sizes:
        key = str(size)
        full, full_cached, _ = results["baseline"]["rows"][key]["full"]
        vllm_hit, vllm_cached, _ = results["baseline"]["rows"][key]["vllm_hit"]
        rows.append(dict(size=size, case="full prefill (no connector)", ttft_s=full, cached=full_cached))
        rows.append(dict(size=size, case="vLLM prefix-cache hit", ttft_s=vllm_hit, cached=vllm_cached))
        for name, label in (("inproc", "in-process store, nothing to hit"), ("shm", "sidecar, nothing to hit")):
            miss, cached, spent = results[name]["rows"][key]["miss"]
            rows.append(dict(size=size, case=label, ttft_s=miss, cached=cached, connector_s=spent))
        for name, label in HITS + ((("audit", "kvstore hit: in-process, audited"),) if "audit" in results else ()):
            hit, cached, spent = results[name]["rows"][key]["hit"]
            own = results[name]["rows"][key].get("own_hit")
            rows.append(dict(size=size, case=label, ttft_s=hit, cached=cached, connector_s=spent,
                             vs_own_hit=hit / own[0] if own else None))
            if name == "audit":
                rows[-1]["vs_unaudited_hit"] = results["audit"]["rows"][key]["audited_vs_unaudited"]
        for row in rows[-8 - ("audit" in results):]:
            row["vs_full"] = row["ttft_s"] / full
            row["vs_vllm_hit"] = row["ttft_s"] / vllm_hit
    return rows


def judge_targets(table: list[dict[str, Any]], results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of TARGETS against the figures it covers: {target, limit, values, met}."""
    def values(case: str, key: str, sizes: Any = None) -> list[float]:
        return [row[key] for row in table if row["case"] == case and (sizes is None or row["size"] in sizes)
                and row.get(key) is not None]

    from_2k = {row["size"] for row in table if row["size"] >= 2048}
    # Each prompt's connector work with nothing to hit, then every hook's time in a 512-token prefill.
    misses = [sum(row["connector_s"].values()) / row["ttft_s"] for row in table
              if row["case"].endswith("nothing to hit")] + [results["inproc"]["connector_share_of_prefill"]]
    figures = {"hit_vs_own_hit": [v for case in MEMORY_HITS for v in values(case, "vs_own_hit")],
               "hit_vs_full_from_2k": [v for case in MEMORY_HITS for v in values(case, "vs_full", from_2k)],
               "tcp_hit_vs_own_hit_2k": values("kvstore hit: sidecar, TCP", "vs_own_hit", {2048}),
               "miss_work_share_of_prefill": misses,
               "hooks_share_of_decode_step": [x for x in [results["inproc"]["connector_share_of_decode_step"]]
                                              if x is not None],
               "audited_hit_vs_hit_2k": values("kvstore hit: in-process, audited", "vs_unaudited_hit", {2048})}
    return [dict(target=name, limit=limit, values=figures[name], met=all(v <= limit for v in figures[name]))
            for name, limit in TARGETS.items() if figures[name]]


def print_table(table: list[dict[str, Any]], results: dict[str, Any]) -> None:
    print(f"{'tokens':>6}  {'case':<38} {'cached':>6} {'TTFT ms':>9} {'/ full':>7} {'/ vLLM hit':>10} "
          f"{'/ own hit':>9}  connector ms: lookup fetch scatter gather store")
    print("(/ own hit: against the same engine's own prefix-cache hit of the prompt, taken in turns with the store's)")
    for row in table:
        spent = row.get("connector_s") or {}
        split = " ".join(f"{spent.get(k, 0) * 1e3:.1f}"
                         for k in ("lookup_s", "fetch_s", "scatter_s", "gather_s", "store_s"))
        own = f"{row['vs_own_hit']:.2f}" if row.get("vs_own_hit") else ""
        print(f"{row['size']:>6}  {row['case']:<38} {row['cached']:>6} {row['ttft_s'] * 1e3:>9.1f} "
              f"{row['vs_full']:>7.3f} {row['vs_vllm_hit']:>10.2f} {own:>9}  {split if spent else ''}")
    if "audit" in results:
        ratios = ", ".join(f"{r['size']}: {r['vs_unaudited_hit']:.3f}" for r in table if r.get("vs_unaudited_hit"))
        print(f"audited engine: {results['audit']['audits']} (its audited turns); audited hit / unaudited hit "
              f"(one engine, the median over pairs taken in turns): {ratios}")
    base, with_connector = results["baseline"]["decode_tokens_per_s"], results["inproc"]["decode_tokens_per_s"]
    inproc = results["inproc"]
    if base is None or with_connector is None or inproc["connector_share_of_decode_step"] is None:
        print("decode tokens/s: not resolved (a decode shorter than the prefill's noise); give more --decode-tokens")
    else:
        print(f"decode tokens/s: no connector {base:.1f}, connector on (nothing to hit) {with_connector:.1f} "
              f"({with_connector / base:.3f}x, two engines); the connector's hooks by their timers: "
              f"{inproc['connector_us_per_decode_step']:.0f} us = {inproc['connector_share_of_decode_step']:.2%} "
              f"of a decode step, {inproc['connector_share_of_prefill']:.2%} of a 512-token prefill")
    for size in sorted({row["size"] for row in table}):
        full = next(r for r in table if r["size"] == size and r["case"].startswith("full"))
        for case in ("in-process store, nothing to hit", "sidecar, nothing to hit"):
            miss = next(r for r in table if r["size"] == size and r["case"] == case)
            own = sum(miss["connector_s"].values())
            print(f"{size} tokens, {case}: prefill throughput {full['ttft_s'] / miss['ttft_s']:.3f}x of no connector; "
                  f"the connector's own work {own * 1e3:.0f} ms = {own / miss['ttft_s']:.1%} of its TTFT")


if __name__ == "__main__":
    sys.exit(main())

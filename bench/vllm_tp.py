"""Pages shared across tensor-parallel degrees on the real model: engines at TP=1 and TP=`--tp`
reuse each other's pages and the decode loop's, a rank's failed store leaves nothing served, P/D
runs across degrees, and a cross-degree hit's TTFT is timed. Each engine a fresh process.

    python bench/vllm_tp.py [--tp 3] [--tokens 2048] [--repeats 3] [--skip-pd] [--json out.json]

The steps, checks and figures: docs/vllm.md, "On the real model at TP=3".
"""
from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: an older kvstore there wins

from bench.reliability.rank_fault_connector import FAULT_SALT  # noqa: E402
from bench import engines  # noqa: E402
from bench.engines import REAL_MODEL, Sidecar, greedy, make_engine, parse_or_serve_engine, run_engine, \
    serve_args  # noqa: E402
from bench.prompts import Prompts  # noqa: E402
from bench.report import check, parser as bench_parser, print_checks, write_json  # noqa: E402
from bench.timing import best_of, timed  # noqa: E402
from kvstore.limits import MAX_SALT_BYTES  # noqa: E402

UNSERVED_SALT = "unserved-" + "x" * MAX_SALT_BYTES  # too long for the store: vLLM alone computes it
ANSWER_TOKENS = 16
CHECK_TOKENS = 512  # the prompts that only check answers (the failed rank's, P/D) and the warm-up
TARGETS = {"cross_hit_share_of_pages": 1.0, "fault_pages_served": 0, "hit_over_full_prefill": 0.25,
           "slice_over_whole_fetch": 0.45}


# -- one engine, in its own process ------------------------------------------------------------

def engine_main(job: dict[str, Any]) -> dict[str, Any]:
    """Run `job["steps"]` in order on one engine: each a prompt, its salt, whether vLLM's own
    prefix cache is emptied first, and how many tokens to generate; -> per step the greedy
    tokens, the store's hit (num_cached_tokens) and the seconds taken."""
    llm = make_engine(job, dtype="float32")
    out = []
    for step in job["steps"]:
        if step.get("reset"):
            llm.reset_prefix_cache()
        started = time.perf_counter()
        answer = greedy(llm, [step["tokens"]], step["max_tokens"], [step.get("salt")])[0]
        out.append({"name": step["name"], "seconds": time.perf_counter() - started,
                    "cached": answer.num_cached_tokens, "tokens": list(answer.outputs[0].token_ids)})
    llm.llm_engine.engine_core.shutdown()
    return {"steps": out}


def run_steps(job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`engine_main(job)` in a fresh process (its ranks share the cores): step name -> its
    results (the best time of steps that share a name)."""
    best: dict[str, dict[str, Any]] = {}
    for step in run_engine(job, __file__, VLLM_CPU_OMP_THREADS_BIND="nobind")["steps"]:
        if step["name"] not in best or step["seconds"] < best[step["name"]]["seconds"]:
            best[step["name"]] = step
    return best


def step(name: str, tokens: list[int], *, salt: str | None = None, reset: bool = False,
         max_tokens: int = ANSWER_TOKENS) -> dict[str, Any]:
    return {"name": name, "tokens": tokens, "salt": salt, "reset": reset, "max_tokens": max_tokens}


# -- P/D through the proxy ----------------------------------------------------------------------

async def complete(url: str, model: str, tokens: list[int]) -> list[int]:
    body = {"model": model, "prompt": tokens, "max_tokens": ANSWER_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async with session.post(url + "/v1/completions", json=body) as answer:
            if answer.status != 200:
                raise RuntimeError(f"{url}: {answer.status} {(await answer.text())[:500]}")
            return list((await answer.json())["choices"][0]["token_ids"])


def disaggregated(model: Path, work: Path, store_url: str, producer_tp: int, consumer_tp: int,
                  tokens: list[int], max_model_len: int) -> list[int]:
    """The answer of a kv_producer at `producer_tp` and a kv_consumer at `consumer_tp` behind `kvstore proxy`."""
    with engines.disaggregated(model, store_url, work, max_model_len, producer_tp, consumer_tp, 1800) as url:
        return asyncio.run(complete(url, str(model), tokens))


# -- head slices -------------------------------------------------------------------------------

def slice_fetches(url: str, spec: Any, tokens: int, tp: int, repeats: int = 7) -> dict[str, float]:
    """Best-of seconds of fetching a prompt's whole pages and a 1/`tp` head slice of them, and
    of storing a prompt whole against storing it as `tp` head parts, one after another (a part's
    staging copy is the cost parts add)."""
    import torch

    from kvstore import KVStore, KVStoreClient, StoreConfig

    per_rank = spec.num_kv_heads // tp
    prompt = list(range(7, 7 + tokens))
    kv = torch.randn(spec.kv_shape(tokens), dtype=torch.float32)
    parts = [kv[:, :, :, r * per_rank:(r + 1) * per_rank].contiguous() for r in range(tp)]
    out: dict[str, float] = {}
    with KVStore(StoreConfig(data_dir=None, cpu_bytes=2 * kv.numel() * kv.element_size(), disk_bytes=0)) as store:
        # In-process, into a reused buffer: the copies alone, without a sidecar's per-request work.
        store.register_model("slices", spec)
        store.store("slices", prompt, kv)
        into = torch.empty(kv.numel() * kv.element_size(), dtype=torch.uint8)
        for name, heads in (("whole", None), ("slice", (0, per_rank))):
            out[f"inproc_{name}_s"] = best_of(lambda: store.fetch("slices", prompt, heads=heads, into=into),
                                              3 * repeats)
    for transport, shm in (("shm", None), ("tcp", 0)):
        with KVStoreClient(url, shared_memory_bytes=shm, timeout_s=120) as client:
            client.register_model("slices", spec)
            stores: dict[str, list[float]] = {"whole": [], "parts": []}
            for i in range(repeats):
                fresh = [1000 + i + (transport == "tcp") * 500] + prompt[1:]  # a prompt no store holds
                stores["whole"].append(timed(lambda: client.store("slices", fresh, kv)))
                fresh[0] += 100
                stores["parts"].append(timed(lambda: [client.store("slices", fresh, part, heads=(r * per_rank,
                                       (r + 1) * per_rank)) for r, part in enumerate(parts)]))
                assert client.lookup("slices", fresh).matched_tokens == tokens
            out[f"{transport}_store_whole_s"], out[f"{transport}_store_parts_s"] = (min(stores["whole"]),
                                                                                    min(stores["parts"]))
            client.store("slices", prompt, kv)
            for name, heads in (("whole", None), ("slice", (0, per_rank))):
                times = []
                for _ in range(repeats):
                    started = time.perf_counter()
                    got = client.fetch("slices", prompt, heads=heads)
                    times.append(time.perf_counter() - started)
                    assert got.matched_tokens == tokens
                    del got
                out[f"{transport}_{name}_s"] = min(times)
    return out


# -- the run -----------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, with_json=False)
    parser.add_argument("--tp", type=int, default=3, help="the tensor-parallel degree next to TP=1")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the prompts timed and reused")
    parser.add_argument("--repeats", type=int, default=3, help="runs per hit measurement (best of)")
    parser.add_argument("--skip-pd", action="store_true", help="leave out the P/D deployments (4 engine servers)")
    parser.add_argument("--slices-only", action="store_true",
                        help="only the head-slice fetches and part stores (no engine; seconds, not minutes)")
    args = parse_or_serve_engine(parser, argv, engine_main)
    if args is None:
        return 0
    from kvstore import KVStoreClient
    from kvstore.decode.engine import generate
    from kvstore.decode.loader import load_checkpoint
    from kvstore.decode.model_pull import pull
    from kvstore.integrations.vllm_model import rank_heads

    directory = pull(REAL_MODEL)
    model = load_checkpoint(directory, name=directory.name)
    spec = model.spec
    rank_heads(spec.num_kv_heads, args.tp, 0)  # refuses a degree vLLM would refuse, before any engine starts
    if args.slices_only:
        with tempfile.TemporaryDirectory(prefix="vllm-tp-") as tmp, \
                Sidecar(Path(tmp) / "sidecar", serve_args("1GiB")) as sidecar:
            results = {"tp": args.tp, "tokens": args.tokens,
                       "slices": slice_fetches(sidecar.url, spec, args.tokens, args.tp)}
        checks = judge_slices(results)
        print_slices(results, checks)
        write_json(args.json, {"results": results, "targets": TARGETS, "checks": checks})
        return 0 if all(c["met"] for c in checks) else 1
    prompt = Prompts(str(directory), 0, True)
    a, b = (prompt(args.tokens, salt=s) for s in (1, 2))
    c, d, fault = (prompt(CHECK_TOKENS, salt=s) for s in (3, 4, 5))
    max_model_len = max(args.tokens, CHECK_TOKENS) + 256
    base = dict(model=str(directory), max_model_len=max_model_len, kv_cache_bytes=max(1 << 30, 6 * spec.bytes_per_token
                                                                                      * max_model_len))
    results: dict[str, Any] = {"tp": args.tp, "tokens": args.tokens}
    whole_pages = (args.tokens - 1) // 32 * 32  # vLLM loads whole blocks, the last prompt token recomputed
    with tempfile.TemporaryDirectory(prefix="vllm-tp-") as tmp, \
            tqdm(total=7 if not args.skip_pd else 5, desc="vllm_tp", unit="step", file=sys.stderr) as bar, \
            Sidecar(Path(tmp) / "sidecar", serve_args("1GiB")) as sidecar:
        root, url = Path(tmp), sidecar.url
        extra = {"url": url, "timeout_s": 120}
        results["tp1_stores"] = run_steps(dict(base, tp=1, extra=extra, steps=[step("a", a)]))
        bar.update()
        steps = [step("warmup", d, salt=UNSERVED_SALT, max_tokens=1),
                 step("full", a, salt=UNSERVED_SALT, max_tokens=1)]
        steps += [step("own_hit", a, salt=UNSERVED_SALT, max_tokens=1) for _ in range(args.repeats)]
        steps += [step("store_hit", a, reset=True, max_tokens=1) for _ in range(args.repeats)]
        steps += [step("a_hit_answer", a, reset=True), step("a_full_answer", a, salt=UNSERVED_SALT),
                  step("b", b), step("fault", fault, salt=FAULT_SALT),
                  # vLLM's own cache emptied: a hit here could only be the store's
                  step("fault_again", fault, salt=FAULT_SALT, reset=True)]
        results["tpn"] = run_steps(dict(base, tp=args.tp, extra=extra, steps=steps,
                                         connector_module="bench.reliability.rank_fault_connector"))
        bar.update()
        with KVStoreClient(url, timeout_s=120) as client:
            results["fault_lookup"] = client.lookup(directory.name, fault, salt=FAULT_SALT).matched_tokens
            results["fault_partial_pages"] = client.stats()["partial_pages"]
            results["b_lookup"] = client.lookup(directory.name, b).matched_tokens
            results["tp1_loads"] = run_steps(dict(base, tp=1, extra=extra, steps=[
                step("b_hit", b), step("b_full", b, salt=UNSERVED_SALT)]))
            bar.update()
            warm = generate(model, b, ANSWER_TOKENS, client, store=False, stop_token_ids=())
            cold = generate(model, b, ANSWER_TOKENS, None, stop_token_ids=())
            results["decode_loop"] = {"reused": warm.reused_tokens, "same": warm.tokens == cold.tokens,
                                      "tokens": warm.tokens, "cold_tokens": cold.tokens}
        bar.update()
        if not args.skip_pd:
            reference = run_steps(dict(base, tp=1, extra=None, steps=[step("c", c)]))["c"]["tokens"]
            results["pd"] = {"reference": reference}
            for producer, consumer in ((1, args.tp), (args.tp, 1)):
                results["pd"][f"tp{producer}->tp{consumer}"] = disaggregated(
                    directory, root, url, producer, consumer, c if producer == 1 else list(reversed(c)),
                    max_model_len)
                bar.update()
            results["pd"]["reference_reversed"] = run_steps(dict(base, tp=1, extra=None, steps=[
                step("c", list(reversed(c)))]))["c"]["tokens"]
        results["slices"] = slice_fetches(url, spec, args.tokens, args.tp)
        bar.update()
    checks = judge(results, whole_pages)
    print_table(results, checks)
    write_json(args.json, {"results": results, "targets": TARGETS, "checks": checks})
    return 0 if all(c["met"] for c in checks) else 1


def judge(results: dict[str, Any], whole_pages: int) -> list[dict[str, Any]]:
    tpn, tp1, share, n = results["tpn"], results["tp1_loads"], TARGETS["cross_hit_share_of_pages"], results["tp"]
    fault_served = results["fault_lookup"] + tpn["fault_again"]["cached"]
    checks = [
        check("TP=n loads TP=1's pages: share of the whole pages", tpn["store_hit"]["cached"] / whole_pages, share,
              tpn["store_hit"]["cached"] == whole_pages),
        check("TP=1 loads TP=n's pages: share of the whole pages", tp1["b_hit"]["cached"] / whole_pages, share,
              tp1["b_hit"]["cached"] == whole_pages),
        check("pages of the failed rank's prompt served", fault_served, 0),
        check("TP=n store hit / full prefill (TTFT)", tpn["store_hit"]["seconds"] / tpn["full"]["seconds"],
              TARGETS["hit_over_full_prefill"]),
        *judge_slices(results)]
    same = [("TP=n: store hit's answer == its full prefill's",
             tpn["a_hit_answer"]["tokens"] == tpn["a_full_answer"]["tokens"]),
            ("TP=n: the failed rank's prompt, recomputed, answers the same", tpn["fault"]["tokens"]
             == tpn["fault_again"]["tokens"]),
            ("TP=1: store hit's answer == its full prefill's", tp1["b_hit"]["tokens"] == tp1["b_full"]["tokens"]),
            ("decode loop: from TP=n's pages == without the store", results["decode_loop"]["same"])]
    if "pd" in results:
        pd = results["pd"]
        same += [(f"P/D TP=1 -> TP={n} == one engine", pd[f"tp1->tp{n}"] == pd["reference"]),
                 (f"P/D TP={n} -> TP=1 == one engine", pd[f"tp{n}->tp1"] == pd["reference_reversed"])]
    return checks + [check(name, bool(ok), True, bool(ok)) for name, ok in same]


def judge_slices(results: dict[str, Any]) -> list[dict[str, Any]]:
    return [check(f"1/{results['tp']} head slice / whole pages fetch ({transport})",
                  results["slices"][f"{transport}_slice_s"] / results["slices"][f"{transport}_whole_s"],
                  TARGETS["slice_over_whole_fetch"]) for transport in ("inproc", "shm", "tcp")]


def print_slices(results: dict[str, Any], checks: list[dict[str, Any]]) -> None:
    s, n = results["slices"], results["tp"]
    print(f"SmolLM2-135M-Instruct's KV (float32), {results['tokens']} tokens, through a sidecar:")
    print(f"fetch of the whole pages / a 1/{n} head slice: in-process {1e3 * s['inproc_whole_s']:.1f} / "
          f"{1e3 * s['inproc_slice_s']:.1f} ms, shared memory {1e3 * s['shm_whole_s']:.1f} / "
          f"{1e3 * s['shm_slice_s']:.1f} ms, TCP {1e3 * s['tcp_whole_s']:.1f} / {1e3 * s['tcp_slice_s']:.1f} ms")
    print(f"store of the whole pages / as {n} head parts: shared memory {1e3 * s['shm_store_whole_s']:.1f} / "
          f"{1e3 * s['shm_store_parts_s']:.1f} ms, TCP {1e3 * s['tcp_store_whole_s']:.1f} / "
          f"{1e3 * s['tcp_store_parts_s']:.1f} ms")
    print_checks(checks)


def print_table(results: dict[str, Any], checks: list[dict[str, Any]]) -> None:
    tpn, n = results["tpn"], results["tp"]
    print(f"SmolLM2-135M-Instruct, float32, {results['tokens']}-token prompts; TP=1 and TP={n}")
    print(f"TP={n} TTFT: full prefill {tpn['full']['seconds']:.2f} s, own prefix-cache hit "
          f"{tpn['own_hit']['seconds']:.3f} s, store hit of TP=1's pages {tpn['store_hit']['seconds']:.3f} s "
          f"({tpn['store_hit']['cached']} tokens loaded); hit / full "
          f"{tpn['store_hit']['seconds'] / tpn['full']['seconds']:.3f}, hit / own hit "
          f"{tpn['store_hit']['seconds'] / tpn['own_hit']['seconds']:.2f}")
    print_slices(results, [])
    print(f"the failed rank's prompt: {results['fault_partial_pages']['pages']} pages waiting for their other "
          f"parts, {results['fault_lookup']} tokens served")
    print_checks(checks)


if __name__ == "__main__":
    sys.exit(main())

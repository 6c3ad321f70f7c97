"""Disaggregated serving through the store (`kvstore serve`, a kv_producer, a kv_consumer, `kvstore
proxy`) against one vLLM engine serving the same mix of streaming decoders and long prompts: the
decoders' time per token alone and while the prompts arrive, and the prompts' TTFT.

    python bench/disagg.py [--decode-tokens 48] [--json out.json]

The mix, the deployments and the figures: docs/disaggregation.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: an older kvstore there wins

from bench import engines  # noqa: E402
from bench.engines import EngineServer, Sidecar, serve_args  # noqa: E402
from bench.prompts import documentation_sections  # noqa: E402
from bench.report import markdown_table, parser as bench_parser, write_json  # noqa: E402
from kvstore.decode.model_pull import pull  # noqa: E402

LONG_ANSWER_TOKENS = 16
LONG_PROMPTS, LONG_TOKENS = 4, 1800
DECODERS = 3
ALONE_S = 4.0  # decoding alone, once every decoder is past its prefill


def long_prompts(model_dir: Path, count: int, tokens: int) -> list[list[dict[str, str]]]:
    """`count` distinct system prompts of about `tokens` tokens of real text, and a question."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = "\n\n".join(sorted(documentation_sections(), key=len, reverse=True))
    ids = tokenizer.encode(text)
    prompts = []
    for i in range(count):
        start = i * tokens
        system = tokenizer.decode(ids[start:start + tokens])
        prompts.append([{"role": "system", "content": system},
                        {"role": "user", "content": "Summarise the first paragraph in one sentence."}])
    return prompts


def short_prompts(count: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"Write a long story about a lighthouse keeper number {i}."}]
            for i in range(count)]


async def stream(session: aiohttp.ClientSession, url: str, model: str, messages, max_tokens: int,
                 times: list[float] | None = None) -> dict[str, Any]:
    """Arrival times of each streamed chunk (perf_counter), filled into `times` as they come."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    started = time.perf_counter()
    times = [] if times is None else times
    async with session.post(url + "/v1/chat/completions", json=body) as answer:
        if answer.status != 200:
            raise RuntimeError(f"{url}: {answer.status} {(await answer.text())[:500]}")
        async for line in answer.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                chunk = json.loads(line[len(b"data: "):])
                if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                    times.append(time.perf_counter())
    return {"started": started, "times": times}


async def run_mix(url: str, model: str, args: argparse.Namespace, longs, shorts) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await stream(session, url, model, short_prompts(1)[0], 4)  # warm-up: the first batch's one-time costs
        arrivals: list[list[float]] = [[] for _ in shorts]
        decoders = [asyncio.create_task(stream(session, url, model, m, args.decode_tokens, times))
                    for m, times in zip(shorts, arrivals)]
        while min(len(times) for times in arrivals) < 2:  # every decoder past its prefill
            await asyncio.sleep(0.05)
        await asyncio.sleep(ALONE_S)
        load_began = time.perf_counter()
        long_results = []
        for messages in longs:
            long_results.append(await stream(session, url, model, messages, LONG_ANSWER_TOKENS))
        load_ended = time.perf_counter()
        decoded = await asyncio.gather(*decoders)
    alone, loaded = [], []
    for d in decoded:
        for before, after in zip(d["times"], d["times"][1:]):
            gap = after - before
            (loaded if load_began <= after <= load_ended else alone if after < load_began else []).append(gap)
    return {
        "tpot_alone_ms": 1000 * statistics.mean(alone) if alone else None,
        "tpot_under_prefill_ms": 1000 * statistics.mean(loaded) if loaded else None,
        "decode_gaps_measured": [len(alone), len(loaded)],
        "long_ttft_ms": [1000 * (r["times"][0] - r["started"]) for r in long_results if r["times"]],
        "long_total_ms": [1000 * (r["times"][-1] - r["started"]) for r in long_results if r["times"]],
    }


def one_engine(model: Path, work: Path, args, longs, shorts) -> dict[str, Any]:
    engine = EngineServer(model, None, None, work / "single.log", max_model_len=LONG_TOKENS + 512).start()
    try:
        engine.wait_ready()
        return asyncio.run(run_mix(engine.url, str(model), args, longs, shorts))
    finally:
        engine.kill()


def disaggregated(model: Path, work: Path, args, longs, shorts) -> dict[str, Any]:
    with Sidecar(work / "sidecar", serve_args("2GiB")) as sidecar, \
            engines.disaggregated(model, sidecar.url, work, LONG_TOKENS + 512) as url:
        return asyncio.run(run_mix(url, str(model), args, longs, shorts))


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--decode-tokens", type=int, default=48)
    args = parser.parse_args()
    if args.decode_tokens < 1:
        parser.error("--decode-tokens must be >= 1")
    model = pull("smollm2")
    longs = long_prompts(model, LONG_PROMPTS, LONG_TOKENS)
    shorts = short_prompts(DECODERS)
    config = {"long_tokens": LONG_TOKENS, "long_prompts": LONG_PROMPTS, "decoders": DECODERS,
              "decode_tokens": args.decode_tokens, "alone_s": ALONE_S}
    results: dict[str, Any] = {"config": config}
    with tempfile.TemporaryDirectory(prefix="kvstore-disagg-") as tmp, \
            tqdm(total=2, desc="disagg", unit="deployment", file=sys.stderr) as bar:
        for name, run in (("one engine", one_engine), ("disagg", disaggregated)):
            results[name] = run(model, Path(tmp), args, longs, shorts)
            bar.update()

    def ms(value: float | None) -> str:
        return f"{value:.1f} ms" if value is not None else "-"

    rows = [[name, ms(r["tpot_alone_ms"]), ms(r["tpot_under_prefill_ms"]), ms(statistics.median(r["long_ttft_ms"])),
             ms(statistics.median(r["long_total_ms"]))] for name, r in results.items() if name != "config"]
    print(markdown_table(["deployment", "decoders' time per token, alone", "while the long prompts arrive",
                          "long prompts' TTFT, median", "long prompts' total, median"], rows))
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

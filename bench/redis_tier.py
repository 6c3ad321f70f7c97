"""Redis tier throughput: a 2 MiB page fetched through a Redis-only store against a raw redis-py GET,
and a multi-page fetch pipelined against page by page, each pair interleaved in one run.

    python bench/redis_tier.py [--pages 32] [--repeat 9] [--redis-url redis://...] [--json out.json]

docs/redis.md, "Measurements".
"""
from __future__ import annotations

import sys
from pathlib import Path
import tempfile
from typing import Callable

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: an older kvstore there wins

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import kvstore.tier_stack  # noqa: E402
from bench import timing  # noqa: E402
from bench.engines import RedisServer  # noqa: E402
from bench.report import parser as bench_parser, write_json  # noqa: E402
import kvstore.tiers.redis  # noqa: E402
from kvstore import KVStore, ModelSpec, StoreConfig  # noqa: E402
from kvstore.keys import namespace_key, prefix_keys  # noqa: E402
from kvstore.tiers.redis_conn import make_client  # noqa: E402
from kvstore.tiers.redis_reader import pipelined_gets  # noqa: E402

# 32 layers x 8 KV heads x 128 dims x fp16 x 16 tokens = a 2 MiB page (Llama-3-8B's shape).
SPEC_2MIB = ModelSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", page_size=16)
# A small model's 16-token page (64 KiB): round trips, not bytes, dominate its fetch.
SPEC_64KIB = ModelSpec(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16", page_size=16)
PREFIX = "bench:"


def interleaved(subject: Callable[[], object], baseline: Callable[[], object], repeat: int, bar: tqdm) -> dict:
    """bench/timing.py's `interleaved`, one baseline, a step of the bar a round."""
    return timing.interleaved(subject, [baseline], repeat, bar.update)


def stored_prompt(store: KVStore, spec: ModelSpec, pages: int,
                  seed: int) -> tuple[list[int], torch.Tensor, list[bytes]]:
    """Store `pages` pages through the store, wait for Redis to hold them, fetch once (the index
    then knows them: later fetches are steady-state Redis reads). Returns tokens, KV, Redis keys."""
    n = pages * spec.page_size
    tokens = list(range(seed * 10**6, seed * 10**6 + n))
    kv = torch.randn(spec.kv_shape(n), generator=torch.Generator().manual_seed(seed)).half()  # (L, 2, T, H, D)
    store.store("m", tokens, kv)
    store.flush(60)
    assert torch.equal(store.fetch("m", tokens).kv, kv), "the Redis tier returned other bytes"
    keys = [PREFIX.encode() + k for k in prefix_keys(namespace_key("m", spec.fingerprint), tokens, spec.page_size)]
    return tokens, kv, keys


def bench_spec(url: str, spec: ModelSpec, pages: int, repeat: int, bar: tqdm) -> dict:
    config = StoreConfig(data_dir=None, cpu_bytes=0, disk_bytes=0, redis_url=url, redis_key_prefix=PREFIX,
                         redis_timeout_s=30)
    raw = make_client(url, 30)  # the same socket settings as the tier, without the tier
    out: dict = {"page_bytes": spec.page_bytes, "pages": pages}
    with KVStore(config) as store:
        store.register_model("m", spec)
        one, _, one_keys = stored_prompt(store, spec, 1, seed=1)
        out["one_page"] = interleaved(lambda: store.fetch("m", one), lambda: raw.get(one_keys[0]), repeat, bar)
        out["one_page"]["rounds"] = repeat
        many, _, keys = stored_prompt(store, spec, pages, seed=2)
        out["pipelined_vs_raw_gets"] = interleaved(lambda: store.fetch("m", many),
                                                   lambda: [raw.get(k) for k in keys], repeat, bar)

        def raw_pipeline() -> list:
            pipe = raw.pipeline(transaction=False)
            for k in keys:
                pipe.get(k)
            return pipe.execute()

        out["pipelined_vs_raw_pipeline"] = interleaved(lambda: store.fetch("m", many), raw_pipeline, repeat, bar)
        batch, ahead = kvstore.tier_stack.READ_BATCH_BYTES, kvstore.tiers.redis.READ_AHEAD

        def page_by_page() -> None:
            # One page per round trip, none ahead: the same code path, unpipelined.
            kvstore.tier_stack.READ_BATCH_BYTES, kvstore.tiers.redis.READ_AHEAD = 1, 1
            try:
                store.fetch("m", many)
            finally:
                kvstore.tier_stack.READ_BATCH_BYTES, kvstore.tiers.redis.READ_AHEAD = batch, ahead

        out["pipelined_vs_page_by_page"] = interleaved(lambda: store.fetch("m", many), page_by_page, repeat, bar)

        # The same two read patterns on the wire alone (no store, no decode, no output tensor):
        # what pipelining can gain at most when the pages' bytes, not round trips, are the cost.
        per_batch = -(-batch // spec.page_bytes)
        batches = [keys[i:i + per_batch] for i in range(0, len(keys), per_batch)]
        out["wire_pipelined_vs_one_by_one"] = interleaved(
            lambda: list(pipelined_gets(raw.connection_pool, batches, None, ahead)),
            lambda: list(pipelined_gets(raw.connection_pool, [[k] for k in keys], None, 1)), repeat, bar)
    raw.close()
    return out


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--pages", type=int, default=32, help="pages per multi-page fetch")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--redis-url", help="an existing Redis (default: start a redis-server here)")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-redis-") as tmp:
        try:
            server = None if args.redis_url else RedisServer(tmp).start()
        except RuntimeError as e:
            sys.exit(f"{e}, or pass --redis-url")
        try:
            with tqdm(total=2 * 5 * args.repeat, desc="redis tier", unit="run") as bar:
                for name, spec in (("2MiB", SPEC_2MIB), ("64KiB", SPEC_64KIB)):
                    results[name] = bench_spec(args.redis_url or server.url, spec, args.pages, args.repeat, bar)
        finally:
            if server is not None:
                server.stop()
    for name, r in results.items():
        mb = r["page_bytes"] / 1e6
        one = r["one_page"]
        print(f"{name} page fetch: tier {one['subject_s'] * 1e3:.2f} ms ({mb / one['subject_s']:.0f} MB/s), "
              f"raw GET {one['baseline_s'] * 1e3:.2f} ms -> {one['ratio']:.2f}x raw ({one['rounds']} rounds)")
        total = mb * r["pages"]
        for key, label in (("pipelined_vs_page_by_page", "page-by-page tier fetch"),
                           ("pipelined_vs_raw_gets", "raw GET per page"),
                           ("pipelined_vs_raw_pipeline", "raw pipelined GETs")):
            c = r[key]
            print(f"{name} x{r['pages']} fetch: pipelined {c['subject_s'] * 1e3:.1f} ms "
                  f"({total / c['subject_s']:.0f} MB/s) vs {label} {c['baseline_s'] * 1e3:.1f} ms -> {c['ratio']:.2f}x")
        w = r["wire_pipelined_vs_one_by_one"]
        print(f"{name} x{r['pages']} wire only (tier's reader, no decode): pipelined {w['subject_s'] * 1e3:.1f} ms "
              f"({total / w['subject_s']:.0f} MB/s) vs one GET per round trip {w['baseline_s'] * 1e3:.1f} ms "
              f"({total / w['baseline_s']:.0f} MB/s) -> {w['ratio']:.2f}x")
    write_json(args.json, results)


if __name__ == "__main__":
    main()

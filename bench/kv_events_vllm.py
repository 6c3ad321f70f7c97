"""A real vLLM engine with kvstore as its connector and KV events on: the connector's events reach
vLLM's subscribers in vLLM's own stream beside its GPU events, each connector block ("CPU") one
vLLM reported on the GPU under the same hash. Not part of `make test` (an engine start is slow).

    python bench/kv_events_vllm.py [--model DIR] [--prompts 3] [--prompt-tokens 200]

docs/kv_events.md says what it shows.
"""
from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: an older kvstore there wins

from bench.engines import BLOCK, checkpoint, greedy, make_engine  # noqa: E402
from bench.report import parser as bench_parser, write_json  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the pulled smollm2)")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import msgspec
    import zmq
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    model = args.model or str(checkpoint(False, Path()))
    with tempfile.TemporaryDirectory() as tmp:
        endpoint = f"ipc://{tmp}/kv-events"
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        store = {"data_dir": f"{tmp}/store", "cpu_bytes": "256MiB", "disk_bytes": 0, "page_size": BLOCK}
        events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv")
        t0 = time.perf_counter()
        llm = make_engine({"model": model, "max_model_len": 2048, "kv_cache_bytes": 256 << 20, "extra": store},
                          kv_events_config=events_config, dtype="float32", enable_prefix_caching=True)
        started_s = time.perf_counter() - t0
        sub.connect(endpoint)
        time.sleep(0.2)  # ZeroMQ's slow joiner
        rng = random.Random(0)
        for _ in range(args.prompts):
            greedy(llm, [[rng.randrange(100, 20000) for _ in range(args.prompt_tokens)]], 4)
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        stored: dict[str, set] = {}
        removed: dict[str, int] = {}
        batches = 0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if not sub.poll(200):
                if batches:
                    break
                continue
            _, _, payload = sub.recv_multipart()
            batches += 1
            for event in decoder.decode(payload).events:
                if isinstance(event, BlockStored):
                    stored.setdefault(str(event.medium), set()).update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    removed[str(event.medium)] = removed.get(str(event.medium), 0) + len(event.block_hashes)
        llm.llm_engine.engine_core.shutdown()
        sub.close(linger=0)
    store_blocks, gpu_blocks = stored.get("CPU", set()), stored.get("GPU", set())
    result = {"engine_start_s": round(started_s, 1), "batches": batches,
              "stored_blocks": {m: len(b) for m, b in stored.items()}, "removed_blocks": removed,
              "store_blocks_seen_on_gpu": len(store_blocks & gpu_blocks),
              "every_store_block_is_a_gpu_block": bool(store_blocks) and store_blocks <= gpu_blocks}
    print(json.dumps(result))
    write_json(args.json, result)
    return 0 if result["every_store_block_is_a_gpu_block"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Cost of a lookup miss, a partial hit and a tail-page store as the store fills with prompts that
all begin with BOS, per store size, and the ratio to the smallest size (flat: no growth).

    python bench/prefix_scale.py [--sizes 1000,10000,50000] [--json out.json]

`PYTHONPATH=<older copy>` measures older code.
"""
from __future__ import annotations

import os
import random
import sys
from pathlib import Path
import tempfile

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: an older kvstore there wins

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench.report import markdown_table, parser as bench_parser, write_json  # noqa: E402
from bench.timing import per_call_us  # noqa: E402
from kvstore import KVStore, ModelSpec, StoreConfig  # noqa: E402

SPEC = ModelSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", page_size=16)
BOS = 1
PROMPT_TOKENS = 40
CALLS = 200  # timed per repeat; --repeat scales the sample


def prompt(rng: random.Random) -> list[int]:
    return [BOS] + [rng.randrange(2, 50_000) for _ in range(PROMPT_TOKENS - 1)]


def measure(size: int, calls: int, repeat: int, rng: random.Random) -> dict[str, float]:
    kv = torch.zeros(SPEC.kv_shape(PROMPT_TOKENS), dtype=torch.float16)
    with tempfile.TemporaryDirectory() as data_dir, \
            KVStore(StoreConfig(data_dir=data_dir, cpu_bytes=1 << 30, disk_bytes=0)) as store:
        store.register_model("m", SPEC)
        stored = []
        for _ in tqdm(range(size), desc=f"fill {size}", leave=False):
            stored.append(prompt(rng))
            store.store("m", stored[-1], kv)
        misses = [prompt(rng) for _ in range(calls * repeat)]
        hits = [rng.choice(stored)[:20] + prompt(rng)[20:] for _ in range(calls * repeat)]
        fresh = [prompt(rng) for _ in range(calls * repeat)]
        return {
            "lookup_miss_us": per_call_us(lambda i: store.lookup("m", misses[i]), calls, repeat),
            "lookup_partial_hit_us": per_call_us(lambda i: store.lookup("m", hits[i]), calls, repeat),
            "store_new_prompt_us": per_call_us(lambda i: store.store("m", fresh[i], kv), calls, repeat),
        }


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--sizes", default="1000,10000,50000", help="prompts stored before timing")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rng = random.Random(0)
    rows = {size: measure(size, CALLS, args.repeat, rng) for size in tqdm(sizes, desc="sizes")}
    first = rows[sizes[0]]
    print(f"kvstore from {os.path.dirname(sys.modules['kvstore'].__file__)}")
    print(markdown_table(["prompts stored (all BOS-led)", "lookup miss µs", "lookup, 20-token hit µs",
                          "store of a new prompt µs"],
                         ([f"{size:,}", *(f"{row[k]:.1f} ({row[k] / first[k]:.2f}×)" for k in first)]
                          for size, row in rows.items())))
    write_json(args.json, {"sizes": sizes, "rows": {str(k): v for k, v in rows.items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

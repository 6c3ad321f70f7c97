"""Eviction benchmark: replay Mooncake-format traces through the store's index and policies.

    python bench/eviction.py bench/data/mooncake_synthetic.jsonl --capacities 0.01,0.02,0.05,0.1,0.2 \
        --policies lru,lru-prefix,belady --json bench/out/eviction.json --plot bench/out/eviction.png

Capacities are fractions of the trace's unique blocks (with a dot) or block counts; `--tiers
gpu=0.01,cpu=0.04,disk=0.15` is one multi-tier split. The columns: docs/eviction.md.
"""
from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` and `kvstore` importable
    sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH: an older kvstore there wins

from tqdm import tqdm

from kvstore.config import StoreConfig

from bench.report import markdown_table, parser as bench_parser, pyplot, write_json
from bench.research.belady import BeladyPolicy
from bench.research.policies import BENCH_POLICIES
from bench.research.replay import CompiledTrace, NextUse, ReplayResult, compile_trace, replay
from bench.research.traces import load_trace

BELADY = "belady"
DEFAULT_POLICY: str = next(f.default for f in fields(StoreConfig) if f.name == "policy")  # type: ignore[assignment]


def parse_amount(text: str, unique_blocks: int) -> int:
    """'0.05' -> 5% of the unique blocks; '1200' -> 1200 blocks."""
    value = float(text)
    if value <= 0:
        raise ValueError(f"capacity: expected > 0, got {text}")
    blocks = round(value * unique_blocks) if "." in text or "e" in text.lower() else int(value)
    return max(1, blocks)


def parse_tiers(text: str, unique_blocks: int) -> list[tuple[str, int]]:
    """'gpu=0.01,cpu=0.04' -> [('gpu', n), ('cpu', m)], top tier first."""
    tiers = []
    for part in text.split(","):
        name, _, amount = part.partition("=")
        if not name or not amount:
            raise ValueError(f"--tiers: expected name=capacity[,name=capacity...], got {text!r}")
        tiers.append((name.strip(), parse_amount(amount.strip(), unique_blocks)))
    return tiers


def run_one(trace: CompiledTrace, tiers: list[tuple[str, int]], policy: str, bar: tqdm) -> ReplayResult:
    if policy == BELADY:
        oracle = NextUse()
        return replay(trace, tiers, lambda tier: BeladyPolicy(tier, oracle), oracle, progress=bar)
    return replay(trace, tiers, policy, progress=bar)


def summary_table(results: list[dict], policies: list[str]) -> str:
    """Markdown: hit ratio per policy and capacity, and the share of the lru -> belady gap that
    the default policy closes."""
    by_cap: dict[int, dict[str, float]] = {}
    fraction: dict[int, float] = {}
    for r in results:
        by_cap.setdefault(r["capacity_blocks"], {})[r["policy"]] = r["hit_ratio"]
        fraction[r["capacity_blocks"]] = r["capacity_fraction"]
    gap = "lru" in policies and BELADY in policies and DEFAULT_POLICY in policies
    lines = []
    for cap in sorted(by_cap):
        row = by_cap[cap]
        cells = [f"{row[p]:.4f}" if p in row else "" for p in policies]
        if gap:
            lru, best, ours = row["lru"], row[BELADY], row[DEFAULT_POLICY]
            cells.append(f"{ours / lru:.3f}×" if lru else "")
            cells.append(f"{(ours - lru) / (best - lru):.0%}" if best > lru else "")
        lines.append([f"{fraction[cap]:.1%} ({cap} blocks)", *cells])
    return markdown_table(["capacity", *policies, *([f"{DEFAULT_POLICY} / lru", "gap closed"] if gap else [])], lines)


def plot(results: list[dict], path: str, title: str) -> None:
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(r["policy"] for r in results):
        points = sorted((r["capacity_fraction"], r["hit_ratio"]) for r in results if r["policy"] == policy)
        style = {"linestyle": "--", "color": "black"} if policy == BELADY else {"marker": "o"}
        ax.plot([100 * x for x, _ in points], [y for _, y in points], label=policy, **style)
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity, % of the trace's unique blocks")
    ax.set_ylabel("hit ratio (leading-run blocks)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("traces", nargs="+", help="Mooncake-format JSONL traces")
    parser.add_argument("--capacities", default="0.01,0.02,0.05,0.1,0.2")
    parser.add_argument("--policies", default=",".join([*BENCH_POLICIES, BELADY]),
                        help="store policies, research ones (bench/research/policies.py) and belady")
    parser.add_argument("--tiers", action="append", default=[], help="name=capacity,... (top first); repeatable")
    parser.add_argument("--plot", dest="plot_path", help="write hit ratio vs capacity here (PNG)")
    args = parser.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        if p not in BENCH_POLICIES and p != BELADY:
            parser.error(f"--policies: unknown {p!r}; choose from {', '.join([*BENCH_POLICIES, BELADY])}")
    reports = []
    for path in args.traces:
        trace = compile_trace(Path(path).name, load_trace(path))
        if args.tiers:
            configs = [parse_tiers(t, trace.unique_blocks) for t in args.tiers]
        else:
            configs = [[("cpu", parse_amount(c.strip(), trace.unique_blocks))] for c in args.capacities.split(",")]
        print(f"{trace.name}: {trace.requests} requests, {trace.total_blocks} blocks, "
              f"{trace.unique_blocks} unique")
        results = []
        with tqdm(total=trace.requests * len(configs) * len(policies), unit="req", leave=False,
                  file=sys.stderr) as bar:
            for tiers in configs:
                capacity = sum(n for _, n in tiers)
                for policy in policies:
                    res = run_one(trace, tiers, policy, bar)
                    row = {"policy": policy, "capacity_fraction": capacity / trace.unique_blocks,
                           "capacity_blocks": capacity, "tiers": dict(tiers), "hit_ratio": res.hit_ratio,
                           "tier_hits": res.tier_hits, "prefill_tokens_saved": res.prefill_tokens_saved,
                           "block_ops_per_s": res.total_blocks / res.seconds}
                    results.append(row)
                    per_tier = " ".join(f"{t}={h}" for t, h in res.tier_hits.items())
                    tqdm.write(f"{policy:>12}  capacity {row['capacity_fraction']:6.1%} ({capacity} blocks)  "
                               f"hit {res.hit_ratio:.4f}  tier hits {per_tier}  "
                               f"saved {res.prefill_tokens_saved / 1e6:.2f}M tokens  "
                               f"{row['block_ops_per_s'] / 1e3:.0f}k block ops/s")
        print(summary_table(results, policies))
        reports.append({"trace": trace.name, "requests": trace.requests,
                        "unique_blocks": trace.unique_blocks, "results": results})
    write_json(args.json, reports[0] if len(reports) == 1 else reports)
    if args.plot_path:
        plot(reports[0]["results"], args.plot_path, f"{reports[0]['trace']}: hit ratio vs capacity")


if __name__ == "__main__":
    main()

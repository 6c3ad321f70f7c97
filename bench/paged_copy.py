"""The vLLM connector's copies into and out of vLLM's CPU-backend blocks (SmolLM2-135M-Instruct's
shapes), each against a plain copy of the same bytes. Needs vLLM's CPU build.

    python bench/paged_copy.py [--tokens 1024 2048 4096 8192] [--json FILE]

The rows and figures: docs/performance.md, "The vLLM connector's copy into vLLM's blocks".
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: an older kvstore there wins

import torch  # noqa: E402

from bench.report import parser as bench_parser, write_json  # noqa: E402
from bench.timing import best_of  # noqa: E402
from kvstore.integrations.paged_layout import (BackendWrittenLayout, BlockPermutationLayout,  # noqa: E402
                                               StridedBlockLayout, join_runs, probe_block_order)

LAYERS, HEADS, HEAD_DIM, PAGE, BLOCK = 30, 3, 64, 16, 32


def best_ms(work: Callable[[], None], repeats: int) -> float:
    return best_of(work, repeats, warm_up=True) * 1e3


def strided_copies(layout: StridedBlockLayout, layer: torch.Tensor, block_ids: torch.Tensor,
                   pages: torch.Tensor, joined: torch.Tensor, rows: torch.Tensor) -> None:
    """The torch-only scatter: join, rearrange into block rows with strided copies, write rows."""
    join_runs([(0, pages)], joined)
    n = block_ids.numel()
    for half, view in enumerate(layout._halves_of(rows)):
        view.copy_(joined[half].view(n, BLOCK, HEADS, HEAD_DIM))
    layer.view(layer.shape[0], -1).index_copy_(0, block_ids, rows)


def writer_per_offset(write: Callable[..., None], layer: torch.Tensor, slots_by_offset: list[torch.Tensor],
                      pages: torch.Tensor) -> None:
    """The writer reading the pages where they lie: one call per token offset within a page,
    whose tokens (one a page) are evenly strided, so no join (tried; not what the connector does).
    `slots_by_offset[p]`: the slots of tokens p, p + PAGE, ... (contiguous, as the op reads them)."""
    for p, slots in enumerate(slots_by_offset):
        write(layer, pages[:, 0, p], pages[:, 1, p], slots)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--isa", default="vec", help="the CPU attention kernels' ISA (vec, vec16, amx)")
    args = parser.parse_args(argv)
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        sys.exit("bench/paged_copy.py needs vLLM's CPU build (make install brings it)")

    def write(layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        n, h, b, _ = layer.shape
        key_cache, value_cache = layer.view(n, h, 2 * b, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, args.isa)

    dtype = torch.float32
    order = probe_block_order(write, block_size=BLOCK, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype=dtype,
                              name=args.isa)
    reader = StridedBlockLayout.from_order(args.isa, BLOCK, HEADS, HEAD_DIM, order)
    if reader is None:
        reader = BlockPermutationLayout(args.isa, BLOCK, HEADS, HEAD_DIM, order)
    written = BackendWrittenLayout(reader, write)
    print(f"CPU backend ISA {args.isa}: blocks {reader.name}, {torch.get_num_threads()} torch threads")
    print(f"{'tokens':>7} {'MB':>5} {'memcpy ms':>10} {'strided ms':>11} {'writer ms':>10} {'offsets ms':>11} "
          f"{'answer ms':>10} {'gather ms':>10}  / memcpy: strided writer offsets answer gather")
    results = []
    for T in args.tokens:
        n = T // BLOCK
        pool = [torch.zeros(2 * n + 8, HEADS, BLOCK, 2 * HEAD_DIM, dtype=dtype) for _ in range(LAYERS)]
        block_ids = torch.randperm(2 * n + 8, generator=torch.Generator().manual_seed(T))[:n].sort().values
        pages = torch.randn(T // PAGE, LAYERS, 2, PAGE, HEADS, HEAD_DIM, dtype=dtype)  # a run of tier slots
        runs_of = [[(0, pages[:, i])] for i in range(LAYERS)]
        copy = torch.empty_like(pages)
        joined = torch.empty(2, T, HEADS, HEAD_DIM, dtype=dtype)
        rows = torch.empty(n, pool[0][0].numel(), dtype=dtype)
        saved = torch.empty(LAYERS, 2, T, HEADS, HEAD_DIM, dtype=dtype)
        row = {"tokens": T, "mb": pages.numel() * pages.element_size() / 1e6,
               "memcpy_ms": best_ms(lambda: copy.copy_(pages), args.repeats)}
        if isinstance(reader, StridedBlockLayout):
            row["strided_ms"] = best_ms(lambda: [strided_copies(reader, pool[i], block_ids, pages[:, i], joined, rows)
                                                 for i in range(LAYERS)], args.repeats)
            expected = [layer.clone() for layer in pool]
            for layer in pool:
                layer.zero_()
        row["writer_ms"] = best_ms(lambda: [written.scatter_runs(pool[i], block_ids, runs_of[i])
                                            for i in range(LAYERS)], args.repeats)
        if isinstance(reader, StridedBlockLayout) and not all(map(torch.equal, expected, pool)):
            sys.exit("the two scatters wrote different blocks")
        written_blocks = [layer.clone() for layer in pool]
        for layer in pool:
            layer.zero_()
        slots = written._slots_of(block_ids, pool[0].shape[0])
        by_offset = [slots[p::PAGE].contiguous() for p in range(PAGE)]
        row["per_offset_ms"] = best_ms(lambda: [writer_per_offset(write, pool[i], by_offset, pages[:, i])
                                                for i in range(LAYERS)], args.repeats)
        if not all(map(torch.equal, written_blocks, pool)):
            sys.exit("the per-offset writer wrote different blocks")
        answer = pages.permute(1, 2, 0, 3, 4, 5).reshape(LAYERS, 2, T, HEADS, HEAD_DIM).contiguous()
        for layer in pool:
            layer.zero_()
        row["answer_ms"] = best_ms(lambda: [written.scatter(pool[i], block_ids, answer[i]) for i in range(LAYERS)],
                                   args.repeats)
        if not all(map(torch.equal, written_blocks, pool)):
            sys.exit("the writer from an answer wrote different blocks")
        row["gather_ms"] = best_ms(lambda: [written.gather(pool[i], block_ids, out=saved[i]) for i in range(LAYERS)],
                                   args.repeats)
        if not torch.equal(saved.view(LAYERS, 2, T // PAGE, PAGE, HEADS, HEAD_DIM).permute(2, 0, 1, 3, 4, 5), pages):
            sys.exit("the gather did not read back the scattered KV")
        strided = row.get("strided_ms", float("nan"))
        memcpy = row["memcpy_ms"]
        print(f"{T:>7} {row['mb']:>5.0f} {memcpy:>10.1f} {strided:>11.1f} {row['writer_ms']:>10.1f} "
              f"{row['per_offset_ms']:>11.1f} {row['answer_ms']:>10.1f} {row['gather_ms']:>10.1f}  "
              f"{strided / memcpy:>15.2f} {row['writer_ms'] / memcpy:.2f} {row['per_offset_ms'] / memcpy:.2f} "
              f"{row['answer_ms'] / memcpy:.2f} {row['gather_ms'] / memcpy:.2f}")
        results.append(row)
    write_json(args.json, {"isa": args.isa, "threads": torch.get_num_threads(), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())

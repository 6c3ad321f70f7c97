"""Paged-layout conversion: every layout moves exactly the named blocks, bit for bit, both ways.

The GPU backends' layouts (FlashAttention and FlashInfer: a logical (N, H, B, 2D) view stored
NHD or HND) are checked on CPU tensors of those shapes; the CPU backend's ISA-specific block
arrangement is checked against vLLM's own cache-write op when vLLM is installed."""
from __future__ import annotations

import pytest
import torch

from kvstore.integrations.paged_layout import (BackendWrittenLayout, BlockPermutationLayout, ContentSplitLayout,
                                               StridedBlockLayout, UnsupportedLayout, probe_block_order)
from kvstore.integrations.backend_layouts import layer_index, layout_for

B, H, D, N = 32, 2, 8, 12  # block size, KV heads, head size, blocks in the pool
BLOCKS = torch.tensor([7, 2, 9])


def canonical_kv(num_blocks: int, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, num_blocks * B, H, D), generator=g).to(dtype)  # (2, T, H, D)


def gpu_layer(physical: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(logical (N, H, B, 2D) view, its physical storage) of a FlashAttention/FlashInfer layer."""
    if physical == "NHD":
        storage = torch.zeros((N, B, H, 2 * D), dtype=torch.bfloat16)
        return storage.permute(0, 2, 1, 3), storage
    storage = torch.zeros((N, H, B, 2 * D), dtype=torch.bfloat16)
    return storage, storage


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "FLASHINFER"])
@pytest.mark.parametrize("physical", ["NHD", "HND"])
def test_content_split_layouts_put_k_then_v_of_each_token_where_the_kernels_read_them(backend, physical):
    layer, storage = gpu_layer(physical)
    layout = layout_for(backend, block_size=B, num_kv_heads=H, head_dim=D, dtype=torch.bfloat16,
                        kv_cache_layout=physical)
    assert isinstance(layout, ContentSplitLayout) and layout.name == f"{backend}/{physical}"
    kv = canonical_kv(len(BLOCKS))
    layout.scatter(layer, BLOCKS, kv)
    for n, block in enumerate(BLOCKS.tolist()):
        for t in (0, 5, B - 1):
            for h in range(H):
                # What the kernels read: NHD storage[block, t, h, :D] is K, HND storage[block, h, t, :D].
                cell = storage[block, t, h] if physical == "NHD" else storage[block, h, t]
                assert torch.equal(cell[:D], kv[0, n * B + t, h]) and torch.equal(cell[D:], kv[1, n * B + t, h])
    untouched = [b for b in range(N) if b not in BLOCKS.tolist()]
    assert not storage[untouched].any()
    assert torch.equal(layout.gather(layer, BLOCKS), kv)
    assert torch.equal(layout.gather(layer, BLOCKS[1:]), kv[:, B:])


def test_content_split_layout_refuses_a_layer_of_another_shape():
    layout = layout_for("FLASH_ATTN", block_size=B, num_kv_heads=H, head_dim=D, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedLayout, match="FLASH_ATTN"):
        layout.check(torch.zeros((N, H, B, D)))


def transposed_k_writer(block, key, value, slots):
    """A writer like the CPU backend's 'vec' ISA: per head, K stored (D, B), V stored (B, D)."""
    n, h, b, _ = block.shape
    halves = block.view(n, h, 2 * b, -1)
    for i, slot in enumerate(slots.tolist()):
        blk, off = divmod(slot, b)
        flat_k = halves[blk, :, :b].reshape(h, -1)  # (H, B * D) viewed as (H, D, B)
        flat_k.view(h, -1, b)[:, :, off] = key[i]
        halves[blk, :, b + off] = value[i]


def paired_k_writer(block, key, value, slots):
    """A writer like AMX's VNNI packing: per head, K stored (D / 2, B, 2), V stored (B, D)."""
    n, h, b, _ = block.shape
    halves = block.view(n, h, 2 * b, -1)
    for i, slot in enumerate(slots.tolist()):
        blk, off = divmod(slot, b)
        packed = halves[blk, :, :b].reshape(h, -1).view(h, -1, b, 2)  # (H, D / 2, B, 2)
        packed[:, :, off, :] = key[i].view(h, -1, 2)
        halves[blk, :, b + off] = value[i]


@pytest.mark.parametrize("writer, kind", [(transposed_k_writer, StridedBlockLayout),
                                          (paired_k_writer, BlockPermutationLayout)])
def test_a_probed_block_order_round_trips_exactly_as_the_writer_stores(writer, kind):
    order = probe_block_order(writer, block_size=B, num_kv_heads=H, head_dim=D, dtype=torch.bfloat16, name="test")
    layout = StridedBlockLayout.from_order("test", B, H, D, order) or BlockPermutationLayout("test", B, H, D, order)
    assert isinstance(layout, kind)
    layer = torch.zeros((N, H, B, 2 * D), dtype=torch.bfloat16)
    kv = canonical_kv(len(BLOCKS))
    layout.scatter(layer, BLOCKS, kv)
    expected = torch.zeros_like(layer)  # what the writer itself produces for the same tokens
    slots = (BLOCKS[:, None] * B + torch.arange(B)).reshape(-1)
    writer(expected, kv[0], kv[1], slots)
    assert torch.equal(layer, expected)
    assert torch.equal(layout.gather(expected, BLOCKS), kv)
    assert torch.equal(BlockPermutationLayout("test", B, H, D, order).gather(expected, BLOCKS), kv)


def dropping_writer(block, key, value, slots):
    transposed_k_writer(block, key, value, slots)
    block.view(-1)[3] = 0


def duplicating_writer(block, key, value, slots):
    transposed_k_writer(block, key, value, slots)
    block.view(-1)[3] = block.view(-1)[4]


@pytest.mark.parametrize("writer", [dropping_writer, duplicating_writer])
def test_probe_refuses_a_writer_that_is_not_a_permutation(writer):
    with pytest.raises(UnsupportedLayout, match="probe-me"):
        probe_block_order(writer, block_size=B, num_kv_heads=H, head_dim=D, dtype=torch.bfloat16, name="probe-me")


def test_an_unknown_backend_is_refused_by_name():
    with pytest.raises(UnsupportedLayout, match="TRITON_MLA"):
        layout_for("TRITON_MLA", block_size=B, num_kv_heads=H, head_dim=D, dtype=torch.bfloat16)


def test_layer_names_map_to_store_layers():
    assert layer_index("model.layers.7.self_attn.attn") == 7
    with pytest.raises(UnsupportedLayout, match="lm_head"):
        layer_index("lm_head")


# Scattered blocks, one run of consecutive blocks (what vLLM gives a fresh request), and runs
# of several lengths out of order.
BLOCK_SETS = [BLOCKS, torch.tensor([3, 4, 5, 6]), torch.tensor([1, 2, 10, 11, 5, 6, 7, 0])]


@pytest.mark.parametrize("blocks", BLOCK_SETS, ids=["scattered", "one-run", "runs"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_cpu_backend_layout_matches_vllms_own_cache_write(isa, dtype, blocks):
    ops = pytest.importorskip("vllm._custom_ops", reason="vLLM (CPU build) is not installed")
    head_dim = 32  # the CPU kernels' smallest head size

    def write(block, key, value, slots):
        n, h, b, _ = block.shape
        key_cache, value_cache = block.view(n, h, 2 * b, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

    order = probe_block_order(write, block_size=B, num_kv_heads=H, head_dim=head_dim, dtype=dtype, name=isa)
    strided = StridedBlockLayout.from_order(isa, B, H, head_dim, order)
    readers = [BlockPermutationLayout(isa, B, H, head_dim, order)] + ([strided] if strided else [])
    layouts = readers + [BackendWrittenLayout(reader, write) for reader in readers]
    connector = layout_for("CPU_ATTN", block_size=B, num_kv_heads=H, head_dim=head_dim, dtype=dtype,
                           cpu_writer=lambda: write)
    assert isinstance(connector, BackendWrittenLayout) and connector.name.startswith("CPU_ATTN/")
    layouts.append(connector)
    g = torch.Generator().manual_seed(1)
    kv = torch.randn((2, len(blocks) * B, H, head_dim), generator=g).to(dtype)
    written = torch.zeros((N, H, B, 2 * head_dim), dtype=dtype)
    slots = (blocks[:, None] * B + torch.arange(B)).reshape(-1)
    write(written, kv[0].contiguous(), kv[1].contiguous(), slots)
    for layout in layouts:
        assert torch.equal(layout.gather(written, blocks), kv)
        scattered = torch.zeros_like(written)
        layout.scatter(scattered, blocks, kv)
        assert torch.equal(scattered, written)  # the named blocks, and no other, written
        from_runs = torch.zeros_like(written)  # the same from pages of 16 tokens in two runs that lie apart
        pages = kv.reshape(2, -1, 16, H, head_dim).transpose(0, 1).contiguous()
        layout.scatter_runs(from_runs, blocks, [(0, pages[:1].clone()), (16, pages[1:].clone())])
        assert torch.equal(from_runs, written)


def as_runs(kv: torch.Tensor, cuts: list[int], page_size: int) -> list[tuple[int, torch.Tensor]]:
    """kv (2, T, H, D) cut at the token positions `cuts` into runs of pages (k, 2, P, H, D),
    each run a strided view apart from the others, as an in-process store's pages lie."""
    runs, edges = [], [0, *cuts, kv.shape[1]]
    for lo, hi in zip(edges, edges[1:]):
        k = (hi - lo) // page_size
        apart = kv[:, lo:hi].reshape(2, k, page_size, H, D).transpose(0, 1).contiguous()  # a buffer of its own
        runs.append((lo, apart))
    return runs


@pytest.mark.parametrize("page_size, cuts", [(16, []), (16, [16, 48]), (32, [32]), (8, [8, 24, 72]), (12, [36])],
                         ids=["one-run", "half-blocks", "whole-blocks", "quarter-blocks", "pages-across-blocks"])
@pytest.mark.parametrize("written", [False, True], ids=["copied", "backend-written"])
@pytest.mark.parametrize("writer", [transposed_k_writer, paired_k_writer], ids=["strided", "permuted"])
def test_runs_of_pages_scatter_exactly_as_the_joined_kv(writer, written, page_size, cuts):
    order = probe_block_order(writer, block_size=B, num_kv_heads=H, head_dim=D, dtype=torch.bfloat16, name="test")
    layout = StridedBlockLayout.from_order("test", B, H, D, order) or BlockPermutationLayout("test", B, H, D, order)
    if written:
        layout = BackendWrittenLayout(layout, writer)
    blocks = torch.tensor([7, 2, 9, 3])
    tokens = -(-len(blocks) * B // page_size) * page_size + 2 * page_size  # pages past the blocks: not written
    kv = canonical_kv(1, seed=3).repeat(1, tokens // B + 2, 1, 1)[:, :tokens] + \
        torch.arange(tokens, dtype=torch.bfloat16)[None, :, None, None]
    expected = torch.zeros((N, H, B, 2 * D), dtype=torch.bfloat16)
    layout.scatter(expected, blocks, kv[:, :len(blocks) * B].contiguous())
    got = torch.zeros_like(expected)
    layout.scatter_runs(got, blocks, as_runs(kv, cuts, page_size))
    assert torch.equal(got, expected)


@pytest.mark.parametrize("written", [False, True], ids=["copied", "backend-written"])
def test_runs_that_leave_a_gap_or_end_early_are_refused(written):
    order = probe_block_order(transposed_k_writer, block_size=B, num_kv_heads=H, head_dim=D, dtype=torch.bfloat16,
                              name="test")
    layout = StridedBlockLayout.from_order("test", B, H, D, order)
    if written:
        layout = BackendWrittenLayout(layout, transposed_k_writer)
    kv = canonical_kv(len(BLOCKS))
    layer = torch.zeros((N, H, B, 2 * D), dtype=torch.bfloat16)
    runs = as_runs(kv, [32], 16)
    with pytest.raises(ValueError, match="runs"):
        layout.scatter_runs(layer, BLOCKS, runs[1:])  # the first block's pages missing
    with pytest.raises(ValueError, match="runs"):
        layout.scatter_runs(layer, BLOCKS, runs[:1])  # only the first block
    assert not layer.any()  # nothing written


def test_the_backend_writer_is_never_handed_a_block_outside_the_pool():
    order = probe_block_order(transposed_k_writer, block_size=B, num_kv_heads=H, head_dim=D, dtype=torch.bfloat16,
                              name="test")
    layout = BackendWrittenLayout(StridedBlockLayout.from_order("test", B, H, D, order), transposed_k_writer)
    layer = torch.zeros((N, H, B, 2 * D), dtype=torch.bfloat16)
    kv = canonical_kv(2)
    for bad in ([3, N], [-1, 2]):
        with pytest.raises(ValueError, match="block_ids"):
            layout.scatter(layer, torch.tensor(bad), kv)
        with pytest.raises(ValueError, match="block_ids"):
            layout.scatter_runs(layer, torch.tensor(bad), as_runs(kv, [], 16))
    assert not layer.any()  # nothing written

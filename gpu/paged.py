"""Copy KV between an engine's paged cache and contiguous KV `(L, 2, T, H, D)`, all layers in
one launch (`gather_pages` / `scatter_pages`), each beside its pure-torch reference.

An engine's paged cache is either one tensor `(num_blocks, L, 2, P, H, D)` or per-layer lists
`(k_caches, v_caches)` of `(num_blocks, P, H, D)` tensors (vLLM's per-layer K/V; a vLLM
`(2, num_blocks, P, H, D)` layer tensor is `k = t[0]`, `v = t[1]`). `block_ids[i]` is the engine
block holding tokens `i*P … i*P+P-1`; token `t` lives in block `block_ids[t // P]` at slot `t % P`.
The last block may be partly used (`T` need not be a multiple of `P`); its unused slots are
neither read nor written. Copies are bit-exact for any dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch

from kvstore.gpu import runtime
from kvstore.gpu.dtypes import BITS_DTYPES

PagedKV = Union[torch.Tensor, tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]]
_THREADS = 256
COPY_WIDTHS = (16, 8, 4, 2, 1)  # bytes per vector copy, widest first: one kernel each (copy_pages_<width>)


def kernel_names() -> set[str]:
    """Every kernel of kernels.cu these wrappers may launch."""
    return {_copy_kernel(width) for width in COPY_WIDTHS}


def _copy_kernel(width: int) -> str:
    return f"copy_pages_{width}"


@dataclass(frozen=True)
class PagedLayout:
    """What `describe` learned about a paged cache, after checking it is self-consistent."""

    num_blocks: int
    num_layers: int
    page_size: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    per_layer: bool


def describe(cache: PagedKV) -> PagedLayout:
    if isinstance(cache, torch.Tensor):
        if cache.dim() != 6 or cache.shape[2] != 2:
            raise ValueError(f"cache: expected (num_blocks, L, 2, P, H, D), got shape {tuple(cache.shape)}")
        nb, L, _, P, H, D = cache.shape
        return PagedLayout(nb, L, P, H, D, cache.dtype, cache.device, per_layer=False)
    try:
        k_caches, v_caches = cache
    except (TypeError, ValueError):
        raise ValueError("cache: expected a (num_blocks, L, 2, P, H, D) tensor or (k_caches, v_caches) lists") from None
    k_caches, v_caches = list(k_caches), list(v_caches)
    if not k_caches or len(k_caches) != len(v_caches):
        raise ValueError(f"cache: need as many K as V layers (>= 1), got {len(k_caches)} and {len(v_caches)}")
    first = k_caches[0]
    if not isinstance(first, torch.Tensor) or first.dim() != 4:
        raise ValueError(f"cache: per-layer tensors must be (num_blocks, P, H, D), "
                         f"got {getattr(first, 'shape', first)!r}")
    for i, t in enumerate(k_caches + v_caches):
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            kind, layer = ("k", i) if i < len(k_caches) else ("v", i - len(k_caches))
            raise ValueError(f"cache: {kind}_caches[{layer}] is {tuple(t.shape)} {t.dtype} on {t.device}; "
                             f"expected {tuple(first.shape)} {first.dtype} on {first.device} like k_caches[0]")
    nb, P, H, D = first.shape
    return PagedLayout(nb, len(k_caches), P, H, D, first.dtype, first.device, per_layer=True)


def _check_ids(layout: PagedLayout, block_ids: torch.Tensor | Sequence[int],
               num_tokens: int | None) -> tuple[torch.Tensor, int]:
    """Validate `block_ids` and the token count: (ids int64 (n,) on the cache's device, T)."""
    ids = torch.as_tensor(block_ids, device=layout.device)
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"block_ids: expected a 1-D integer tensor, got {ids.dtype} of shape {tuple(ids.shape)}")
    ids = ids.to(torch.int64).contiguous()
    n, P = ids.numel(), layout.page_size
    T = n * P if num_tokens is None else num_tokens
    if not ((n - 1) * P < T <= n * P or n == T == 0):
        raise ValueError(f"num_tokens: {n} blocks of {P} tokens hold {max(0, (n - 1) * P + 1)}..{n * P} tokens, "
                         f"got {T}")
    return ids, T


def _token_slots(ids: torch.Tensor, T: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block (T,), slot (T,)): where each token lives."""
    t = torch.arange(T, device=ids.device)  # (T,)
    return ids[t // page_size], t % page_size


def _check_bounds(ids: torch.Tensor, num_blocks: int, *, unique: bool) -> None:
    """One host sync: out-of-range ids would read or write another allocation."""
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_blocks:
        raise IndexError(f"block_ids: must be in [0, {num_blocks}), got values in [{lo}, {hi}]")
    if unique and torch.unique(ids).numel() != ids.numel():
        raise ValueError("block_ids: scatter_pages needs distinct blocks (two tokens would race for one slot)")


def _layer_views(cache: PagedKV, layout: PagedLayout) -> list[torch.Tensor]:
    """The 2L (num_blocks, P, H, D) views, index 2*layer + kv (strided views for one tensor)."""
    if layout.per_layer:
        k_caches, v_caches = cache
        return [t for pair in zip(k_caches, v_caches) for t in pair]
    assert isinstance(cache, torch.Tensor)
    return [cache[:, layer, kv] for layer in range(layout.num_layers) for kv in (0, 1)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as integers: copies are bit-exact and work for every dtype (fp8 included,
    whose index kernels torch does not always have)."""
    return t.view(BITS_DTYPES[t.dtype.itemsize])


def gather_pages_ref(cache: PagedKV, block_ids: torch.Tensor | Sequence[int],
                     num_tokens: int | None = None) -> torch.Tensor:
    """Contiguous KV (L, 2, T, H, D) of the tokens in `block_ids`' blocks (T defaults to n*P)."""
    layout = describe(cache)
    ids, T = _check_ids(layout, block_ids, num_tokens)
    _check_bounds(ids, layout.num_blocks, unique=False)
    block, slot = _token_slots(ids, T, layout.page_size)
    rows = [_bits(view)[block, slot] for view in _layer_views(cache, layout)]  # 2L x (T, H, D)
    kv = torch.stack(rows).view(layout.num_layers, 2, T, layout.num_heads, layout.head_dim)
    return kv.view(layout.dtype)


def scatter_pages_ref(kv: torch.Tensor, cache: PagedKV, block_ids: torch.Tensor | Sequence[int]) -> None:
    """Write KV (L, 2, T, H, D) into the blocks `block_ids` of `cache`, token t at slot t % P."""
    layout = describe(cache)
    _check_kv(kv, layout, "kv")
    ids, T = _check_ids(layout, block_ids, kv.shape[2])
    _check_bounds(ids, layout.num_blocks, unique=True)
    block, slot = _token_slots(ids, T, layout.page_size)
    for lk, view in enumerate(_layer_views(cache, layout)):
        _bits(view)[block, slot] = _bits(kv[lk // 2, lk % 2]).to(view.device)  # index_put_ writes through


def _check_kv(kv: torch.Tensor, layout: PagedLayout, name: str) -> None:
    L, H, D = layout.num_layers, layout.num_heads, layout.head_dim
    if kv.dim() != 5 or kv.shape[0] != L or kv.shape[1] != 2 or kv.shape[3:] != (H, D):
        raise ValueError(f"{name}: expected (L={L}, 2, T, H={H}, D={D}), got {tuple(kv.shape)}")
    if kv.dtype != layout.dtype:
        raise ValueError(f"{name}: dtype {kv.dtype} does not match the cache's {layout.dtype}")


# --- CUDA kernels ------------------------------------------------------------------------------

# Page-pointer tables already on the device: (device, addresses) -> (table, alignment in bytes).
_ptr_tables: dict[tuple[int, ...], tuple[torch.Tensor, int]] = {}


def _alignment(addrs: list[int], row_bytes: int) -> int:
    """The largest copy width (COPY_WIDTHS) that every page address and the row length divide."""
    common = row_bytes
    for a in addrs:
        common |= a
    return next(w for w in COPY_WIDTHS if common % w == 0)


def _page_ptr_table(cache: PagedKV, layout: PagedLayout, row_bytes: int) -> tuple[torch.Tensor, int, int]:
    """(2L uint64 addresses on the device, block stride in bytes, the widest copy width they allow).
    Made once per cache: a launch's host time is most of a small copy's (docs/performance.md)."""
    item = layout.dtype.itemsize
    page_elems = layout.page_size * layout.num_heads * layout.head_dim
    if layout.per_layer:
        views = _layer_views(cache, layout)
        for i, v in enumerate(views):
            if not v.is_contiguous():
                raise ValueError(f"cache: per-layer tensor {i // 2} ({'kv'[i % 2]}) must be contiguous")
        addrs = [v.data_ptr() for v in views]
        stride = page_elems * item
        key = (layout.device.index, row_bytes, *addrs)
    else:
        assert isinstance(cache, torch.Tensor)
        if not cache.is_contiguous():
            raise ValueError("cache: the (num_blocks, L, 2, P, H, D) tensor must be contiguous")
        base = cache.data_ptr()
        stride = 2 * layout.num_layers * page_elems * item
        # One tensor: its base, layer count and page size name every address.
        key = (layout.device.index, row_bytes, base, layout.num_layers, page_elems * item)
        addrs = []
    entry = _ptr_tables.get(key)
    if entry is None:
        if not layout.per_layer:
            addrs = [base + lk * page_elems * item for lk in range(2 * layout.num_layers)]
        if len(_ptr_tables) > 64:  # engines reuse a handful of caches; don't grow without bound
            _ptr_tables.clear()
        # Addresses are < 2**63 on every CUDA platform, so int64 holds them unchanged.
        entry = (torch.tensor(addrs, dtype=torch.int64).to(layout.device), _alignment(addrs, row_bytes))
        _ptr_tables[key] = entry
    table, page_width = entry
    return table, stride, page_width


def _launch_copy(cache: PagedKV, layout: PagedLayout, ids: torch.Tensor, contig: torch.Tensor,
                 to_pages: bool) -> None:
    T = contig.shape[2]
    if T == 0:
        return
    row_bytes = layout.num_heads * layout.head_dim * layout.dtype.itemsize
    table, stride_bytes, page_width = _page_ptr_table(cache, layout, row_bytes)
    # The widest vector that every row start divides: 16-byte copies reach full bandwidth.
    contig_ptr = contig.data_ptr()
    width = next(w for w in COPY_WIDTHS if w <= page_width and contig_ptr % w == 0)
    row_vecs = row_bytes // width
    tpr = min(_THREADS, 1 << (row_vecs - 1).bit_length())
    rpb = _THREADS // tpr
    runtime.launch(
        _copy_kernel(width), layout.device, ((T + rpb - 1) // rpb, 2 * layout.num_layers, 1), (tpr, rpb, 1),
        (runtime.ptr(table), runtime.i64(stride_bytes // width), runtime.ptr(ids), runtime.i64(layout.num_blocks),
         runtime.ptr(contig), runtime.i32(T), runtime.i32(layout.page_size), runtime.i32(row_vecs),
         runtime.i32(int(to_pages))),
    )


def _check_cuda(layout: PagedLayout) -> None:
    if layout.device.type != "cuda":
        raise ValueError(f"cache: the CUDA kernels need CUDA tensors, got {layout.device} (use the *_ref functions)")


def gather_pages(cache: PagedKV, block_ids: torch.Tensor | Sequence[int], num_tokens: int | None = None, *,
                 out: torch.Tensor | None = None, check_bounds: bool = True) -> torch.Tensor:
    """CUDA `gather_pages_ref`: one launch for all layers. `out`, if given, is a contiguous
    (L, 2, T, H, D) tensor on the cache's device. `check_bounds=False` skips the host sync that
    validates ids (the kernel still never touches memory outside the cache)."""
    layout = describe(cache)
    _check_cuda(layout)
    ids, T = _check_ids(layout, block_ids, num_tokens)
    if check_bounds:
        _check_bounds(ids, layout.num_blocks, unique=False)
    shape = (layout.num_layers, 2, T, layout.num_heads, layout.head_dim)
    if out is None:
        out = torch.empty(shape, dtype=layout.dtype, device=layout.device)  # (L, 2, T, H, D)
    elif (tuple(out.shape) != shape or out.dtype != layout.dtype or out.device != layout.device
          or not out.is_contiguous()):
        raise ValueError(f"out: expected a contiguous {shape} {layout.dtype} tensor on {layout.device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    _launch_copy(cache, layout, ids, out, to_pages=False)
    return out


def scatter_pages(kv: torch.Tensor, cache: PagedKV, block_ids: torch.Tensor | Sequence[int], *,
                  check_bounds: bool = True) -> None:
    """CUDA `scatter_pages_ref`: `kv` (L, 2, T, H, D) on the cache's device; a non-contiguous
    `kv` is copied once first. `check_bounds` also checks that the blocks are distinct."""
    layout = describe(cache)
    _check_cuda(layout)
    _check_kv(kv, layout, "kv")
    if kv.device != layout.device:
        raise ValueError(f"kv: must be on the cache's device {layout.device}, got {kv.device}")
    ids, _ = _check_ids(layout, block_ids, kv.shape[2])
    if check_bounds:
        _check_bounds(ids, layout.num_blocks, unique=True)
    _launch_copy(cache, layout, ids, kv.contiguous(), to_pages=True)

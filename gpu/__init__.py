"""kvstore's GPU kernels: one CUDA source (`kernels.cu`) compiled once per device with
`cupy.RawModule` (`kvstore.gpu.runtime`), behind validating wrappers, each beside a pure-torch `*_ref`
that CPU tests run and that the CUDA tests compare the kernel against:

- `kvstore.gpu.paged`: `gather_pages` / `scatter_pages` between an engine's paged KV cache and
  contiguous KV (L, 2, T, H, D), all layers in one launch;
- `kvstore.gpu.quant`: `quantize` / `dequantize`, int8 and fp8 (e4m3) with per-token-per-head scales;
- `kvstore.gpu.rope`: `rope_rerotate` (CacheBlend: K at positions p -> p + delta) and `apply_rope_ref`.

A leaf package: it imports torch, and CuPy only when a kernel runs, so it imports anywhere.
`kernels_available()` says whether the CUDA kernels can run here.
"""
from kvstore.gpu.paged import gather_pages, gather_pages_ref, scatter_pages, scatter_pages_ref
from kvstore.gpu.quant import dequantize, dequantize_ref, quantize, quantize_ref
from kvstore.gpu.rope import RopeScalingUnsupported, apply_rope_ref, inv_freq, rope_rerotate, rope_rerotate_ref
from kvstore.gpu.runtime import KernelsUnavailable, kernels_available, kernels_unavailable_reason

__all__ = [
    "gather_pages", "gather_pages_ref", "scatter_pages", "scatter_pages_ref",
    "quantize", "quantize_ref", "dequantize", "dequantize_ref",
    "rope_rerotate", "rope_rerotate_ref", "apply_rope_ref", "inv_freq", "RopeScalingUnsupported",
    "kernels_available", "kernels_unavailable_reason", "KernelsUnavailable",
]

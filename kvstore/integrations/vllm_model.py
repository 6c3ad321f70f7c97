"""The store's name and `ModelSpec` for the model a vLLM engine serves.

Pages are shared only between clients that register the same name and the same spec, so both
are derived exactly as the decode loop derives them for the same Hugging Face checkpoint
(decode/loader.py, decode/arch.py): the name of a checkpoint directory is the directory's own
name, the spec holds the KV layout (layers, KV heads, head size, the KV dtype, the page size)
and how K was rotated (theta and the HF rope scaling without `rope_theta`, none for "default").
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from kvstore import ModelSpec
from kvstore.gpu.dtypes import KV_DTYPE_NAMES



def store_model_name(served_model_name: Any, override: str | None = None) -> str:
    """`override`, else vLLM's served model name; a path names the model by its last component,
    as `load_checkpoint` does (`vllm serve /models/llama-3-8b` -> "llama-3-8b")."""
    if override:
        return override
    name = served_model_name[0] if isinstance(served_model_name, (list, tuple)) else served_model_name
    name = str(name)
    if os.path.isdir(name) or name.startswith(("/", "./", "../", "~")):
        return os.path.basename(os.path.normpath(os.path.expanduser(name)))
    return name


def rope_of(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from a transformers config: 5.x `rope_parameters` or 4.x `rope_theta` +
    `rope_scaling`, read as decode/loader.py reads config.json."""
    found: Mapping[str, Any] | None = getattr(hf_config, "rope_parameters", None) \
        or getattr(hf_config, "rope_scaling", None)
    rope = dict(found or {})
    theta = rope.pop("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    kind = rope.get("rope_type", rope.get("type", "default"))
    return float(theta), (None if not rope or kind == "default" else rope)


def model_spec(*, num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: Any, page_size: int,
               hf_config: Any) -> ModelSpec:
    dtype = next((name for torch_dtype, name in KV_DTYPE_NAMES.items() if str(torch_dtype) == str(kv_dtype)), None)
    if dtype is None:
        raise ValueError(f"kv cache dtype: kvstore holds {', '.join(KV_DTYPE_NAMES.values())} KV, got {kv_dtype}")
    theta, scaling = rope_of(hf_config)
    return ModelSpec(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                     page_size=page_size, rope_theta=theta, rope_style="neox", rope_scaling=scaling)


def spec_from_vllm(vllm_config: Any, page_size: int) -> ModelSpec:
    """The spec of the KV a vLLM engine computes, all of its KV heads whatever the tensor-parallel
    degree (a rank stores and loads its own heads of these pages: `rank_heads`). Refuses what the
    connector does not move: pipeline parallelism, a quantized KV cache, a block size the page
    size does not divide."""
    parallel, model, cache = vllm_config.parallel_config, vllm_config.model_config, vllm_config.cache_config
    if parallel.pipeline_parallel_size != 1:
        raise ValueError("KVStoreConnector: pipeline_parallel_size must be 1 (the store takes pages by layer "
                         f"range, but the connector does not yet split them by stage), got "
                         f"{parallel.pipeline_parallel_size}")
    if cache.cache_dtype not in ("auto", None):
        raise ValueError(f"KVStoreConnector: kv_cache_dtype {cache.cache_dtype!r} is not supported (use auto)")
    block_size = cache.block_size
    if block_size % page_size:
        raise ValueError(f"kv_connector_extra_config.page_size: must divide vLLM's block_size {block_size}, "
                         f"got {page_size}")
    return model_spec(num_layers=model.get_num_layers(parallel), num_kv_heads=model.get_total_num_kv_heads(),
                      head_dim=model.get_head_size(), kv_dtype=model.dtype, page_size=page_size,
                      hf_config=model.hf_text_config)


@dataclass(frozen=True)
class RankHeads:
    """Which of a model's KV heads one tensor-parallel rank holds, and whether it stores them."""

    heads: tuple[int, int] | None  # [start, stop) of the model's KV heads; None: all (TP = 1)
    stores: bool  # False for a rank holding a replica another rank stores


def rank_heads(num_kv_heads: int, tp_size: int, tp_rank: int) -> RankHeads:
    """vLLM's split of the KV heads over `tp_size` ranks (QKVParallelLinear): `H / tp` heads a
    rank when tp <= H; when tp > H each head is replicated on `tp / H` consecutive ranks, of which
    the first stores it and every one loads it."""
    if tp_size == 1:
        return RankHeads(None, True)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} outside [0, {tp_size})")
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ValueError(f"KVStoreConnector: {num_kv_heads} KV heads do not split over tensor_parallel_size "
                             f"{tp_size}")
        per_rank = num_kv_heads // tp_size
        return RankHeads((tp_rank * per_rank, (tp_rank + 1) * per_rank), True)
    if tp_size % num_kv_heads:
        raise ValueError(f"KVStoreConnector: tensor_parallel_size {tp_size} is not a multiple of the model's "
                         f"{num_kv_heads} KV heads")
    replicas = tp_size // num_kv_heads
    head = tp_rank // replicas
    return RankHeads((head, head + 1), tp_rank % replicas == 0)

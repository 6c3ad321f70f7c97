"""The architecture of a Llama-style model: sizes, norms, RoPE, and the KV layout it implies.

`LlamaArch` is what the loader reads from a Hugging Face `config.json` and what `LlamaModel` is
built from; `spec()` turns it into the store's `ModelSpec` (the KV layout pages are keyed by).
This module holds no weights and does no math.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from kvstore.config import DTYPE_BYTES, ModelSpec

# RoPE scaling types this decode loop computes exactly like transformers does.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class LlamaArch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF-style scaling parameters without rope_theta, e.g. {"rope_type": "llama3", "factor": 8.0, ...};
    # None means plain RoPE. A mapping on construction, kept as sorted pairs so the dataclass stays hashable.
    rope_scaling: tuple[tuple[str, Any], ...] | Mapping[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: must divide num_heads ({self.num_heads}), got {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim: must be even for RoPE, got {self.head_dim}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype: must be one of {', '.join(DTYPE_BYTES)}; got {self.dtype!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps: must be > 0, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta: must be > 0, got {self.rope_theta!r}")
        scaling = self.rope_scaling
        if isinstance(scaling, Mapping):
            scaling = tuple(sorted((str(k), v) for k, v in scaling.items() if k != "rope_theta"))
            object.__setattr__(self, "rope_scaling", scaling)
        kind = self.rope_type
        if kind not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling.rope_type: must be one of {', '.join(SUPPORTED_ROPE_TYPES)}; got {kind!r}")
        if kind == "default":
            object.__setattr__(self, "rope_scaling", None)

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def rope_type(self) -> str:
        scaling = self.rope_scaling_dict or {}
        return str(scaling.get("rope_type", scaling.get("type", "default")))

    @property
    def num_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        attn = h * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head

    def spec(self, page_size: int = 16) -> ModelSpec:
        """The store's view of this model: the KV layout, page size and how K was rotated."""
        return ModelSpec(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                         dtype=self.dtype, page_size=page_size, rope_theta=self.rope_theta, rope_style="neox",
                         rope_scaling=self.rope_scaling_dict)

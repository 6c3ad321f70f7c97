"""A Llama-architecture decoder in plain torch: RMSNorm, RoPE, grouped-query attention, SwiGLU.

One sequence at a time, no batch dimension: tensors are (T, ...) for the T tokens being computed.
`forward` takes token ids *and* their positions explicitly plus an `AttentionContext`, so the
same layers serve a full prefill, the prefill of an uncached suffix, one decode step, or a
CacheBlend recompute of an arbitrary token subset. Parameter names follow Hugging Face's
`LlamaForCausalLM` (minus the `model.` prefix) so checkpoints load without renaming.
This module does not talk to the store (see engine.py) or read files (see loader.py).
"""
from __future__ import annotations

from typing import Literal, Sequence, cast

import torch
import torch.nn.functional as F
from torch import nn

from kvstore.decode.arch import LlamaArch
from kvstore.decode.attention import AttentionContext, paged_attention
from kvstore.decode.paged_cache import PagedKVCache
from kvstore.decode.rope import Rotary
from kvstore.decode.tokenizer import Tokenizer
from kvstore.config import ModelSpec


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the model dtype, as HF does, so half precision stays stable.
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class MLP(nn.Module):
    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.gate_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=arch.mlp_bias)
        self.up_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=arch.mlp_bias)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class Attention(nn.Module):
    def __init__(self, arch: LlamaArch, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.scale = arch.head_dim ** -0.5
        self.q_proj = nn.Linear(arch.hidden_size, arch.num_heads * arch.head_dim, bias=arch.attention_bias)
        self.k_proj = nn.Linear(arch.hidden_size, arch.num_kv_heads * arch.head_dim, bias=arch.attention_bias)
        self.v_proj = nn.Linear(arch.hidden_size, arch.num_kv_heads * arch.head_dim, bias=arch.attention_bias)
        self.o_proj = nn.Linear(arch.num_heads * arch.head_dim, arch.hidden_size, bias=arch.attention_bias)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Project x (T, hidden) to q (T, Hq, D) and rotated k (T, H, D), v (T, H, D).

        Public so CacheBlend can compute K/V of chosen tokens at chosen positions."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # (T, Hq, D)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # (T, H, D)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)  # (T, H, D)
        return Rotary.rotate(q, cos, sin), Rotary.rotate(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: PagedKVCache,
                ctx: AttentionContext) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        k_pool, v_pool = cache.layer(self.layer_index)
        out = paged_attention(q, k, v, k_pool, v_pool, ctx, self.scale)  # (T, Hq, D)
        return self.o_proj(out.reshape(x.shape[0], -1))


class DecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArch, layer_index: int):
        super().__init__()
        self.self_attn = Attention(arch, layer_index)
        self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: PagedKVCache,
                ctx: AttentionContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Llama decoder + LM head. `name` is the model name the store knows it by.

    `tokenizer` (text in and out) and `eos_token_ids` (where greedy generation stops by default)
    come from the checkpoint; a model built without one has neither and takes token ids."""

    def __init__(self, arch: LlamaArch, *, name: str = "llama", page_size: int = 16):
        super().__init__()
        self.arch = arch
        self.name = name
        self.spec: ModelSpec = arch.spec(page_size)
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        # A ModuleList (registered submodules), typed as what it holds: torch types its items as Module.
        self.layers = cast("Sequence[DecoderLayer]",
                           nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers)))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(arch.head_dim, arch.rope_theta, arch.rope_scaling_dict)
        self._kv_cache: PagedKVCache | None = None  # a plain attribute: never in the state_dict
        self.tokenizer: Tokenizer | None = None
        self.eos_token_ids: tuple[int, ...] = ()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, num_tokens: int) -> PagedKVCache:
        """A fresh paged cache big enough for one sequence of `num_tokens` tokens."""
        return PagedKVCache.for_tokens(self.spec, num_tokens, device=self.device, dtype=self.dtype)

    def kv_cache(self, num_tokens: int) -> PagedKVCache:
        """The model's paged cache, grown to hold at least `num_tokens` tokens, kept between requests.

        Engines preallocate their KV cache once for the same reason: a fresh multi-MiB buffer
        page-faults on first touch, which at 8k tokens costs more than scattering a fetched prefix.
        One request at a time uses it (generate is not reentrant per model).
        """
        pages = -(-num_tokens // self.spec.page_size)
        cache = self._kv_cache
        if cache is None or cache.num_blocks < pages or cache.buffer.device != self.device \
                or cache.buffer.dtype != self.dtype:
            cache = PagedKVCache(self.spec, pages, device=self.device, dtype=self.dtype)
            cache.buffer.zero_()  # touch every page now, not inside a request
            self._kv_cache = cache
        return cache

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                ctx: AttentionContext, *, logits: Literal["last", "all", "none"] = "last") -> torch.Tensor | None:
        """Run tokens `input_ids` (T,) at RoPE `positions` (T,); their K/V land in the cache.

        Returns float32 logits: (V,) for the last token, (T, V) for all, or None. Computing only
        the last row matters: the LM head over a long prompt costs as much as a layer.
        """
        assert input_ids.shape == positions.shape and input_ids.dim() == 1, (input_ids.shape, positions.shape)
        cos, sin = self.rotary.cos_sin(positions, self.dtype)  # (T, 1, D) each
        x = self.embed_tokens(input_ids)  # (T, hidden)
        for layer in self.layers:
            x = layer(x, cos, sin, cache, ctx)
        if logits == "none":
            return None
        if logits == "last":
            x = x[-1:]
        out = self.lm_head(self.norm(x)).float()  # (T or 1, V)
        return out[0] if logits == "last" else out

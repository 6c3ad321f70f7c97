"""Shared fixtures: tiny random Hugging Face Llama checkpoints written by transformers itself."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}

# Variants the equivalence test covers: GQA (4 query heads per KV head or 2), rope scaling, tying.
CHECKPOINTS: dict[str, dict[str, Any]] = {
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "gqa4-llama3": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, rope_scaling=LLAMA3_SCALING),
    "linear-tied": dict(num_attention_heads=4, num_key_value_heads=1,
                        rope_scaling={"rope_type": "linear", "factor": 4.0}, tie_word_embeddings=True),
}


def save_checkpoint(directory: Path, seed: int = 0, max_shard_size: str | None = None, **overrides: Any) -> Path:
    """Write a tiny random LlamaForCausalLM with transformers' own save_pretrained."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=10000.0, initializer_range=0.1, **overrides)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return directory


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    paths = {name: save_checkpoint(root / name, seed=i, **cfg) for i, (name, cfg) in enumerate(CHECKPOINTS.items())}
    # The "gqa" weights again, split into several shards with an index file.
    paths["gqa-sharded"] = save_checkpoint(root / "gqa-sharded", seed=0, max_shard_size="40KB", **CHECKPOINTS["gqa"])
    return paths


class DictBackend:
    """A minimal in-memory `KVCacheBackend`: whole sequences, longest-common-prefix matching.

    Stands in for the store where a test is about the decode loop rather than the store."""

    def __init__(self) -> None:
        self.entries: list[tuple[tuple[int, ...], torch.Tensor]] = []  # (tokens, kv (L, 2, T, H, D))
        self.calls: list[str] = []

    def register_model(self, model: str, spec: Any, *, tenant: str | None = None) -> Any:
        self.calls.append("register_model")
        return spec

    def _best(self, tokens: list[int]) -> tuple[int, torch.Tensor | None]:
        best, best_kv = 0, None
        for stored, kv in self.entries:
            n = 0
            while n < min(len(stored), len(tokens)) and stored[n] == tokens[n]:
                n += 1
            if n > best:
                best, best_kv = n, kv
        return best, best_kv

    def lookup(self, model: str, tokens: Any, *, tenant: str | None = None) -> Any:
        from kvstore.results import LookupResult

        self.calls.append("lookup")
        matched, _ = self._best(list(tokens))
        return LookupResult(matched_tokens=matched, tiers={"cpu": matched} if matched else {})

    def fetch(self, model: str, tokens: Any, *, start: int = 0, tenant: str | None = None, device: str = "cpu") -> Any:
        from kvstore.results import FetchResult

        self.calls.append("fetch")
        matched, kv = self._best(list(tokens))
        return FetchResult(matched_tokens=matched, kv=None if kv is None else kv[:, :, start:matched].clone())

    def store(self, model: str, tokens: Any, kv: Any, *, start: int = 0, tenant: str | None = None) -> Any:
        from kvstore.results import StoreResult

        self.calls.append("store")
        tokens = list(tokens)
        if start:
            matched, prefix = self._best(tokens[:start])
            assert matched == start and prefix is not None, "store(start=...) needs the prefix stored"
            kv = torch.cat([prefix[:, :, :start], kv], dim=2)
        assert kv.shape[2] == len(tokens), (kv.shape, len(tokens))
        self.entries.append((tuple(tokens), kv.clone()))
        return StoreResult(stored_tokens=len(tokens), new_pages=1)

    def store_chunk(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def blend(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


@pytest.fixture
def dict_backend() -> DictBackend:
    return DictBackend()

"""Shared fixtures: tiny random Hugging Face Llama checkpoints written by transformers itself."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}

# Variants the equivalence test covers: GQA (4 query heads per KV head or 2), rope scaling, tying.
CHECKPOINTS: dict[str, dict[str, Any]] = {
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "gqa4-llama3": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, rope_scaling=LLAMA3_SCALING),
    "linear-tied": dict(num_attention_heads=4, num_key_value_heads=1, rope_scaling={"rope_type": "linear", "factor": 4.0},
                        tie_word_embeddings=True),
}


def save_checkpoint(directory: Path, seed: int = 0, **overrides: Any) -> Path:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=10000.0, initializer_range=0.1, **overrides)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: save_checkpoint(root / name, seed=i, **cfg) for i, (name, cfg) in enumerate(CHECKPOINTS.items())}

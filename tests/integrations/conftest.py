"""Fixtures of the vLLM connector tests: tiny random Llama checkpoints written by transformers."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 256}

# head_dim 32: the smallest head size vLLM's CPU attention kernels take.
CHECKPOINTS: dict[str, dict[str, Any]] = {
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "gqa4-llama3": dict(num_attention_heads=8, num_key_value_heads=2, rope_scaling=LLAMA3_SCALING),
    "linear-tied": dict(num_attention_heads=4, num_key_value_heads=1,
                        rope_scaling={"rope_type": "linear", "factor": 4.0}, tie_word_embeddings=True),
}


def save_checkpoint(directory: Path, seed: int = 0, dtype: str = "bfloat16", **overrides: Any) -> Path:
    """A tiny random LlamaForCausalLM (2 layers, hidden 128, vocab 512) saved by transformers itself."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    settings = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, head_dim=32,
                    max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, initializer_range=0.1,
                    dtype=dtype)
    settings.update(overrides)
    config = transformers.LlamaConfig(**settings)
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm-checkpoints")
    return {name: save_checkpoint(root / name, seed=i, **cfg) for i, (name, cfg) in enumerate(CHECKPOINTS.items())}

"""Loading Hugging Face checkpoints and configs, and the built-in random model."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstore.decode import generate, load_checkpoint, tiny_model
from kvstore.decode.loader import arch_from_hf_config


def test_sharded_checkpoint_loads_the_same_weights(checkpoints: dict[str, Path]) -> None:
    sharded = checkpoints["gqa-sharded"]
    assert (sharded / "model.safetensors.index.json").exists() and len(list(sharded.glob("*.safetensors"))) > 1
    a, b = load_checkpoint(checkpoints["gqa"]), load_checkpoint(sharded)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    prompt = list(range(1, 30))
    assert generate(a, prompt, 8).tokens == generate(b, prompt, 8).tokens


def test_dtype_override_and_tied_embeddings(checkpoints: dict[str, Path]) -> None:
    model = load_checkpoint(checkpoints["linear-tied"], dtype="bfloat16", page_size=8)
    assert model.dtype == torch.bfloat16 and model.spec.dtype == "bfloat16" and model.spec.page_size == 8
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert len(generate(model, [3, 1, 4, 1, 5], 4).tokens) == 4


def test_transformers_4_config_layout_is_read() -> None:
    # 4.x configs keep rope_theta and rope_scaling at the top level (and "type" instead of "rope_type").
    arch = arch_from_hf_config({
        "model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0}, "torch_dtype": "bfloat16"})
    assert (arch.head_dim, arch.num_kv_heads, arch.rope_theta, arch.dtype) == (8, 2, 500000.0, "bfloat16")
    assert arch.rope_scaling_dict == {"type": "linear", "factor": 2.0} and arch.rope_type == "linear"


@pytest.mark.parametrize("change, field", [
    ({"model_type": "gpt2"}, "model_type"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"num_key_value_heads": 3}, "num_kv_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_configs_are_refused_by_name(change: dict, field: str) -> None:
    config = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, **change}
    with pytest.raises(ValueError, match=field):
        arch_from_hf_config(config)


def test_missing_weights_are_refused(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    (tmp_path / "config.json").write_text((checkpoints["gqa"] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_checkpoint(tmp_path)


def test_tiny_model_is_deterministic_per_seed() -> None:
    a, b, c = tiny_model(seed=1), tiny_model(seed=1), tiny_model(seed=2)
    prompt = list(range(40))
    assert generate(a, prompt, 6).tokens == generate(b, prompt, 6).tokens
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert a.spec.num_layers == a.arch.num_layers and a.spec.page_size == 16


def test_model_apply_reaches_every_module() -> None:
    # torch's Module.apply visits every submodule: the rotary one among them, which once shadowed
    # `apply` with its RoPE rotation, so this call raised a TypeError.
    model = tiny_model(seed=1)
    seen: list[str] = []
    model.apply(lambda module: seen.append(type(module).__name__))
    assert "Rotary" in seen and seen[-1] == type(model).__name__

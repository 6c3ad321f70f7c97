"""Build a `LlamaModel`: from a Hugging Face checkpoint directory, or the built-in tiny random one.

A checkpoint directory holds `config.json` and the weights as one `model.safetensors` or shards
listed in `model.safetensors.index.json`. Both the transformers 4.x config (`rope_theta`,
`rope_scaling`) and the 5.x one (`rope_parameters`) are read. Only Llama-architecture models
(llama, and mistral without sliding windows) are accepted; anything else is refused by name
rather than loaded wrong.

The checkpoint's tokenizer and chat template (when it has them) come with the model, and so do
its end-of-sequence ids (`generation_config.json`, else `config.json`), where generation stops
by default, as in transformers' `generate` and vLLM. `load_model` also takes the name of a known
model (`smollm2`), pulled into the cache on first use (decode/model_pull.py).

`tiny_model()` is **randomly initialised**: it produces meaningless tokens. It exists so the
decode loop, the CLI, the demo and the tests run with no download.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import load_file

from kvstore.decode.arch import LlamaArch
from kvstore.decode.model import LlamaModel
from kvstore.decode.tokenizer import Tokenizer

SUPPORTED_MODEL_TYPES = ("llama", "mistral")

# The built-in random model: small enough for tests, big enough to have GQA and several pages.
TINY_ARCH = LlamaArch(vocab_size=512, hidden_size=128, intermediate_size=344, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=32, dtype="float32")


def arch_from_hf_config(config: Mapping[str, Any], *, dtype: str | None = None) -> LlamaArch:
    """Read a Hugging Face Llama `config.json` (as a dict) into a `LlamaArch`."""
    model_type = config.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type: must be one of {', '.join(SUPPORTED_MODEL_TYPES)}; got {model_type!r}")
    if config.get("sliding_window") is not None:
        raise ValueError("sliding_window: sliding-window attention is not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: only silu (SwiGLU) is supported, got {config.get('hidden_act')!r}")
    heads = config["num_attention_heads"]
    # 5.x nests theta inside rope_parameters; 4.x has rope_theta next to rope_scaling.
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
    if dtype is None:
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32").replace("torch.", "")
    return LlamaArch(
        vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"], num_layers=config["num_hidden_layers"],
        num_heads=heads, num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
        rope_scaling=rope or None, tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", False)), mlp_bias=bool(config.get("mlp_bias", False)),
        dtype=dtype)


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / "model.safetensors").exists():
        shards = ["model.safetensors"]
    else:
        shards = sorted(p.name for p in directory.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{directory}: no *.safetensors weights (only safetensors checkpoints are supported)")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(str(directory / shard)))
    return weights


def load_checkpoint(path: str | Path, *, page_size: int = 16, dtype: str | None = None, name: str | None = None,
                    device: str | torch.device = "cpu") -> LlamaModel:
    """Load a Hugging Face Llama checkpoint directory; `dtype` overrides the checkpoint's."""
    directory = Path(path)
    config = json.loads((directory / "config.json").read_text())
    arch = arch_from_hf_config(config, dtype=dtype)
    # Build on the meta device so no memory or time goes to an init the checkpoint overwrites.
    with torch.device("meta"):
        model = LlamaModel(arch, name=name or directory.name, page_size=page_size)
    target = getattr(torch, arch.dtype)
    state = {key.removeprefix("model."): tensor.to(device=device, dtype=target)
             for key, tensor in _read_weights(directory).items() if not key.endswith("rotary_emb.inv_freq")}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    allowed_missing = {"lm_head.weight"} if arch.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise ValueError(f"{directory}: weights do not match a {arch.num_layers}-layer Llama "
                         f"(missing {sorted(set(missing) - allowed_missing)[:5]}, unexpected {sorted(unexpected)[:5]})")
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.tokenizer = Tokenizer.from_dir(directory)
    model.eos_token_ids = eos_token_ids(directory, config)
    return model.eval()


def eos_token_ids(directory: Path, config: Mapping[str, Any]) -> tuple[int, ...]:
    """The ids that end a generation: the generation config's, else the model config's."""
    generation = directory / "generation_config.json"
    value = json.loads(generation.read_text()).get("eos_token_id") if generation.exists() else None
    if value is None:
        value = config.get("eos_token_id")
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def load_model(model: str | Path, *, page_size: int = 16, dtype: str | None = None,
               device: str | torch.device = "cpu") -> LlamaModel:
    """`tiny` (random weights), a known model's name (pulled on first use), or a checkpoint directory."""
    from kvstore.decode.model_pull import KNOWN_MODELS, pull

    if str(model) == "tiny":
        tiny = tiny_model(page_size=page_size, device=device)
        return tiny if dtype in (None, "float32") else tiny.to(getattr(torch, dtype))
    if str(model) in KNOWN_MODELS and not Path(model).is_dir():
        return load_checkpoint(pull(str(model)), page_size=page_size, dtype=dtype, name=str(model), device=device)
    directory = Path(model)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"model: {model!r} is neither 'tiny', a known model ({', '.join(KNOWN_MODELS)}) "
                                f"nor a checkpoint directory with a config.json")
    return load_checkpoint(directory, page_size=page_size, dtype=dtype, device=device)


def tiny_model(*, seed: int = 0, page_size: int = 16, arch: LlamaArch = TINY_ARCH, init_std: float = 0.02,
               name: str = "tiny-random-llama", device: str | torch.device = "cpu") -> LlamaModel:
    """A randomly initialised Llama (normal(0, init_std) weights, unit norms): output is gibberish."""
    generator = torch.Generator().manual_seed(seed)
    model = LlamaModel(arch, name=name, page_size=page_size)
    with torch.no_grad():
        for key, param in model.named_parameters():
            if key.endswith("layernorm.weight") or key == "norm.weight":
                param.fill_(1.0)
            elif key.endswith("bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * init_std)
    return model.to(device=device, dtype=getattr(torch, arch.dtype)).eval()

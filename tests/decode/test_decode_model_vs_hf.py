"""The decode model computes what transformers' LlamaForCausalLM computes, on the same checkpoint."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstore.decode import generate, load_checkpoint
from kvstore.decode.attention import AttentionContext
transformers = pytest.importorskip("transformers")

TOL = 1e-4
DECODE_STEPS = 16


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(0, 256, (45,), generator=torch.Generator().manual_seed(7))  # (T,), ends mid-page


def hf_greedy(directory: Path, prompt: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
    """Prefill logits (T, V), greedy tokens and per-step logits from transformers with its own KV cache."""
    model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(prompt[None], use_cache=True)
        prefill, past = out.logits[0], out.past_key_values
        step_logits = [prefill[-1]]
        tokens = [int(prefill[-1].argmax())]
        for _ in range(steps - 1):
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            step_logits.append(out.logits[0, -1])
            tokens.append(int(step_logits[-1].argmax()))
    return prefill, tokens, step_logits


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@pytest.mark.parametrize("name", ["gqa", "gqa4-llama3", "linear-tied"])
@pytest.mark.parametrize("page_size", [4, 16])
def test_prefill_and_greedy_decode_match_transformers(checkpoints: dict[str, Path], prompt: torch.Tensor,
                                                       name: str, page_size: int) -> None:
    # One token from the prefill, then DECODE_STEPS incremental decode steps.
    ref_prefill, ref_tokens, ref_steps = hf_greedy(checkpoints[name], prompt, DECODE_STEPS + 1)
    model = load_checkpoint(checkpoints[name], page_size=page_size)

    cache = model.new_cache(len(prompt))
    table = cache.new_table()
    cache.reserve(table, len(prompt))
    logits = model(prompt, torch.arange(len(prompt)), cache, AttentionContext.for_span(cache, table, 0, len(prompt)),
                   logits="all")  # (T, V)
    torch.testing.assert_close(logits, ref_prefill, atol=TOL, rtol=0)

    result = generate(model, prompt, DECODE_STEPS + 1, return_logits=True)
    assert len(set(ref_tokens)) > 4  # the checkpoint is peaked enough that greedy is not a constant
    assert result.tokens == ref_tokens
    torch.testing.assert_close(result.logits, torch.stack(ref_steps), atol=TOL, rtol=0)


def test_spec_is_derived_from_config(checkpoints: dict[str, Path]) -> None:
    model = load_checkpoint(checkpoints["gqa4-llama3"], page_size=8)
    spec = model.spec
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.page_size, spec.dtype) == (2, 2, 16, 8, "float32")
    assert spec.rope_scaling_dict["rope_type"] == "llama3" and spec.rope_scaling_dict["factor"] == 8.0
    assert "rope_theta" not in spec.rope_scaling_dict and spec.rope_theta == 10000.0

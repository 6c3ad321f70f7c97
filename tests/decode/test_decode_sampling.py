"""Greedy and seeded temperature / top-p sampling."""
from __future__ import annotations

import pytest
import torch

from kvstore.decode import SamplingParams, generate, tiny_model
from kvstore.decode.sampling import Sampler


def test_seeded_sampling_is_reproducible_and_seed_dependent() -> None:
    model = tiny_model(init_std=0.1)
    prompt = list(range(20))

    def run(seed: int) -> list[int]:
        return generate(model, prompt, 12, sampling=SamplingParams(temperature=1.0, seed=seed)).tokens

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_tiny_top_p_keeps_only_the_most_likely_token() -> None:
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(SamplingParams(temperature=2.0, top_p=1e-6, seed=0))
    assert {sampler(logits) for _ in range(20)} == {int(logits.argmax())}


def test_top_p_never_samples_outside_the_nucleus() -> None:
    logits = torch.tensor([3.0, 2.9, 0.0, -1.0, -5.0])  # the first two hold ~0.9 of the mass
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.8, seed=1))
    assert {sampler(logits) for _ in range(200)} == {0, 1}


@pytest.mark.parametrize("kwargs, field", [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p")])
def test_bad_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_stop_token_ends_generation() -> None:
    model = tiny_model()
    first = generate(model, [5, 6, 7], 10).tokens
    stopped = generate(model, [5, 6, 7], 10, stop_token_ids=[first[2]]).tokens
    assert stopped == first[:first.index(first[2]) + 1]

"""A backend that fails, hangs or answers nonsense costs a full prefill and a warning, never a
wrong token."""
from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from kvstore.decode import BackendWarning, LlamaModel, generate, tiny_model
from kvstore.errors import BackendUnavailable, ModelConflict
from kvstore.config import StoreConfig
from kvstore.results import FetchResult
from kvstore.store import KVStore

PAGE = 8


@pytest.fixture
def store() -> Any:
    with KVStore(StoreConfig(data_dir=None, cpu_bytes=16 << 20, disk_bytes=0)) as store:
        yield store


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return tiny_model(init_std=0.05, page_size=PAGE)


PROMPT = torch.randint(0, 512, (41,), generator=torch.Generator().manual_seed(11)).tolist()


class Faulty:
    """Wraps a working backend and breaks one method in a chosen way."""

    def __init__(self, inner: Any, method: str, behaviour: Any):
        self.inner, self.method, self.behaviour = inner, method, behaviour

    def __getattr__(self, name: str) -> Any:
        real = getattr(self.inner, name)
        if name != self.method:
            return real

        def broken(*args: Any, **kwargs: Any) -> Any:
            return self.behaviour(real, *args, **kwargs)

        return broken


def raise_unavailable(real: Any, *args: Any, **kwargs: Any) -> Any:
    raise BackendUnavailable("sidecar unreachable")


def raise_conflict(real: Any, *args: Any, **kwargs: Any) -> Any:
    raise ModelConflict("registered with another spec")


def hang(real: Any, *args: Any, **kwargs: Any) -> Any:
    time.sleep(1.0)
    return real(*args, **kwargs)


def wrong_shape(real: Any, *args: Any, **kwargs: Any) -> Any:
    result = real(*args, **kwargs)
    return FetchResult(result.matched_tokens, result.kv[:, :, :-1])  # one token short


def wrong_dtype(real: Any, *args: Any, **kwargs: Any) -> Any:
    result = real(*args, **kwargs)
    return FetchResult(result.matched_tokens, result.kv.half())


def overclaims(real: Any, *args: Any, **kwargs: Any) -> Any:
    result = real(*args, **kwargs)
    return FetchResult(len(args[1]) + 5, result.kv)  # claims more tokens than were asked for


@pytest.mark.parametrize("method, behaviour", [
    ("lookup", raise_unavailable), ("fetch", raise_unavailable), ("register_model", raise_conflict),
    ("fetch", hang), ("lookup", hang), ("fetch", wrong_shape), ("fetch", wrong_dtype), ("fetch", overclaims),
])
def test_broken_backend_falls_back_to_full_prefill(model: LlamaModel, store: KVStore, method: str,
                                                   behaviour: Any) -> None:
    baseline = generate(model, PROMPT, 8, return_logits=True)
    generate(model, PROMPT, 8, backend=store)  # the healthy store now holds the prompt
    with pytest.warns(BackendWarning, match=method.split("_")[0]):
        result = generate(model, PROMPT, 8, backend=Faulty(store, method, behaviour), timeout_s=0.2,
                          return_logits=True)
    assert (result.reused_tokens, result.computed_tokens) == (0, len(PROMPT))
    assert result.backend_error and result.tokens == baseline.tokens
    torch.testing.assert_close(result.logits, baseline.logits, atol=1e-5, rtol=0)


def test_failed_store_is_a_warning_and_the_next_request_misses(model: LlamaModel, store: KVStore) -> None:
    faulty = Faulty(store, "store", raise_unavailable)
    with pytest.warns(BackendWarning, match="store"):
        first = generate(model, PROMPT, 4, backend=faulty)
    assert first.tokens == generate(model, PROMPT, 4).tokens
    assert generate(model, PROMPT, 4, backend=store).reused_tokens == 0


def test_model_is_registered_once_per_backend(model: LlamaModel, dict_backend: Any) -> None:
    for _ in range(3):
        generate(model, PROMPT, 2, backend=dict_backend)
    assert dict_backend.calls.count("register_model") == 1


def test_short_hits_below_min_reuse_tokens_are_not_fetched(model: LlamaModel, dict_backend: Any) -> None:
    generate(model, PROMPT[:12], 2, backend=dict_backend)
    result = generate(model, PROMPT, 2, backend=dict_backend, min_reuse_tokens=16)
    assert result.reused_tokens == 0 and "fetch" not in dict_backend.calls


def test_a_backend_that_forgot_the_model_gets_it_registered_again(model: LlamaModel) -> None:
    class Restartable:
        """One client object in front of a store that restarts (memory only): the model is gone."""

        def __init__(self) -> None:
            self.inner = KVStore(StoreConfig(data_dir=None, cpu_bytes=16 << 20, disk_bytes=0))

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    backend = Restartable()
    generate(model, PROMPT, 4, backend=backend)
    backend.inner.close()
    backend.inner = KVStore(StoreConfig(data_dir=None, cpu_bytes=16 << 20, disk_bytes=0))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", BackendWarning)
        assert generate(model, PROMPT, 4, backend=backend).reused_tokens == 0  # a miss, not a failure
    assert generate(model, PROMPT, 4, backend=backend).reused_tokens == len(PROMPT) - 1
    backend.inner.close()

"""The decode loop on a real model, SmolLM2-135M-Instruct: text in, text out, with and without the store.

The reference is transformers on the same checkpoint and the same chat template, so "the same
answer" means the same token ids and the same text. For every prompt, transformers' forward pass
over prompt + our answer must pick each of our tokens as its greedy next token (teacher forcing:
one pass per prompt, which is what greedy `generate` would produce token by token); for two
prompts, `generate` itself is run. Prompts are real
chat: short questions, and questions about a section of Python's language reference in the
system prompt, from a few dozen to several hundred tokens.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstore.config import StoreConfig
from kvstore.decode import GenerateResult, LlamaModel, generate
from kvstore.api.server.in_process import InProcessSidecar
from kvstore.store import KVStore

transformers = pytest.importorskip("transformers")
# The module's first test computes every prompt's answer once; on a busy 2-core host that alone
# can pass the suite's per-test default.
pytestmark = [pytest.mark.timeout(900), pytest.mark.heavy]

NEW_TOKENS = 12
QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Who wrote Romeo and Juliet?",
    "What is 7 times 8?",
    "Give me a synonym for happy.",
    "What is the boiling point of water in Celsius?",
    "Explain what a hash table is in one sentence.",
    "What language is spoken in Brazil?",
]
# (section of the language reference, question about it): system prompts of 150-800 tokens.
DOCUMENTS = [
    ("if", "What does the if statement do?"),
    ("while", "When does a while loop stop?"),
    ("assert", "What does assert do when the expression is false?"),
    ("for", "What does the for statement iterate over?"),
    ("exceptions", "What happens when an exception is not handled?"),
    ("with", "What is the with statement used for?"),
]


def conversation(index: int) -> list[dict[str, str]]:
    if index < len(QUESTIONS):
        return [{"role": "user", "content": QUESTIONS[index]}]
    from pydoc_data.topics import topics

    topic, question = DOCUMENTS[index - len(QUESTIONS)]
    system = "Answer the question about this part of the Python reference.\n\n" + topics[topic].strip()
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


PROMPTS = range(len(QUESTIONS) + len(DOCUMENTS))


@pytest.fixture(scope="module")
def model(smollm2_model: LlamaModel) -> LlamaModel:
    return smollm2_model


@pytest.fixture(scope="module")
def hf(smollm2: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def answers(model: LlamaModel) -> dict[int, list[int]]:
    """The decode loop's greedy answer to every prompt, without a store."""
    return {i: generate(model, conversation(i), NEW_TOKENS).tokens for i in PROMPTS}


def transformers_greedy_choices(hf, prompt: list[int], answer: list[int]) -> list[int]:
    """transformers' greedy next token after the prompt and after each answer token but the last."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + answer[:-1]])).logits[0]  # (T, V)
    return logits[len(prompt) - 1:].argmax(-1).tolist()


def test_the_prompts_are_real_chat_of_many_lengths(model: LlamaModel) -> None:
    lengths = [len(model.tokenizer.chat(conversation(i))) for i in PROMPTS]
    assert len(lengths) >= 14 and min(lengths) < 50 and max(lengths) > 600
    # The template ends by opening the assistant's turn, as transformers renders it.
    assert model.tokenizer.hf.decode(model.tokenizer.chat(conversation(0))).endswith("<|im_start|>assistant\n")


def test_greedy_answers_are_transformers_greedy_answers(model: LlamaModel, hf, answers: dict[int, list[int]]) -> None:
    for i in PROMPTS:
        prompt = model.tokenizer.chat(conversation(i))
        assert transformers_greedy_choices(hf, prompt, answers[i]) == answers[i], \
            (i, model.tokenizer.decode(answers[i]))
        # Stopped at the end of its answer, or at the length limit.
        assert answers[i][-1] in model.eos_token_ids or len(answers[i]) == NEW_TOKENS
    assert model.tokenizer.decode(answers[0]) == "The capital of France is Paris."


def test_greedy_answers_equal_transformers_generate(model: LlamaModel, hf, answers: dict[int, list[int]]) -> None:
    for i, text in ((0, "The capital of France is Paris."), (1, "1. Red\n2. Blue\n3. Green")):
        prompt = model.tokenizer.chat(conversation(i))
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert out[0, len(prompt):].tolist() == answers[i]
        assert model.tokenizer.decode(answers[i]) == text


def test_text_messages_and_token_ids_are_the_same_prompt(model: LlamaModel, smollm2: Path) -> None:
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2)
    text = "The three primary colors are"
    by_text = generate(model, text, 6, stop_token_ids=())
    assert by_text.prompt_ids == hf_tokenizer(text)["input_ids"]  # plain text: the tokenizer's own ids
    by_ids = generate(model, by_text.prompt_ids, 6, stop_token_ids=())
    assert by_ids.tokens == by_text.tokens and len(by_ids.tokens) == 6 and by_ids.text == by_text.text
    messages = conversation(1)
    rendered = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert generate(model, messages, 1).prompt_ids == list(rendered)


def test_streamed_tokens_are_the_answer(model: LlamaModel, answers: dict[int, list[int]]) -> None:
    seen: list[int] = []
    result = generate(model, conversation(2), NEW_TOKENS, on_token=seen.append)
    assert seen == result.tokens == answers[2]


def assert_reused_answer(model: LlamaModel, backend, i: int, answers: dict[int, list[int]],
                         *, at_least: int) -> GenerateResult:
    result = generate(model, conversation(i), NEW_TOKENS, backend=backend)
    assert result.backend_error is None
    assert result.reused_tokens >= at_least
    assert result.tokens == answers[i] and result.text == model.tokenizer.decode(answers[i])
    return result


# Prompts the store tests reuse: a short question and one with a document.
STORED = (0, len(QUESTIONS) + 3)


def test_a_prefix_from_the_cpu_tier_gives_the_same_answer(model: LlamaModel, answers: dict[int, list[int]]) -> None:
    with KVStore(StoreConfig(data_dir=None, cpu_bytes=256 << 20, disk_bytes=0)) as store:
        held: list[list[int]] = []  # what the store holds: each earlier prompt with its answer
        for i in STORED:
            first = assert_reused_answer(model, store, i, answers, at_least=0)
            # The first time, only what an earlier prompt shares can be reused (the template's opening).
            shared = max((shared_prefix(first.prompt_ids, h) for h in held), default=0)
            assert first.reused_tokens == min(shared, first.prompt_tokens - 1)
            assert first.stored_tokens >= first.prompt_tokens
            again = assert_reused_answer(model, store, i, answers, at_least=first.prompt_tokens - 1)
            assert set(again.tiers) == {"cpu"}
            held.append(first.prompt_ids + first.tokens)


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_prefix_from_the_disk_tier_after_a_restart_gives_the_same_answer(
        model: LlamaModel, answers: dict[int, list[int]], tmp_path: Path) -> None:
    config = StoreConfig(data_dir=str(tmp_path / "kv"), cpu_bytes=0, disk_bytes=256 << 20, durability="write-through")
    with KVStore(config) as store:
        stored = {i: generate(model, conversation(i), NEW_TOKENS, backend=store).prompt_tokens for i in STORED}
    with KVStore(config) as store:  # a new process's store over the same directory
        for i in STORED:
            result = assert_reused_answer(model, store, i, answers, at_least=stored[i] - 1)
            assert set(result.tiers) == {"disk"}


def test_a_prefix_through_the_sidecar_gives_the_same_answer(model: LlamaModel, answers: dict[int, list[int]]) -> None:
    from kvstore import KVStoreClient

    with InProcessSidecar(StoreConfig(data_dir=None, cpu_bytes=256 << 20, disk_bytes=0)) as url, \
            KVStoreClient(url) as client:
        for i in STORED:
            first = assert_reused_answer(model, client, i, answers, at_least=0)
            assert_reused_answer(model, client, i, answers, at_least=first.prompt_tokens - 1)


def test_a_conversation_that_reuses_each_turn_reads_the_same(model: LlamaModel) -> None:
    turns = ["Tell me a fun fact about octopuses.", "Why is that?", "Give me another one."]
    # Each turn's answer is cut at 12 tokens: enough for a sentence, and the test stays short.
    with KVStore(StoreConfig(data_dir=None, cpu_bytes=256 << 20, disk_bytes=0)) as store:
        history: list[dict[str, str]] = []
        previous_prompt = 0
        for n, question in enumerate(turns):
            history.append({"role": "user", "content": question})
            cold = generate(model, history, 12)
            warm = generate(model, history, 12, backend=store)
            assert warm.text == cold.text and warm.tokens == cold.tokens
            assert cold.reused_tokens == 0
            # Turn N's prompt begins with turn N-1's prompt and answer, which the store holds.
            assert warm.reused_tokens >= (previous_prompt if n else 0)
            assert len(warm.text) > 10  # a real sentence, not an empty or cut answer
            previous_prompt = warm.prompt_tokens
            history.append({"role": "assistant", "content": warm.text})

"""Prompts of real text for the engine benches: sections of Python's own documentation
(pydoc_data.topics), tokenized with the model's tokenizer; random ids for a model without one."""
from __future__ import annotations

import random


def documentation_sections() -> list[str]:
    import pydoc_data.topics

    return [pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics)]


class Prompts:
    """One prompt per (size, salt), the same in every engine process. With a tokenizer: sections of
    Python's documentation, from a section that depends on both, under a header naming both (so
    no two prompts share a first page), tokenized and cut to `size`. Without: random ids."""

    def __init__(self, directory: str, vocab_size: int, has_tokenizer: bool):
        self.vocab_size, self.tokenizer = vocab_size, None
        if has_tokenizer:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(directory)
            self.sections = documentation_sections()

    def __call__(self, size: int, salt: int = 0) -> list[int]:
        if self.tokenizer is None:
            rng = random.Random(size * 1000 + salt)
            return [rng.randrange(3, self.vocab_size) for _ in range(size)]
        first = (size + 7 * salt) % len(self.sections)
        text = f"Python documentation, part {salt} of a {size}-token prompt.\n\n" + "\n\n".join(
            self.sections[first:] + self.sections[:first])
        tokens = list(self.tokenizer(text)["input_ids"])
        if len(tokens) < size:
            raise ValueError(f"--sizes: the documentation holds {len(tokens)} tokens, fewer than {size}")
        return tokens[:size]

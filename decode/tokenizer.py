"""A checkpoint's tokenizer and chat template, as the decode loop uses them: text in, text out.

The tokenizer is transformers' own, loaded from the checkpoint directory, so the ids are exactly
the ones transformers and vLLM compute for the same text. A checkpoint without tokenizer files
(the random test checkpoints) has no `Tokenizer`; the decode loop then takes token ids only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class Tokenizer:
    def __init__(self, hf_tokenizer: Any):
        self.hf = hf_tokenizer

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tokenizer | None:
        """The tokenizer saved in a checkpoint directory, or None when it holds none."""
        directory = Path(directory)
        if not any((directory / name).exists() for name in TOKENIZER_FILES):
            return None
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise ImportError(f"{directory}: reading its tokenizer needs transformers "
                              f"(pip install 'kvstore[model]')") from exc
        return cls(AutoTokenizer.from_pretrained(str(directory)))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """Plain text, with the special tokens the tokenizer itself adds (as transformers and vLLM do)."""
        return list(self.hf(text)["input_ids"])

    def chat(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
        """A conversation ({"role", "content"} messages) through the checkpoint's chat template."""
        if not self.has_chat_template:
            raise ValueError("prompt: this checkpoint's tokenizer has no chat template; pass plain text or ids")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("content"), str) \
                    or not isinstance(message.get("role"), str):
                raise ValueError(f"prompt[{i}]: a message must be a mapping with str 'role' and 'content'")
        ids = self.hf.apply_chat_template([dict(m) for m in messages], tokenize=True,
                                          add_generation_prompt=add_generation_prompt, return_dict=False)
        return [int(t) for t in ids]

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)


class TextStream:
    """Turns tokens, as they are sampled, into the text they add.

    A token can end inside a multi-byte character; its text is held back until the character is
    whole, so what is printed never has to be taken back."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.sent = 0  # characters of the decoded text already handed out

    def push(self, token: int) -> str:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if text.endswith("\ufffd"):
            return ""
        new, self.sent = text[self.sent:], len(text)
        return new

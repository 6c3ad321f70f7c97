"""A retrieval-style workload of real text for CacheBlend: documents, prompts, needle questions.

Two workloads of different kinds, by name (`WORKLOADS`):

    langref   sections of the Python language reference that ships with Python
              (`pydoc_data.topics`), 200-600 tokens each, 3-8 per prompt; questions ask what a
              section explains; needles are a reviewer's name and review number
    packages  the long descriptions and license texts of the packages `make install` puts in
              place (bench/blend_packages.py): READMEs in Markdown and reStructuredText with code,
              lists and tables, and legal text; 80-700 tokens each, 2-12 per prompt; other
              question forms, other needles

Each text is cut at paragraph boundaries into pieces of `doc_tokens` tokens (a piece outside
the range is not used). A prompt is

    [system prompt + the user turn's opening] [document] ... [document] [question + assistant turn]

in the model's chat template, with `docs_per_prompt` documents drawn from one pool, so the same
documents recur across prompts in other orders and at other positions, as retrieved chunks do.
Each document is its own chunk (tokenized alone, so its tokens are the same wherever it lands).

A fraction `needle_fraction` of the prompts asks a needle question: one of its documents carries
a planted fact sentence (a name and a number) and the question asks for the number, which is
checked exactly. The other prompts ask about one of their documents by title, with no single
right answer: their quality is how close the answer stays to a full prefill's.

Everything comes from `seed`: the same seed, tokenizer, config and installed text give the
same prompts. Nothing generated is committed; `python bench/blend_workload.py [NAME]` prints a
summary.
"""
from __future__ import annotations

import random
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

NAMES = ("Mirela Okafor", "Tobias Lindqvist", "Ana Ferreira", "Kenji Watanabe", "Priya Raman", "Lucas Moreau",
         "Amara Nwosu", "Jonas Becker", "Sofia Rossi", "Daniel Kowalski", "Leila Haddad", "Mateo Alvarez")


@dataclass(frozen=True)
class Needle:
    fact: str  # the sentence planted in a document
    question: str
    answer: str  # the number the answer must name first


class LanguageReference:
    """Sections of the Python language reference (`pydoc_data.topics`, part of every Python)."""

    name = "langref"
    system_prompt = ("You are a helpful assistant. Answer the question at the end using the documents "
                     "from the Python language reference below.")
    config_defaults = {"doc_tokens": (200, 600), "docs_per_prompt": (3, 8), "pool_docs": 40}
    max_pieces = None  # every piece of every section

    def texts(self) -> list[tuple[str, list[str]]]:
        """(title, paragraphs) of each text, in a fixed order."""
        from pydoc_data.topics import topics

        out = []
        for key in sorted(topics):
            paragraphs = [p for p in topics[key].strip().split("\n\n") if p.strip()]
            out.append((paragraphs[0].splitlines()[0].strip(), paragraphs))
        return out

    def piece(self, title: str, part: int, paragraphs: list[str]) -> str:
        text = "\n\n".join(paragraphs) + "\n\n"
        return text if part == 1 else f"## {title} (part {part})\n\n" + text

    def needle(self, rng: random.Random) -> Needle:
        name, answer = rng.choice(NAMES), str(rng.randint(1000, 9999))
        return Needle(f"The reviewer of this section is {name}, and its review number is {answer}.",
                      f"What is the review number of the section reviewed by {name}? Answer with the number only.",
                      answer)

    def needle_place(self, rng: random.Random, paragraphs: int) -> int:
        return rng.randint(1, paragraphs)  # after the section's heading paragraph

    def question(self, rng: random.Random, doc: "Document") -> str:
        return f"What does the document \"{doc.title}\" explain? Answer in one sentence."

    def question_turn(self, question: str) -> str:
        return f"Question: {question}"


def _source(name: str):
    if name == "packages":
        from bench.blend_packages import PackageDocs

        return PackageDocs()
    return LanguageReference()


class _Defaults:
    """WORKLOADS[name].config_defaults without importing a source before it is used."""

    def __init__(self, name: str):
        self.name = name

    @property
    def config_defaults(self) -> dict:
        return _source(self.name).config_defaults


WORKLOADS = {"langref": _Defaults("langref"), "packages": _Defaults("packages")}


@dataclass(frozen=True)
class WorkloadConfig:
    name: str = "langref"  # which text, questions and needles (WORKLOADS)
    prompts: int = 100
    seed: int = 0
    doc_tokens: tuple[int, int] = (200, 600)  # each document's length, inclusive
    docs_per_prompt: tuple[int, int] = (3, 8)
    prompt_tokens: tuple[int, int] = (1000, 6000)  # a drawn prompt outside this is drawn again
    pool_docs: int = 40  # the documents prompts draw from: fewer means more recurrence
    needle_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"workload: must be one of {', '.join(WORKLOADS)}, got {self.name!r}")
        if self.prompts < 1:
            raise ValueError(f"prompts: must be >= 1, got {self.prompts}")
        for name in ("doc_tokens", "docs_per_prompt", "prompt_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}: must be (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
        if self.pool_docs < self.docs_per_prompt[1]:
            raise ValueError(f"pool_docs: must be >= docs_per_prompt's maximum {self.docs_per_prompt[1]}, "
                             f"got {self.pool_docs}")
        if not 0.0 <= self.needle_fraction <= 1.0:
            raise ValueError(f"needle_fraction: must be in [0, 1], got {self.needle_fraction}")


    @classmethod
    def named(cls, name: str, **overrides) -> "WorkloadConfig":
        """The config of workload `name`: its own document sizes, then `overrides` (None: the default)."""
        if name not in WORKLOADS:
            raise ValueError(f"workload: must be one of {', '.join(WORKLOADS)}, got {name!r}")
        given = {k: v for k, v in overrides.items() if v is not None}
        return cls(name=name, **(WORKLOADS[name].config_defaults | given))


@dataclass(frozen=True)
class Document:
    title: str
    text: str
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class BlendPrompt:
    prefix: list[int]  # system prompt and the user turn's opening
    chunks: list[list[int]]  # one per document, each tokenized alone
    question: list[int]  # the question and the assistant turn's opening
    titles: list[str]
    question_text: str
    needle_answer: str | None = None  # the planted number, for needle questions
    needle_doc: int | None = None  # which chunk holds the needle

    @property
    def tokens(self) -> list[int]:
        return [*self.prefix, *(t for c in self.chunks for t in c), *self.question]


def needle_correct(answer_text: str, needle: str) -> bool:
    """The answer's first number is the planted one (so "4817" and "It is 4817." both count)."""
    found = re.search(r"\d+", answer_text.replace(",", ""))
    return found is not None and found.group(0) == needle


class Workload:
    def __init__(self, tokenizer, config: WorkloadConfig = WorkloadConfig()):
        self.tokenizer = tokenizer
        self.config = config
        self.source = _source(config.name)
        turn = tokenizer.hf.apply_chat_template([{"role": "system", "content": self.source.system_prompt},
                                                 {"role": "user", "content": "\x00"}],
                                                tokenize=False, add_generation_prompt=True)
        self.opening, self.closing = turn.split("\x00")  # the template around the user's content
        self.documents = self._documents()
        if len(self.documents) < config.pool_docs:
            raise ValueError(f"pool_docs: the text gives {len(self.documents)} documents of "
                             f"{config.doc_tokens} tokens, fewer than {config.pool_docs}")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def token_counts(self, texts: list[str]) -> list[int]:
        """len(self.encode(t)) of each text, in one call (the tokenizer batches them)."""
        return [len(ids) for ids in self.tokenizer.hf(texts)["input_ids"]] if texts else []

    def _documents(self) -> list[Document]:
        """Each text cut at paragraph boundaries into pieces of `doc_tokens` tokens (the source's
        first `max_pieces` of each text, if it sets that). Pieces are grown by the paragraphs' own
        token counts; each piece is then tokenized whole and kept only if that count is within
        the range."""
        lo, hi = self.config.doc_tokens
        docs = []
        for title, paragraphs in self.source.texts():
            pieces: list[list[str]] = [[]]
            used = 0
            for paragraph, count in zip(paragraphs, self.token_counts(paragraphs)):
                size = count + 1  # + the paragraph break
                if used + size > hi and pieces[-1]:
                    if len(pieces) == self.source.max_pieces:
                        break
                    pieces.append([])
                    used = 0
                pieces[-1].append(paragraph)
                used += size
            for part, piece in enumerate(pieces, 1):
                name = title if part == 1 else f"{title} (part {part})"
                body = self.source.piece(title, part, piece)
                tokens = self.encode(body)
                if lo <= len(tokens) <= hi:
                    docs.append(Document(name, body, tuple(tokens)))
        return docs

    def prompts(self) -> list[BlendPrompt]:
        rng = random.Random(self.config.seed)
        pool = rng.sample(self.documents, self.config.pool_docs)
        return [self._prompt(rng, pool, i) for i in range(self.config.prompts)]

    def _prompt(self, rng: random.Random, pool: Sequence[Document], index: int) -> BlendPrompt:
        lo, hi = self.config.prompt_tokens
        prefix = self.encode(self.opening)
        while True:
            docs = rng.sample(list(pool), rng.randint(*self.config.docs_per_prompt))
            needle = rng.random() < self.config.needle_fraction
            target = rng.randrange(len(docs))
            chunks = [list(d.tokens) for d in docs]
            answer = None
            if needle:
                planted = self.source.needle(rng)
                answer, question = planted.answer, planted.question
                paragraphs = docs[target].text.rstrip("\n").split("\n\n")
                at = self.source.needle_place(rng, len(paragraphs))
                text = "\n\n".join(paragraphs[:at] + [planted.fact] + paragraphs[at:]) + "\n\n"
                chunks[target] = self.encode(text)
            else:
                question = self.source.question(rng, docs[target])
            question_ids = self.encode(f"{self.source.question_turn(question)}{self.closing}")
            total = len(prefix) + sum(map(len, chunks)) + len(question_ids)
            if lo <= total <= hi:
                return BlendPrompt(prefix, chunks, question_ids, [d.title for d in docs], question,
                                   answer, target if needle else None)


def main(argv: list[str] | None = None) -> int:
    from kvstore.decode import load_model

    args = sys.argv[1:] if argv is None else argv
    name = args[0] if args else "langref"
    workload = Workload(load_model("smollm2").tokenizer, WorkloadConfig.named(name))
    prompts = workload.prompts()
    lengths = [len(p.tokens) for p in prompts]
    uses: dict[tuple[int, ...], int] = {}
    for p in prompts:
        for c in p.chunks:
            uses[tuple(c)] = uses.get(tuple(c), 0) + 1
    print(f"{name}: {len(workload.documents)} documents of {workload.config.doc_tokens} tokens; "
          f"{len(prompts)} prompts of "
          f"{min(lengths)}-{max(lengths)} tokens (mean {statistics.mean(lengths):.0f}), "
          f"{sum(p.needle_answer is not None for p in prompts)} needle questions, "
          f"{len(uses)} distinct chunks used {sum(uses.values())} times")
    return 0


if __name__ == "__main__":
    sys.exit(main())

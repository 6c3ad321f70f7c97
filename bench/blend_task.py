"""The synthetic task of bench/blend_quality.py: "payload of the highest-level value before a marker".

A prompt is [prefix][chunk 1]...[chunk N][question]:

    prefix   = BOS v0                  v0: a value token
    chunk    = fillers, 1-2 value tokens and 2 markers (marker ids unique per prompt)
    question = Q ?m                    ?m: the query token naming marker m
    answer   = payload of the value token with the highest level among those *before marker m*

A value token is a (level, payload) pair: levels rank values, payloads are what is asked for, so
the answer is uniform over the payloads and cannot be guessed from the level statistics.
Filler tokens run in arithmetic progressions (a step per chunk); the model is also trained to
continue them, so fillers learn to look at their neighbours, as most tokens of real text do.

Why this needs attention across chunks *inside the chunk tokens' KV*: the cheap solution, and
the one a small model learns, is for each marker to gather the answer into its own residual
stream (one content-based attention: values score by level, the causal mask keeps only those
before the marker) and for the question to copy it from the marker it names. The question alone
cannot redo it: "values before that marker's position" compares two other tokens' positions. So
a marker's KV holds its answer only if the marker attended to the chunks (and prefix) before its
own: with each chunk's KV computed standalone (full KV reuse), a marker sees only its own chunk
and answers wrong whenever the top value sits earlier. Questions ask about exactly those markers;
CacheBlend has to find them (their KV deviates most) and recompute them.

Chunks come from a pool and recur across prompts at different positions, as retrieved documents
do; a prompt only combines chunks whose markers are distinct.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

# Vocabulary (token ids).
PAD, BOS, Q = 0, 1, 2
LEVELS, PAYLOADS = 12, 8
VALUE0 = 4  # value (level, payload) is token VALUE0 + level * PAYLOADS + payload
MARKERS = 40
MARKER0 = VALUE0 + LEVELS * PAYLOADS  # marker i is token MARKER0 + i
QUERY0 = MARKER0 + MARKERS  # the question naming marker i is token QUERY0 + i
FILLERS = 24
FILLER0 = QUERY0 + MARKERS
ANSWER0 = FILLER0 + FILLERS  # the answer "payload p" is token ANSWER0 + p
VOCAB_SIZE = 224  # >= ANSWER0 + PAYLOADS, rounded up to a multiple of 16

CHUNK_TOKENS = (16, 28)  # min, max tokens per chunk
VALUES_PER_CHUNK = (1, 2)
MARKERS_PER_CHUNK = 2


def is_value(token: int) -> bool:
    return VALUE0 <= token < VALUE0 + LEVELS * PAYLOADS


def is_filler(token: int) -> bool:
    return FILLER0 <= token < FILLER0 + FILLERS


def value_token(rng: random.Random) -> int:
    return VALUE0 + rng.randrange(LEVELS * PAYLOADS)


@dataclass(frozen=True)
class Chunk:
    tokens: tuple[int, ...]
    markers: tuple[int, ...]  # marker ids in the chunk


@dataclass(frozen=True)
class Example:
    prefix: list[int]
    chunks: list[list[int]]
    question: list[int]
    answer: int  # the answer token

    @property
    def prompt(self) -> list[int]:
        return self.prefix + [t for c in self.chunks for t in c] + self.question


def make_prefix(rng: random.Random) -> list[int]:
    return [BOS, value_token(rng)]


def make_chunk(rng: random.Random) -> Chunk:
    n = rng.randint(*CHUNK_TOKENS)
    start, step = rng.randrange(FILLERS), rng.randint(1, 3)
    tokens = [FILLER0 + (start + i * step) % FILLERS for i in range(n)]
    slots = rng.sample(range(n), MARKERS_PER_CHUNK + rng.randint(*VALUES_PER_CHUNK))
    markers = rng.sample(range(MARKERS), MARKERS_PER_CHUNK)
    for slot, marker in zip(slots, markers):
        tokens[slot] = MARKER0 + marker
    for slot in slots[MARKERS_PER_CHUNK:]:
        tokens[slot] = value_token(rng)
    return Chunk(tuple(tokens), tuple(markers))


def answer_at(prompt: list[int], index: int) -> int | None:
    """The answer token for the marker at `index`, or None when the top level before it is tied
    between different payloads (ambiguous: never asked)."""
    values = [t - VALUE0 for t in prompt[:index] if is_value(t)]
    top = max(v // PAYLOADS for v in values)
    payloads = {v % PAYLOADS for v in values if v // PAYLOADS == top}
    return ANSWER0 + payloads.pop() if len(payloads) == 1 else None


def pick_chunks(rng: random.Random, pool: list[Chunk], n: int) -> list[Chunk]:
    """n chunks of the pool with pairwise distinct markers, so a question names one marker."""
    while True:
        chosen = rng.sample(pool, n)
        markers = [m for c in chosen for m in c.markers]
        if len(set(markers)) == len(markers):
            return chosen


def questions(rng: random.Random, prefix: list[int], chunks: list[Chunk], count: int,
              cross_only: bool) -> list[tuple[int, int]]:
    """Up to `count` (marker id, answer token) pairs, distinct markers. With `cross_only`, only
    markers whose answer needs an earlier chunk or the prefix (standalone chunk KV gets them
    wrong)."""
    prompt = list(prefix)
    candidates: list[tuple[int, int, bool]] = []  # marker, answer, needs an earlier chunk
    for chunk in chunks:
        start = len(prompt)
        prompt.extend(chunk.tokens)
        for i in range(start, len(prompt)):
            if MARKER0 <= prompt[i] < MARKER0 + MARKERS and (answer := answer_at(prompt, i)) is not None:
                own = answer_at(prompt[start:], i - start) if any(map(is_value, prompt[start:i])) else None
                candidates.append((prompt[i] - MARKER0, answer, own != answer))
    pool = [c for c in candidates if c[2]] if cross_only else candidates
    return [(m, a) for m, a, _ in rng.sample(pool, min(count, len(pool)))]


def make_example(rng: random.Random, pool: list[Chunk], num_chunks: int) -> Example:
    """One evaluation prompt whose question is about a marker that needs an earlier chunk."""
    while True:
        prefix = make_prefix(rng)
        chunks = pick_chunks(rng, pool, num_chunks)
        asked = questions(rng, prefix, chunks, 1, cross_only=True)
        if asked:
            (marker, answer), = asked
            return Example(prefix, [list(c.tokens) for c in chunks], [Q, QUERY0 + marker], answer)


def training_sequence(rng: random.Random, num_chunks: int,
                      num_questions: int) -> tuple[list[int], list[int], list[int]]:
    """A training prompt (fresh chunks) with question/answer pairs appended; returns the tokens,
    the indices of the answers (the main loss) and of fillers that continue a progression (the
    auxiliary loss). Half the prompts ask about any marker, half only about cross-chunk ones."""
    prefix = make_prefix(rng)
    chunks = pick_chunks(rng, [make_chunk(rng) for _ in range(num_chunks * 3)], num_chunks)
    cross_only = rng.random() < 0.5
    asked = (cross_only and questions(rng, prefix, chunks, num_questions, cross_only=True)) or \
        questions(rng, prefix, chunks, num_questions, cross_only=False)
    seq = list(prefix)
    fillers = []  # progressions restart at each chunk: only triples inside one chunk are predictable
    for chunk in chunks:
        t = chunk.tokens
        fillers += [len(seq) + i for i in range(2, len(t)) if all(map(is_filler, t[i - 2:i + 1]))]
        seq += t
    answers = []
    for marker, answer in asked:
        seq += [Q, QUERY0 + marker, answer]
        answers.append(len(seq) - 1)
    return seq, answers, fillers

"""CacheBlend in the decode loop: reuse the KV of chunks that are not a prefix of the prompt.

A prompt is [prefix][chunk 1]...[chunk N][question] (a system prompt, retrieved documents or
tool outputs, the user's question). Its prefill:

    prefix    prefix reuse as usual (fetch what the store holds, compute the rest)
    chunks    `backend.blend`: each chunk's stored standalone KV, K re-rotated to the positions
              the chunk takes here; a missed chunk is computed standalone (positions 0..n-1),
              stored with `store_chunk` for the next request, and moved into place the same way
    recompute decode/recompute.py: fresh KV for the fraction `ratio` of chunk tokens that the
              selection rule picks (decode/blend_selection.py), restoring the cross-chunk
              attention standalone KV lacks
    question  computed in full, attending to everything before it: the first token's logits

With `audit_rate`, each chunk hit of at least one page is audited with that probability
(decode/chunk_audit.py: its KV rotated back to positions 0..n-1, its last full page recomputed
standalone there and compared with the stored page). A failed chunk is reported to the store,
which drops it, and is treated as a miss: computed standalone here, stored fresh, blended on.

Only the prefix goes back to the store under prefix keys. Blended chunk KV is not what a full
prefill computes (unless ratio = 1), so storing the whole prompt as a prefix would hand
approximate KV to exact prefix reuse.

Where cached K cannot be re-rotated exactly (RoPE whose rotation depends on more than the
position: dynamic NTK, YaRN, LongRoPE) the whole prompt is prefilled instead, with a
`BackendWarning`: slower, never wrong. Backend failures degrade the same way as prefix reuse:
missed chunks are computed here, nothing fails.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Sequence

import torch

from kvstore.decode.attention import AttentionContext
from kvstore.decode.blend_selection import TokenSelection
from kvstore.decode.chunk_audit import audit_chunk
from kvstore.decode.model import LlamaModel
from kvstore.decode.paged_cache import BlockTable, PagedKVCache
from kvstore.decode.recompute import selective_recompute
from kvstore.decode.reuse import BackendWarning, PrefixReuse, log
from kvstore.errors import Unsupported
from kvstore.rerotate import check_rerotatable, rerotate_into
from kvstore.reuse_audit import AuditOutcome, sampled

DEFAULT_BLEND_RATIO = 0.15  # the paper's operating point: quality of a full prefill at ~15% recompute


@dataclass(frozen=True)
class BlendOutcome:
    logits: torch.Tensor  # (V,) float32 of the last prompt token
    reused_tokens: int  # prefix tokens fetched + tokens of chunks the store held
    chunk_hits: list[bool] = field(default_factory=list)
    recomputed_tokens: int = 0  # chunk tokens recomputed through the layers after the first
    fetch_s: float = 0.0  # time spent talking to the store and placing its KV
    error: str | None = None  # why the store (or blending) could not be used, if it could not
    chunk_audits: tuple[AuditOutcome, ...] = ()  # the audited chunk hits' outcomes, in prompt order


def blended_prompt(prefix: Sequence[int], chunks: Sequence[Sequence[int]], question: Sequence[int]) -> list[int]:
    return [*prefix, *(t for chunk in chunks for t in chunk), *question]


def cache_tokens(prefix: Sequence[int], chunks: Sequence[Sequence[int]], question: Sequence[int],
                 max_new_tokens: int, page_size: int) -> int:
    """Cache slots a blended request needs: the sequence's pages, plus pages to compute the
    longest missed (or audited) chunk standalone beside it."""
    pages = lambda n: -(-n // page_size)  # noqa: E731
    sequence = len(blended_prompt(prefix, chunks, question)) + max_new_tokens
    return page_size * (pages(sequence) + pages(max((len(c) for c in chunks), default=0)))


class ChunkReuse(PrefixReuse):
    """PrefixReuse plus the chunk calls: blend, and store_chunk of the chunks computed here."""

    def load_chunks(self, chunks: list[list[int]],
                    start_pos: int) -> tuple[list[bool], torch.Tensor | None, str | None]:
        """(hits, KV (L, 2, T, H, D) of all chunks at their positions or None, error)."""
        error = self.register()
        if error:
            return [False] * len(chunks), None, error
        try:
            found = self._call_registered(lambda: self.backend.blend(self.model.name, chunks, start_pos=start_pos,
                                                                     tenant=self.tenant))
            kv = torch.as_tensor(found.kv)
            expected = self.model.spec.kv_shape(sum(map(len, chunks)))
            if len(found.hits) != len(chunks) or tuple(kv.shape) != expected or kv.dtype != self.model.dtype:
                raise ValueError(f"blend answered {len(found.hits)} hits and kv {tuple(kv.shape)} {kv.dtype} for "
                                 f"{len(chunks)} chunks, expected kv {expected} {self.model.dtype}")
        except Exception as exc:
            return [False] * len(chunks), None, self._degrade("blend", exc)
        return [bool(h) for h in found.hits], kv, None

    def audited_chunk(self, chunk: list[int], kv: torch.Tensor, position: int, cache: PagedKVCache,
                      audit_rate: float) -> AuditOutcome | None:
        """With probability `audit_rate`, audit a chunk hit (`kv`: blend's answer for it, at
        `position`) and report the outcome; None when not audited (or shorter than a page: no draw)."""
        if len(chunk) < self.model.spec.page_size or not sampled(audit_rate):
            return None
        outcome = audit_chunk(self.model, chunk, kv, position, cache)
        if not outcome.passed:
            log.warning("kvstore audit: model %s, chunk of %d tokens at position %d, %s; computing it standalone",
                        self.model.name, len(chunk), position, outcome.describe())
        self.report_audit(chunk, outcome, tier=None, chunk=True)  # the store names the tier holding the chunk
        return outcome

    def store_chunk(self, tokens: list[int], kv: torch.Tensor) -> str | None:
        try:
            self._call_registered(lambda: self.backend.store_chunk(self.model.name, tokens, kv, tenant=self.tenant))
        except Exception as exc:
            return self._degrade("store_chunk", exc)
        return None


def blend_prefill(model: LlamaModel, prefix: list[int], chunks: list[list[int]], question: list[int],
                  cache: PagedKVCache, table: BlockTable, reuse: ChunkReuse | None, *, ratio: float,
                  store: bool = True, selection: TokenSelection = TokenSelection(),
                  audit_rate: float = 0.0) -> BlendOutcome:
    """Prefill [prefix][chunks][question] into `table` (reserved for the whole sequence) and
    return the last token's logits. `reuse` None: no store, every chunk computed standalone.
    `selection`: which chunk tokens are recomputed (the deviation rule, or a control).
    `audit_rate`: the probability that a chunk hit is audited (the module docstring)."""
    if not question:
        raise ValueError("prompt_tokens: the question after the chunks must not be empty "
                         "(its last token gives the logits)")
    started = time.perf_counter()
    try:
        check_rerotatable(model.spec)
    except Unsupported as exc:
        warnings.warn(f"{exc.message}; prefilling the whole prompt instead", BackendWarning, stacklevel=3)
        return _full_prefill(model, blended_prompt(prefix, chunks, question), cache, table, exc.message)
    errors: list[str] = []
    reused = 0
    if prefix:
        hit = reuse.load_prefix(prefix, cache, table) if reuse else None
        reused = hit.reused_tokens if hit else 0
        if hit and hit.error:
            errors.append(hit.error)
        _run(model, prefix[reused:], reused, cache, table, logits=False)
    start = len(prefix)
    hits, kv, error = reuse.load_chunks(chunks, start) if reuse else ([False] * len(chunks), None, None)
    if error:
        errors.append(error)
    audits = _place_chunks(model, chunks, hits, kv, start, cache, table, reuse, errors, store=store,
                           audit_rate=audit_rate)
    reused += sum(len(chunk) for chunk, chunk_hit in zip(chunks, hits) if chunk_hit)
    offset = start + sum(map(len, chunks))
    fetch_s = time.perf_counter() - started
    chunk_ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=model.device)  # (C,)
    ends = [start + sum(map(len, chunks[:i + 1])) for i in range(len(chunks))]
    prefix_ids = torch.tensor(prefix, dtype=torch.long, device=model.device)  # (start,)
    question_ids = torch.tensor(question, dtype=torch.long, device=model.device)  # (Q,)
    recomputed = selective_recompute(model, chunk_ids, cache, table, start, ratio, ends, prefix_ids, selection,
                                     question_ids)
    logits = _run(model, question, offset, cache, table, logits=True)
    assert logits is not None
    return BlendOutcome(logits, reused, hits, recomputed, fetch_s, "; ".join(errors) or None, audits)


def _place_chunks(model: LlamaModel, chunks: list[list[int]], hits: list[bool], kv: torch.Tensor | None, start: int,
                  cache: PagedKVCache, table: BlockTable, reuse: ChunkReuse | None, errors: list[str], *,
                  store: bool, audit_rate: float) -> tuple[AuditOutcome, ...]:
    """Put each chunk's KV at its place in `table` from `start`: a hit's as `blend` answered it
    (after its audit, when drawn), a miss's computed standalone. A hit whose audit failed turns
    into a miss in `hits`. Returns the audits' outcomes."""
    audits = []
    offset = start
    for i, chunk in enumerate(chunks):
        if hits[i]:
            assert kv is not None and reuse is not None  # load_chunks answers the hits' KV
            chunk_kv = kv[:, :, offset - start:offset - start + len(chunk)]  # (L, 2, n, H, D)
            audit = reuse.audited_chunk(chunk, chunk_kv, offset, cache, audit_rate)
            if audit is not None:
                audits.append(audit)
            hits[i] = audit is None or audit.passed
        if not hits[i]:
            chunk_kv = _standalone(model, chunk, cache, reuse if store else None, errors, offset)
        cache.scatter(table, chunk_kv, start=offset)
        offset += len(chunk)
    return tuple(audits)


def _run(model: LlamaModel, tokens: Sequence[int], start: int, cache: PagedKVCache, table: BlockTable, *,
         logits: bool) -> torch.Tensor | None:
    """Prefill `tokens` at positions start.. (causal over everything before them)."""
    if not tokens:
        return None
    end = start + len(tokens)
    ids = torch.tensor(list(tokens), dtype=torch.long, device=model.device)  # (T,)
    out = model(ids, torch.arange(start, end, device=model.device), cache,
                AttentionContext.for_span(cache, table, start, end), logits="last" if logits else "none")
    table.num_tokens = max(table.num_tokens, end)
    return out


def _standalone(model: LlamaModel, chunk: list[int], cache: PagedKVCache, reuse: ChunkReuse | None,
                errors: list[str], position: int) -> torch.Tensor:
    """A missed chunk's KV computed alone at positions 0..n-1 (what the store keeps), stored for
    the next request, and returned moved to `position`: (L, 2, n, H, D)."""
    scratch = cache.new_table()
    cache.reserve(scratch, len(chunk))
    try:
        _run(model, chunk, 0, cache, scratch, logits=False)
        kv = cache.gather(scratch, 0, len(chunk))  # (L, 2, n, H, D) at positions 0..n-1
    finally:
        cache.release(scratch)
    if reuse is not None and (error := reuse.store_chunk(chunk, kv)):
        errors.append(error)
    moved = torch.empty_like(kv)  # (L, 2, n, H, D)
    rerotate_into(moved, kv, model.spec, position)
    return moved


def _full_prefill(model: LlamaModel, prompt: list[int], cache: PagedKVCache, table: BlockTable,
                  error: str) -> BlendOutcome:
    logits = _run(model, prompt, 0, cache, table, logits=True)
    assert logits is not None
    return BlendOutcome(logits, 0, error=error)

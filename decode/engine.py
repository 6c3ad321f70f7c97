"""`generate`: one request through the decode loop, reusing a cached prefix when a store has it.

    lookup -> fetch -> scatter into the paged cache -> prefill only the unmatched suffix
    -> first token (TTFT) -> store the prompt's new pages -> decode -> store prompt + output

The prompt is token ids, plain text, or a conversation (a list of {"role", "content"} messages,
rendered by the checkpoint's chat template); text needs a model with a tokenizer, and the result
then carries the answer's text too. Generation stops at the checkpoint's end-of-sequence ids
unless `stop_token_ids` says otherwise, as transformers' `generate` and vLLM do.

The last prompt token is always computed, so even a fully cached prompt yields logits. The
result says what was reused and what it cost. Without a backend this is a plain decode loop.

With `audit_rate`, a sampled hit is audited (kvstore/reuse_audit.py): its last full page is
prefilled here instead of reused and compared with the stored page; on a failure the store
drops the matched path and this request prefills its whole prompt, so it never answers from
KV that failed.

With `chunks`, the prompt is [prefix][chunk 1]...[chunk N][prompt_tokens] and its prefill is
CacheBlend's (decode/blend.py): the chunks' KV comes from the store wherever they sat before,
and a fraction `blend_ratio` of their tokens is recomputed. There `audit_rate` audits chunk hits
(decode/chunk_audit.py): a failed chunk is dropped by the store and computed standalone here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence, Union, cast

import torch

from kvstore.decode.attention import AttentionContext
from kvstore.decode.blend import DEFAULT_BLEND_RATIO, ChunkReuse, blend_prefill, blended_prompt, cache_tokens
from kvstore.decode.model import LlamaModel
from kvstore.decode.paged_cache import BlockTable, PagedKVCache
from kvstore.decode.reuse import BackendWarning
from kvstore.decode.sampling import Sampler, SamplingParams
from kvstore.backend import KVCacheBackend
from kvstore.reuse_audit import AuditOutcome, check_audit_rate

__all__ = ["GenerateResult", "generate", "BackendWarning", "Prompt"]

# Token ids, plain text, or a conversation for the chat template.
Prompt = Union[Sequence[int], torch.Tensor, str, Sequence[Mapping[str, str]]]


@dataclass(frozen=True)
class GenerateResult:
    tokens: list[int]  # generated tokens (the prompt not included)
    prompt_tokens: int
    reused_tokens: int  # prompt tokens whose KV came from the store
    computed_tokens: int  # prompt tokens prefilled here; reused + computed = prompt_tokens
    ttft_s: float  # request start -> first token, including lookup, fetch and prefill
    tpot_s: float | None  # mean time of a decode step (tokens after the first); None with one token
    fetch_s: float = 0.0  # part of ttft_s spent talking to the store and scattering its KV
    store_s: float = 0.0  # time spent storing prompt and output (after the first token, not in TPOT)
    stored_tokens: int = 0  # tokens of prompt + output the store holds after this request
    tiers: dict[str, int] = field(default_factory=dict)  # tier -> matched tokens, from lookup
    backend_error: str | None = None  # why the store could not be used, if it could not
    logits: torch.Tensor | None = None  # (N, V) float32 per generated token, when asked for
    chunk_hits: list[bool] | None = None  # CacheBlend: per chunk, whether the store held it
    recomputed_tokens: int = 0  # CacheBlend: chunk tokens recomputed past the first layer
    text: str | None = None  # the generated tokens as text, when the model has a tokenizer
    prompt_ids: list[int] = field(default_factory=list)  # the whole prompt as the model saw it
    audit: AuditOutcome | None = None  # the audit of this request's reused prefix, when it was audited
    chunk_audits: tuple[AuditOutcome, ...] = ()  # CacheBlend: the audits of chunk hits, in prompt order

    def summary(self) -> str:
        tpot = "-" if self.tpot_s is None else f"{self.tpot_s * 1e3:.1f} ms"
        blend = "" if self.chunk_hits is None else (
            f"chunks hit {sum(self.chunk_hits)}/{len(self.chunk_hits)}, "
            f"recomputed {self.recomputed_tokens} chunk tokens; ")
        audit = "" if self.audit is None else f"audit {self.audit.describe()}; "
        audit += "".join(f"chunk audit {a.describe()}; " for a in self.chunk_audits)
        return blend + audit + (f"reused {self.reused_tokens}/{self.prompt_tokens} prompt tokens, "
                f"computed {self.computed_tokens}, "
                f"TTFT {self.ttft_s * 1e3:.1f} ms (fetch {self.fetch_s * 1e3:.1f} ms), TPOT {tpot}, "
                f"store {self.store_s * 1e3:.1f} ms, generated {len(self.tokens)}")


def prompt_ids(model: LlamaModel, prompt: Prompt) -> list[int]:
    """The token ids of a prompt given as ids, text or a conversation."""
    if isinstance(prompt, str) or (isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], Mapping)):
        if model.tokenizer is None:
            raise ValueError(f"prompt: text needs a model with a tokenizer; {model.name} has none (pass token ids)")
        if isinstance(prompt, str):
            return model.tokenizer.encode(prompt)
        return model.tokenizer.chat(cast("Sequence[Mapping[str, str]]", prompt))  # its first item is a mapping
    if isinstance(prompt, torch.Tensor):
        return [int(t) for t in prompt.tolist()]
    return [int(t) for t in cast("Sequence[int]", prompt)]  # not text, a conversation or a tensor: ids


def _check_prompt(model: LlamaModel, prompt_tokens: Prompt) -> list[int]:
    prompt = prompt_ids(model, prompt_tokens)
    if not prompt:
        raise ValueError("prompt_tokens: must not be empty")
    bad = [t for t in prompt if not 0 <= t < model.arch.vocab_size]
    if bad:
        raise ValueError(f"prompt_tokens: ids must be in [0, {model.arch.vocab_size}), got {bad[0]}")
    return prompt


def generate(model: LlamaModel, prompt_tokens: Prompt, max_new_tokens: int,
             backend: KVCacheBackend | None = None, *, sampling: SamplingParams = SamplingParams(),
             stop_token_ids: Sequence[int] | None = None, tenant: str | None = None, timeout_s: float | None = 10.0,
             min_reuse_tokens: int = 1, store: bool = True, return_logits: bool = False,
             chunks: Sequence[Prompt] | None = None, prefix: Prompt = (),
             blend_ratio: float = DEFAULT_BLEND_RATIO, audit_rate: float = 0.0,
             on_token: Callable[[int], None] | None = None) -> GenerateResult:
    """Generate up to `max_new_tokens` tokens after `prompt_tokens` (ids, text or messages).

    Stops after a token of `stop_token_ids` (default: the checkpoint's end-of-sequence ids; pass
    `()` to always generate `max_new_tokens`). `on_token` is called with each token as it is
    sampled, for streaming.

    With a `backend`, the longest cached prefix of the prompt is fetched instead of computed
    (if at least `min_reuse_tokens` long), and with `store=True` the prompt and the output are
    stored for the next request. Each backend call is abandoned after `timeout_s`.

    With `chunks` (CacheBlend), the prompt is `prefix + chunk 1 + ... + chunk N + prompt_tokens`:
    stored chunks are reused at any position, a fraction `blend_ratio` of their tokens is
    recomputed (0: plain concatenation of their KV, 1: exactly a full prefill), missed chunks are
    computed and stored with `store_chunk`. Only the prefix is stored as a prefix.

    `audit_rate` (0 to 1): the probability that a hit, or with `chunks` a chunk hit, is audited
    (the module docstring).
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be an integer >= 1, got {max_new_tokens!r}")
    audit_rate = check_audit_rate(audit_rate)
    start_time = time.perf_counter()
    stops = model.eos_token_ids if stop_token_ids is None else tuple(int(t) for t in stop_token_ids)
    if chunks is not None:
        parts = _check_blend(model, prefix, chunks, prompt_tokens, blend_ratio)
        prompt, slots = blended_prompt(*parts), cache_tokens(*parts, max_new_tokens, model.spec.page_size)
    else:
        prompt = _check_prompt(model, prompt_tokens)
        parts, slots = None, len(prompt) + max_new_tokens
    cache = model.kv_cache(slots)
    table = cache.new_table()
    cache.reserve(table, len(prompt) + max_new_tokens)
    reuse = ChunkReuse(model, backend, tenant=tenant, timeout_s=timeout_s) if backend is not None else None
    try:
        return _run(model, prompt, max_new_tokens, cache, table, reuse, start_time, sampling=sampling,
                    stop_token_ids=stops, min_reuse_tokens=min_reuse_tokens, store=store,
                    return_logits=return_logits, blend=parts, blend_ratio=blend_ratio, audit_rate=audit_rate,
                    on_token=on_token)
    finally:
        cache.release(table)  # the cache outlives the request: give its pages back even on error


def _run(model: LlamaModel, prompt: list[int], max_new_tokens: int, cache: PagedKVCache, table: BlockTable,
         reuse: ChunkReuse | None, start_time: float, *, sampling: SamplingParams, stop_token_ids: Sequence[int],
         min_reuse_tokens: int, store: bool, return_logits: bool,
         blend: tuple[list[int], list[list[int]], list[int]] | None = None,
         blend_ratio: float = DEFAULT_BLEND_RATIO, audit_rate: float = 0.0,
         on_token: Callable[[int], None] | None = None) -> GenerateResult:
    n = len(prompt)
    audit = None
    device = model.device
    if blend is not None:
        outcome = blend_prefill(model, *blend, cache, table, reuse, ratio=blend_ratio, store=store,
                                audit_rate=audit_rate)
        hit, reused, fetch_s, logits = None, outcome.reused_tokens, outcome.fetch_s, outcome.logits
        table.num_tokens = n
    else:
        outcome = None
        hit = reuse.load_prefix(prompt, cache, table, min_reuse_tokens=min_reuse_tokens,
                                audit_rate=audit_rate) if reuse else None
        reused = hit.reused_tokens if hit else 0
        fetch_s = time.perf_counter() - start_time
        logits = _prefill(model, prompt, reused, cache, table)
        known = reused
        if reuse is not None and hit is not None and hit.audit is not None:  # (a hit comes from reuse)
            audit = reuse.finish_audit(hit.audit, cache, table)
            if audit.passed:
                known = hit.audit.end  # the withheld page is in the store already
            else:  # the reused prefix is not what this model computes: prefill all of it here
                reused = known = 0
                logits = _prefill(model, prompt, 0, cache, table)
    sampler = Sampler(sampling)
    output = [sampler(logits)]
    first_token_time = time.perf_counter()
    if on_token is not None:
        on_token(output[0])
    kept = [logits] if return_logits else None

    # Stored after the first token so it never delays it; the next turn's hit starts here.
    if outcome is not None and blend is not None:  # CacheBlend (an outcome comes from `blend`): only the
        # exact part, the prefix, is a prefix for others
        stored = reuse.store(blend[0], cache, table) if reuse and store and blend[0] else 0
    else:
        stored = reuse.store(prompt, cache, table, known_tokens=known) if reuse and store else known
    decode_start = time.perf_counter()
    stops = set(stop_token_ids)
    while len(output) < max_new_tokens and output[-1] not in stops:
        pos = n + len(output) - 1  # position of the token being fed (the last one sampled)
        logits = model(torch.tensor(output[-1:], device=device), torch.tensor([pos], device=device), cache,
                       AttentionContext.for_span(cache, table, pos, pos + 1), logits="last")
        table.num_tokens = pos + 1
        output.append(sampler(logits))
        if on_token is not None:
            on_token(output[-1])
        if kept is not None:
            kept.append(logits)
    end_time = time.perf_counter()

    if reuse and store and len(output) > 1 and outcome is None:
        # The last sampled token was never fed, so its KV does not exist: store up to the one before.
        stored = reuse.store(prompt + output[:-1], cache, table, known_tokens=stored)
    store_s = (decode_start - first_token_time) + (time.perf_counter() - end_time)
    return GenerateResult(
        tokens=output, prompt_tokens=n, reused_tokens=reused, computed_tokens=n - reused,
        ttft_s=first_token_time - start_time,
        tpot_s=(end_time - decode_start) / (len(output) - 1) if len(output) > 1 else None,
        fetch_s=fetch_s, store_s=store_s, stored_tokens=stored, tiers=hit.tiers if hit else {},
        backend_error=outcome.error if outcome else hit.error if hit else None,
        logits=torch.stack(kept) if kept is not None else None,
        chunk_hits=outcome.chunk_hits if outcome else None,
        recomputed_tokens=outcome.recomputed_tokens if outcome else 0,
        text=None if model.tokenizer is None else model.tokenizer.decode(output), prompt_ids=prompt, audit=audit,
        chunk_audits=outcome.chunk_audits if outcome else ())


def _prefill(model: LlamaModel, prompt: list[int], start: int, cache: PagedKVCache, table: BlockTable) -> torch.Tensor:
    """Prefill prompt[start:] after the KV of positions 0..start-1 in `table`; the last logits (V,)."""
    n = len(prompt)
    ids = torch.tensor(prompt[start:], dtype=torch.long, device=model.device)  # (n - start,)
    positions = torch.arange(start, n, device=model.device)  # (n - start,)
    logits = model(ids, positions, cache, AttentionContext.for_span(cache, table, start, n), logits="last")
    table.num_tokens = n
    return logits


def _check_blend(model: LlamaModel, prefix: Prompt, chunks: Sequence[Prompt],
                 question: Prompt, ratio: float) -> tuple[list[int], list[list[int]], list[int]]:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"blend_ratio: must be a number in [0, 1], got {ratio!r}")
    if not chunks:
        raise ValueError("chunks: must hold at least one chunk")
    checked = [_check_prompt(model, c) for c in chunks]  # each non-empty, ids in the vocabulary
    prefix_ids = prompt_ids(model, prefix) if len(prefix) else []
    return prefix_ids and _check_prompt(model, prefix_ids), checked, _check_prompt(model, question)

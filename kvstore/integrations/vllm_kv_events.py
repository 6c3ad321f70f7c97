"""The connector's KV events: what the store holds of an engine's blocks, as vLLM's own events.

vLLM's scheduler publishes `KVConnectorBase_V1.take_events()` in the same batches as its own
GPU events, through its own publisher and `--kv-events-config`, so every consumer of vLLM's
stream (llm-d's indexer, Dynamo's router) learns, under the engine's own block hashes, which of
its blocks the store holds and in which medium: "CPU", "STORAGE" (the disk tier; the shared
Redis tier with locality "REMOTE"), "GPU" for a kvstore GPU tier.

How: the scheduler side says which blocks a request saves (`expect`: the prompt, its vLLM block
hashes); the store reports every page entering or leaving a tier (kvstore/kv_events/recorder.py,
an in-memory log attached to this process's store). A vLLM block is `block_size / page_size`
store pages; it is held in a medium while every one of its pages is, so `take` turns the
store's reports into `BlockStored` (a block becomes held there: its hash, its parent's, its
token ids, vLLM's block size) and `BlockRemoved` (it is not any more). A save that failed or was
refused stores no page, so it reports nothing; a block the store already held is reported as
soon as a request expects it.

The store's events come from this process's store (`StoreEventSource`) or, with a sidecar
(`url`), from the sidecar's own stream (`kv_events_endpoint`: kvstore/kv_events/subscriber.py). The store's
page keys are computed here from the request's tokens and salt in the default tenant (the only
one in-process; a sidecar's without an auth file): a sidecar tenant named by a bearer token has
keys this side cannot compute, and its blocks are not reported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from kvstore.keys import namespace_key, page_key, salt_root, tokens_bytes
from kvstore.kv_events.log import KVEventLog
from kvstore.kv_events.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, block_hash

Medium = tuple  # (medium, locality)


@dataclass
class _Block:
    hash: Any  # vLLM's external block hash (bytes, or int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    parent: Any  # the previous block's, None for a prompt's first
    token_ids: list[int]
    pages: tuple[int, ...]  # the store pages that hold it (their block hashes)
    announced: frozenset = frozenset()  # media a BlockStored was sent for


class StoreEventSource:
    """The reports of this process's store, through an in-memory log."""

    def __init__(self, store: Any):
        self.store = store
        self.log = KVEventLog()
        store.attach_kv_events(self.log)

    def take(self) -> list[Any]:
        return self.log.take(self.store)

    def close(self) -> None:
        self.store.detach_kv_events(self.log)


class ConnectorEvents:
    def __init__(self, source: Any, model: str, spec: Any, block_size: int):
        """`source.take()` gives the store's events (StoreEventSource, or a sidecar's stream:
        kvstore/kv_events/subscriber.py)."""
        self.source, self.model, self.spec, self.block_size = source, model, spec, block_size
        self._root = namespace_key(model, spec.fingerprint)  # the default tenant's
        self._media: dict[BlockHash, set[Medium]] = {}  # store page (its block hash) -> media holding it
        self._blocks: dict[Any, _Block] = {}  # vLLM hash -> block
        self._block_of: dict[BlockHash, Any] = {}  # store page -> the vLLM hash of its block
        self._out: list[Any] = []

    def expect(self, salt: str | None, tokens: Sequence[int], block_hashes: Sequence[Any]) -> None:
        """A request saves the blocks of `tokens` (whole blocks), hashed by vLLM as `block_hashes`."""
        self._apply_store_events()
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        P, B = self.spec.page_size, self.block_size
        parent_key = salt_root(self._root, salt)
        parent = None
        for i, raw in enumerate(block_hashes[:len(tokens) // B]):
            pages = []
            for s in range(i * B, (i + 1) * B, P):
                parent_key = page_key(parent_key, tokens_bytes(tokens[s:s + P]))
                pages.append(block_hash(parent_key))
            vllm_hash = maybe_convert_block_hash(raw)
            block = self._blocks.get(vllm_hash)
            if block is None:
                block = self._blocks[vllm_hash] = _Block(vllm_hash, parent, list(tokens[i * B:(i + 1) * B]),
                                                         tuple(pages))
                for page in pages:
                    self._block_of[page] = vllm_hash
                self._refresh(block)
            parent = vllm_hash

    def take(self) -> list[Any]:
        """vLLM's events for what changed since the last take (vLLM's own structs)."""
        self._apply_store_events()
        out, self._out = self._out, []
        return [_to_vllm(event) for event in out]

    def close(self) -> None:
        self.source.close()

    # -- from the store's pages to vLLM's blocks -------------------------------------------------
    def _apply_store_events(self) -> None:
        for event in self.source.take():
            if isinstance(event, BlockStored):
                touched = event.block_hashes
                for page in touched:
                    self._media.setdefault(page, set()).add((event.medium, event.locality))
            elif isinstance(event, BlockRemoved):
                touched = event.block_hashes
                for page in touched:
                    held = self._media.get(page)
                    if held is not None:
                        held.discard((event.medium, event.locality))
                        if not held:
                            del self._media[page]
            else:
                self._media.clear()
                for block in list(self._blocks.values()):
                    self._refresh(block)
                continue
            for page in touched:
                vllm_hash = self._block_of.get(page)
                if vllm_hash is not None:
                    self._refresh(self._blocks[vllm_hash])

    def _refresh(self, block: _Block) -> None:
        held: set[Medium] | None = None
        for page in block.pages:
            media = self._media.get(page, set())
            held = set(media) if held is None else held & media
        now = frozenset(held or ())
        for medium, locality in sorted(now - block.announced, key=str):
            self._out.append(BlockStored(block_hashes=[block.hash], parent_block_hash=block.parent,
                                         token_ids=block.token_ids, block_size=self.block_size, medium=medium,
                                         locality=locality))
        for medium, locality in sorted(block.announced - now, key=str):
            self._out.append(BlockRemoved(block_hashes=[block.hash], medium=medium, locality=locality))
        was, block.announced = block.announced, now
        if was and not now and not any(page in self._media for page in block.pages):
            del self._blocks[block.hash]  # the store holds none of it: forgotten until expected again
            for page in block.pages:
                if self._block_of.get(page) == block.hash:
                    del self._block_of[page]


def _to_vllm(event: Any) -> Any:
    from vllm.distributed import kv_events as vllm_events

    if isinstance(event, BlockStored):
        return vllm_events.BlockStored(block_hashes=event.block_hashes, parent_block_hash=event.parent_block_hash,
                                       token_ids=event.token_ids, block_size=event.block_size, lora_id=None,
                                       medium=event.medium, lora_name=None, locality=event.locality)
    if isinstance(event, BlockRemoved):
        return vllm_events.BlockRemoved(block_hashes=event.block_hashes, medium=event.medium,
                                        locality=event.locality)
    assert isinstance(event, AllBlocksCleared)
    return vllm_events.AllBlocksCleared()

"""What a subscriber knows after applying KV events in order: per (medium, locality), the blocks
held and how they chain (`parent`, `token_ids`).

The picture a router keeps (llm-d's indexer, Dynamo's radix tree), in a few lines, so tests and
bench/kv_router.py hold the store to it: a view that applied every event of a store holds, per
tier, exactly the pages the store holds.
"""
from __future__ import annotations

from typing import Iterable

from kvstore.kv_events.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent

Medium = tuple  # (medium, locality)


class KVEventView:
    def __init__(self) -> None:
        self.held: dict[Medium, set[BlockHash]] = {}
        self.parents: dict[BlockHash, BlockHash | None] = {}
        self.tokens: dict[BlockHash, list[int]] = {}
        self.extra: dict[BlockHash, tuple | None] = {}  # its extra key (kvstore: model, tenant)
        self.applied = 0

    def apply(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            self.applied += 1
            if isinstance(event, BlockStored):
                held = self.held.setdefault((event.medium, event.locality), set())
                parent = event.parent_block_hash
                size = event.block_size
                for i, block in enumerate(event.block_hashes):
                    held.add(block)
                    self.parents[block] = parent
                    self.tokens[block] = event.token_ids[i * size:(i + 1) * size]
                    self.extra[block] = event.extra_keys[i] if event.extra_keys else None
                    parent = block
            elif isinstance(event, BlockRemoved):
                held = self.held.get((event.medium, event.locality))
                if held is not None:
                    held.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.held.clear()
                self.parents.clear()
                self.tokens.clear()
                self.extra.clear()

    def holds(self, block: BlockHash) -> list[Medium]:
        return [medium for medium, blocks in self.held.items() if block in blocks]

    def pages(self, medium: Medium) -> set[BlockHash]:
        return set(self.held.get(medium, ()))

"""What the store reports to KV-event subscribers: every page entering or leaving a tier, once.

Placement is the one place pages enter and leave tiers (docs/design.md §4), so it is the one
place that reports them: `Placement.add` calls `stored`, `Placement._discard` calls `removed`,
and a store that publishes a page it has just written calls `published` (a page being written is
not matchable, so it is reported only once it is `ready`; a store that fails or is refused never
makes it ready and reports nothing). Tiers know nothing of events.

A report is a small tuple (a *record*), made under the store's lock and handed to each attached
sink's `append`, which must not block: turning it into a vLLM event (kvstore/kv_events/wire.py) is
the sink's work, on its own thread. A sink attached to a live store first gets `reset` with the
store's whole picture (`snapshot`: `AllBlocksCleared`, then every ready page in every tier,
parents first), which is also how a restarted store reports what its disk tier holds and how a
sink that fell behind and dropped records catches up. Closing the store reports
`AllBlocksCleared`: a closed store serves nothing.

Records:
    (STORED, key, parent key or None, token bytes, tier, (extra key, block size))
    (REMOVED, key, tier)
    (CLEARED,)
With no sink attached the store has no recorder at all: placement tests `events is None`.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

from kvstore.index import Node, PageIndex
from kvstore.kv_events.wire import (TIER_MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, block_hash,
                                    token_list)
from kvstore.registry import ModelRegistry

STORED, REMOVED, CLEARED = 0, 1, 2
Record = tuple


class KVEventSink(Protocol):
    def append(self, record: Record) -> None:
        """One record, under the store's lock: must return at once."""

    def reset(self, records: list[Record]) -> None:
        """The store's whole picture (CLEARED first), under the store's lock: replaces whatever
        the sink still holds unsent, which it supersedes."""


class KVEventRecorder:
    def __init__(self, registry: ModelRegistry):
        self.registry = registry
        self.sinks: list[KVEventSink] = []
        self._emit: Callable[[Record], None] = _nothing
        # (namespace, chunk page?) -> (extra key, block size): what every event of its pages carries.
        self._described: dict[tuple[bytes, bool], tuple[tuple[Any, ...], int]] = {}

    def attach(self, sink: KVEventSink, index: PageIndex) -> None:
        sink.reset(self.snapshot(index))
        if sink not in self.sinks:  # attached again: it only gets the picture again
            self.sinks.append(sink)
        self._rebind()

    def detach(self, sink: KVEventSink) -> None:
        if sink in self.sinks:
            self.sinks.remove(sink)
        self._rebind()

    def _rebind(self) -> None:
        sinks = list(self.sinks)
        if not sinks:
            self._emit = _nothing
        elif len(sinks) == 1:
            self._emit = sinks[0].append
        else:
            def emit(record: Record) -> None:
                for sink in sinks:
                    sink.append(record)
            self._emit = emit

    # -- placement's reports (under the store's lock) ----------------------------------------
    def stored(self, node: Node, tier: str) -> None:
        parent = node.parent
        assert parent is not None
        chunk = node.root.key != node.namespace
        info = self._described.get((node.namespace, chunk))
        if info is None:
            info = self._describe(node.namespace, chunk, node.num_tokens)
        self._emit((STORED, node.key, None if parent.parent is None else parent.key, node.tokens, tier, info))

    def removed(self, node: Node, tier: str) -> None:
        self._emit((REMOVED, node.key, tier))

    def published(self, node: Node) -> None:
        """A page just made ready: its copies so far are reported now."""
        for tier in node.tiers:
            self.stored(node, tier)

    def cleared(self) -> None:
        self._emit((CLEARED,))

    def snapshot(self, index: PageIndex) -> list[Record]:
        records: list[Record] = [(CLEARED,)]
        emit, self._emit = self._emit, records.append
        try:
            for node in sorted((n for n in index.nodes.values() if n.ready), key=lambda n: n.depth):
                for tier in node.tiers:
                    self.stored(node, tier)
        finally:
            self._emit = emit
        return records

    def _describe(self, namespace: bytes, chunk: bool, num_tokens: int) -> tuple[tuple[Any, ...], int]:
        model = self.registry.models_by_namespace.get(namespace)
        if model is None:  # pages on disk of a model nobody registered: keyed by namespace alone
            return (("namespace", namespace.hex()), num_tokens)
        extra = (model.name, model.tenant, "chunk") if chunk else (model.name, model.tenant)
        info = self._described[(namespace, chunk)] = (extra, model.spec.page_size)
        return info


def _nothing(record: Record) -> None:
    pass


def record_to_event(record: Record) -> KVEvent:
    """The vLLM event a record stands for (on the sink's thread: token ids are listed here)."""
    kind = record[0]
    if kind == STORED:
        _, key, parent, tokens, tier, (extra, block_size) = record
        medium, locality = TIER_MEDIA.get(tier, (tier.upper(), None))
        return BlockStored(block_hashes=[block_hash(key)],
                           parent_block_hash=None if parent is None else block_hash(parent),
                           token_ids=token_list(tokens), block_size=block_size, medium=medium, extra_keys=[extra],
                           locality=locality)
    if kind == REMOVED:
        medium, locality = TIER_MEDIA.get(record[2], (record[2].upper(), None))
        return BlockRemoved(block_hashes=[block_hash(record[1])], medium=medium, locality=locality)
    return AllBlocksCleared()


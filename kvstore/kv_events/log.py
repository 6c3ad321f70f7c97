"""A KV-event sink that keeps records in memory until taken: for a caller in the store's own
process (the vLLM connector's `take_events`, tests) that reads events at its own pace.

Bounded like the sidecar's publisher: past `max_records` unsent records it stops keeping them,
counts them in `dropped`, and asks the store for its whole picture again on the next `take`
(`KVStore.resync_kv_events`), so what a reader applies stays exact.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from kvstore.kv_events.recorder import Record, record_to_event
from kvstore.kv_events.wire import KVEvent

if TYPE_CHECKING:
    from kvstore.store import KVStore


class KVEventLog:
    def __init__(self, max_records: int = 1 << 20):
        if isinstance(max_records, bool) or not isinstance(max_records, int) or max_records < 1:
            raise ValueError(f"max_records: expected an integer >= 1, got {max_records!r}")
        self.max_records = max_records
        self._records: deque[Record] = deque()
        self.dropped = 0  # records past the bound, superseded by a resync
        self._limit = max_records  # the bound, plus the size of a snapshot held
        self._behind = False

    # -- KVEventSink ---------------------------------------------------------------------------
    def append(self, record: Record) -> None:
        if self._behind:
            self.dropped += 1
            return
        if len(self._records) >= self._limit:
            self._behind = True
            self.dropped += 1
            return
        self._records.append(record)

    def reset(self, records: list[Record]) -> None:
        self._limit = self.max_records + len(records)
        self._records = deque(records)  # a take in flight finishes the old one: records before these
        self._behind = False

    # -- the reader ----------------------------------------------------------------------------
    def take_records(self, store: "KVStore | None" = None) -> list[Record]:
        """Every record since the last take, in order (after a resync from `store` if the log fell behind)."""
        if self._behind and store is not None:
            store.resync_kv_events(self)
        # append and reset run under the store's lock, this on any thread: popleft and append on a
        # deque are atomic, so nothing is lost or taken twice.
        records, taken = self._records, []
        while records:
            taken.append(records.popleft())
        return taken

    def take(self, store: "KVStore | None" = None) -> list[KVEvent]:
        return [record_to_event(record) for record in self.take_records(store)]

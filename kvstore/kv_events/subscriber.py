"""The KV events of a sidecar (`kvstore serve --kv-events-endpoint`), read by the connector.

With a sidecar (`url`) the store reports its pages on the sidecar's ZeroMQ stream; the
connector's scheduler side subscribes to it (`kv_events_endpoint` in kv_connector_extra_config)
and reads it without blocking once a step (`take`), so `take_events()` can say which of the
engine's blocks the sidecar holds. With `kv_events_replay_endpoint` it first asks the sidecar's
ROUTER for every batch it still keeps (the picture the sidecar sent at its start, if still
buffered) and fills a gap in the sequence numbers the same way; what the replay buffer no longer
holds is reported once it changes again.

A SUB socket receives only what the publisher sends after the subscription has reached it (a
ZeroMQ PUB drops the rest), so a batch sent while the source is joining arrives neither live
nor, when nothing follows it, as a gap. Until the first batch arrives live the source therefore
asks the replay endpoint again, at most every JOIN_REPLAY_EVERY_S, from where it stands.
"""
from __future__ import annotations

import logging
import time

import zmq

from kvstore.kv_events.wire import KVEvent, decode_batch

log = logging.getLogger("kvstore.vllm")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_TIMEOUT_MS = 200  # a replay that does not answer costs a step at most this long
JOIN_REPLAY_EVERY_S = 0.5  # until the subscription is live: how often a take replays what it may have missed


class SidecarEventSource:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, context: zmq.Context | None = None):
        self._ctx = context or zmq.Context.instance()
        self.sub = self._ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.next_seq: int | None = None  # the batch expected next; None before the first
        self._live = False  # a batch arrived on the SUB: the subscription has reached the publisher
        self._next_join_replay = 0.0  # monotonic time of the next replay while not live

    def take(self) -> list[KVEvent]:
        """Every event received since the last take, in order (replayed ones first)."""
        events: list[KVEvent] = []
        if self.replay_endpoint is not None and not self._live and time.monotonic() >= self._next_join_replay:
            events += self._replay(0 if self.next_seq is None else self.next_seq, None)
            self._next_join_replay = time.monotonic() + JOIN_REPLAY_EVERY_S
        while True:
            try:
                _, seq_bytes, payload = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return events
            except ValueError:  # not three frames: not a KV-event stream
                continue
            seq = int.from_bytes(seq_bytes, "big")
            self._live = True
            if self.next_seq is not None and seq < self.next_seq:
                continue  # had it from a replay
            if self.next_seq is not None and seq > self.next_seq and self.replay_endpoint is not None:
                events += self._replay(self.next_seq, seq)
            events += self._decode(payload)
            self.next_seq = seq + 1

    def _replay(self, start: int, stop: int | None) -> list[KVEvent]:
        dealer = self._ctx.socket(zmq.DEALER)
        events: list[KVEvent] = []
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while dealer.poll(REPLAY_TIMEOUT_MS):
                frames = dealer.recv_multipart()
                if len(frames) != 4 or frames[2] == END_SEQ:
                    break
                seq = int.from_bytes(frames[2], "big")
                if seq >= start and (stop is None or seq < stop) and (self.next_seq is None or seq >= self.next_seq):
                    events += self._decode(frames[3])
                    self.next_seq = seq + 1
        finally:
            dealer.close(linger=0)
        return events

    @staticmethod
    def _decode(payload: bytes) -> list[KVEvent]:
        try:
            return list(decode_batch(payload).events)
        except ValueError as exc:
            log.warning("kvstore: a KV event batch from the sidecar was not readable (%s); skipped", exc)
            return []

    def close(self) -> None:
        self.sub.close(linger=0)

"""The sidecar answers first and lets the eviction policy learn after (api/server/catch_up.py): every
request it answers, a data request (the data plane) or an admin one (aiohttp), is learnt from once its answer is out,
and a busy store lock delays that learning instead of stalling the event loop."""
from __future__ import annotations

import asyncio
import time

from api_helpers import MAX_BODY_BYTES, LiveServer, random_kv

from kvstore.api.server.catch_up import CatchUp
from kvstore.api.client import KVStoreClient
from kvstore.api.server.config import ServerConfig
from kvstore import KVStore, ModelSpec


def _wait_caught_up(policy, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while policy.pending and time.monotonic() < deadline:
        time.sleep(0.005)


def test_every_answered_request_is_learnt_from_after_its_answer(store: KVStore, spec: ModelSpec) -> None:
    policy = store._placement.policies["cpu"]  # duel, the default
    assert policy.pending is None  # an in-process store learns inline
    server = LiveServer(store, ServerConfig(max_body_bytes=MAX_BODY_BYTES))
    try:
        assert policy.pending == []  # the app holds the learning for after its answers
        with KVStoreClient(server.url, shared_memory_bytes=0) as client:
            client.register_model("m", spec)
            for first in (0, 100):
                assert client.store("m", list(range(first, first + 12)), random_kv(spec, 12, seed=2)).new_pages == 3
            assert client.fetch("m", list(range(12))).matched_tokens == 12
        _wait_caught_up(policy)
        assert policy.pending == []
        # Both shadows saw the six pages stored and the three fetched again: the duel learnt
        # from every request.
        assert all(len(shadow) == 6 for shadow in policy.shadows)
        assert all(sum(page.hits for page in shadow.pages.values()) == 3 for shadow in policy.shadows)
    finally:
        server.close()
    assert policy.pending is None  # the app's cleanup hands the store back learning inline


async def test_a_busy_store_lock_delays_the_catch_up_and_never_blocks_the_loop() -> None:
    class BusyStore:  # a LoopStore whose lock a pool thread holds: catch_up_unless_busy never waits
        calls = 0

        def catch_up_unless_busy(self) -> bool:
            self.calls += 1
            return self.calls >= 3  # the lock is held by a pool thread twice

    store = BusyStore()
    catch_up = CatchUp(store)
    catch_up.soon()
    catch_up.soon()  # already queued: one catch-up, not two
    for _ in range(100):
        await asyncio.sleep(0.002)
        if not catch_up.queued:
            break
    assert store.calls == 3 and not catch_up.queued

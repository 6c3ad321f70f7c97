"""The eviction policy learns after the answer: the sidecar's half of `KVStore.learn_later`.

`duel`, the default policy, replays every page a request stores or reads through two shadow
caches to learn which of its two rules to follow. That is most of what the policy costs a store
(kvstore/policies/duel.py, `DuelPolicy`), and none of it changes the answer. So the app holds it
(`learn_later` when the app is made, undone on cleanup) and replays it once an answer is
written: `soon()` queues one `catch_up` behind the answers of the current loop pass, where it
runs while the client reads its answer and sends the next request. The data plane calls it after
each answer it writes; aiohttp's `learn_after` middleware (api/admin/middleware.py) after each admin one.

A pool thread holding the store's lock (a disk store, a blend) makes the catch-up retry a
millisecond later rather than block the event loop.
"""
from __future__ import annotations

import asyncio
from typing import Any

RETRY_S = 0.001  # the store's lock was busy: try again this much later


class CatchUp:
    """At most one queued catch-up at a time. `loop_store`: the app's `LoopStore`
    (api/server/loop_store.py), whose `catch_up_unless_busy` never waits for the store's lock."""

    def __init__(self, loop_store: Any):
        self.loop_store = loop_store
        self.queued = False

    def soon(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """`loop`: the running loop, when the caller has it (asyncio.get_running_loop() makes a
        getpid syscall, once per answer otherwise)."""
        if not self.queued:
            self.queued = True
            (loop or asyncio.get_running_loop()).call_soon(self._run)

    def _run(self) -> None:
        if self.loop_store.catch_up_unless_busy():
            self.queued = False
        else:
            asyncio.get_running_loop().call_later(RETRY_S, self._run)

"""Work that can wait on I/O never runs on the sidecar's event loop: while a lookup waits for a
Redis that accepts connections but never answers, the sidecar keeps answering other requests."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

from aiohttp.test_utils import TestClient, TestServer
from api_helpers import MAX_BODY_BYTES, call

from kvstore.api.app import create_app
from kvstore.api.config import ServerConfig
from kvstore import KVStore, ModelSpec, StoreConfig

REDIS_TIMEOUT_S = 3.0


def _silent_server() -> tuple[socket.socket, list[socket.socket]]:
    """A TCP listener that accepts connections and never sends a byte (a hung Redis)."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return listener, accepted


async def test_a_hung_redis_does_not_stall_other_requests(tmp_path):
    listener, accepted = _silent_server()
    port = listener.getsockname()[1]
    config = StoreConfig(data_dir=str(tmp_path / "data"), cpu_bytes=16 << 20, disk_bytes=0,
                         redis_url=f"redis://127.0.0.1:{port}", redis_timeout_s=REDIS_TIMEOUT_S)
    spec = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)
    try:
        with KVStore(config) as store:
            store.register_model("m", spec)
            app = create_app(store, ServerConfig(max_body_bytes=MAX_BODY_BYTES))
            async with TestClient(TestServer(app)) as http:
                began = time.monotonic()
                lookup = asyncio.ensure_future(call(http, "POST", "/v1/lookup", {"model": "m", "tokens": list(range(12))}))
                await asyncio.sleep(0.2)  # the lookup is now waiting on Redis
                status, body = await call(http, "GET", "/healthz", headers={})
                healthz_s = time.monotonic() - began
                assert status == 200 and body == {"status": "ok"}
                assert not lookup.done()  # still waiting for Redis...
                assert healthz_s < REDIS_TIMEOUT_S / 2  # ...and the loop answered meanwhile
                status, body = await lookup
                assert status == 200 and body["matched_tokens"] == 0  # Redis gave nothing: a miss, not an error
    finally:
        listener.close()
        for conn in accepted:
            conn.close()

"""Settings of the HTTP sidecar (address, auth, limits), next to the store's `StoreConfig`.

Frozen and validated like every config in kvstore; `kvstore serve` builds it from flags and
`KVSTORE_*` variables (kvstore/cli.py is the one place that reads them).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvstore.api.protocol import is_loopback
from kvstore.api.server.event_loop import EVENT_LOOPS
from kvstore.config import check_int
from kvstore.kv_events.wire import check_endpoints

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8100  # 0 picks a free port; the startup line names the one bound
    auth_file: str | None = None  # JSON object {"<bearer token>": "<tenant>", ...}
    max_body_bytes: int = 1 << 30
    log_level: str = "info"
    insecure: bool = False  # allow a non-loopback bind without an auth file
    shutdown_timeout_s: float = 30.0  # how long SIGTERM waits for in-flight requests
    socket_buffer_bytes: int = 4 << 20  # SO_SNDBUF/SO_RCVBUF: a 2 MiB page in one send
    executor_threads: int = 8  # threads for blocking store calls (LMDB, big copies)
    body_timeout_s: float = 60.0  # a whole request body must arrive within this (slow clients: 408)
    max_connections: int = 1024  # open client connections; one more is answered 503 and closed
    shared_memory: bool = True  # same-host clients may move KV through shared memory (api/server/shared_memory.py)
    # A fetch or store moving at most this many bytes with no I/O to do (memory tiers only, no
    # Redis, no disk writes) runs on the event loop: a copy that size costs about what the hop to a
    # pool thread and back does on a busy host, so the hop would only add to it.
    inline_copy_bytes: int = 4 << 20
    # The event loop `kvstore serve` runs on: "auto" (uvloop when installed, else asyncio's),
    # "uvloop" or "asyncio" (api/server/event_loop.py says why).
    event_loop: str = "auto"
    # KV events for routers (kvstore/kv_events/publisher.py, docs/kv_events.md): vLLM's ZeroMQ wire,
    # PUB on `kv_events_endpoint` (None: no events, and the store reports nothing), replays on
    # `kv_events_replay_endpoint`, each message under `kv_events_topic`.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_max_queue_records: int = 100_000  # unsent events held; past it they are dropped, counted, resynced
    kv_events_replay_batches: int = 10_000  # batches kept for replay

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host: expected an address or host name, got {self.host!r}")
        check_int("port", self.port, 0, 65535)
        check_int("max_body_bytes", self.max_body_bytes, 1024)
        check_int("socket_buffer_bytes", self.socket_buffer_bytes, 0)
        check_int("executor_threads", self.executor_threads, 1, 1024)
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level: must be one of {', '.join(LOG_LEVELS)}; got {self.log_level!r}")
        for name in ("insecure", "shared_memory"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected true or false, got {getattr(self, name)!r}")
        if not (isinstance(self.shutdown_timeout_s, (int, float)) and 0 <= self.shutdown_timeout_s <= 3600):
            raise ValueError(f"shutdown_timeout_s: must be in [0, 3600], got {self.shutdown_timeout_s!r}")
        if not (isinstance(self.body_timeout_s, (int, float)) and 0 < self.body_timeout_s <= 3600):
            raise ValueError(f"body_timeout_s: must be in (0, 3600], got {self.body_timeout_s!r}")
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(f"event_loop: must be one of {', '.join(EVENT_LOOPS)}; got {self.event_loop!r}")
        check_int("max_connections", self.max_connections, 1, 1 << 20)
        check_int("inline_copy_bytes", self.inline_copy_bytes, 0, 64 << 20)
        check_endpoints(self.kv_events_endpoint, self.kv_events_replay_endpoint)
        if not isinstance(self.kv_events_topic, str):
            raise ValueError(f"kv_events_topic: expected a string, got {self.kv_events_topic!r}")
        check_int("kv_events_max_queue_records", self.kv_events_max_queue_records, 1, 1 << 26)
        check_int("kv_events_replay_batches", self.kv_events_replay_batches, 0, 1 << 24)
        if self.auth_file is not None and (not isinstance(self.auth_file, str) or not self.auth_file):
            raise ValueError(f"auth_file: expected a path, got {self.auth_file!r}")

    @property
    def is_loopback(self) -> bool:
        """True when every address `host` resolves to is a loopback address."""
        return is_loopback(self.host)




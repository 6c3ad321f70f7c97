"""Connecting to Redis, and staying out of its way while it is down.

- `make_client(url, timeout_s)`: a redis-py client for `redis://`, `rediss://`, `unix://` URLs, or
  a `RedisCluster` client for `redis+cluster://` / `rediss+cluster://` (the cluster client routes
  each key of a pipeline to its node, so per-key GET/SET pipelines work without hash tags). Every
  socket operation times out after `timeout_s` and redis-py's own retries are off: a request must
  never wait longer than that on a dead Redis (redis-py 6+ retries three times by default).
  The protocol is RESP2 (redis-py 8 defaults to RESP3): the tier's GET reader
  (tiers/redis_reader.py) then never meets out-of-band push messages.
- `Breaker`: after a failure, Redis is skipped (every call is a miss at once) for a backoff that
  doubles up to `MAX_BACKOFF_S`; the first call after the backoff tries again, so the tier
  reconnects by itself when Redis returns. Failures are logged at most once per `LOG_EVERY_S`.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger("kvstore.redis")

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
BASE_BACKOFF_S = 0.25
MAX_BACKOFF_S = 5.0
LOG_EVERY_S = 10.0
SOCKET_READ_BYTES = 1 << 16  # redis-py reads replies in chunks this big; pages are MiBs
# What a dead, restarting or unreachable Redis raises (the cluster client's errors are not RedisErrors).
FAULTS: tuple[type[BaseException], ...] = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                                          redis.exceptions.RedisClusterException, redis.exceptions.BusyLoadingError,
                                          redis.exceptions.ClusterDownError, OSError)


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def make_client(url: str, timeout_s: float) -> Any:
    """A client for `url`. The cluster client connects (to discover slots) right here, so call
    this under the breaker: it raises a FAULTS error while the cluster is down."""
    options: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s, "protocol": 2}
    scheme, rest = url.split("://", 1)
    if scheme.lower() in CLUSTER_SCHEMES:
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(f"{CLUSTER_SCHEMES[scheme.lower()]}://{rest}", retry=Retry(NoBackoff(), 0),
                                     socket_read_size=SOCKET_READ_BYTES, **options)
    return redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), socket_read_size=SOCKET_READ_BYTES, **options)


class Breaker:
    """Open (skip Redis) for a growing backoff after each failure; closed after a success."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._lock = threading.Lock()
        self._open_until = 0.0
        self._backoff_s = 0.0  # 0: closed (the last call succeeded)
        self._last_log = 0.0
        self._unlogged = 0
        self.failures = 0  # calls that failed (metric)
        self.skipped = 0  # calls not made because the breaker was open (metric)

    @property
    def available(self) -> bool:
        """False while backing off after a failure (callers treat Redis as a miss)."""
        return time.monotonic() >= self._open_until

    def allow(self) -> bool:
        if self.available:
            return True
        with self._lock:
            self.skipped += 1
        return False

    def failure(self, exc: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            self.failures += 1
            self._backoff_s = min(MAX_BACKOFF_S, self._backoff_s * 2 or BASE_BACKOFF_S)
            self._open_until = now + self._backoff_s
            self._unlogged += 1
            if now - self._last_log < LOG_EVERY_S:
                return
            count, self._unlogged, self._last_log = self._unlogged, 0, now
        log.warning("redis tier: %s unreachable (%s: %s); %d failure(s) since the last report; "
                    "serving local tiers only, retrying in %.2fs", self._what, type(exc).__name__, exc,
                    count, self._backoff_s)

    def success(self) -> None:
        if not self._backoff_s:
            return
        with self._lock:
            was_down, self._backoff_s, self._open_until = self._backoff_s > 0, 0.0, 0.0
        if was_down:
            log.warning("redis tier: %s reachable again", self._what)

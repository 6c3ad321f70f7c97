"""`kvstore serve`: run the sidecar until SIGTERM/SIGINT, then shut down cleanly; and `serve_app`,
the one way the app is served: by `kvstore serve`, `InProcessSidecar` (api/server/in_process.py, which
`kvstore demo`, bench/ttft.py and the vLLM connector's loopback sidecar run) and the tests' live
server. Each gets the same site: the connection limit, and the data plane (api/server/fast_path.py)
reading every connection.

Order on a signal: stop accepting connections, let in-flight requests finish (up to
`shutdown_timeout_s`), shut the app's thread pool down (waiting for running store calls), then
close the store — which flushes the disk writer and closes LMDB — and exit 0.

Without an auth file, every tenant shares one namespace and anyone who can connect can read
every page, so the server refuses a non-loopback address unless told `--insecure`.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
import sys
from typing import Any

from aiohttp import web

from kvstore.api.admin.app import create_app
from kvstore.api.server.auth import load_auth_file
from kvstore.api.server import event_loop
from kvstore.api.server.config import ServerConfig
from kvstore.api.admin.connection_limit import ConnectionLimitedSite
from kvstore.api.admin.context import METRICS
from kvstore.config import StoreConfig
from kvstore.sizes import format_bytes

log = logging.getLogger("kvstore.serve")

# Young objects the collector lets pile up before it looks at them (CPython's default: 700).
# The store makes a few hundred long-lived objects per request (index nodes, policy heap
# entries, `duel`'s shadow pages), so at 700 the collector ran every few requests and its
# middle generation kept re-scanning them (docs/performance.md has the measurement).
GC_YOUNG_THRESHOLD = 50_000
# aiohttp's own keep-alive timeout: never. The data plane times idle connections out, since it
# sees every request (aiohttp sees only the admin ones, and closed connections the data plane
# was serving).
AIOHTTP_KEEPALIVE_S = 1e9


class ServeError(Exception):
    """The server cannot start as configured; the message says why and what to change."""


def check_bind(config: ServerConfig) -> None:
    if not config.auth_file and not config.insecure and not config.is_loopback:
        raise ServeError(f"refusing to bind {config.host}: not a loopback address and no --auth-file; "
                         "give --auth-file (bearer tokens -> tenants) or, on a trusted network, --insecure")


def listen_socket(config: ServerConfig) -> socket.socket:
    """Bound before the store opens, so a taken port fails fast; accepted sockets inherit the
    buffer sizes (a 2 MiB page then goes out in one send)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(config.host, config.port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if config.socket_buffer_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.socket_buffer_bytes)
        sock.bind(address)
    except OSError as exc:
        raise ServeError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from None
    return sock


def describe(store_config: StoreConfig, server_config: ServerConfig, sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    tiers = []
    for name in store_config.tier_names:
        if name == "redis":
            tiers.append(f"redis {store_config.redis_url}")
            continue
        detail = f"{name} {format_bytes(getattr(store_config, f'{name}_bytes'))}"
        if name == "cpu" and store_config.cpu_codec != "none":
            detail += f" {store_config.cpu_codec}"
        if name == "disk":
            detail += f" at {store_config.data_dir}"
        tiers.append(detail)
    auth = f"bearer tokens from {server_config.auth_file}" if server_config.auth_file else "off"
    shm = "on" if server_config.shared_memory else "off"
    loop = event_loop.loop_name(asyncio.get_running_loop())
    return (f"kvstore serving on http://{host}:{port} | tiers: {', '.join(tiers)} | policy {store_config.policy}, "
            f"{store_config.durability} | auth: {auth} | shared memory: {shm} | event loop: {loop}")


async def run(store_config: StoreConfig, server_config: ServerConfig) -> None:
    from kvstore.store import KVStore  # torch, lmdb: only when actually serving

    check_bind(server_config)
    if server_config.auth_file:
        try:  # before the store opens: a bad entry is one line naming it, not a traceback
            load_auth_file(server_config.auth_file)
        except ValueError as exc:
            raise ServeError(str(exc)) from None
    sock = listen_socket(server_config)
    try:
        publisher = kv_events_publisher(server_config)  # bound before the store opens, like the port
        try:
            store = KVStore(store_config)
            try:
                if publisher is not None:
                    publisher.start(store)  # its first batches: AllBlocksCleared and what the disk holds
                await _serve_until_signal(store, store_config, server_config, sock, publisher)
            finally:
                store.close()  # flushes the disk writer and closes LMDB; reports AllBlocksCleared
        finally:
            if publisher is not None:
                publisher.close()
    finally:
        sock.close()
    log.info("stopped; store closed")


def kv_events_publisher(config: ServerConfig) -> Any:
    """The KV-event publisher `--kv-events-endpoint` asks for, its sockets bound; None without it."""
    if config.kv_events_endpoint is None:
        return None
    from kvstore.kv_events.publisher import KVEventsPublisher, KVEventsPublisherConfig

    try:
        return KVEventsPublisher(KVEventsPublisherConfig(
            endpoint=config.kv_events_endpoint, replay_endpoint=config.kv_events_replay_endpoint,
            topic=config.kv_events_topic, max_queue_records=config.kv_events_max_queue_records,
            replay_batches=config.kv_events_replay_batches))
    except ValueError as exc:
        raise ServeError(str(exc)) from None


class Served:
    """The app being served on a socket; `close()` stops accepting, lets in-flight requests finish
    (up to the config's shutdown_timeout_s) and runs the app's cleanup (its thread pool)."""

    def __init__(self, app: web.Application, runner: web.AppRunner, sock: socket.socket):
        self.app, self.runner, self.sock = app, runner, sock

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    async def close(self) -> None:
        await self.runner.cleanup()


async def serve_app(store: Any, config: ServerConfig, sock: socket.socket, *, publisher: Any = None,
                    keepalive_timeout_s: float = 75.0, access_log: logging.Logger | None = None,
                    before_listening: Any = None) -> Served:
    """Serve the app around `store` on the bound socket `sock` (`listen_socket`) until `close()`.
    `publisher`: a started KV-events publisher, whose counters /metrics then shows;
    `keepalive_timeout_s`: how long a connection may sit with no request under way;
    `before_listening`: called once the app is set up, before the first connection is accepted."""
    app = create_app(store, config, keepalive_timeout_s=keepalive_timeout_s)
    if publisher is not None:
        app[METRICS].watch_kv_events(publisher)
    runner = web.AppRunner(app, handle_signals=False, access_log=access_log, keepalive_timeout=AIOHTTP_KEEPALIVE_S,
                           shutdown_timeout=config.shutdown_timeout_s)
    await runner.setup()
    try:
        if before_listening is not None:
            before_listening()
        await ConnectionLimitedSite(runner, sock, max_connections=config.max_connections).start()
    except BaseException:
        await runner.cleanup()
        raise
    return Served(app, runner, sock)


async def _serve_until_signal(store: object, store_config: StoreConfig, server_config: ServerConfig,
                              sock: socket.socket, publisher: Any = None) -> None:
    access_log = logging.getLogger("aiohttp.access") if server_config.log_level == "debug" else None
    served = await serve_app(store, server_config, sock, publisher=publisher, access_log=access_log,
                             before_listening=_settle_collector)
    try:
        line = describe(store_config, server_config, sock)
        if publisher is not None:
            replay = f", replay {publisher.replay_endpoint}" if publisher.replay_endpoint else ""
            line += f" | kv events: {publisher.endpoint}{replay}"
        print(line, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("shutting down: finishing in-flight requests")
    finally:
        await served.close()  # stop accepting, drain in-flight, app cleanup (thread pool)


def _settle_collector() -> None:
    """Before the first request: what start-up made (torch's modules, the index rebuilt from
    disk) is moved out of the collector's sight, where a full collection scanned all of it, a
    stall in the middle of some request; and young collections are made rarer
    (GC_YOUNG_THRESHOLD)."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


def serve(store_config: StoreConfig, server_config: ServerConfig) -> int:
    logging.basicConfig(level=server_config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        # uvloop asked for and missing: one line, before anything starts
        event_loop.loop_factory(server_config.event_loop)
    except ValueError as exc:
        print(f"kvstore serve: {exc}", file=sys.stderr)
        return 2
    try:
        event_loop.run(run(store_config, server_config), server_config.event_loop)
    except ServeError as exc:
        print(f"kvstore serve: {exc}", file=sys.stderr)
        return 2
    return 0

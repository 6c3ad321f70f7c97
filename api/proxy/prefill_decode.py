"""`kvstore proxy`: prefill on one engine, decode on another, the KV moving through the store.

An OpenAI-compatible front for disaggregated serving (docs/disaggregation.md). Each
`/v1/completions` or `/v1/chat/completions` request goes twice:

    prefill   to a prefill engine (kv_role "kv_producer"), with one output token and no stream:
              the engine computes the prompt, its connector stores every block, and its answer
              carries `kv_transfer_params` saying what it stored
    decode    to a decode engine (kv_role "kv_consumer"), the client's own request plus those
              `kv_transfer_params`: the connector loads the prompt from the store, the engine
              generates, and its answer (streamed or not) goes back to the client byte for byte

The client sees one engine. So the proxy never adds an error of its own where one engine would
have answered:
- a prefill engine that cannot be reached, times out or answers anything but 200 is skipped,
  and the decode engine computes the prompt itself: slower, the same text. A request that no
  engine accepts gets the decode engine's own 4xx, exactly what one engine would have said;
- a decode engine that cannot be reached is replaced by the next one; only when none answers
  does the client get 502.

Engines are taken round-robin in each pool. The proxy keeps no state per request and reads
nothing but the JSON it forwards.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

log = logging.getLogger("kvstore.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
# What the producer is asked for: its connector stores the prompt and answers what it stored.
PREFILL_PARAMS = {"do_remote_decode": True}
# Headers that describe one hop's connection or body, never forwarded (RFC 9110 §7.6.1).
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "te", "trailer", "upgrade",
               "proxy-authorization", "proxy-authenticate", "content-encoding"}


@dataclass(frozen=True)
class ProxyConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8200
    timeout_s: float = 600.0  # one engine's answer, a long generation included
    connect_timeout_s: float = 5.0
    max_body_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill_urls", tuple(u.rstrip("/") for u in self.prefill_urls))
        object.__setattr__(self, "decode_urls", tuple(u.rstrip("/") for u in self.decode_urls))
        if not self.decode_urls:
            raise ValueError("decode_urls: at least one decode engine is needed")
        for name in ("prefill_urls", "decode_urls"):
            for url in getattr(self, name):
                parts = urlsplit(url)
                if parts.scheme not in ("http", "https") or not parts.netloc:
                    raise ValueError(f"{name}: {url!r} is not an http(s)://host:port URL")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in 0..65535, got {self.port}")
        for name in ("timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: must be >= 1, got {self.max_body_bytes}")


class EngineUnreachable(Exception):
    """An engine gave no usable answer."""


class Proxy:
    def __init__(self, config: ProxyConfig):
        self.config = config
        self._prefill = itertools.cycle(range(len(config.prefill_urls))) if config.prefill_urls else None
        self._decode = itertools.cycle(range(len(config.decode_urls)))
        self.counts = {"requests": 0, "prefilled": 0, "prefill_skipped": 0, "decode_retries": 0, "failed": 0}
        self.session: aiohttp.ClientSession | None = None

    async def start(self, _app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s, sock_connect=self.config.connect_timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)

    async def stop(self, _app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    # -- the two hops ------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.counts["requests"] += 1
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError):
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        headers = _forwarded(request.headers)
        headers.setdefault("X-Request-Id", str(uuid.uuid4()))  # one id for both hops, for the engines' logs
        params = await self._prefill_once(request.path, body, headers)
        decode_body = dict(body)
        if params is not None:
            decode_body["kv_transfer_params"] = params
        return await self._decode_once(request, decode_body, headers)

    async def _prefill_once(self, path: str, body: dict[str, Any],
                            headers: CIMultiDict[str]) -> dict[str, Any] | None:
        """The producer's kv_transfer_params; None when no prefill engine served the request (the
        decode engine then computes the prompt)."""
        if self._prefill is None:
            return None
        url = self.config.prefill_urls[next(self._prefill)] + path
        prefill = dict(body, max_tokens=1, stream=False, n=1, kv_transfer_params=dict(PREFILL_PARAMS))
        for name in ("stream_options", "min_tokens"):  # settings one output token could not honour
            prefill.pop(name, None)
        if "max_completion_tokens" in prefill:
            prefill["max_completion_tokens"] = 1
        assert self.session is not None
        try:
            async with self.session.post(url, json=prefill, headers=headers) as answer:
                payload = await answer.read()
                if answer.status != 200:
                    raise EngineUnreachable(f"{url}: {answer.status} {payload[:200]!r}")
                params = json.loads(payload).get("kv_transfer_params")
        except (aiohttp.ClientError, asyncio.TimeoutError, EngineUnreachable, ValueError, AttributeError) as exc:
            self.counts["prefill_skipped"] += 1
            log.warning("prefill engine %s did not serve the request (%s); the decode engine computes the prompt",
                        url, exc or type(exc).__name__)
            return None
        self.counts["prefilled"] += 1
        return params if isinstance(params, dict) else None

    async def _decode_once(self, request: web.Request, body: dict[str, Any],
                           headers: CIMultiDict[str]) -> web.StreamResponse:
        return await self._from_decode_engines(request, next(self._decode), headers, json=body)

    async def _from_decode_engines(self, request: web.Request, first: int, headers: CIMultiDict[str],
                                   **send: Any) -> web.StreamResponse:
        """The request's method and path on decode engines from the `first`-th on, each in turn
        until one answers; that answer is relayed. 502 when none does."""
        assert self.session is not None
        urls = self.config.decode_urls
        for attempt in range(len(urls)):
            url = urls[(first + attempt) % len(urls)] + request.path
            try:
                answer = await self.session.request(request.method, url, headers=headers, **send)
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                self.counts["decode_retries"] += 1
                log.warning("decode engine %s is unreachable (%s)", url, exc or type(exc).__name__)
                continue
            async with answer:
                return await _relay(request, answer)
        self.counts["failed"] += 1
        return _error(502, "no decode engine answered")

    # -- what the proxy itself answers -------------------------------------------------------

    async def models(self, request: web.Request) -> web.StreamResponse:
        return await self._from_decode_engines(request, 0, _forwarded(request.headers))

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **self.counts})


async def _relay(request: web.Request, answer: aiohttp.ClientResponse) -> web.StreamResponse:
    """The engine's answer to the client as it arrives: a stream stays a stream."""
    response = web.StreamResponse(status=answer.status, headers=_forwarded(answer.headers))
    await response.prepare(request)
    async for chunk in answer.content.iter_any():
        await response.write(chunk)
    await response.write_eof()
    return response


def _forwarded(headers: Any) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in HOP_HEADERS)


def _error(status: int, message: str) -> web.Response:
    # The shape of vLLM's own error answers, so a client parses the proxy's the same way.
    return web.json_response({"error": {"message": message, "type": "proxy_error", "code": status}}, status=status)


def create_proxy_app(config: ProxyConfig) -> web.Application:
    proxy = Proxy(config)
    app = web.Application(client_max_size=config.max_body_bytes)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    for route in ROUTES:
        app.router.add_post(route, proxy.handle)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/healthz", proxy.health)
    return app


def run_proxy(config: ProxyConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    print(f"kvstore proxy on http://{config.host}:{config.port}: prefill {', '.join(config.prefill_urls) or 'none'}; "
          f"decode {', '.join(config.decode_urls)}", flush=True)
    web.run_app(create_proxy_app(config), host=config.host, port=config.port, print=None)
    return 0

"""`kvstore proxy` against engines that answer as vLLM's OpenAI server does.

Each fake engine records the bodies it was sent. A prefill engine answers one token and the
`kv_transfer_params` a producer's connector returns; a decode engine answers with the
parameters it was handed, so a test sees what travelled from one to the other.
"""
from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvstore.api.proxy.prefill_decode import ProxyConfig, create_proxy_app


class FakeEngine:
    def __init__(self, name: str, *, status: int = 200):
        self.name, self.status = name, status
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[Any] = []
        self.server: TestServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")

    async def start(self) -> "FakeEngine":
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_get("/v1/models", self.models)
        self.server = TestServer(app)
        await self.server.start_server()
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.close()

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "smollm2", "owned_by": self.name}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(request.headers.copy())
        if self.status != 200:
            return web.json_response({"error": {"message": f"{self.name} says no", "code": self.status}},
                                     status=self.status)
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):  # a producer: one token, and what it stored
            return web.json_response({"choices": [{"text": "The"}],
                                      "kv_transfer_params": {"store_model": "smollm2", "num_tokens": 37}})
        text = f"{self.name} answers" + (" from the store" if params.get("num_tokens") else "")
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": text}], "engine": self.name, "received": params})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for word in text.split():
            await response.write(f"data: {json.dumps({'choices': [{'text': word}]})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@pytest.fixture
async def engines():
    started: list[FakeEngine] = []

    async def make(name: str, **kwargs: Any) -> FakeEngine:
        engine = await FakeEngine(name, **kwargs).start()
        started.append(engine)
        return engine

    yield make
    for engine in started:
        await engine.stop()


async def proxy_client(prefill: list[str], decode: list[str]) -> TestClient:
    client = TestClient(TestServer(create_proxy_app(ProxyConfig(tuple(prefill), tuple(decode), timeout_s=10,
                                                                connect_timeout_s=2))))
    await client.start_server()
    return client


COMPLETION = {"model": "smollm2", "prompt": "What is the capital of France?", "max_tokens": 16, "temperature": 0}


async def test_prefill_then_decode_with_the_producers_params(engines):
    prefill, decode = await engines("prefill"), await engines("decode")
    client = await proxy_client([prefill.url], [decode.url])
    try:
        answer = await client.post("/v1/completions", json=COMPLETION)
        assert answer.status == 200
        body = await answer.json()
    finally:
        await client.close()
    assert body["choices"][0]["text"] == "decode answers from the store"
    (sent,) = prefill.bodies
    assert sent["max_tokens"] == 1 and sent["stream"] is False
    assert sent["kv_transfer_params"] == {"do_remote_decode": True}
    assert sent["prompt"] == COMPLETION["prompt"]
    (handed,) = decode.bodies
    assert handed == dict(COMPLETION, kv_transfer_params={"store_model": "smollm2", "num_tokens": 37})
    assert prefill.headers[0]["X-Request-Id"] == decode.headers[0]["X-Request-Id"]


async def test_a_streamed_chat_streams_the_decode_engines_events(engines):
    prefill, decode = await engines("prefill"), await engines("decode")
    client = await proxy_client([prefill.url], [decode.url])
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "stream": True,
            "stream_options": {"include_usage": True}, "max_completion_tokens": 32, "min_tokens": 4}
    try:
        answer = await client.post("/v1/chat/completions", json=chat)
        assert answer.status == 200 and answer.headers["Content-Type"].startswith("text/event-stream")
        events = (await answer.text()).strip().split("\n\n")
    finally:
        await client.close()
    assert events[-1] == "data: [DONE]"
    assert [json.loads(e[len("data: "):])["choices"][0]["text"] for e in events[:-1]] == \
        ["decode", "answers", "from", "the", "store"]
    (sent,) = prefill.bodies
    assert sent["max_completion_tokens"] == 1 and sent["stream"] is False
    assert "stream_options" not in sent and "min_tokens" not in sent
    assert decode.bodies[0]["stream"] is True and decode.bodies[0]["min_tokens"] == 4


async def test_requests_go_round_robin_over_both_pools(engines):
    prefills = [await engines(f"prefill-{i}") for i in range(2)]
    decodes = [await engines(f"decode-{i}") for i in range(3)]
    client = await proxy_client([e.url for e in prefills], [e.url for e in decodes])
    try:
        names = []
        for _ in range(6):
            answer = await client.post("/v1/completions", json=COMPLETION)
            names.append((await answer.json())["engine"])
    finally:
        await client.close()
    assert [len(e.bodies) for e in prefills] == [3, 3]
    assert names == ["decode-0", "decode-1", "decode-2"] * 2


async def test_a_prefill_engine_down_or_failing_leaves_the_prompt_to_the_decode_engine(engines):
    failing, decode = await engines("prefill", status=500), await engines("decode")
    down = "http://127.0.0.1:9"  # discard port: nothing listens there
    client = await proxy_client([down, failing.url], [decode.url])
    try:
        for _ in range(2):
            answer = await client.post("/v1/completions", json=COMPLETION)
            assert answer.status == 200
            assert (await answer.json())["choices"][0]["text"] == "decode answers"  # computed, not loaded
        health = await (await client.get("/healthz")).json()
    finally:
        await client.close()
    assert [b.get("kv_transfer_params") for b in decode.bodies] == [None, None]
    assert health["prefill_skipped"] == 2 and health["prefilled"] == 0


async def test_a_request_no_engine_accepts_gets_the_decode_engines_own_error(engines):
    prefill, decode = await engines("prefill", status=400), await engines("decode", status=400)
    client = await proxy_client([prefill.url], [decode.url])
    try:
        answer = await client.post("/v1/completions", json=dict(COMPLETION, max_tokens=-1))
        assert answer.status == 400
        assert (await answer.json())["error"]["message"] == "decode says no"
    finally:
        await client.close()


async def test_a_decode_engine_down_is_replaced_and_none_left_is_502(engines):
    decode = await engines("decode")
    down = "http://127.0.0.1:9"
    client = await proxy_client([], [down, decode.url])
    try:
        for _ in range(2):
            answer = await client.post("/v1/completions", json=COMPLETION)
            assert answer.status == 200 and (await answer.json())["engine"] == "decode"
    finally:
        await client.close()
    client = await proxy_client([], [down])
    try:
        answer = await client.post("/v1/completions", json=COMPLETION)
        assert answer.status == 502 and "no decode engine" in (await answer.json())["error"]["message"]
    finally:
        await client.close()


@pytest.mark.parametrize("body", [b"", b"{", b"[1, 2]", b"\xff\xfe", b'"text"'])
async def test_a_body_that_is_not_a_json_object_is_400(engines, body):
    decode = await engines("decode")
    client = await proxy_client([], [decode.url])
    try:
        answer = await client.post("/v1/completions", data=body, headers={"Content-Type": "application/json"})
        assert answer.status == 400 and "JSON" in (await answer.json())["error"]["message"]
    finally:
        await client.close()
    assert decode.bodies == []


async def test_models_come_from_a_decode_engine(engines):
    decode = await engines("decode")
    client = await proxy_client([], [decode.url])
    try:
        answer = await client.get("/v1/models")
        assert answer.status == 200 and (await answer.json())["data"][0]["owned_by"] == "decode"
    finally:
        await client.close()


@pytest.mark.parametrize("fields, message", [
    (dict(prefill_urls=(), decode_urls=()), "decode_urls"),
    (dict(prefill_urls=("127.0.0.1:8001",), decode_urls=("http://127.0.0.1:8002",)), "prefill_urls"),
    (dict(prefill_urls=(), decode_urls=("http://h:1",), port=70000), "port"),
    (dict(prefill_urls=(), decode_urls=("http://h:1",), timeout_s=0), "timeout_s"),
])
def test_config_errors_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        ProxyConfig(**fields)


def test_the_cli_refuses_a_bad_engine_url_naming_it(capsys):
    from kvstore.cli import main

    assert main(["proxy", "--prefill", "localhost:8001", "--decode", "http://127.0.0.1:8002"], environ={}) == 2
    assert "prefill_urls: 'localhost:8001' is not an http(s)://host:port URL" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["proxy", "--prefill", "http://127.0.0.1:8001"], environ={})
    assert exited.value.code == 2 and "--decode" in capsys.readouterr().err

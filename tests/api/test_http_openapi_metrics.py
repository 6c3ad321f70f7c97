"""GET /openapi.json describes every route of the route table; GET /metrics counts them."""
from __future__ import annotations

from api_helpers import call, kv_bin, random_kv

from kvstore.api.admin.openapi import OPERATIONS, template_path
from kvstore.api.admin.routes import DATA_ROUTES, ROUTES
from kvstore import ModelSpec


async def test_openapi_describes_every_route_in_the_table(http):
    status, doc = await call(http, "GET", "/openapi.json", headers={})
    assert status == 200 and doc["openapi"].startswith("3.")
    routes = [("POST", path) for path in DATA_ROUTES] + [(r.method, r.path) for r in ROUTES]  # data plane, aiohttp
    for method, path in routes:
        operation = doc["paths"][template_path(path)][method.lower()]
        assert operation["summary"] != "undocumented", (method, path)
        assert "200" in operation["responses"], (method, path)
        if method in ("POST", "PUT"):
            schema = operation["requestBody"]["content"]["application/msgpack"]["schema"]
            assert schema["$ref"].split("/")[-1] in doc["components"]["schemas"]
    assert set(OPERATIONS) == {(method, template_path(path)) for method, path in routes}, \
        "OPERATIONS describes a route that does not exist"


async def test_openapi_schemas_resolve(http):
    _, doc = await call(http, "GET", "/openapi.json", headers={})
    text = str(doc)
    for name in doc["components"]["schemas"]:
        assert f"#/components/schemas/{name}" in text or name in ("Stats",)


async def test_metrics_count_requests_and_export_tiers(http_model, spec: ModelSpec):
    await call(http_model, "POST", "/v1/store",
               {"model": "m", "tokens": list(range(8)), "kv": kv_bin(random_kv(spec, 8))})
    await call(http_model, "POST", "/v1/lookup", {"model": "nope", "tokens": [1]})
    status, text = await call(http_model, "GET", "/metrics", headers={})
    assert status == 200
    assert 'kvstore_http_requests_total{method="POST",route="/v1/store",status="200"} 1.0' in text
    assert 'kvstore_http_requests_total{method="POST",route="/v1/lookup",status="404"} 1.0' in text
    assert 'kvstore_http_requests_total{method="PUT",route="/v1/models/{model}",status="201"} 1.0' in text
    assert 'kvstore_http_request_duration_seconds_bucket{le="0.5",method="POST",route="/v1/store"} 1.0' in text
    assert 'kvstore_tier_pages{tier="cpu"} 2.0' in text
    assert 'kvstore_tier_hits_total{tier="cpu"}' in text and 'kvstore_tier_evictions_total{tier="disk"}' in text
    assert "kvstore_corrupt_records_total 0.0" in text

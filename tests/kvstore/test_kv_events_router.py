"""bench/kv_router.py's router, fed only by the sidecars' KV events: a request goes to the
sidecar holding the longest prefix in the best medium, and that sidecar then serves exactly
the tokens the router predicted."""
from __future__ import annotations

import torch

from bench.kv_router import Router
from kvstore import KVStore, ModelSpec, StoreConfig
from kvstore.kv_events.log import KVEventLog

SPEC = ModelSpec(num_layers=1, num_kv_heads=2, head_dim=8, dtype="float16", page_size=8)
P = SPEC.page_size
DOC_A = list(range(1, 6 * P + 1))
DOC_B = list(range(5000, 5000 + 4 * P))
QUESTION = [42, 43, 44]


def kv(tokens):
    return torch.randn(SPEC.kv_shape(len(tokens))).to(torch.float16)


def test_requests_go_where_their_prefix_is_held_and_hit_as_predicted(tmp_path):
    stores = [KVStore(StoreConfig(data_dir=str(tmp_path / str(i)), cpu_bytes=8 * SPEC.page_bytes + 256,
                                  disk_bytes=1 << 20)) for i in range(3)]
    logs = [KVEventLog() for _ in stores]
    router = Router()
    try:
        for store, log in zip(stores, logs):
            store.register_model("m", SPEC)
            store.attach_kv_events(log)
        stores[0].store("m", DOC_A, kv(DOC_A))  # in the CPU tier
        stores[1].store("m", DOC_A, kv(DOC_A))
        filler = [9000 + t for t in range(8 * P)]
        stores[1].store("m", filler, kv(filler))  # pushes DOC_A down to sidecar 1's disk
        assert stores[1].lookup("m", DOC_A).tiers == {"disk": len(DOC_A)}
        stores[2].store("m", DOC_B[:2 * P], kv(DOC_B[:2 * P]))
        stores[0].store("m", DOC_B, kv(DOC_B))  # the longer prefix of B, though on another sidecar

        def hear():
            for i, (store, log) in enumerate(zip(stores, logs)):
                router.apply(f"sidecar-{i}", log.take(store))

        hear()
        for doc, expected in ((DOC_A, "sidecar-0"), (DOC_B, "sidecar-0")):
            request = doc + QUESTION
            pod, scores = router.route(("m", None), request, P)
            assert pod == expected, scores
            predicted, _ = router.prefix(pod, ("m", None), request, P)
            assert predicted == len(doc)
            assert stores[int(pod[-1])].fetch("m", request).matched_tokens == predicted
        # Sidecar 1 holds all of A, but on disk: it scores below sidecar 0's CPU copy, above nothing.
        _, scores = router.route(("m", None), DOC_A + QUESTION, P)
        assert scores["sidecar-0"] > scores["sidecar-1"] > 0 == scores["sidecar-2"]
        # Sidecar 0 drops the model: A's requests now go to sidecar 1, which serves all of A.
        stores[0].drop_model("m")
        hear()
        pod, _ = router.route(("m", None), DOC_A + QUESTION, P)
        assert pod == "sidecar-1"
        assert stores[1].fetch("m", DOC_A + QUESTION).matched_tokens == len(DOC_A)
        assert router.route(("m", None), [7] * (3 * P), P)[0] is None  # nobody holds it
        assert router.route(("other-model", None), DOC_A, P)[0] is None  # another model's keys
    finally:
        for store in stores:
            store.close()

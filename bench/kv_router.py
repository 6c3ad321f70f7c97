"""A cache-aware router in a few lines: which of N sidecars holds the longest prefix of a request,
from their KV events (what llm-d's KV-cache indexer does with vLLM's), checked against what each
sidecar then serves.

    python bench/kv_router.py [--sidecars 3] [--documents 6] [--requests 30] [--seed 0]

docs/kv_events.md.
"""
from __future__ import annotations

import hashlib
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: an older kvstore there wins

from bench.report import parser as bench_parser  # noqa: E402
from kvstore.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent  # noqa: E402

# Weight of a block by the medium that holds it (medium, locality); unknown media count as storage.
WEIGHTS: dict[tuple[str, str | None], float] = {
    ("GPU", "LOCAL"): 1.0, ("CPU", "LOCAL"): 0.8, ("STORAGE", "LOCAL"): 0.5, ("STORAGE", "REMOTE"): 0.3,
}


def router_key(parent: bytes | None, extra: Any, token_ids: Sequence[int]) -> bytes:
    """The router's own key for a block: chained over token ids, rooted in the model (extra key)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else repr(("root", extra)).encode())
    h.update(repr(list(token_ids)).encode())
    return h.digest()


@dataclass
class PodIndex:
    """What one pod holds, learnt from its events alone."""

    keys: dict[Any, bytes] = field(default_factory=dict)  # the pod's block hash -> router key
    held: dict[bytes, set[tuple]] = field(default_factory=dict)  # router key -> media holding it

    def apply(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                parent = self.keys.get(event.parent_block_hash) if event.parent_block_hash is not None else None
                if event.parent_block_hash is not None and parent is None:
                    continue  # a parent never seen: this chain cannot be placed
                size = event.block_size
                for i, block in enumerate(event.block_hashes):
                    extra = event.extra_keys[i] if event.extra_keys else None
                    key = router_key(parent, extra, event.token_ids[i * size:(i + 1) * size])
                    self.keys[block] = key
                    self.held.setdefault(key, set()).add((event.medium, event.locality))
                    parent = key
            elif isinstance(event, BlockRemoved):
                for block in event.block_hashes:
                    key = self.keys.get(block)
                    media = self.held.get(key) if key is not None else None
                    if media is not None:
                        media.discard((event.medium, event.locality))
                        if not media:
                            del self.held[key]  # type: ignore[arg-type]
            elif isinstance(event, AllBlocksCleared):
                self.keys.clear()
                self.held.clear()


class Router:
    def __init__(self, weights: dict[tuple[str, str | None], float] | None = None):
        self.weights = weights or WEIGHTS
        self.pods: dict[str, PodIndex] = {}

    def apply(self, pod: str, events: Iterable[KVEvent]) -> None:
        self.pods.setdefault(pod, PodIndex()).apply(events)

    def prefix(self, pod: str, extra: Any, tokens: Sequence[int], block_size: int) -> tuple[int, float]:
        """(leading tokens `pod` holds, score) for a request, whole blocks only."""
        index = self.pods.get(pod)
        held_tokens, score, parent = 0, 0.0, None
        if index is None:
            return 0, 0.0
        for s in range(0, len(tokens) - block_size + 1, block_size):
            key = router_key(parent, extra, tokens[s:s + block_size])
            media = index.held.get(key)
            if not media:
                break
            held_tokens += block_size
            score += max(self.weights.get(m, self.weights[("STORAGE", "LOCAL")]) for m in media)
            parent = key
        return held_tokens, score

    def route(self, extra: Any, tokens: Sequence[int], block_size: int) -> tuple[str | None, dict[str, float]]:
        """The pod with the best score (None if no pod holds the first block), and every score."""
        scores = {pod: self.prefix(pod, extra, tokens, block_size)[1] for pod in self.pods}
        best = max(scores, key=scores.__getitem__, default=None)
        return (best if best is not None and scores[best] > 0 else None), scores


def demo(sidecars: int, documents: int, requests: int, seed: int) -> dict[str, Any]:
    import tempfile

    import torch
    import zmq

    from kvstore import KVStore, ModelSpec, StoreConfig
    from kvstore.kv_events.publisher import KVEventsPublisher, KVEventsPublisherConfig
    from kvstore.kv_events.wire import decode_batch

    rng = random.Random(seed)
    spec = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", page_size=16)
    P = spec.page_size
    docs = [[rng.randrange(1, 30000) for _ in range(P * rng.randrange(4, 12))] for _ in range(documents)]
    router = Router()
    ctx = zmq.Context.instance()
    with tempfile.TemporaryDirectory() as tmp:
        stores, publishers, subs = [], [], []
        try:
            for i in range(sidecars):
                store = KVStore(StoreConfig(data_dir=f"{tmp}/{i}", cpu_bytes=24 * spec.page_bytes, disk_bytes=1 << 22))
                store.register_model("m", spec)
                publisher = KVEventsPublisher(KVEventsPublisherConfig(endpoint="tcp://127.0.0.1:*",
                                                                      batch_interval_s=0.005))
                sub = ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(publisher.endpoint)
                stores.append(store)
                publishers.append(publisher)
                subs.append(sub)
            time.sleep(0.3)  # ZeroMQ's slow joiner
            for store, publisher in zip(stores, publishers):
                publisher.start(store)
            for d, doc in enumerate(docs):  # each document on one or two sidecars
                for i in rng.sample(range(sidecars), rng.choice((1, 1, 2))):
                    stores[i].store("m", doc, torch.randn(spec.kv_shape(len(doc))).to(torch.float16))

            def listen() -> None:
                deadline = time.monotonic() + 10
                while any(p.queued for p in publishers) or any(s.poll(20) for s in subs):
                    for i, sub in enumerate(subs):
                        while sub.poll(0):
                            _, _, payload = sub.recv_multipart()
                            router.apply(f"sidecar-{i}", decode_batch(payload).events)
                    if time.monotonic() > deadline:
                        raise TimeoutError("events did not arrive")

            listen()
            routed = hits = exact = 0
            for _ in range(requests):
                doc = rng.choice(docs)
                tokens = doc + [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 2 * P))]
                pod, scores = router.route(("m", None), tokens, P)
                if pod is None:
                    continue
                predicted, _ = router.prefix(pod, ("m", None), tokens, P)
                i = int(pod.split("-")[1])
                served = stores[i].fetch("m", tokens).matched_tokens
                routed += 1
                hits += served > 0
                exact += served // P * P == predicted
                listen()  # the fetch promoted pages: the router hears of it
            return {"sidecars": sidecars, "documents": documents, "requests": requests, "routed": routed,
                    "hits": hits, "predicted_exactly": exact}
        finally:
            for publisher in publishers:
                publisher.close()
            for sub in subs:
                sub.close(linger=0)
            for store in stores:
                store.close()


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, with_json=False)
    parser.add_argument("--sidecars", type=int, default=3)
    parser.add_argument("--documents", type=int, default=6)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = demo(args.sidecars, args.documents, args.requests, args.seed)
    print(f"{result['requests']} requests over {result['sidecars']} sidecars: {result['routed']} routed, "
          f"{result['hits']} hit on the sidecar chosen, {result['predicted_exactly']} served exactly the "
          f"prefix the router predicted")
    return 0 if result["hits"] == result["routed"] == result["predicted_exactly"] else 1


if __name__ == "__main__":
    sys.exit(main())

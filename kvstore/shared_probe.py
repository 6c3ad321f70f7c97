"""Probing the shared tier (Redis) for pages other sidecars stored, before a lookup or fetch.

Sidecars that share a Redis tier do not share their trees: a page another sidecar stored is in
Redis but not in this store's index. So a lookup or fetch first asks Redis for the pages past
the local match and adds those it holds to the tree, as held in the shared tier only; the
request then reports them (lookup) or serves and promotes them (fetch) like any other page.

Why no index is needed for the question: page keys are chained hashes of the tokens (a page's
key hashes its parent's key and its tokens), so the keys past the local match are computed from
the prompt alone, lazily, and Redis answers pipelined EXISTS for them in batches that stop at
the first miss.

Invariants: Redis I/O runs outside the store's lock; the tree is re-checked under it before
anything is added (the anchor page may have left meanwhile: nothing is added, the next request
probes again). Token ids are verified when a page is read (tier_stack.read_page): a collision
is a miss, never wrong KV.
"""
from __future__ import annotations

from typing import Iterator

from kvstore.config import ModelSpec
from kvstore.index import TOKEN_BYTES
from kvstore.keys import page_key
from kvstore.store_state import StoreState


def probe_shared(state: StoreState, root_key: bytes, namespace: bytes, spec: ModelSpec, tb: bytes) -> None:
    """Add the pages of `tb` past the local match that the shared tier holds to the tree whose
    root is `root_key` (the model's `namespace`, or a salt's or chunk's root in it)."""
    shared = state.tiers.shared
    if shared is None or not shared.available:
        return
    P = spec.page_size
    n_tokens = len(tb) // TOKEN_BYTES
    page_bytes = P * TOKEN_BYTES
    with state.lock:
        # The leading full pages the tree holds, walked by their tokens: the pages
        # `PageIndex.match` finds by chained hash, without hashing a prompt that the fetch then
        # matches (and hashes) again; a prompt held in full returns here at the cost of dict
        # lookups.
        full, anchor = 0, root_key
        node = state.index.roots.get(root_key)
        while node is not None and (full + 1) * P <= n_tokens:
            ptoks = tb[full * page_bytes:(full + 1) * page_bytes]
            node = node.by_tokens.get(ptoks)
            if node is not None and not node.ready:
                node = None
            if node is not None:
                full += 1
                anchor = node.key
    if full * P >= n_tokens:
        return
    pages: list[tuple[bytes, bytes]] = []  # (key, tokens) of each page probed, in order

    def keys() -> Iterator[bytes]:
        key = anchor
        for s in range(full * P, n_tokens, P):
            ptoks = tb[s * TOKEN_BYTES:min(s + P, n_tokens) * TOKEN_BYTES]
            key = page_key(key, ptoks)
            pages.append((key, ptoks))
            yield key

    found = shared.probe(keys())  # keys are hashed lazily: a cold long prompt costs one batch
    if not found:
        return
    with state.lock:
        parent = state.index.get(anchor) if full else state.index.roots.get(root_key)
        if parent is None and not full and namespace in state.registry.specs_by_namespace:
            parent = state.index.root(root_key, namespace)
        if parent is None or not parent.ready:
            return  # the anchor left meanwhile: the next request probes again
        clock = state.tick()
        for key, ptoks in pages[:found]:
            node = state.index.get(key)
            if node is None:
                node = state.index.insert(parent, key, ptoks, tail=len(ptoks) < page_bytes)
                node.ready = True
                state.placement.add(node, shared.name, state.tiers.size_in(node, shared.name))
                state.placement.touch(node, clock)
            elif node.parent is not parent or not node.ready or node.tokens != ptoks:
                break  # a concurrent store is writing it, or a collision: stop here
            if node.num_tokens < P:
                break  # a tail page is a leaf
            parent = node

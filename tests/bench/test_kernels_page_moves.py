"""bench/kernels.py's demotion and promotion rows move the store's pages as eviction and a hit
do: checked here with the stand-in device tier (tests/tiers/off_host_tier.py), so a change to
the bench's moves is caught on a machine without a GPU."""
from __future__ import annotations

import torch

import kvstore.tier_stack
from bench.kernels import page_moves
from kvstore import KVStore, ModelSpec, StoreConfig
from kvstore.tiers.cpu import CPUTier
from tests.tiers.off_host_tier import OffHostTier

SPEC = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)
PAGES = 5


def test_demote_promote_and_undo_move_every_page_and_keep_its_kv(monkeypatch) -> None:
    monkeypatch.setattr(kvstore.tier_stack, "TIER_TYPES", (OffHostTier, CPUTier))
    pb = SPEC.page_bytes
    store = KVStore(StoreConfig(data_dir=None, gpu_bytes=PAGES * OffHostTier.slot_bytes(pb),
                                cpu_bytes=2 * PAGES * pb + (1 << 20), disk_bytes=0, promote_on_hit=False))
    try:
        store.register_model("m", SPEC)
        tokens = list(range(1, PAGES * SPEC.page_size + 1))
        kv = torch.randn(SPEC.kv_shape(len(tokens))).half()  # (L, 2, T, H, D)
        assert store.store("m", tokens, kv).stored_tokens == len(tokens)
        demote, promote, back_on_gpu_only = page_moves(store, SPEC, tokens)

        demote()
        assert store.lookup("m", tokens).tiers == {"cpu": len(tokens)}
        back_on_gpu_only()
        assert store.lookup("m", tokens).tiers == {"gpu": len(tokens)}
        demote()
        promote()  # back on the device, and still held on the CPU
        assert store.lookup("m", tokens).tiers == {"gpu": len(tokens)}
        assert store.stats()["tiers"]["gpu"]["promotions"] == 2 * PAGES
        assert store.stats()["tiers"]["gpu"]["demotions"] == 2 * PAGES  # each eviction copied them down
        got = store.fetch("m", tokens)
        assert got.matched_tokens == len(tokens)
        assert torch.equal(got.kv.view(torch.int16), kv.view(torch.int16))
    finally:
        store.close()

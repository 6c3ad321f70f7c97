"""The cheapest one-page store and fetch CPython allows with a KV store's basic guarantees
(`FloorStore`: checks, a digest key, a lock, pins, eviction, the copy), beside kvstore's and
bench/ops.py's dict baseline in one interleaved run, and the floor's steps alone.

    python -m bench.profiling floor [--rounds 5] [--seconds 0.4] [--json FILE]

docs/performance.md, "The floor".
"""
from __future__ import annotations

import argparse
import hashlib
import struct
import sys
import threading
import timeit
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

sys.path.append(str(Path(__file__).resolve().parents[2]))  # after PYTHONPATH: an older kvstore there wins

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.ops import KIB, SPEC_64K, Case, TokenSource, Values, run_rounds  # noqa: E402
from bench.report import markdown_table, parser as bench_parser, write_json  # noqa: E402
from bench.timing import settle_collector  # noqa: E402
from kvstore import KVStore, StoreConfig  # noqa: E402

MAX_TOKEN_ID = (1 << 31) - 1


class FloorPage:
    __slots__ = ("tokens", "buffer", "pins")

    def __init__(self, tokens: bytes, buffer: np.ndarray):
        self.tokens = tokens
        self.buffer = buffer
        self.pins = 0


class FloorResult:
    __slots__ = ("matched_tokens", "kv")

    def __init__(self, matched_tokens: int, kv: torch.Tensor | None):
        self.matched_tokens = matched_tokens
        self.kv = kv


class FloorStore:
    """One-page values of `page_tokens` tokens and `shape` (dtype float16), at most `capacity` of them."""

    def __init__(self, page_tokens: int, shape: tuple[int, ...], capacity: int):
        self.page_tokens = page_tokens
        self.shape = shape
        self.page_bytes = int(np.prod(shape)) * 2
        self.capacity = capacity
        self.pack = struct.Struct(f"<{page_tokens}i")
        self.lock = threading.Lock()
        self.pages: OrderedDict[bytes, FloorPage] = OrderedDict()  # least recently used first

    def _key(self, tokens: Any) -> tuple[bytes, bytes]:
        if tokens.__class__ is not list or len(tokens) != self.page_tokens or not set(map(type, tokens)) <= {int}:
            raise ValueError(f"tokens: expected a list of {self.page_tokens} ints")
        try:
            packed = self.pack.pack(*tokens)
        except struct.error:
            raise ValueError(f"tokens: ids must be in [0, {MAX_TOKEN_ID}]") from None
        if min(tokens) < 0:
            raise ValueError(f"tokens: ids must be in [0, {MAX_TOKEN_ID}]")
        return hashlib.blake2b(packed, digest_size=16).digest(), packed

    def fetch(self, tokens: Any) -> FloorResult:
        key, packed = self._key(tokens)
        with self.lock:
            page = self.pages.get(key)
            if page is None or page.tokens != packed:
                return FloorResult(0, None)
            page.pins += 1  # the copy below runs outside the lock: nothing evicts it meanwhile
            self.pages.move_to_end(key)
        try:
            out = np.empty(self.page_bytes, np.uint8)
            np.copyto(out, page.buffer)
        finally:
            with self.lock:
                page.pins -= 1
        return FloorResult(self.page_tokens, torch.from_numpy(out.view(np.float16).reshape(self.shape)))

    def store(self, tokens: Any, kv: Any) -> int:
        key, packed = self._key(tokens)
        if not isinstance(kv, torch.Tensor) or kv.dtype != torch.float16 or kv.shape != self.shape \
                or kv.device.type != "cpu" or not kv.is_contiguous():
            raise ValueError(f"kv: expected a contiguous float16 CPU tensor of shape {self.shape}")
        with self.lock:
            if key in self.pages:
                self.pages.move_to_end(key)
                return 0
            buffer = None
            if len(self.pages) >= self.capacity:  # the oldest unpinned page makes room; its buffer is reused
                for old_key, old in self.pages.items():
                    if not old.pins:
                        del self.pages[old_key]
                        buffer = old.buffer
                        break
                else:
                    return 0  # every page is in use
            if buffer is None:
                buffer = np.empty(self.page_bytes, np.uint8)
            page = self.pages[key] = FloorPage(packed, buffer)
            page.pins += 1
        np.copyto(buffer, kv.view(torch.uint8).numpy().reshape(-1))
        with self.lock:
            page.pins -= 1
        return self.page_tokens


@dataclass
class FloorCase(Case):
    """A bench/ops.py case whose subjects are kvstore's operation, the floor's and the dict's."""

    floor: Callable[[int], Any] | None = None

    def subjects(self) -> dict[str, Callable[[int], Any]]:
        return {"op": self.call, "floor": self.floor, "dict": self.dict_op}  # type: ignore[dict-item]


def floor_cases(tokens: TokenSource) -> tuple[list[FloorCase], list[tuple[str, Any]]]:
    spec, nbytes, count = SPEC_64K, 64 * KIB, 64
    n_tokens = nbytes // spec.bytes_per_token
    shape = spec.kv_shape(n_tokens)
    values = Values(nbytes, count, seed=nbytes)
    kvs = values.kvs(spec)
    prompts = [tokens.take(n_tokens) for _ in range(count)]
    floor = FloorStore(n_tokens, tuple(shape), capacity=1024)
    store = KVStore(StoreConfig(data_dir=None, disk_bytes=0, cpu_bytes=64 << 20))
    store.register_model("m", spec)
    for prompt, kv in zip(prompts, kvs):
        floor.store(prompt, kv)
        store.store("m", prompt, kv)
    for i in (0, count - 1):
        want = values.src[i].tobytes()
        if floor.fetch(prompts[i]).kv.numpy().tobytes() != want or \
                store.fetch("m", prompts[i]).kv.contiguous().numpy().tobytes() != want:
            raise SystemExit("a fetch did not return the stored bytes")
    # Stores write new tokens into full tables (each store evicts), as bench/ops.py's do.
    floor_put = FloorStore(n_tokens, tuple(shape), capacity=1024)
    for n in range(1100):
        floor_put.store(tokens.take(n_tokens), kvs[0])
    store_store = KVStore(StoreConfig(data_dir=None, disk_bytes=0, cpu_bytes=64 << 20))
    store_store.register_model("m", spec)
    for n in range(1100):
        store_store.store("m", tokens.take(n_tokens), kvs[0])
    kv, source = kvs[0], kvs[0].view(torch.uint8).numpy().reshape(-1).copy()
    # New tokens for every store, made outside the timed calls; `prepare` runs before each
    # block of kvstore's stores and adds a block for each side (4 blocks ahead for the floor,
    # whose block may come first in a round).
    pending: list[list[int]] = []
    floor_pending = [tokens.take(n_tokens) for _ in range(4 * 8)]

    def prepare(n: int) -> None:
        pending.extend(tokens.take(n_tokens) for _ in range(n))
        floor_pending.extend(tokens.take(n_tokens) for _ in range(n))

    fetch = FloorCase("in-process", "fetch", nbytes, lambda i: store.fetch("m", prompts[i % count]), values.memcpy,
                      values.dict_get, values.fresh, floor=lambda i: floor.fetch(prompts[i % count]))
    put = FloorCase("in-process", "store", nbytes, lambda i: store_store.store("m", pending.pop(), kv), values.memcpy,
                    values.dict_put(source), floor=lambda i: floor_put.store(floor_pending.pop(), kv))
    put.prepare = prepare
    steps = floor_steps(floor, prompts[0], kv)
    return [fetch, put], steps


def floor_steps(floor: FloorStore, prompt: list[int], kv: torch.Tensor) -> list[tuple[str, Any]]:
    """Each step of the floor's fetch alone, as (name, zero-argument callable)."""
    key, packed = floor._key(prompt)
    page = floor.pages[key]
    out = np.empty(floor.page_bytes, np.uint8)
    lock = floor.lock
    pack = floor.pack

    def locks() -> None:
        with lock:
            pass
        with lock:
            pass
    return [
        ("check and pack 16 token ids", lambda: (set(map(type, prompt)) <= {int}, pack.pack(*prompt), min(prompt))),
        ("blake2b-128 of the page's tokens", lambda: hashlib.blake2b(packed, digest_size=16).digest()),
        ("lock, twice", locks),
        ("table lookup and LRU move", lambda: (floor.pages.get(key), floor.pages.move_to_end(key))),
        ("np.empty of 64 KiB", lambda: np.empty(floor.page_bytes, np.uint8)),
        ("np.copyto of 64 KiB (warm)", lambda: np.copyto(out, page.buffer)),
        ("torch.from_numpy of a float16 view", lambda: torch.from_numpy(out.view(np.float16).reshape(floor.shape))),
        ("result object", lambda: FloorResult(16, None)),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.4, help="per case and round")
    parser.add_argument("--step-scale", type=float, default=1.0, help=argparse.SUPPRESS)  # tests: fewer step calls
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cases, steps = floor_cases(TokenSource())
    settle_collector()
    rows = []
    for case, samples in zip(cases, run_rounds(cases, args.rounds, args.seconds, "rounds")):
        p50 = {name: float(np.percentile(np.array(s) / 1e3, 50)) for name, s in samples.items()}
        rows.append({"op": case.op, "bytes": case.nbytes, "kvstore_us": p50["op"], "floor_us": p50["floor"],
                     "dict_us": p50["dict"], "kvstore_vs_dict": p50["op"] / p50["dict"],
                     "floor_vs_dict": p50["floor"] / p50["dict"]})
    print(markdown_table(["op", "bytes", "kvstore p50 µs", "floor p50 µs", "dict p50 µs", "kvstore vs dict",
                          "floor vs dict"],
                         ([r["op"], "64 KiB", f"{r['kvstore_us']:.1f}", f"{r['floor_us']:.1f}", f"{r['dict_us']:.1f}",
                           f"{r['kvstore_vs_dict']:.1f}×", f"{r['floor_vs_dict']:.1f}×"] for r in rows)))
    number = max(1, round(20_000 * args.step_scale))
    timed = [{"step": name, "us": min(timeit.repeat(fn, number=number, repeat=7)) / number * 1e6}
             for name, fn in steps]
    print("\n" + markdown_table(["the floor's fetch, step by step (timeit, best of 7)", "µs"],
                                [[t["step"], f"{t['us']:.2f}"] for t in timed]
                                + [["sum", f"{sum(t['us'] for t in timed):.2f}"]]))
    write_json(args.json, {"cases": rows, "floor_fetch_steps": timed})
    return 0


if __name__ == "__main__":
    sys.exit(main())

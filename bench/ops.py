"""Per-operation cost of the hot path (one- and four-page store and fetch, fetch into a caller's
buffer, a disk-tier fetch, the same through the sidecar), each beside a memcpy, a dict and
redis-py, timed call by call in interleaved blocks in one run.

    python bench/ops.py [--quick] [--rounds 5] [--seconds 0.4] [--json FILE] [--paths ...] [--no-redis]
                        [--before-site DIR]

docs/performance.md, "Per-operation cost". `PYTHONPATH=/old/site` or `--before-site` measures older code.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: an older kvstore there wins

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import kvstore  # noqa: E402
from bench import engines  # noqa: E402
from bench.engines import RedisServer, Sidecar, run_on_site  # noqa: E402
from bench.timing import settle_collector  # noqa: E402
from bench.report import markdown_table, parser as bench_parser, write_json  # noqa: E402
from kvstore import KVStore, ModelSpec, StoreConfig  # noqa: E402

# 1 layer x 8 KV heads x 128 dims x fp16 x 16 tokens x (K, V) = a 64 KiB page.
SPEC_64K = ModelSpec(num_layers=1, num_kv_heads=8, head_dim=128, dtype="float16", page_size=16)
# 8 layers x 8 KV heads x 128 dims x fp16 x 16 tokens x (K, V) = a 512 KiB page: 2 MiB is 4 pages.
SPEC_512K = ModelSpec(num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16", page_size=16)
KIB, MIB = 1 << 10, 1 << 20


@dataclass
class Target:
    """`kind` "cost": operation time / baseline time <= bound; "speed": baseline / operation >= bound."""
    baseline: str  # memcpy, dict or redis
    kind: str
    bound: float

    def text(self) -> str:
        return f"{self.kind} vs {self.baseline} {'<=' if self.kind == 'cost' else '>='} {self.bound:g}"


@dataclass
class Case:
    path: str  # in-process, disk only, cpu+disk, sidecar shm, sidecar tcp
    op: str  # store, fetch, fetch into
    nbytes: int
    call: Callable[[int], Any]  # call i of the operation
    memcpy: Callable[[int], Any]  # np.copyto of the same bytes into a preallocated array
    dict_op: Callable[[int], Any]
    fresh: Callable[[int], Any] | None = None  # a copy into a fresh array (operations that return fresh memory)
    redis: dict[str, Callable[[int], Any]] = field(default_factory=dict)  # config -> SET or GET
    targets: list[Target] = field(default_factory=list)
    note: str = ""
    block: int = 8  # calls per subject per block
    check: Callable[[], str] | None = None  # after the run: what the case really did (e.g. disk pages per fetch)
    prepare: Callable[[int], Any] | None = None  # before a block of n calls of the op, untimed: its arguments

    @property
    def name(self) -> str:
        return f"{self.path}: {self.op} {size_name(self.nbytes)}"

    def subjects(self) -> dict[str, Callable[[int], Any]]:
        out = {"op": self.call, "memcpy": self.memcpy, "dict": self.dict_op}
        if self.fresh is not None:
            out["memcpy-fresh"] = self.fresh
        out.update({f"redis-{config}": fn for config, fn in self.redis.items()})
        return out


def size_name(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"


# ---- the baselines -------------------------------------------------------------------------

class Values:
    """`count` distinct source buffers of `nbytes` (the bytes each case's values hold), the
    arrays the baselines copy from and into, and the dict baseline's table."""

    def __init__(self, nbytes: int, count: int, seed: int):
        gen = np.random.default_rng(seed)
        self.src = [gen.integers(0, 255, nbytes, dtype=np.uint8) for _ in range(count)]
        self.dst = np.empty(nbytes, dtype=np.uint8)
        self.dst[:] = 1  # faulted in
        self.keys = [f"value:{nbytes}:{i}".encode() for i in range(count)]
        self.table = dict(zip(self.keys, self.src))
        self.count, self.nbytes = count, nbytes

    def memcpy(self, i: int) -> None:
        np.copyto(self.dst, self.src[i % self.count])

    def fresh(self, i: int) -> np.ndarray:
        return self.src[i % self.count].copy()

    def kvs(self, spec: ModelSpec) -> list[torch.Tensor]:
        """Each source buffer as `spec`'s KV (L, 2, T, H, D): the same bytes, no copy."""
        return [torch.from_numpy(src).view(torch.float16).view(spec.kv_shape(self.nbytes // spec.bytes_per_token))
                for src in self.src]

    def dict_get(self, i: int) -> np.ndarray:
        return self.table[self.keys[i % self.count]].copy()

    def dict_get_into(self, into: np.ndarray) -> Callable[[int], None]:
        keys, table, count = self.keys, self.table, self.count
        return lambda i: np.copyto(into, table[keys[i % count]])

    def dict_put(self, source: np.ndarray) -> Callable[[int], None]:
        keys, table, count = self.keys, self.table, self.count
        return lambda i: np.copyto(table[keys[i % count]], source)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact (the values are random bytes: some are NaNs, which torch.equal calls unequal)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def check_fetch(got: Any, kv: torch.Tensor, where: str) -> None:
    """A fetch's answer must be all of `kv`, bit for bit: else the run stops, saying `where`."""
    if got.matched_tokens != kv.shape[2] or not same_bytes(got.kv, kv):
        raise SystemExit(f"{where} fetch did not return the stored KV")


def flat_bytes(kv: torch.Tensor) -> np.ndarray:
    return kv.contiguous().view(torch.uint8).reshape(-1).numpy()


class TokenSource:
    """Distinct token ids: every store writes new pages, every prestored value has its own prompt."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        first, self.next = self.next, self.next + n
        return list(range(first, first + n))


def store_case(path: str, model: str, kv: torch.Tensor, store: Callable[..., Any], values: Values,
               tokens: TokenSource, **fields: Any) -> Case:
    """Stores of `kv` (`store(model, tokens, kv)`: a store's or a client's method), each under
    new tokens, made before each block: a store's cost, not building its token list. The dict
    baseline copies from a copy of `kv`'s bytes, as a store copies from the caller's KV."""
    pending: list[list[int]] = []
    return Case(path, "store", values.nbytes, lambda i: store(model, pending.pop(), kv), values.memcpy,
                values.dict_put(flat_bytes(kv).copy()),
                prepare=lambda n: pending.extend(tokens.take(kv.shape[2]) for _ in range(n)), **fields)


def fill(backend: Any, model: str, kv: torch.Tensor, tokens: TokenSource) -> None:
    """Store `kv` under new tokens until `backend`'s (a store's or a client's) CPU tier is full: a
    long-running store's memory is all touched and every store evicts, which is what a store costs
    in steady state."""
    capacity, nbytes = backend.stats()["tiers"]["cpu"]["capacity_bytes"], kv.numel() * kv.element_size()
    for _ in range(capacity // nbytes + 4):
        if backend.stats()["tiers"]["cpu"]["bytes"] >= capacity - nbytes:
            break
        backend.store(model, tokens.take(kv.shape[2]), kv)


# ---- in-process ----------------------------------------------------------------------------

def in_process_cases(big_mib: int, tmp: Path, tokens: TokenSource) -> tuple[list[Case], list[Any]]:
    """A store for the fetch cases (every value fits: nothing is evicted while they run) and one
    for the store cases (filled, so each store evicts)."""
    cases: list[Case] = []
    big = big_mib * MIB
    plan = [(SPEC_64K, 64 * KIB, 64), (SPEC_512K, 2 * MIB, 32)] + ([(SPEC_512K, big, 2)] if big > 2 * MIB else [])
    fetch_store = KVStore(StoreConfig(data_dir=None, disk_bytes=0,
                                      cpu_bytes=sum(n * k for _, n, k in plan) + 16 * MIB))
    # One store per page size for the store cases: a CPU tier's freed slots serve only pages of
    # their own size (tiers/slots.py), so one tier shared by both would refuse the larger pages.
    store_stores = {spec: KVStore(StoreConfig(data_dir=None, disk_bytes=0, cpu_bytes=64 * MIB))
                    for spec in (SPEC_64K, SPEC_512K)}
    model = {SPEC_64K: "m64k", SPEC_512K: "m512k"}
    for spec, name in model.items():
        fetch_store.register_model(name, spec)
        store_stores[spec].register_model(name, spec)
    for spec, nbytes, count in plan:
        values = Values(nbytes, count, seed=nbytes)
        n_tokens = nbytes // spec.bytes_per_token
        kvs = values.kvs(spec)
        prompts = [tokens.take(n_tokens) for _ in range(count)]
        for prompt, kv in zip(prompts, kvs):
            fetch_store.store(model[spec], prompt, kv)
        m = model[spec]
        check_fetch(fetch_store.fetch(m, prompts[0]), kvs[0], f"in-process {size_name(nbytes)}")
        into = torch.ones(nbytes, dtype=torch.uint8)  # faulted in
        into_np = into.numpy()
        got = fetch_store.fetch(m, prompts[0], into=into)
        if not same_bytes(into.view(torch.float16).view(spec.kv_shape(n_tokens)), kvs[0]) or \
                got.kv.data_ptr() != into.data_ptr():
            raise SystemExit(f"in-process fetch into= of {size_name(nbytes)} did not land in the caller's buffer")
        block = 8 if nbytes <= 2 * MIB else 2
        if nbytes <= 2 * MIB:
            cases.append(Case("in-process", "fetch", nbytes, lambda i, m=m, p=prompts, n=count: fetch_store.fetch(
                m, p[i % n]), values.memcpy, values.dict_get, values.fresh, block=block,
                targets=[Target("dict", "cost", 3.0)] if nbytes == 64 * KIB else []))
        if nbytes >= 2 * MIB:
            cases.append(Case("in-process", "fetch into", nbytes, lambda i, m=m, p=prompts, n=count, into=into:
                              fetch_store.fetch(m, p[i % n], into=into),
                              lambda i, dst=into_np, v=values: np.copyto(dst, v.src[i % v.count]),
                              values.dict_get_into(into_np),
                              targets=[Target("memcpy", "speed", 0.7 if nbytes == 2 * MIB else 0.9)],
                              note="into= a preallocated flat uint8 tensor", block=block))
        if nbytes <= 2 * MIB:
            s = store_stores[spec]
            fill(s, m, kvs[0], tokens)
            cases.append(store_case("in-process", m, kvs[0], s.store, values, tokens, block=block,
                                    targets=[Target("dict", "cost", 4.0)] if nbytes == 64 * KIB else []))
    return cases, [fetch_store, *store_stores.values()]


def disk_cases(tmp: Path, tokens: TokenSource) -> tuple[list[Case], list[Any]]:
    """2 MiB (4 x 512 KiB pages) fetched from the disk tier, its records in the OS page cache,
    round-robin over 16 values: in a store with only the disk tier, and in the default CPU+disk
    store whose CPU tier holds one value, so each fetch reads its 4 pages from disk and promotes
    them (evicting the previous value's copies, which are also on disk: no write)."""
    nbytes, count, spec = 2 * MIB, 16, SPEC_512K
    n_tokens = nbytes // spec.bytes_per_token
    values = Values(nbytes, count, seed=7)
    kvs = values.kvs(spec)
    prompts = [tokens.take(n_tokens) for _ in range(count)]
    cases, stores = [], []
    for path, cpu_bytes, how in (("disk only", 0, "disk-only store (cpu_bytes=0)"),
                                 ("cpu+disk", nbytes, "CPU tier of one value; every fetch reads disk and promotes")):
        store = KVStore(StoreConfig(data_dir=str(tmp / path.replace(" ", "-").replace("+", "-")),
                                    cpu_bytes=cpu_bytes, disk_bytes=4 * count * nbytes))
        stores.append(store)
        store.register_model("m", spec)
        for prompt, kv in zip(prompts, kvs):
            store.store("m", prompt, kv)
        store.flush()
        for prompt, kv in zip(prompts, kvs):  # one pass: every value's records in the OS page cache
            check_fetch(store.fetch("m", prompt), kv, path)
        before = dict(store.stats()["tiers"]["disk"])
        calls = [0]

        def fetch(i: int, store=store, calls=calls) -> Any:
            calls[0] += 1
            return store.fetch("m", prompts[i % count])

        def check(store=store, before=before, calls=calls, how=how) -> str:
            disk = store.stats()["tiers"]["disk"]
            per_fetch = (disk["hits"] - before["hits"]) / max(1, calls[0])
            return f"{how}: {per_fetch:.2f} disk pages read per fetch (4 = all)"

        cases.append(Case(path, "fetch", nbytes, fetch, values.memcpy, values.dict_get, values.fresh,
                          targets=[Target("memcpy", "speed", 0.5)], check=check))
    return cases, stores


# ---- the sidecar ---------------------------------------------------------------------------

LAUNCH = """import sys, kvstore
print(kvstore.__file__, flush=True)
from kvstore.cli import main
sys.exit(main(sys.argv[1:]))
"""


def start_sidecar(data_dir: Path, cpu_bytes: int, launch: str = LAUNCH, extra_args: tuple[str, ...] = (),
                  serve_args: tuple[str, ...] = ()) -> Sidecar:
    """`kvstore serve` (CPU tier only) in a subprocess that imports the kvstore this process
    does (PYTHONPATH is inherited; the working directory is its data directory, since `-c` puts
    it first on sys.path); its `preamble` holds the kvstore.__file__ it imported."""
    return Sidecar(data_dir, [*engines.serve_args(cpu_bytes), *serve_args],
                   launch=[sys.executable, "-c", launch, *extra_args], cwd=data_dir).start()


def sidecar_cases(fetch_url: str, store_urls: dict[int, str], tokens: TokenSource,
                  redis_port: int | None) -> tuple[list[Case], list[Any]]:
    from kvstore import KVStoreClient

    cases, clients = [], []
    redis_clients = redis_configs(redis_port) if redis_port is not None else {}
    for spec, nbytes, count in ((SPEC_64K, 64 * KIB, 64), (SPEC_512K, 2 * MIB, 32)):
        values = Values(nbytes, count, seed=nbytes + 1)
        n_tokens = nbytes // spec.bytes_per_token
        kvs = values.kvs(spec)
        model = f"m{nbytes}"
        prompts = [tokens.take(n_tokens) for _ in range(count)]
        with KVStoreClient(fetch_url) as admin:
            admin.register_model(model, spec)
            for prompt, kv in zip(prompts, kvs):
                admin.store(model, prompt, kv)
        store_url = store_urls[nbytes]
        with KVStoreClient(store_url) as admin:
            admin.register_model(model, spec)
            fill(admin, model, kvs[0], tokens)
        redis_get, redis_set = redis_ops(redis_clients, nbytes, count, values)
        for transport in ("shm", "tcp"):
            shm_bytes = None if transport == "shm" else 0
            fetch_client = KVStoreClient(fetch_url, shared_memory_bytes=shm_bytes)
            store_client = KVStoreClient(store_url, shared_memory_bytes=shm_bytes)
            clients += [fetch_client, store_client]
            check_fetch(fetch_client.fetch(model, prompts[0]), kvs[0], f"sidecar {transport} {size_name(nbytes)}")
            path = f"sidecar {transport}"
            fetch_targets = []
            if redis_get and nbytes == 64 * KIB:
                fetch_targets = [Target("redis", "cost", 2.0)]
            elif redis_get and transport == "shm":
                fetch_targets = [Target("redis", "speed", 2.0)]
            cases.append(Case(path, "fetch", nbytes, lambda i, c=fetch_client, m=model, p=prompts, n=count: c.fetch(
                m, p[i % n]), values.memcpy, values.dict_get, values.fresh, redis=redis_get, targets=fetch_targets))
            cases.append(store_case(path, model, kvs[0], store_client.store, values, tokens, redis=redis_set))
    return cases, clients


# ---- redis-py, both configurations -----------------------------------------------------------

def redis_configs(port: int) -> dict[str, Any]:
    """redis-py with hiredis (its default when installed: hiredis parses replies and packs
    commands) and with its pure-Python reply parser and command packer, chosen on the pool."""
    import redis
    from redis._parsers import Encoder, _RESP2Parser
    from redis.connection import PythonRespSerializer

    configs = {}
    try:
        import hiredis  # noqa: F401

        configs["hiredis"] = redis.Redis(port=port)
    except ImportError:
        pass
    encoder = Encoder("utf-8", "strict", False)
    pool = redis.ConnectionPool(port=port, parser_class=_RESP2Parser,
                                command_packer=PythonRespSerializer(6000, encoder.encode))
    configs["python"] = redis.Redis(connection_pool=pool)
    return configs


def redis_ops(configs: dict[str, Any], nbytes: int, count: int,
              values: Values) -> tuple[dict[str, Callable[[int], Any]], dict[str, Callable[[int], Any]]]:
    gets, sets = {}, {}
    for name, r in configs.items():
        keys = [f"ops:{nbytes}:{i}" for i in range(count)]
        for key, src in zip(keys, values.src):
            r.set(key, src.tobytes())
        payloads = [src.tobytes() for src in values.src]
        if r.get(keys[0]) != payloads[0]:
            raise SystemExit(f"redis-py {name}: GET did not return what SET stored")
        gets[name] = lambda i, r=r, keys=keys: r.get(keys[i % count])
        sets[name] = lambda i, r=r, keys=keys, payloads=payloads: r.set(keys[i % count], payloads[0])
    return gets, sets


# ---- timing --------------------------------------------------------------------------------

def run_round(case: Case, seconds: float, samples: dict[str, list[float]], counters: dict[str, int]) -> None:
    """Blocks of `case.block` calls of each subject in turn (the order rotates per block) until
    `seconds` have passed (at least two blocks)."""
    subjects = list(case.subjects().items())
    prepare = case.prepare
    began = time.perf_counter()
    blocks = 0
    clock = time.perf_counter_ns
    while blocks < 2 or time.perf_counter() - began < seconds:
        for k in range(len(subjects)):
            name, fn = subjects[(k + blocks) % len(subjects)]
            if name == "op" and prepare is not None:
                prepare(case.block)
            out = samples.setdefault(name, [])
            i = counters.get(name, 0)
            for j in range(i, i + case.block):
                t0 = clock()
                fn(j)
                out.append(clock() - t0)
            counters[name] = i + case.block
        blocks += 1


def run_rounds(cases: list[Case], rounds: int, seconds: float, desc: str) -> list[dict[str, list[float]]]:
    """Each case's samples (subject -> ns per call) from `rounds` rounds of every case in turn
    (the case order rotates per round too)."""
    samples: list[dict[str, list[float]]] = [{} for _ in cases]
    counters: list[dict[str, int]] = [{} for _ in cases]
    with tqdm(total=rounds * len(cases), desc=desc, unit="case", file=sys.stderr) as bar:
        for r in range(rounds):
            for k in range(len(cases)):
                c = (k + r) % len(cases)
                run_round(cases[c], seconds, samples[c], counters[c])
                bar.update()
    return samples


def summarize(case: Case, samples: dict[str, list[float]]) -> dict[str, Any]:
    def pct(name: str, q: float) -> float:
        return float(np.percentile(np.array(samples[name]) / 1e3, q))

    op50 = pct("op", 50)
    memcpy_kind = "prealloc"
    memcpy50 = pct("memcpy", 50)
    if "memcpy-fresh" in samples and pct("memcpy-fresh", 50) < memcpy50:
        memcpy_kind, memcpy50 = "fresh", pct("memcpy-fresh", 50)
    redis_kind, redis50 = None, None
    for name in samples:
        if name.startswith("redis-") and (redis50 is None or pct(name, 50) < redis50):
            redis_kind, redis50 = name[len("redis-"):], pct(name, 50)
    base = {"memcpy": memcpy50, "dict": pct("dict", 50), "redis": redis50}
    targets = []
    for t in case.targets:
        b = base[t.baseline]
        if b is None:
            continue
        value = op50 / b if t.kind == "cost" else b / op50
        targets.append({"target": t.text(), "value": value,
                        "met": value <= t.bound if t.kind == "cost" else value >= t.bound})
    return {
        "path": case.path, "op": case.op, "bytes": case.nbytes, "name": case.name, "calls": len(samples["op"]),
        "p50_us": op50, "p90_us": pct("op", 90),
        "memcpy_us": memcpy50, "memcpy_kind": memcpy_kind, "speed_vs_memcpy": memcpy50 / op50,
        "dict_us": base["dict"], "cost_vs_dict": op50 / base["dict"],
        "redis_us": redis50, "redis_config": redis_kind, "cost_vs_redis": None if redis50 is None else op50 / redis50,
        "baselines_p50_us": {name: pct(name, 50) for name in samples},
        "baselines_p90_us": {name: pct(name, 90) for name in samples},
        "targets": targets, "note": case.note,
    }


def table(rows: list[dict[str, Any]]) -> str:
    return markdown_table(
        ["path", "op", "bytes", "p50 µs", "p90 µs", "memcpy µs", "speed vs memcpy", "dict µs", "cost vs dict",
         "redis-py µs", "cost vs redis-py", "target", "met"],
        ([r["path"], r["op"], size_name(r["bytes"]), f"{r['p50_us']:,.1f}", f"{r['p90_us']:,.1f}",
          f"{r['memcpy_us']:,.1f} ({r['memcpy_kind']})", f"{r['speed_vs_memcpy']:.2f}", f"{r['dict_us']:,.1f}",
          f"{r['cost_vs_dict']:.1f}×", "–" if r["redis_us"] is None else f"{r['redis_us']:,.1f} ({r['redis_config']})",
          "–" if r["cost_vs_redis"] is None else f"{r['cost_vs_redis']:.2f}×", *target_cells(r)] for r in rows))


def target_cells(row: dict[str, Any]) -> tuple[str, str]:
    """A result row's targets and whether each was met, as two table cells."""
    targets = row["targets"]
    return ("; ".join(t["target"] for t in targets) or "–",
            "; ".join(("met" if t["met"] else "missed") + f" ({t['value']:.2f})" for t in targets) or "–")


def close_all(closers: list[Any], servers: list[Sidecar | RedisServer]) -> None:
    """Close the clients and stores a run opened, then stop the servers it started."""
    for c in closers:
        c.close()
    for server in servers:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="a short run: 3 rounds of 0.1 s per case")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; --quick 3)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="per case per round, baselines included (default 0.4; --quick 0.1)")
    parser.add_argument("--paths", default="in-process,disk,sidecar",
                        help="which cases: in-process, disk and/or sidecar")
    parser.add_argument("--big-mib", type=int, default=64, help="size of the large fetch into= (MiB, >= 2)")
    parser.add_argument("--no-redis", action="store_true", help="no redis-py column on the sidecar rows")
    parser.add_argument("--before-site", metavar="DIR",
                        help="first run the same cases with PYTHONPATH=DIR (older code), then print both")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 5)
    seconds = args.seconds if args.seconds is not None else (0.1 if args.quick else 0.4)
    paths = set(args.paths.split(","))
    if not paths <= {"in-process", "disk", "sidecar"}:
        parser.error(f"--paths: expected in-process, disk and/or sidecar, got {args.paths!r}")
    if args.big_mib < 2:
        parser.error("--big-mib: must be >= 2")
    before = None
    if args.before_site:
        same = ["--rounds", str(rounds), "--seconds", str(seconds), "--paths", args.paths,
                "--big-mib", str(args.big_mib)]
        before = run_on_site(__file__, same + (["--no-redis"] if args.no_redis else []), args.before_site)
    print(f"kvstore: {os.path.dirname(kvstore.__file__)}", flush=True)
    torch.set_num_threads(1)
    procs: list[Sidecar | RedisServer] = []
    built: list[tuple[list[Case], list[Any]]] = []  # per path: its cases, and the stores or clients to close
    header = [f"kvstore in this process: {os.path.dirname(kvstore.__file__)}"]
    with tempfile.TemporaryDirectory(prefix="kvstore-ops-") as tmpdir:
        tmp = Path(tmpdir)
        try:
            tokens = TokenSource()
            built += [in_process_cases(args.big_mib, tmp, tokens)] if "in-process" in paths else []
            built += [disk_cases(tmp, tokens)] if "disk" in paths else []
            if "sidecar" in paths:
                redis_port = None
                if not args.no_redis:
                    try:
                        procs.append(RedisServer(tmp).start())
                        redis_port = procs[-1].port
                    except RuntimeError as e:
                        header.append(f"redis-py column: {e}")
                procs.append(start_sidecar(tmp / "sidecar-fetch", 128 * MIB))
                fetch_url, where = procs[-1].url, procs[-1].preamble[0]
                # One sidecar per page size for the stores (each evicts: its tier is filled first);
                # a CPU tier's freed slots serve only pages of their own size (tiers/slots.py).
                store_urls = {}
                for nbytes in (64 * KIB, 2 * MIB):
                    procs.append(start_sidecar(tmp / f"sidecar-store-{nbytes}", 64 * MIB))
                    store_urls[nbytes] = procs[-1].url
                header.append(f"kvstore in the sidecars: {os.path.dirname(where)}")
                built.append(sidecar_cases(fetch_url, store_urls, tokens, redis_port))
            cases = [case for found, _ in built for case in found]
            settle_collector()
            rows = [summarize(case, s) for case, s in zip(cases, run_rounds(cases, rounds, seconds, "bench/ops"))]
            for case, row in zip(cases, rows):
                if case.check is not None:
                    row["note"] = case.check()
        finally:
            close_all([closer for _, opened in built for closer in opened], procs)
    print("\n".join(header))
    print(f"{rounds} interleaved rounds of {seconds:g} s per case; speed vs memcpy = memcpy time / op time, "
          "cost vs dict (or redis-py) = op time / baseline time, p50s")
    print(table(rows))
    for r in rows:
        if r["note"]:
            print(f"- {r['name']}: {r['note']}")
    result = {"kvstore": os.path.dirname(kvstore.__file__), "header": header, "rounds": rounds, "seconds": seconds,
              "rows": rows}
    if before is not None:
        print(f"\nbefore (kvstore from {before['kvstore']}, run first) / after (this run):")
        print(compare_table(before["rows"], rows))
        result = {"before": before, "after": result}
    write_json(args.json, result)
    return 0


def compare_table(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> str:
    """Each case's p50 and ratios as `before / after`, and its targets judged on the after run."""
    old = {r["name"]: r for r in before}

    def pair(name: str, key: str, fmt: str) -> str:
        vals = [old.get(name, {}).get(key), next(r for r in after if r["name"] == name).get(key)]
        return " / ".join("–" if v is None else format(v, fmt) for v in vals)

    return markdown_table(
        ["path", "op", "bytes", "p50 µs", "speed vs memcpy", "cost vs dict", "cost vs redis-py", "target", "after"],
        ([r["path"], r["op"], size_name(r["bytes"]), pair(r["name"], "p50_us", ",.1f"),
          pair(r["name"], "speed_vs_memcpy", ".2f"), pair(r["name"], "cost_vs_dict", ".1f"),
          pair(r["name"], "cost_vs_redis", ".2f"), *target_cells(r)] for r in after))


if __name__ == "__main__":
    sys.exit(main())

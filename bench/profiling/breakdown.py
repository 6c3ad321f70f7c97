"""Where the time goes: cProfile self times of one-page (64 KiB) and four-page (2 MiB) stores and
fetches, in-process and through the sidecar, grouped into categories and scaled to each case's
unprofiled p50 (µs per call). The sidecar's event loop thread is profiled between SIGUSR1 and SIGUSR2.

    python -m bench.profiling breakdown [--quick] [--json FILE] [--before-site DIR]

docs/performance.md, "Where the time goes".
"""
from __future__ import annotations

import cProfile
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.append(str(Path(__file__).resolve().parents[2]))  # after PYTHONPATH: an older kvstore there wins

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import kvstore  # noqa: E402
from kvstore import KVStore, StoreConfig  # noqa: E402
from bench.ops import (KIB, MIB, SPEC_512K, SPEC_64K, TokenSource, check_fetch, close_all, fill,  # noqa: E402
                       size_name, start_sidecar)
from bench.engines import run_on_site  # noqa: E402
from bench.report import markdown_table, parser as bench_parser, write_json  # noqa: E402
from bench.timing import settle_collector  # noqa: E402

SIZES = ((SPEC_64K, 64 * KIB, 64), (SPEC_512K, 2 * MIB, 16))  # (spec, value bytes, prestored values)
TIER_BYTES = 64 * MIB

# The sidecar's launcher: kvstore serve, with a profiler of the event loop's thread that
# SIGUSR1 starts afresh and SIGUSR2 stops and dumps to <prefix>.<n>.
LAUNCH_PROFILED = """import cProfile, os, signal, sys, kvstore
print(kvstore.__file__, flush=True)
prefix = sys.argv.pop(1)
state = {"n": 0, "prof": None}
import numpy as np
copyto = np.copyto
def profiled_copyto(*args, **kwargs):  # numpy 2's copyto is invisible to cProfile
    return copyto(*args, **kwargs)
def start(*_):
    np.copyto = profiled_copyto
    state["prof"] = cProfile.Profile()
    state["prof"].enable()
def stop(*_):
    prof = state["prof"]
    prof.disable()
    np.copyto = copyto
    path = f"{prefix}.{state['n']}"
    prof.dump_stats(path + ".tmp")
    os.replace(path + ".tmp", path)
    state["n"] += 1
signal.signal(signal.SIGUSR1, start)
signal.signal(signal.SIGUSR2, stop)
from kvstore.cli import main
sys.exit(main(sys.argv[1:]))
"""

# ---- categories ----------------------------------------------------------------------------

# Builtins (C functions) by a part of their name: their own category, wherever called from.
BUILTIN_RULES = [
    (("copyto", "method 'copy_'", "'clone'", "method 'copy' of 'numpy", "memmove", "'tobytes'", "readinto",
      "method 'write' of 'mmap", "'__setitem__' of 'mmap", "method 'copy' of 'mmap"), "copy"),
    (("acquire", "release", "of '_thread.RLock'", "of '_thread.lock'"), "lock"),
    (("poll' of 'select", "select.epoll", "'select'"), "idle: waiting in the event loop's poll"),
    (("recv",), "socket receive"),
    (("send",), "socket send"),
    (("xxh", "blake2", "digest", "hexdigest", "sha1", "sha256", "md5"), "token hashing and tree match"),
    (("msgpack", "Packer", "Unpacker", "unpackb", "packb"), "msgpack framing"),
]
# Python code by the file it is in (the first rule with a fragment in the path wins).
FILE_RULES = [
    (("bench/", "cProfile"), "harness"),
    (("kvstore/validation.py", "kvstore/config.py"), "validation"),
    (("kvstore/keys.py", "kvstore/index.py"), "token hashing and tree match"),
    (("kvstore/placement.py", "kvstore/policies/", "kvstore/shadow.py", "kvstore/store_state.py",
      "kvstore/tier_stack.py", "tiers/slots.py", "tiers/cpu.py", "tiers/base.py"), "placement and policy bookkeeping"),
    (("kvstore/host_copy.py", "kvstore/copy_threads.py"), "copy"),
    (("kvstore/results.py", "kvstore/host_memory.py", "kvstore/codecs.py", "torch/", "numpy/"),
     "tensor and result objects"),
    (("tiers/disk",), "disk tier"),
    (("api/client",), "client code"),
    (("api/server/shared_memory.py",), "shared memory"),
    (("api/framing.py",), "msgpack framing"),
    (("api/server/wire.py",), "request decoding and checks"),
    # api/: handlers, middleware, the rest of the app
    (("api/server/connection.py", "api/", "aiohttp/", "multidict", "yarl"), "HTTP parsing and dispatch"),
    (("asyncio/", "selectors.py"), "event loop"),
    (("kvstore/",), "store control flow"),  # store.py, fetch_plan.py, page_writes.py, registry.py, ...
    (("socket.py",), "socket send"),
]
# Functions by name, before the file rules: the harness's stand-in for np.copyto (below).
NAME_RULES = {"profiled_copyto": "copy"}
OTHER = "other"
IDLE = "idle: waiting in the event loop's poll"
WAIT = "socket receive"
POLICY = "placement and policy bookkeeping"  # the client: waiting for (and, over TCP, receiving) the answer


def profiled_copyto(*args: Any, **kwargs: Any) -> Any:
    """np.copyto while profiling: numpy 2 dispatches it through an object cProfile does not see,
    so without this its time lands in whatever function called it."""
    return _copyto(*args, **kwargs)


_copyto = np.copyto


def file_category(filename: str) -> str:
    path = filename.replace(os.sep, "/")
    for fragments, category in FILE_RULES:
        if any(f in path for f in fragments):
            return category
    return OTHER


def builtin_category(name: str) -> str | None:
    for fragments, category in BUILTIN_RULES:
        if any(f in name for f in fragments):
            return category
    return None


def categorize(stats: dict) -> dict[str, float]:
    """Seconds of self time per category. A builtin without a category of its own is split over
    its callers' categories in proportion to the time each call site spent in it."""
    out: dict[str, float] = {}
    own: dict[tuple, str] = {}

    def category_of(func: tuple) -> str:
        if func not in own:
            filename, _, name = func
            if name in NAME_RULES:
                own[func] = NAME_RULES[name]
            elif filename == "~":
                own[func] = builtin_category(name) or ""
            else:
                own[func] = file_category(filename)
        return own[func]

    def caller_category(func: tuple, depth: int = 0) -> str:
        c = category_of(func)
        if c or depth > 8:
            return c or OTHER
        callers = stats[func][4] if func in stats else {}
        if not callers:
            return OTHER
        top = max(callers.items(), key=lambda kv: kv[1][2])[0]
        return caller_category(top, depth + 1)

    for func, (_, _, tt, _, callers) in stats.items():
        c = category_of(func)
        if c:
            out[c] = out.get(c, 0.0) + tt
            continue
        total = sum(v[2] for v in callers.values())
        if not callers or total <= 0:
            out[OTHER] = out.get(OTHER, 0.0) + tt
            continue
        for caller, v in callers.items():
            cc = caller_category(caller)
            out[cc] = out.get(cc, 0.0) + tt * v[2] / total
    return out


# ---- running a case ------------------------------------------------------------------------

def p50_us(fn: Callable[[int], Any], calls: int, warm: int) -> float:
    """The median µs of `calls` calls, after `warm` untimed ones."""
    for j in range(warm):
        fn(j)
    times = np.empty(calls)
    clock = time.perf_counter_ns
    for j in range(calls):
        t0 = clock()
        fn(warm + j)
        times[j] = clock() - t0
    return float(np.median(times)) / 1e3


def profiled(fn: Callable[[int], Any], calls: int, offset: int) -> tuple[dict, float]:
    """-> (pstats' table, wall µs per call under the profiler)."""
    prof = cProfile.Profile()
    np.copyto = profiled_copyto
    try:
        t0 = time.perf_counter()
        prof.enable()
        for j in range(calls):
            fn(offset + j)
        prof.disable()
        wall = (time.perf_counter() - t0) / calls * 1e6
    finally:
        np.copyto = _copyto
    return pstats.Stats(prof).stats, wall  # type: ignore[attr-defined]


def top(stats: dict, calls: int, n: int = 15) -> list[list]:
    """The `n` functions with the most self time: [file:line(name), category, µs per call]."""
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:n]
    return [[f"{f}:{line}({name})", categorize({k: v}).popitem()[0] if v[2] else "", v[2] / calls * 1e6]
            for (f, line, name), v in rows for k in [(f, line, name)]]


def after_answer_s(stats: dict) -> float:
    """Seconds in the sidecar's catch-up (the policy learning after an answer is written,
    api/server/catch_up.py), which runs while the client reads its answer: off the call's critical path."""
    return sum(v[3] for (f, _, name), v in stats.items()
               if f.replace(os.sep, "/").endswith("api/server/catch_up.py") and name == "_run")


def in_process_case(fn: Callable[[int], Any], calls: int, warm: int) -> dict[str, Any]:
    p50 = p50_us(fn, calls, warm)
    stats, wall = profiled(fn, calls, warm + calls)
    seconds = categorize(stats)
    seconds.pop("harness", None)
    total = sum(seconds.values())
    return {"p50_us": p50, "profiled_us": wall,
            "categories_us": {c: s / total * p50 for c, s in sorted(seconds.items(), key=lambda kv: -kv[1])},
            "top": top(stats, calls)}


def sidecar_case(fn: Callable[[int], Any], calls: int, warm: int, proc: subprocess.Popen,
                 prefix: str, counter: list[int]) -> dict[str, Any]:
    p50 = p50_us(fn, calls, warm)
    proc.send_signal(signal.SIGUSR1)
    time.sleep(0.1)  # the sidecar's handler runs at its next bytecode
    stats, wall = profiled(fn, calls, warm + calls)
    proc.send_signal(signal.SIGUSR2)
    path = f"{prefix}.{counter[0]}"
    counter[0] += 1
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit("the sidecar did not write its profile")
        time.sleep(0.02)
    client = categorize(stats)
    client.pop("harness", None)
    server_stats = pstats.Stats(path).stats  # type: ignore[attr-defined]
    server = categorize(server_stats)
    server.pop(IDLE, None)
    server.pop("harness", None)
    # The catch-up is nearly all policy work; it overlaps the client, so it is shown apart.
    after = min(after_answer_s(server_stats), server.get(POLICY, 0.0))
    server[POLICY] = server.get(POLICY, 0.0) - after
    waiting = client.pop(WAIT, 0.0)
    client_us = sum(client.values()) / calls * 1e6
    server_us = sum(server.values()) / calls * 1e6
    between_us = max(0.0, wall - client_us - server_us)
    scale = p50 / (client_us + server_us + between_us)
    out = {f"client: {c}": s / calls * 1e6 * scale for c, s in client.items()}
    out.update({f"sidecar: {c}": s / calls * 1e6 * scale for c, s in server.items()})
    out["between the processes: wake-ups, loopback, scheduling"] = between_us * scale
    return {"p50_us": p50, "profiled_us": wall, "client_waiting_profiled_us": waiting / calls * 1e6,
            "after_answer_us": after / calls * 1e6 * scale,
            "categories_us": dict(sorted(out.items(), key=lambda kv: -kv[1])),
            "top_client": top(stats, calls), "top_sidecar": top(server_stats, calls)}


def run_all(quick: bool, paths: set[str], serve_args: tuple[str, ...] = ()) -> dict[str, Any]:
    torch.set_num_threads(1)
    calls = {64 * KIB: 300 if quick else 2000, 2 * MIB: 100 if quick else 600}
    results: dict[str, Any] = {"kvstore": os.path.dirname(kvstore.__file__), "cases": {}}
    with tempfile.TemporaryDirectory(prefix="kvstore-profile-") as tmpdir:
        tmp = Path(tmpdir)
        tokens = TokenSource()
        todo: list[tuple[str, Callable[[], dict]]] = []
        closers: list[Any] = []
        procs: list[Any] = []
        try:
            for spec, nbytes, count in SIZES:
                n_tokens = nbytes // spec.bytes_per_token
                kv = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).view(torch.float16).view(
                    spec.kv_shape(n_tokens))
                if "in-process" in paths:
                    todo += in_process_todo(spec, nbytes, count, n_tokens, kv, tokens, calls[nbytes], closers)
                if "sidecar" in paths:
                    todo += sidecar_todo(tmp, spec, nbytes, count, n_tokens, kv, tokens, calls[nbytes], closers, procs,
                                         serve_args)
            settle_collector()
            for name, job in tqdm(todo, desc="bench/profile_ops", unit="case", file=sys.stderr):
                results["cases"][name] = job()
        finally:
            close_all(closers, procs)
    return results


def fetch_case(prestore: Callable[[list[int]], Any], fetch: Callable[[list[int]], Any], prompts: list[list[int]],
               tokens: TokenSource, n_tokens: int, count: int, kv: Any, where: str,
               run: Callable[[Callable[[int], Any]], dict]) -> dict:
    """A fetch case: `count` prompts stored once, after the store cases (which evict), so every
    fetch hits; the first checked to come back as stored, the last to hit after the run."""
    if not prompts:
        prompts.extend(tokens.take(n_tokens) for _ in range(count))
        for p in prompts:
            prestore(p)
    check_fetch(fetch(prompts[0]), kv, where)
    out = run(lambda i: fetch(prompts[i % count]))
    if fetch(prompts[-1]).matched_tokens != n_tokens:
        raise SystemExit(f"{where} fetch missed")
    return out


def in_process_todo(spec, nbytes, count, n_tokens, kv, tokens, calls, closers) -> list:
    store = KVStore(StoreConfig(data_dir=None, disk_bytes=0, cpu_bytes=TIER_BYTES))
    closers.append(store)
    store.register_model("m", spec)
    fill(store, "m", kv, tokens)
    prompts: list[list[int]] = []
    stored = [tokens.take(n_tokens) for _ in range(4 * calls + 64)]

    def store_job() -> dict:
        return in_process_case(lambda i: store.store("m", stored[i], kv), calls, 32)

    def fetch_job() -> dict:
        return fetch_case(lambda p: store.store("m", p, kv), lambda p: store.fetch("m", p), prompts, tokens,
                          n_tokens, count, kv, "in-process", lambda fn: in_process_case(fn, calls, 32))

    label = size_name(nbytes)
    return [(f"in-process store {label}", store_job), (f"in-process fetch {label}", fetch_job)]


def sidecar_todo(tmp, spec, nbytes, count, n_tokens, kv, tokens, calls, closers, procs, serve_args) -> list:
    from kvstore import KVStoreClient

    # One sidecar per value size: a CPU tier's freed slots serve only pages of their own size.
    prefix = str(tmp / f"profile-{nbytes}")
    sidecar = start_sidecar(tmp / f"sidecar-{nbytes}", TIER_BYTES, launch=LAUNCH_PROFILED, extra_args=(prefix,),
                            serve_args=serve_args)
    procs.append(sidecar)
    proc, url = sidecar.proc, sidecar.url
    counter = [0]
    admin = KVStoreClient(url)
    closers.append(admin)
    admin.register_model("m", spec)
    fill(admin, "m", kv, tokens)
    prompts: list[list[int]] = []
    label = size_name(nbytes)
    stores, fetches = [], []  # every store case first: they evict, and the fetches must all hit
    for transport in ("shm", "tcp"):
        client = KVStoreClient(url, shared_memory_bytes=None if transport == "shm" else 0)
        closers.append(client)
        stored = [tokens.take(n_tokens) for _ in range(4 * calls + 64)]

        def store_job(client=client, stored=stored) -> dict:
            return sidecar_case(lambda i: client.store("m", stored[i], kv), calls, 32, proc, prefix, counter)

        def fetch_job(client=client) -> dict:
            return fetch_case(lambda p: admin.store("m", p, kv), lambda p: client.fetch("m", p), prompts, tokens,
                              n_tokens, count, kv, "sidecar",
                              lambda fn: sidecar_case(fn, calls, 32, proc, prefix, counter))

        stores.append((f"sidecar {transport} store {label}", store_job))
        fetches.append((f"sidecar {transport} fetch {label}", fetch_job))
    return stores + fetches


# ---- report --------------------------------------------------------------------------------

GROUPS = ("in-process", "sidecar shm", "sidecar tcp")
MAJOR_SHARE = 0.03


def tables(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """One table per group: categories down, cases across (each as `before / after` when two runs)."""
    out = []
    for group in GROUPS:
        names = [n for n in runs[0][1]["cases"] if n.startswith(group + " ")]
        if not names:
            continue
        cases = [case for _, run in runs for n in names for case in [run["cases"].get(n, {})] if case]

        def share(case: dict, categories: list[str]) -> float | None:  # None: the run lacks the case
            return sum(case.get("categories_us", {}).get(c, 0.0) for c in categories) if case else None

        totals: dict[str, float] = {}
        for case in cases:
            for c, us in case.get("categories_us", {}).items():
                totals[c] = totals.get(c, 0.0) + us
        # Categories under 3% of every call they appear in fold into one row, so the tables stay readable.
        order = sorted((c for c in totals if any(share(case, [c]) >= MAJOR_SHARE * case["p50_us"] for case in cases)),
                       key=lambda c: -totals[c])
        minor = [c for c in totals if c not in order]

        def row(label: str, get: Callable[[dict], float | None]) -> list[str]:
            return [label] + [" / ".join("–" if v is None else f"{v:,.1f}" for v in
                                         (get(run["cases"].get(n, {})) for _, run in runs)) for n in names]

        rows = [row("**p50, unprofiled**", lambda case: case.get("p50_us"))]
        rows += [row(c, lambda case, c=c: share(case, [c])) for c in order]
        rows += [row(f"smaller categories ({len(minor)})", lambda case: share(case, minor))] if minor else []
        if any("after_answer_us" in case for case in cases):
            rows.append(row("*sidecar, after the answer (policy learning, overlaps the next request; not in p50)*",
                            lambda case: case.get("after_answer_us")))
        rows.append(row("profiled call (inflation)", lambda case: case.get("profiled_us")))
        labels = " / ".join(label for label, _ in runs)
        out += [f"**{group}** (µs per call{', ' + labels if len(runs) > 1 else ''})\n",
                markdown_table(["category", *(n[len(group) + 1:] for n in names)], rows), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer calls per case")
    parser.add_argument("--paths", default="in-process,sidecar", help="in-process and/or sidecar")
    parser.add_argument("--before-site", metavar="DIR",
                        help="also run the cases with PYTHONPATH=DIR (older code) and print both")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="passed to this checkout's `kvstore serve` (repeatable): --serve-arg=--event-loop=asyncio")
    args = parser.parse_args(argv)
    paths = set(args.paths.split(","))
    if not paths <= {"in-process", "sidecar"}:
        parser.error(f"--paths: expected in-process and/or sidecar, got {args.paths!r}")
    runs: list[tuple[str, dict[str, Any]]] = []
    if args.before_site:
        before = run_on_site(__file__, ["--paths", args.paths] + (["--quick"] if args.quick else []), args.before_site)
        runs.append(("before", before["this run"]))
    print(f"kvstore: {os.path.dirname(kvstore.__file__)}", flush=True)
    runs.append(("after" if runs else "this run", run_all(args.quick, paths, tuple(args.serve_arg))))
    for label, run in runs:
        print(f"{label}: kvstore from {run['kvstore']}")
    print(tables(runs))
    write_json(args.json, {label: run for label, run in runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Instructions per store operation under valgrind's callgrind (counting on only around each
case's loop): a fixed cost that noise cannot move; one-page cases also print the count less a
plain `np.copyto` of the same bytes. Needs valgrind.

    python -m bench.profiling instructions [--before-site OLD_SITE]

docs/performance.md, "Instructions per operation".
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = ("fetch-64KiB", "store-64KiB", "fetch-into-2MiB", "plan-128-pages")
CALLS = 300  # counted per case
ONE_COPY = ("fetch-64KiB", "store-64KiB")  # cases whose copy glibc makes as the baseline's (see above)

# The child: builds a store as bench/ops.py does (a 64 MiB CPU tier filled first, so a store
# evicts), says "ready PID", waits for a line on stdin, runs the case N times, says "done",
# waits again. The parent switches counting on and off in between.
CHILD = r"""
import gc, os, sys
import numpy as np, torch
import kvstore
from kvstore import KVStore, ModelSpec, StoreConfig
case, n, data_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
gc.freeze(); gc.set_threshold(50_000); torch.set_num_threads(1)
spec64 = ModelSpec(num_layers=1, num_kv_heads=8, head_dim=128, dtype="float16", page_size=16)
spec512 = ModelSpec(num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16", page_size=16)
store = KVStore(StoreConfig(data_dir=data_dir, cpu_bytes=64 << 20, disk_bytes=0))
store.register_model("m64", spec64); store.register_model("m512", spec512)
kv64 = torch.randn(spec64.kv_shape(16)).half()
for i in range(1100):
    store.store("m64", [10**6 + i] * 16, kv64)
tokens64 = list(range(16)); store.store("m64", tokens64, kv64)
tokens2m = list(range(64)); kv2m = torch.randn(spec512.kv_shape(64)).half(); store.store("m512", tokens2m, kv2m)
tokens128 = list(range(5000, 5000 + 128 * 16))
store.store("m64", tokens128, torch.randn(spec64.kv_shape(128 * 16)).half())
into = torch.zeros(4 << 20, dtype=torch.uint8)
if store.fetch("m64", tokens64).matched_tokens != 16 or store.fetch("m512", tokens2m, into=into).matched_tokens != 64:
    raise SystemExit("the stored values do not come back")
if store._plan_fetch("m64", tokens128).matched_tokens != len(tokens128):
    raise SystemExit("the 128-page value does not come back")
nbytes = {"fetch-64KiB": 64 << 10, "store-64KiB": 64 << 10, "fetch-into-2MiB": 2 << 20,
          "plan-128-pages": 0}[case.removeprefix("memcpy-")]
src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
counter = iter(range(2 * 10**6, 10**9))
ops = {
    "fetch-64KiB": lambda: store.fetch("m64", tokens64),
    "store-64KiB": lambda: store.store("m64", [next(counter)] * 16, kv64),
    "fetch-into-2MiB": lambda: store.fetch("m512", tokens2m, into=into),
    # A long prompt's planning without its copy: validation, match, pins, touches, unpins.
    "plan-128-pages": lambda: store._plan_fetch("m64", tokens128).release(),
}
op = ops.get(case) or (lambda: np.copyto(dst, src))
print("ready", os.getpid(), kvstore.__file__, flush=True)
sys.stdin.readline()
for _ in range(n):
    op()
print("done", flush=True)
sys.stdin.readline()
"""


def count(case: str, n: int, site: str | None) -> tuple[float, str]:
    """Instructions per call of `case` (n calls), and the kvstore the child imported."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # this checkout: the installed (editable) kvstore
    if site:
        env["PYTHONPATH"] = site  # an older copy, first on the path
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "callgrind.log"
        child = subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--log-file={log}",
             f"--callgrind-out-file={Path(tmp) / 'callgrind.out'}", sys.executable, "-c", CHILD,
             case, str(n), str(Path(tmp) / "store")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, cwd=tmp)
        try:
            ready = child.stdout.readline().split()  # type: ignore[union-attr]
            if not ready or ready[0] != "ready":
                raise SystemExit(f"{case}: the child did not start (see {log})")
            pid, imported = ready[1], ready[2]
            subprocess.run(["callgrind_control", "-i", "on", pid], check=True, capture_output=True)
            say(child, "go")
            if child.stdout.readline().strip() != "done":  # type: ignore[union-attr]
                raise SystemExit(f"{case}: the child failed (see {log})")
            subprocess.run(["callgrind_control", "-i", "off", pid], check=True, capture_output=True)
            say(child, "exit")
            child.wait(timeout=300)
        finally:
            if child.poll() is None:
                child.kill()
        found = re.search(r"Collected\s*:\s*([\d,]+)", log.read_text())
        if found is None:
            raise SystemExit(f"{case}: no instruction count in valgrind's log")
        return int(found.group(1).replace(",", "")) / n, imported


def say(child: subprocess.Popen, line: str) -> None:
    child.stdin.write(line + "\n")  # type: ignore[union-attr]
    child.stdin.flush()  # type: ignore[union-attr]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before-site", metavar="DIR", help="an importable copy of older code, counted first")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind is not installed: apt-get install -y valgrind")
    sites = ([("before", args.before_site)] if args.before_site else []) + [("this checkout", None)]
    print("| case | code | instructions per call | of them besides the copy (a np.copyto of the same bytes) |")
    print("|---|---|---|---|")
    for case in CASES:
        copy = count(f"memcpy-{case}", CALLS, None)[0] if case in ONE_COPY else None
        for label, site in sites:
            per_call, imported = count(case, CALLS, site)
            besides = "–" if copy is None else f"{per_call - copy:,.0f}"
            print(f"| {case} | {label} ({Path(imported).parent}) | {per_call:,.0f} | {besides} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

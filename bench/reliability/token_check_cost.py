"""The 2048-token check of the store (kvstore/validation.py token_bytes) and of the client's
encoder (api/client_codec.py tokens_bin), against the same files at another commit, in
interleaved rounds (best of each, microseconds).

    python bench/reliability/token_check_cost.py [COMMIT]   # default: HEAD~1
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path

import numpy as np
import torch

from kvstore import validation as new_v
from kvstore.api import client_codec as new_c

ROOT = Path(__file__).resolve().parents[2]


def load(name: str, commit: str, path: str):
    source = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


commit = sys.argv[1] if len(sys.argv) > 1 else "HEAD~1"
old_v = load("validation_before", commit, "kvstore/validation.py")
old_c = load("client_codec_before", commit, "api/client_codec.py")
inputs = {"list of 2048 ints": list(range(2048)), "int32 array": np.arange(2048, dtype=np.int32),
          "int64 array": np.arange(2048), "int64 tensor": torch.arange(2048)}
fns = {"token_bytes": (lambda t: old_v.token_bytes(t, max_tokens=1 << 21),
                       lambda t: new_v.token_bytes(t, max_tokens=1 << 21)),
       "client tokens_bin": (old_c.tokens_bin, new_c.tokens_bin)}
print(f"| tokens | check | at {commit} (us) | now (us) |\n|---|---|---|---|")
for name, toks in inputs.items():
    for fname, (old, new) in fns.items():
        b = [float("inf")] * 2
        for _ in range(15):
            for i, f in enumerate((old, new)):
                b[i] = min(b[i], timeit.timeit(lambda: f(toks), number=300) / 300 * 1e6)
        print(f"| {name} | {fname} | {b[0]:.1f} | {b[1]:.1f} |")
scalars = list(np.arange(2048))
scalars_s = min(timeit.repeat(lambda: new_v.token_bytes(scalars, max_tokens=1 << 21), number=100, repeat=5)) / 100
print("list of 2048 numpy int64 scalars, token_bytes after:", f"{scalars_s * 1e6:.0f} us")

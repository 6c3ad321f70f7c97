"""What refusing deep nesting costs a normal request body: the whole JSON or msgpack decode and the
depth check alone, in the same run (µs per body); docs/reliability.md, "Refusing deep nesting".

    python bench/research/body_depth.py
"""
from __future__ import annotations

import base64
import json
import sys
import timeit
from pathlib import Path

import msgpack
import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))  # after PYTHONPATH: an older kvstore there wins

from bench.report import parser as bench_parser  # noqa: E402
from kvstore.api.framing import unpack_map  # noqa: E402
from kvstore.api.nesting import json_too_deep  # noqa: E402
from kvstore.api.server.wire import MAX_BODY_DEPTH, decode_json, decode_msgpack  # noqa: E402


def _best_us(fn, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=7)) / number * 1e6


def bodies() -> dict[str, tuple[str, bytearray]]:
    tokens = list(range(2048))
    kv = bytes(np.random.default_rng(0).integers(0, 256, 256 << 10, dtype=np.uint8))
    tokens_bin = np.arange(2048, dtype="<i4").tobytes()
    chunks = [tokens[i:i + 64] for i in range(0, 2048, 64)]
    return {
        "JSON lookup, 2048 tokens": ("json", json.dumps({"model": "m", "tokens": tokens})),
        "JSON store, 256 KiB kv in base64": ("json", json.dumps({"model": "m", "tokens": tokens[:64],
                                                                 "kv": base64.b64encode(kv).decode()})),
        "JSON blend, 32 chunks of 64": ("json", json.dumps({"model": "m", "chunks": chunks})),
        "msgpack lookup, 2048 tokens as bin": ("msgpack", msgpack.packb({"model": "m", "tokens": tokens_bin})),
        "msgpack lookup, 2048 tokens as array": ("msgpack", msgpack.packb({"model": "m", "tokens": tokens})),
        "msgpack blend, 32 chunks of 64 as arrays": ("msgpack", msgpack.packb({"model": "m", "chunks": chunks})),
        "msgpack fetch into shm": ("msgpack", msgpack.packb({"model": "m", "tokens": tokens_bin,
                                                             "shm": {"offset": 0, "nbytes": 1 << 21}})),
        "msgpack store, 2 MiB kv (walked)": ("msgpack", msgpack.packb({"model": "m",
                                                                       "tokens": np.arange(16, dtype="<i4").tobytes(),
                                                                       "kv": bytes(2 << 20)})),
    }


def main(argv: list[str] | None = None) -> int:
    bench_parser(__doc__, with_json=False).parse_args(argv)
    print("| body | decode (us) | of which the depth check (us) | share |\n|---|---|---|---|")
    for name, (kind, body) in bodies().items():
        raw = bytearray(body.encode() if isinstance(body, str) else body)
        number = 20 if len(raw) > 1 << 18 else 300
        if kind == "json":
            text = str(raw, "utf-8-sig")
            whole = _best_us(lambda: decode_json(raw), number)
            check = _best_us(lambda: json_too_deep(raw, text, MAX_BODY_DEPTH), number)
        else:
            whole = _best_us(lambda: decode_msgpack(raw), number)
            check = max(0.0, whole - _best_us(lambda: unpack_map(raw), number))
        print(f"| {name} | {whole:.1f} | {check:.1f} | {check / whole:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`kvstore generate` and `kvstore demo`: the decode loop from the command line.

`register(subparsers)` adds both subcommands to kvstore's argparse tree (kvstore/cli.py wires it
in); each handler takes the parsed args and returns an exit code. Token ids in, token ids out:
there is no tokenizer here, and `--model tiny` is a random model that emits gibberish ids.
"""
from __future__ import annotations

import argparse
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from kvstore.decode.blend import DEFAULT_BLEND_RATIO
from kvstore.decode.engine import GenerateResult, generate
from kvstore.decode.loader import load_checkpoint, tiny_model
from kvstore.decode.model import LlamaModel
from kvstore.decode.sampling import SamplingParams


def register(subparsers: Any) -> None:
    gen = subparsers.add_parser("generate", help="generate tokens, reusing cached prefixes through the store "
                                "(--server or --data-dir; with neither, no store is used)",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_args(gen)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-tokens", help="comma-separated token ids, e.g. 1,2,3")
    prompt.add_argument("--prompt-file", type=Path, help="file of token ids separated by commas or whitespace")
    gen.add_argument("--chunk-file", type=Path, action="append", default=None,
                     help="CacheBlend: a file of one chunk's token ids (repeat, in prompt order); the prompt "
                          "is then [--prefix-tokens][chunks][--prompt-tokens/--prompt-file]")
    gen.add_argument("--prefix-tokens", default="", help="with --chunk-file: comma-separated ids before the chunks")
    gen.add_argument("--blend-ratio", type=float, default=DEFAULT_BLEND_RATIO,
                     help=f"with --chunk-file: fraction of chunk tokens recomputed (default {DEFAULT_BLEND_RATIO})")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    store = gen.add_mutually_exclusive_group()
    store.add_argument("--server", help="sidecar URL, e.g. http://127.0.0.1:8100")
    store.add_argument("--data-dir", help="use an in-process store with its disk tier here (persists across runs)")
    gen.add_argument("--token", help="bearer token for a sidecar with auth")
    gen.set_defaults(func=run_generate, run=run_generate)  # kvstore/cli.py calls `run`

    demo = subparsers.add_parser("demo", help="multi-turn conversation: TTFT per turn with and without reuse")
    _model_args(demo)
    demo.add_argument("--server", help="sidecar URL; default: start one in this process")
    demo.add_argument("--token", help="bearer token for a sidecar with auth")
    demo.add_argument("--turns", type=int, default=4)
    demo.add_argument("--system-tokens", type=int, default=1024, help="shared system prompt length")
    demo.add_argument("--turn-tokens", type=int, default=64, help="new user tokens per turn")
    demo.add_argument("--max-new-tokens", type=int, default=16)
    demo.add_argument("--seed", type=int, default=None, help="seed of the random conversation (default: fresh)")
    demo.set_defaults(func=run_demo, run=run_demo)


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="HF Llama checkpoint directory, or 'tiny' (random weights)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per store page")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="compute dtype (default: the checkpoint's; tiny is float32)")


def _load_model(args: argparse.Namespace) -> LlamaModel:
    if args.model == "tiny":
        model = tiny_model(page_size=args.page_size)
        return model if args.dtype in (None, "float32") else model.to(getattr(torch, args.dtype))
    return load_checkpoint(args.model, page_size=args.page_size, dtype=args.dtype)


def _parse_tokens(text: str) -> list[int]:
    return [int(t) for t in text.replace(",", " ").split()]


def _client(url: str, token: str | None) -> Any:
    from kvstore.api.client import KVStoreClient  # only with --server: keeps aiohttp out of plain generate

    return KVStoreClient(url, token=token)


def run_generate(args: argparse.Namespace) -> int:
    try:
        prompt = _parse_tokens(args.prompt_tokens if args.prompt_tokens is not None else args.prompt_file.read_text())
        chunks = None if args.chunk_file is None else [_parse_tokens(f.read_text()) for f in args.chunk_file]
        blend = {} if chunks is None else {"chunks": chunks, "prefix": _parse_tokens(args.prefix_tokens),
                                           "blend_ratio": args.blend_ratio}
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        model = _load_model(args)
    except (ValueError, OSError) as exc:
        print(f"kvstore generate: {exc}", file=sys.stderr)
        return 2
    with ExitStack() as stack:
        backend = None
        if args.server:
            backend = stack.enter_context(_client(args.server, args.token))
        elif args.data_dir:
            from kvstore.config import StoreConfig
            from kvstore.store import KVStore

            # One request per process: a CPU tier would only be allocated and flushed, so go to disk.
            backend = stack.enter_context(KVStore(StoreConfig(data_dir=args.data_dir, cpu_bytes=0)))
        try:
            result = generate(model, prompt, args.max_new_tokens, backend=backend, sampling=sampling, **blend)
        except ValueError as exc:
            print(f"kvstore generate: {exc}", file=sys.stderr)
            return 2
    print(",".join(map(str, result.tokens)))
    print(result.summary(), file=sys.stderr)
    return 0


def run_demo(args: argparse.Namespace) -> int:
    for name in ("turns", "system_tokens", "turn_tokens", "max_new_tokens"):
        if getattr(args, name) < 1:
            print(f"kvstore demo: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    try:
        model = _load_model(args)
    except (ValueError, OSError) as exc:
        print(f"kvstore demo: {exc}", file=sys.stderr)
        return 2
    with ExitStack() as stack:
        url = args.server
        if url is None:
            from kvstore.decode.sidecar import InProcessSidecar
            from kvstore.config import StoreConfig

            url = stack.enter_context(InProcessSidecar(StoreConfig(data_dir=None, cpu_bytes=256 << 20, disk_bytes=0)))
        client = stack.enter_context(_client(url, args.token))
        print(f"kvstore demo: model {model.name} ({model.arch.num_params / 1e6:.1f} M params), sidecar {url}")
        for line in demo_lines(model, client, args):
            print(line, flush=True)
    return 0


def demo_lines(model: LlamaModel, backend: Any, args: argparse.Namespace) -> Any:
    """Run the conversation; yield one line per turn comparing TTFT with and without reuse."""
    rng = torch.Generator()
    # A fresh conversation per run unless seeded, so a long-lived sidecar does not make turn 1 a hit.
    rng.seed() if args.seed is None else rng.manual_seed(args.seed)
    new_ids = lambda n: torch.randint(0, model.arch.vocab_size, (n,), generator=rng).tolist()  # noqa: E731
    history = new_ids(args.system_tokens)
    # Warm up torch's kernels, the connection and the model registration: turn 1 is not charged for them.
    generate(model, new_ids(32), 2, backend=backend, store=False)
    for turn in range(1, args.turns + 1):
        prompt = history + new_ids(args.turn_tokens)
        cold = generate(model, prompt, args.max_new_tokens)
        warm: GenerateResult = generate(model, prompt, args.max_new_tokens, backend=backend)
        same = "same tokens" if warm.tokens == cold.tokens else "TOKENS DIFFER"
        yield (f"turn {turn}: prompt {len(prompt)} tokens, reused {warm.reused_tokens}; TTFT with reuse "
               f"{warm.ttft_s * 1e3:.1f} ms vs without {cold.ttft_s * 1e3:.1f} ms "
               f"({cold.ttft_s / warm.ttft_s:.1f}x); {same}")
        history = prompt + warm.tokens

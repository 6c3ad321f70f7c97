"""The CacheBlend levers behind docs/cacheblend.md's "What was tried" tables: selections beside
the decode loop's rule, measured by bench/blend_quality.py on its workloads at equal recompute.

    python bench/research/blend_levers.py [bench/blend_quality.py's options]
        [--first-share F] [--query-share F] [--select-layer L] [--narrowing 4/2/1.5/1]
        [--rules rule,random,first] [--rules-at R:label,...;R:...] [--variants label:key=value,...;...]

`--first-share`, `--query-share`, `--select-layer` and `--narrowing` change the rule's schedule
(and so its controls', which recompute as many tokens); `--variants` adds labelled selections
(keys: rule, first_share, query_share, select_layer, narrowing as 4/2/1, score, seed) at every
ratio; `--rules` picks which of the rule and its controls run; `--rules-at` runs only the listed
labels at a ratio. Everything else is bench/blend_quality.py's, results file and resume included.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.append(str(Path(__file__).resolve().parents[2]))  # after PYTHONPATH: an older kvstore there wins

from bench import blend_quality  # noqa: E402
from kvstore.decode.blend_selection import TokenSelection  # noqa: E402


def parse_selection(spec: str, base: TokenSelection) -> TokenSelection:
    """'key=value,...' over `base`."""
    fields: dict[str, Any] = {}
    for item in (x for x in spec.split(",") if x):
        key, _, value = item.partition("=")
        if key in ("first_share", "query_share"):
            fields[key] = float(value)
        elif key in ("select_layer", "seed"):
            fields[key] = int(value)
        elif key == "narrowing":
            fields[key] = tuple(float(f) for f in value.split("/"))
        elif key in ("rule", "score"):
            fields[key] = value
        else:
            raise ValueError(f"--variants: unknown key {key!r} in {spec!r} (rule, first_share, query_share, "
                             f"select_layer, narrowing, score, seed)")
    return replace(base, **fields)


def lever_variants(args: argparse.Namespace) -> Callable[[Sequence[float]], list[blend_quality.Variant]]:
    """The variants the lever flags ask for, at whichever ratios bench/blend_quality.py runs."""
    schedule = {"first_share": args.first_share, "query_share": args.query_share, "select_layer": args.select_layer,
                "narrowing": tuple(float(f) for f in args.narrowing.split("/")) if args.narrowing else None}
    base = replace(TokenSelection(), **{k: v for k, v in schedule.items() if v is not None})
    extra = [(label, parse_selection(spec, base))
             for label, _, spec in (item.partition(":") for item in args.variants.split(";") if item)]
    rules = [x for x in args.rules.split(",") if x]
    rules_at = blend_quality.RULES_AT if args.rules_at is None else {
        float(r): [x for x in labels.split(",") if x]
        for r, _, labels in (item.partition(":") for item in args.rules_at.split(";") if item)}
    return lambda ratios: blend_quality.variants_for(ratios, rules, base, extra, rules_at)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--first-share", type=float, help="the rule's share of each chunk's first tokens")
    parser.add_argument("--query-share", type=float, help="the rule's share of the question's attention")
    parser.add_argument("--select-layer", type=int, help="the first layer that narrows (the rule's and controls')")
    parser.add_argument("--narrowing", help="keep factors x r from the select layer on, e.g. 2/1")
    parser.add_argument("--rules", default=",".join(("rule", *blend_quality.CONTROLS)),
                        help="the rule and the controls to run")
    parser.add_argument("--rules-at", help="only these labels at these ratios: R:label,...;R:... (default: "
                                           "bench/blend_quality.py's; '' for every rule at every ratio)")
    parser.add_argument("--variants", default="", help="more variants: label:key=value,...;label:...")
    args, rest = parser.parse_known_args(argv)
    try:
        make_variants = lever_variants(args)
        make_variants([0.15])  # a bad label or key is refused here, before the model loads
    except ValueError as exc:
        parser.error(str(exc))
    return blend_quality.main(rest, make_variants)


if __name__ == "__main__":
    sys.exit(main())

"""What a bench writes: its JSON file, its judged targets and its plots, one way for every bench."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Iterable, Sequence


def parser(doc: str | None, with_json: bool = True) -> argparse.ArgumentParser:
    """A bench's command line: its docstring as the help text, and `--json FILE` (unless `with_json` is False)."""
    out = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if with_json:
        out.add_argument("--json", metavar="FILE", help="write the results here")
    return out


def write_json(path: Path | str | None, data: Any) -> None:
    """`data` as JSON at `path` (its folder made first); nothing where `path` is None or ''."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1, default=str))


def markdown_table(header: Sequence[Any], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table: `header`'s cells, then a line per row (each cell as `str` gives it)."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows])


def check(name: str, value: Any, limit: Any, met: bool | None = None) -> dict[str, Any]:
    """One target: `value` against `limit` (met when value <= limit, or as `met` says)."""
    return {"check": name, "value": value, "limit": limit, "met": bool(value <= limit if met is None else met)}


def print_checks(checks: list[dict[str, Any]]) -> None:
    for c in checks:
        value = c["value"] if isinstance(c["value"], bool) else f"{c['value']:.3f}"
        print(f"  {c['check']}: {value} (limit {c['limit']}) -> {'met' if c['met'] else 'NOT met'}")


def pyplot() -> Any:
    """matplotlib's pyplot on the file backend (benches draw PNGs, never windows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt

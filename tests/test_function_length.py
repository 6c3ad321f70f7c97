"""No function on the data path is longer than 60 lines: kvstore/*.py (the store, its fetch and
store paths, placement, the tier stack) and tiers/*.py, read with `ast`. A function that outgrows
that is split into its phases, each named for what it does (docs/design.md §4, §9), so a reader
follows a request through short steps and a profile names the step that costs. And no library
file (kvstore, api, tiers, gpu, decode) is longer than 400 lines: one that grows past it holds
more than one concept.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA_PATH = ("kvstore", "tiers")
LIBRARY = ("kvstore", "api", "tiers", "gpu", "decode")
MAX_LINES = 60
MAX_FILE_LINES = 400


def long_functions(paths: list[Path], root: Path = REPO) -> list[str]:
    """'file:line name (n lines)' for each function or method of `paths` over MAX_LINES lines,
    its decorators and docstring included."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                lines = node.end_lineno - first + 1  # type: ignore[operator]
                if lines > MAX_LINES:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_on_the_data_path_is_longer_than_60_lines() -> None:
    paths = sorted(p for folder in DATA_PATH for p in (REPO / folder).glob("*.py"))
    assert len(paths) > 20  # it reads the folders
    found = long_functions(paths)
    assert not found, f"functions over {MAX_LINES} lines on the data path (split them):\n" + "\n".join(found)


def test_the_checker_names_a_long_method_with_its_file_and_line(tmp_path) -> None:
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_LINES - 1))
    source = f"class A:\n    @staticmethod\n    def short():\n        pass\n\n    def long(self):\n{body}"
    path = tmp_path / "kvstore" / "fake.py"
    path.parent.mkdir()
    path.write_text(source)
    assert long_functions([path], tmp_path) == []  # exactly MAX_LINES lines
    path.write_text(source + "        return x0\n")
    assert long_functions([path], tmp_path) == [f"kvstore/fake.py:6 long ({MAX_LINES + 1} lines)"]


def test_no_library_file_is_longer_than_400_lines() -> None:
    paths = sorted(p for folder in LIBRARY for p in (REPO / folder).rglob("*.py"))
    assert len(paths) > 100  # it reads the packages, sub-packages included
    lengths = {p: len(p.read_text().splitlines()) for p in paths}
    found = [f"{p.relative_to(REPO)} ({n} lines)" for p, n in lengths.items() if n > MAX_FILE_LINES]
    assert not found, f"library files over {MAX_FILE_LINES} lines (split them by concept):\n" + "\n".join(found)

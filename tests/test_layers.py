"""The import layers, read from the source with `ast` (nothing is imported, so a missing optional
dependency cannot hide a violation). Every import statement counts, at module level or inside a
function, except where a rule names its exception.

- tiers/ never imports the store (or its parts), its tier stack, placement or the policies: tiers
  stay dumb, and placement, eviction, promotion and demotion live once, in the store
  (docs/design.md §1).
- gpu/ is a leaf: it imports torch and itself, nothing else of kvstore.
- kvstore's core (kvstore/*.py but the CLI, kvstore/policies/ and kvstore/kv_events/) imports no aiohttp,
  kvstore.api or kvstore.decode: an embedder gets the store, and its KV events, without the sidecar or the
  decode loop. The one exception is the
  package's lazy public names (`from kvstore import KVStoreClient`, inside `__getattr__`).
- Only the CLIs (kvstore/cli.py, and decode/cli.py, whose `demo` serves a store in-process to
  the decode loop's client) import the server, the client and the decode loop together.
- The index, keys and policies import no torch, lmdb or aiohttp; no installed package imports
  bench/ or tests/ (neither is installed).
- The data plane (api/server/fast_path.py, connection.py and answering.py, the HTTP/1.1 server
  that reads every connection and answers it, and api/server/handlers.py, the data routes'
  handlers) loads no aiohttp, directly or through what it imports: a data request never meets
  aiohttp's request machinery, which serves the admin routes.
- `KVStore`'s public methods are the embedder's (docs/design.md §7.1): the sidecar's event-loop
  plumbing lives in the api's adapter (api/server/loop_store.py), the one file of api/ and
  decode/ that reaches into the store's internals.
- api/ is split by role (docs/design.md §1): the client (api/client/) loads no module of the
  server (api/server/, api/admin/) or the proxy, directly or through what it imports; the
  server and the admin app import no client module; what both sides share (api/protocol.py, the
  contract, and api/framing.py with api/nesting.py, how bodies are framed) imports neither; a
  module directly in api/ is one of those shared ones. In api/server/, only serve.py (which
  serves it) imports the admin app.
- The integrations (kvstore/integrations/) import no kvstore.decode: the connector serves its
  store through the server's `InProcessSidecar`, not through the decode loop.

`make lint` runs this file before the test suite.
"""
from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Each installed package and the repository folder it comes from (pyproject.toml's package-dir).
PACKAGE_DIRS = {"kvstore": "kvstore", "kvstore.api": "api", "kvstore.tiers": "tiers", "kvstore.gpu": "gpu",
                "kvstore.decode": "decode"}
CLIS = ("kvstore/cli.py", "decode/cli.py")
# The store and its parts (docs/design.md §1), the tier stack, placement, the policies.
STORE_SIDE = re.compile(r"^kvstore\.(store(_\w+)?|page_writes|fetch_plan|shared_probe|blend|tier_stack|placement"
                        r"|polic(y|ies)(_\w+)?|shadow)$")
LIGHT = ("kvstore/index.py", "kvstore/keys.py", "kvstore/shadow.py",
         *sorted(str(p.relative_to(REPO)) for p in (REPO / "kvstore" / "policies").glob("*.py")))
SERVER = re.compile(r"^kvstore\.api\.((server|admin)(\.\w+)*|create_app|ServerConfig)$")
CLIENT = re.compile(r"^kvstore\.(api\.client(\.\w+)*|(api\.)?(Async)?KVStoreClient)$")
PROXY = re.compile(r"^kvstore\.api\.proxy(\.\w+)*$")
# What the client and the server share: the contract, and how bodies are framed.
SHARED = ("api/protocol.py", "api/framing.py", "api/nesting.py")
DECODE = re.compile(r"^kvstore\.decode(\.\w+)?$")


@dataclass(frozen=True)
class Import:
    path: str  # the importing file, relative to the repository
    line: int
    module: str  # the module imported, absolute (a name taken from a package counts as its submodule)
    in_function: bool


def module_name(path: Path) -> str:
    folder, *rest = path.relative_to(REPO).with_suffix("").parts
    package = next(p for p, d in PACKAGE_DIRS.items() if d == folder)
    parts = [package, *rest]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    own = module_name(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    inside = {id(n) for f in functions for n in ast.walk(f) if n is not f}
    rel = str(path.relative_to(REPO))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from kvstore.api import client` imports the module kvstore.api.client.
            modules = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        found += [Import(rel, node.lineno, m, id(node) in inside) for m in modules]
    return found


def sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (REPO / folder).rglob("*.py"))


def violations(paths: list[Path], forbidden, allowed=lambda imp: False) -> list[str]:
    """'file:line imports module' for each import `forbidden(module)` refuses, one per statement."""
    found: dict[tuple[str, int], str] = {}
    for path in paths:
        for imp in imports_of(path):
            if forbidden(imp.module) and not allowed(imp):
                found.setdefault((imp.path, imp.line), f"{imp.path}:{imp.line} imports {imp.module}")
    return list(found.values())


def _tiers_forbidden(module: str) -> bool:
    return bool(STORE_SIDE.match(module)) or module == "kvstore.KVStore"


def test_tiers_never_import_the_store_placement_or_policies() -> None:
    found = violations(sources("tiers"), _tiers_forbidden)
    assert not found, "tiers/ must not import the store, placement or policies:\n" + "\n".join(found)


def test_gpu_is_a_leaf_that_imports_torch_and_itself() -> None:
    found = violations(sources("gpu"), lambda m: m.split(".")[0] == "kvstore" and not (
        m == "kvstore.gpu" or m.startswith("kvstore.gpu.")))
    assert not found, "gpu/ imports torch and kvstore.gpu only:\n" + "\n".join(found)


def _core_forbidden(module: str) -> bool:
    top = module.split(".")
    return top[0] == "aiohttp" or module.startswith(("kvstore.api", "kvstore.decode")) \
        or module in ("kvstore.KVStoreClient", "kvstore.AsyncKVStoreClient")


def _public_name(imp: Import) -> bool:
    """kvstore/__init__.py's lazy `KVStoreClient`/`AsyncKVStoreClient` (in `__getattr__`)."""
    return imp.path == "kvstore/__init__.py" and imp.in_function and imp.module in ("kvstore.api", "kvstore.api.client")


def test_the_core_imports_no_aiohttp_api_or_decode() -> None:
    core = [p for p in sorted([*(REPO / "kvstore").glob("*.py"), *(REPO / "kvstore" / "policies").glob("*.py"),
                               *(REPO / "kvstore" / "kv_events").glob("*.py")])
            if str(p.relative_to(REPO)) not in CLIS]
    found = violations(core, _core_forbidden, _public_name)
    assert not found, "kvstore's core must not import aiohttp, kvstore.api or kvstore.decode:\n" + "\n".join(found)


def test_only_the_cli_imports_server_client_and_decode_together() -> None:
    found = []
    for path in sources(*PACKAGE_DIRS.values()):
        rel = str(path.relative_to(REPO))
        touched = {imp.module for imp in imports_of(path)} | {module_name(path)}
        sides = {side for side, rule in (("server", SERVER), ("client", CLIENT), ("decode", DECODE))
                 if any(rule.match(m) for m in touched)}
        if len(sides) == 3 and rel not in CLIS:
            found.append(f"{rel} imports the server, the client and the decode loop")
    assert not found, "only the CLIs wire the server, client and decode together:\n" + "\n".join(found)


def test_the_index_keys_and_policies_import_no_torch_lmdb_or_aiohttp() -> None:
    found = violations([REPO / p for p in LIGHT], lambda m: m.split(".")[0] in ("torch", "lmdb", "aiohttp"))
    assert not found, "the index, keys and policies import no torch, lmdb or aiohttp:\n" + "\n".join(found)


def test_no_installed_package_imports_bench_or_tests() -> None:
    found = violations(sources(*PACKAGE_DIRS.values()), lambda m: m.split(".")[0] in ("bench", "tests"))
    assert not found, "bench/ and tests/ are not installed: nothing installed may import them:\n" + "\n".join(found)


# What the sidecar's event loop needs from the store: never on KVStore's public surface.
LOOP_PLUMBING = frozenset({"unless_busy", "plan_fetch", "fetch_in_memory", "stores_in_memory", "has_shared_tier",
                           "register_model_created", "catch_up_unless_busy"})
STORE_INTERNALS = frozenset({"_state", "_lock", "_index", "_registry", "_tiers", "_placement", "_plan_fetch",
                             "_register_model", "_model", "_fetch"})
LOOP_STORE = "api/server/loop_store.py"


def test_kvstore_keeps_the_event_loops_plumbing_out_of_its_public_surface() -> None:
    tree = ast.parse((REPO / "kvstore" / "store.py").read_text())
    kvstore = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KVStore")
    public = {n.name for n in kvstore.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
              and not n.name.startswith("_")}
    found = sorted(public & LOOP_PLUMBING)
    assert not found, f"KVStore's public surface carries the sidecar's plumbing ({LOOP_STORE} owns it): {found}"


def test_only_the_loop_store_adapter_reaches_into_the_store() -> None:
    found = []
    for path in sources("api", "decode"):
        rel = str(path.relative_to(REPO))
        if rel == LOOP_STORE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in STORE_INTERNALS and not (
                    isinstance(node.value, ast.Name) and node.value.id == "self"):
                found.append(f"{rel}:{node.lineno} reaches .{node.attr}")
    assert not found, f"only {LOOP_STORE} uses the store's internals:\n" + "\n".join(found)


# The data plane: the HTTP/1.1 server that reads every connection and the data routes' handlers
# (docs/design.md §7.2). Nothing it loads may import aiohttp, so no data request can reach
# aiohttp's request machinery: aiohttp serves the admin routes only.
DATA_PLANE = ("api/server/fast_path.py", "api/server/connection.py", "api/server/answering.py",
              "api/server/handlers.py")


def module_path(module: str) -> Path | None:
    """The repository file of an installed module (a package's __init__.py), None if not ours."""
    for package, folder in sorted(PACKAGE_DIRS.items(), key=lambda item: -len(item[0])):
        if module == package or module.startswith(package + "."):
            rest = module[len(package):].lstrip(".").split(".") if module != package else []
            base = REPO / folder / Path(*rest) if rest else REPO / folder
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if candidate.is_file():
                    return candidate
            return None
    return None


def loaded_by(roots: list[Path]) -> dict[Path, list[Import]]:
    """Every file of ours that importing `roots` loads (their module-level imports, followed),
    with its module-level imports."""
    seen: dict[Path, list[Import]] = {}
    todo = list(roots)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen[path] = [imp for imp in imports_of(path) if not imp.in_function]
        for imp in seen[path]:
            target = module_path(imp.module)
            if target is not None and target not in seen:
                todo.append(target)
    return seen


def test_the_data_plane_loads_no_aiohttp() -> None:
    loaded = loaded_by([REPO / p for p in DATA_PLANE])
    # It follows imports:
    assert REPO / "api" / "server" / "wire.py" in loaded and REPO / "kvstore" / "fetch_plan.py" in loaded
    found = [f"{imp.path}:{imp.line} imports {imp.module}" for imports in loaded.values() for imp in imports
             if imp.module.split(".")[0] == "aiohttp"]
    assert not found, ("the data plane (" + ", ".join(DATA_PLANE) + ") must not load aiohttp, directly or "
                       "through what it imports:\n" + "\n".join(sorted(set(found))))


def _server_or_proxy(module: str) -> bool:
    return bool(SERVER.match(module) or PROXY.match(module))


def test_the_client_loads_no_server_admin_or_proxy_module() -> None:
    loaded = loaded_by(sources("api/client"))
    assert REPO / "api" / "protocol.py" in loaded and REPO / "api" / "framing.py" in loaded  # it follows imports
    found = [f"{imp.path}:{imp.line} imports {imp.module}" for imports in loaded.values() for imp in imports
             if _server_or_proxy(imp.module)]
    found += violations(sources("api/client"), _server_or_proxy)  # imports inside functions too
    assert not found, ("the client (api/client/) must load no module of the server, the admin app or the "
                       "proxy, directly or through what it imports:\n" + "\n".join(sorted(set(found))))


def test_the_server_and_admin_import_no_client_module() -> None:
    found = violations(sources("api/server", "api/admin"), lambda m: bool(CLIENT.match(m)))
    assert not found, "api/server/ and api/admin/ must not import the client:\n" + "\n".join(found)


def test_only_serve_brings_the_admin_app_into_the_server() -> None:
    # serve.py serves the aiohttp app around the data plane; nothing else of api/server/ needs it.
    paths = [p for p in sources("api/server") if p.name != "serve.py"]
    found = violations(paths, lambda m: m.startswith("kvstore.api.admin"))
    assert not found, "only api/server/serve.py imports api/admin/:\n" + "\n".join(found)


def test_the_proxy_imports_neither_the_server_nor_the_client() -> None:
    found = violations(sources("api/proxy"), lambda m: bool(SERVER.match(m) or CLIENT.match(m)))
    assert not found, "the proxy (api/proxy/) is a client of engines only:\n" + "\n".join(found)


def test_what_client_and_server_share_imports_neither() -> None:
    found = violations([REPO / p for p in SHARED],
                       lambda m: bool(SERVER.match(m) or CLIENT.match(m) or PROXY.match(m)))
    assert not found, "the shared modules (" + ", ".join(SHARED) + ") import neither side:\n" + "\n".join(found)


def test_every_module_of_api_has_a_role() -> None:
    # A module directly in api/ is shared by both sides; everything else lives in its role's package.
    loose = sorted(str(p.relative_to(REPO)) for p in (REPO / "api").glob("*.py")
                   if p.name != "__init__.py" and str(p.relative_to(REPO)) not in SHARED)
    assert not loose, f"modules directly in api/ are the shared ones ({', '.join(SHARED)}); move these into " \
                      f"api/server/, api/admin/, api/client/ or api/proxy/: {loose}"


def test_the_integrations_import_no_decode_loop() -> None:
    found = violations(sources("kvstore/integrations"), lambda m: bool(DECODE.match(m)))
    assert not found, "kvstore/integrations/ must not import kvstore.decode:\n" + "\n".join(found)


@pytest.mark.parametrize("source, path, forbidden, expected", [
    ("from kvstore.placement import Placement\n", "tiers/fake.py", _tiers_forbidden,
     "tiers/fake.py:1 imports kvstore.placement"),
    ("def f():\n    import kvstore.store\n", "tiers/fake.py", _tiers_forbidden,
     "tiers/fake.py:2 imports kvstore.store"),
    ("from kvstore import KVStore\n", "tiers/fake.py", _tiers_forbidden, "tiers/fake.py:1 imports kvstore.KVStore"),
    ("import aiohttp.web\n", "kvstore/fake.py", _core_forbidden, "kvstore/fake.py:1 imports aiohttp.web"),
    ("from .api import wire\n", "kvstore/fake.py", _core_forbidden, "kvstore/fake.py:1 imports kvstore.api.wire"),
])
def test_a_violation_names_the_file_the_line_and_the_import(tmp_path, monkeypatch, source, path, forbidden,
                                                            expected) -> None:
    # The checker itself: an import the rules forbid is found, at module level or in a function,
    # relative imports resolved.
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    target = tmp_path / path
    target.parent.mkdir(parents=True)
    target.write_text(source)
    assert violations([target], forbidden) == [expected]

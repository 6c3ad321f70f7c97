"""Makes the working tree importable as `kvstore` on a machine with no network and nothing of the
project installed (bench/gpu_check.sh runs this first on a borrowed GPU machine).

    python bench/offline_stage.py STAGE [--wheels .whl] [--check MODULE ...]

STAGE (to put first on PYTHONPATH) gets `kvstore/` as symlinks into the tree laid out as
pyproject.toml's package-dir maps it, and the `--wheels` this interpreter lacks, unpacked; then
each is imported from the stage. Any failure is a message and exit status 2. Standard library only.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import platform
import re
import shutil
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# name-version(-build)-python-abi-platform.whl (PEP 427)
WHEEL_NAME = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?"
                        r"-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$")
DEFAULT_CHECKS = ("kvstore", "kvstore.gpu", "kvstore.tiers.gpu", "kvstore.tier_stack", "kvstore.store")


class StageError(Exception):
    """The stage cannot be made or does not import: the message says what to do."""


def package_dirs(pyproject: Path) -> dict[str, Path]:
    """pyproject.toml's package-dir: package -> folder of the tree (only what it maps)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise StageError("needs Python >= 3.11 (tomllib) to read pyproject.toml") from None
    with pyproject.open("rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {package: pyproject.parent / folder for package, folder in mapping.items()}


def stage_packages(stage: Path, root: Path = ROOT) -> Path:
    """STAGE/kvstore: the top package's entries, and each mapped subpackage, as symlinks."""
    dirs = package_dirs(root / "pyproject.toml")
    top = stage / "kvstore"
    if top.exists():
        shutil.rmtree(top)
    top.mkdir(parents=True)
    for entry in dirs["kvstore"].iterdir():
        if entry.name != "__pycache__":
            (top / entry.name).symlink_to(entry)
    for package, folder in dirs.items():
        parts = package.split(".")
        if parts[0] != "kvstore" or len(parts) != 2:
            continue
        link = top / parts[1]
        if not link.exists():
            link.symlink_to(folder, target_is_directory=True)
    return top


def _python_tags() -> set[str]:
    major, minor = sys.version_info[:2]
    return {f"py{major}", f"py{major}{minor}", f"cp{major}{minor}"} | {f"py{major}{m}" for m in range(minor)}


def runs_here(filename: str) -> bool:
    """Whether this interpreter can use the wheel, by its file name's tags (PEP 427): a Python
    tag it is, an ABI it has (none, abi3 of an older CPython, or its own) and this machine's
    platform (any, or Linux of this architecture)."""
    m = WHEEL_NAME.match(filename)
    if m is None:
        return False
    major, minor = sys.version_info[:2]
    pys, abis, plats = (set(m[k].split(".")) for k in ("py", "abi", "plat"))
    own_abi = f"cp{major}{minor}"
    abi3 = "abi3" in abis and any(re.fullmatch(rf"cp{major}(\d+)", p) and int(p[3:]) <= minor for p in pys)
    python_ok = bool(pys & _python_tags()) or abi3
    abi_ok = "none" in abis or own_abi in abis or abi3
    machine = platform.machine()
    plat_ok = "any" in plats or any(p.endswith(machine) and (p.startswith("manylinux") or p.startswith("linux"))
                                    for p in plats) and sys.platform == "linux"
    return python_ok and abi_ok and plat_ok


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def unpack_wheel(wheel: Path, stage: Path) -> None:
    """Extract `wheel` into `stage` as an install would: `<dist>.data/purelib|platlib/` go to the
    top; file modes (executables) are kept."""
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            name = info.filename
            data = re.match(r"^[^/]+\.data/(purelib|platlib)/(.*)$", name)
            if data:
                name = data[2]
            elif re.match(r"^[^/]+\.data/", name):
                continue  # scripts, headers, data: nothing a check imports
            target = stage / name
            if not target.resolve().is_relative_to(stage.resolve()):
                raise StageError(f"{wheel.name}: refuses to write outside the stage ({info.filename})")
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(target, mode)


def top_levels(wheel: Path) -> list[str]:
    """The importable names a wheel installs, from what it holds (its top_level.txt may name
    modules it does not ship): its top-level packages and modules."""
    tops = set()
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            data = re.match(r"^[^/]+\.data/(purelib|platlib)/(.*)$", name)
            if data:
                name = data[2]
            elif re.match(r"^[^/]+\.(dist-info|data)/", name):
                continue
            first, _, rest = name.partition("/")
            if rest:  # a folder: a package (or a namespace one)
                tops.add(first)
            elif first.endswith((".py", ".so")):  # a module: spam.py, _spam.cpython-312-x86_64-linux-gnu.so
                tops.add(first.split(".")[0])
    return sorted(t for t in tops if t.isidentifier())


def stage_wheels(wheels: Path, stage: Path, unpacked: list[str] | None = None) -> list[str]:
    """Unpack the wheels this interpreter needs and can run; returns a line per wheel, and adds
    the names they install to `unpacked`."""
    lines = []
    for wheel in sorted(wheels.glob("*.whl")) if wheels.is_dir() else []:
        m = WHEEL_NAME.match(wheel.name)
        if m is None:
            lines.append(f"skipped {wheel.name}: not a wheel's file name")
            continue
        if _installed(m["name"]):
            lines.append(f"kept the installed {m['name']} {importlib.metadata.version(m['name'])} over {wheel.name}")
        elif not runs_here(wheel.name):
            lines.append(f"skipped {wheel.name}: not for Python {platform.python_version()} on {platform.machine()}")
        else:
            unpack_wheel(wheel, stage)
            lines.append(f"unpacked {wheel.name}")
            if unpacked is not None:
                unpacked.extend(top_levels(wheel))
    return lines


def check_imports(stage: Path, modules: list[str]) -> list[str]:
    """Import each module with the stage first on sys.path; `kvstore` must come from the stage."""
    sys.path.insert(0, str(stage))
    lines = []
    for module in modules:
        try:
            imported = importlib.import_module(module)
        except Exception as exc:
            raise StageError(f"import {module} failed: {type(exc).__name__}: {exc} (a wheel missing from "
                             f"--wheels? bench/gpu_wheels.sh fills .whl/)") from exc
        origin = getattr(imported, "__file__", None) or list(getattr(imported, "__path__", []))
        lines.append(f"import {module}: {origin}")
    kvstore = sys.modules.get("kvstore")
    if kvstore is not None and Path(list(kvstore.__path__)[0]) != stage / "kvstore":
        raise StageError(f"kvstore was imported from {list(kvstore.__path__)}, not from the stage {stage}: "
                         f"something earlier on sys.path shadows it")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", type=Path)
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl")
    parser.add_argument("--check", nargs="*", default=list(DEFAULT_CHECKS), metavar="MODULE")
    args = parser.parse_args()
    stage = args.stage.resolve()
    try:
        stage_packages(stage)
        print(f"offline_stage: kvstore -> {stage / 'kvstore'} (symlinks into {ROOT})")
        unpacked: list[str] = []
        for line in stage_wheels(args.wheels, stage, unpacked):
            print(f"offline_stage: {line}")
        # Every wheel unpacked must import here (a wheel for another CPU or Python fails now,
        # not in the middle of the tests), then the project.
        for line in check_imports(stage, unpacked + args.check):
            print(f"offline_stage: {line}")
    except (StageError, OSError) as exc:
        print(f"offline_stage: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

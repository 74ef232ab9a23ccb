"""Bad input gives one line naming the file and the cause, exit code 2, and no traceback."""

from __future__ import annotations

import os
import subprocess

import pytest
from gguf.constants import GGMLQuantizationType as Q
from tiny_gguf import TinyModel, write_tiny_model

from miniapp.engine.kv.types import KV_TYPE_NAMES

KV_CHOICES = "choose from " + ", ".join(KV_TYPE_NAMES)


def _run(exe: str, *args: str, stdin: str = "hi\n", env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [exe, *args], input=stdin, capture_output=True, text=True, timeout=120, env=env
    )


def _assert_one_line_error(done: subprocess.CompletedProcess, *fragments: str) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def bad_files(tmp_path):
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("this is not a model\n")
    good = write_tiny_model(tmp_path / "good.gguf")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    alien = write_tiny_model(tmp_path / "alien.gguf", TinyModel(architecture="nosucharch"))
    k_quant = write_tiny_model(
        tmp_path / "kquant.gguf", TinyModel(dim=256, ffn_dim=256, n_heads=4, down_type=Q.Q2_K)
    )
    return {
        "missing": (tmp_path / "missing.gguf", "file not found"),
        "not_gguf": (not_gguf, "not a GGUF file"),
        "truncated": (truncated, "truncated"),
        "architecture": (alien, "architecture 'nosucharch' is not supported"),
        "tensor_type": (k_quant, "type Q2_K"),
    }


@pytest.mark.parametrize(
    "case", ["missing", "not_gguf", "truncated", "architecture", "tensor_type"]
)
@pytest.mark.parametrize("command", [["chat"], ["eval", "ppl", "__TEXT__"], ["bench"]])
def test_bad_model_file(miniapp_exe, bad_files, tmp_path, case, command):
    path, reason = bad_files[case]
    text = tmp_path / "text.txt"
    text.write_text("some text " * 50)
    args = [str(text) if a == "__TEXT__" else a for a in command]
    line = _assert_one_line_error(_run(miniapp_exe, *args, "--model", str(path)), reason)
    assert path.name in line
    if case in ("architecture", "tensor_type"):
        assert "--backend llamacpp" in line


def test_llamacpp_backend_reports_unknown_architecture_in_one_line(miniapp_exe, bad_files):
    """llama.cpp does not know this architecture either; its failure is still one line."""
    path, _ = bad_files["architecture"]
    done = _run(miniapp_exe, "chat", "--backend", "llamacpp", "--model", str(path))
    _assert_one_line_error(done, path.name)


def test_missing_text_for_eval(miniapp_exe, tmp_path):
    missing = tmp_path / "nope.txt"
    _assert_one_line_error(
        _run(miniapp_exe, "eval", "ppl", str(missing)), str(missing), "not found"
    )


def test_text_too_short_for_ctx(miniapp_exe, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("just a few words")
    _assert_one_line_error(_run(miniapp_exe, "eval", "ppl", str(short)), "needs at least")


@pytest.mark.parametrize(
    "command",
    [
        ["chat", "--kv-type", "q9"],
        ["eval", "ppl", "__TEXT__", "--kv-type", "nonsense"],
        ["bench", "--kv-type", "q9"],
        ["doctor", "--kv-type", "int3"],
    ],
    ids=["chat", "eval-ppl", "bench", "doctor"],
)
def test_a_bad_kv_type_is_one_line_naming_the_choices(miniapp_exe, tmp_path, command):
    """Checked as the flags are parsed: the engine's line, not argparse's usage block."""
    text = tmp_path / "text.txt"
    text.write_text("some text " * 50)
    args = [str(text) if a == "__TEXT__" else a for a in command]
    _assert_one_line_error(_run(miniapp_exe, *args), f"--kv-type '{args[-1]}'", KV_CHOICES)


@pytest.mark.parametrize(
    "command",
    [["chat"], ["serve"], ["eval", "ppl", "__TEXT__", "--window", "64"], ["bench"]],
    ids=["chat", "serve", "eval-ppl", "bench"],
)
def test_a_bad_kv_policy_is_one_line_naming_the_choices(miniapp_exe, tmp_path, command):
    text = tmp_path / "text.txt"
    text.write_text("some text " * 50)
    args = [str(text) if a == "__TEXT__" else a for a in command]
    done = _run(miniapp_exe, *args, "--kv-policy", "h2o")
    _assert_one_line_error(done, "--kv-policy 'h2o'", "window, attention")


def test_kv_policy_attention_is_refused_by_llamacpp_in_one_line(miniapp_exe):
    done = _run(miniapp_exe, "chat", "--backend", "llamacpp", "--kv-policy", "attention")
    _assert_one_line_error(done, "--kv-policy", "torch backend")


def test_a_bad_kv_type_from_the_environment_is_one_line_naming_it(miniapp_exe):
    done = _run(miniapp_exe, "chat", env={**os.environ, "MINIAPP_KV_TYPE": "q9"})
    _assert_one_line_error(done, "setting kv_type (from the environment)", KV_CHOICES)

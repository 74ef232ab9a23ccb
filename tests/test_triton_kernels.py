"""Our Triton kernels (engine/ops/stored_attention.py) are checked on this CPU by Triton's
interpreter, in a process of their own (tests/interpreted): there Triton, which `make setup`
installs beside the virtual environment, is on the path. Here, as in a user's CPU install,
there is no Triton, and the CPU's attention never goes near it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from miniapp.engine.models.attention_backends import stored_attention_runs
from miniapp.engine.platform.devices import stored_attention_unavailable

TESTS = Path(__file__).resolve().parent
TRITON_DIR = Path(sys.prefix) / "triton"  # Makefile: TRITON_DIR


def test_the_triton_kernels_pass_their_checks_under_the_interpreter():
    assert (TRITON_DIR / "triton").is_dir(), f"no Triton in {TRITON_DIR}: run make setup"
    paths = [str(TRITON_DIR), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(filter(None, paths)))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(TESTS / "interpreted"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "deselected" not in summary


def test_the_triton_kernels_compile_for_nvidia_and_amd_gpus_without_one(tmp_path):
    # The interpreter checks the kernels' numbers but not what a GPU's compiler refuses (a
    # branch leaving a variable of two types failed so, unseen by the interpreter): Triton
    # compiles them here for sm_90 and gfx942, down to machine code, as a first call there
    # would.
    paths = [str(TRITON_DIR), os.environ.get("PYTHONPATH", "")]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, paths)), TRITON_DEFAULT_FP_FUSION="1")
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled now, not found from an earlier run
    script = TESTS.parent / "scripts" / "compile_kernels.py"
    shape = ["--shape", "smollm2", "--kind", "bf16", "--kind", "q8"]
    done = subprocess.run(
        [sys.executable, str(script), *shape], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    compiled = [line for line in done.stdout.splitlines() if ": ok in " in line]
    assert len(compiled) == 8  # two kernels, two types, two targets


def test_the_cpu_attends_without_triton(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not stored_attention_runs(torch.device("cpu"))
    assert "triton" not in sys.modules
    assert stored_attention_unavailable("cpu") == "the CPU attends through its native kernel"
    monkeypatch.setenv("MINIAPP_STORED_ATTENTION", "off")
    assert stored_attention_unavailable("cuda") == "switched off by MINIAPP_STORED_ATTENTION=off"

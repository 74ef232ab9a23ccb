"""Shared fixtures. Tests use the real bundled model and real llama.cpp; nothing downloads."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Calibrations and hashes go to a fresh folder: the user's own never change test results.
os.environ["MINIAPP_CACHE_DIR"] = tempfile.mkdtemp(prefix="miniapp-test-cache-")
# Likewise settings: a developer's config file or MINIAPP_* settings never reach the tests.
os.environ["MINIAPP_CONFIG"] = os.path.join(
    tempfile.mkdtemp(prefix="miniapp-test-config-"), "config.toml"
)
_SETTINGS = (
    "MODEL",
    "BACKEND",
    "DEVICE",
    "THREADS",
    "CTX",
    "WINDOW",
    "SINKS",
    "SPEC",
    "MAX_TOKENS",
    "TEMPERATURE",
    "TOP_K",
    "TOP_P",
    "MIN_P",
    "REPEAT_PENALTY",
    "SEED",
    "SYSTEM",
    "ASR_MODEL",
    "HOST",
    "PORT",
    "KV_TYPE",
    "PARALLEL",
    "API_KEY",
)
for _name in _SETTINGS:
    os.environ.pop("MINIAPP_" + _name, None)
# The suite runs the CPU path on every machine, a GPU machine too: GPU paths are tested
# through the simulated probe (and measured by scripts/gpu_check.sh on a real GPU). The CPU is
# the real one unless a test simulates another.
os.environ["MINIAPP_SIMULATE_GPU"] = "none"
for _name in ("MINIAPP_SIMULATE_CPU", "MINIAPP_LLAMACPP_REPACK", "MINIAPP_NATIVE"):
    os.environ.pop(_name, None)

from miniapp.engine.modelfile.store import resolve_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def default_model() -> Path:
    return resolve_model(None)


@pytest.fixture(scope="session")
def torch_runtime(default_model):
    from miniapp.engine.runtimes.torch_runtime import TorchRuntime

    return TorchRuntime(default_model, n_ctx=1024)


@pytest.fixture(scope="session")
def llamacpp_runtime(default_model):
    from miniapp.engine.runtimes.llamacpp_runtime import LlamaCppRuntime

    return LlamaCppRuntime(default_model, n_ctx=1024, logits_all=True)


@pytest.fixture(scope="session")
def miniapp_exe() -> str:
    """The installed console script (tests run it as a user would)."""
    exe = Path(sys.executable).parent / "miniapp"
    return str(exe) if exe.exists() else shutil.which("miniapp")

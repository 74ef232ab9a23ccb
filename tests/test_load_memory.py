"""Loading holds one copy of a file's quantized weights, never two: weights read in place
stay the memory map's pages, and those rewritten into an interleaved layout are copied a
slice at a time, each slice's file pages dropped once copied. The process's peak resident
memory grows by about the file's size while a model loads, whatever its size."""

from __future__ import annotations

import gc
import importlib.util
import sys
from pathlib import Path

import numpy as np
from tiny_gguf import TinyModel, write_tiny_model

from miniapp.engine.runtimes.torch_runtime import TorchRuntime

SCRIPT = Path(__file__).parents[1] / "scripts" / "make_synthetic_gguf.py"


def _synthetic():
    spec = importlib.util.spec_from_file_location("make_synthetic_gguf", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmHWM: the peak resident set so far)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Start VmHWM again from the current resident set."""
    Path("/proc/self/clear_refs").write_text("5")


def test_a_q4_k_m_file_loads_holding_one_copy_of_its_weights(tmp_path):
    synthetic = _synthetic()
    vocabulary = write_tiny_model(tmp_path / "vocabulary.gguf", TinyModel())
    # Qwen2-shaped, Q4_K with Q6_K values, down projections and head: about 100 MB.
    shape = synthetic.Shape(dim=2048, layers=4, heads=16, kv_heads=2, ffn=5632, tied=False)
    path = tmp_path / "model.gguf"
    synthetic.write(shape, path, vocabulary)
    size = path.stat().st_size
    assert size > 90e6
    gc.collect()
    reset_peak()
    before = status_bytes("VmRSS")
    runtime = TorchRuntime(path, n_ctx=256, spec="off")
    grown = status_bytes("VmHWM") - before
    # Bound: the file and a third more (the slice being copied, the norms, biases, caches
    # and buffers). Two copies of the weights at once would be twice the file.
    assert grown < 1.35 * size, (grown, size)
    assert np.isfinite(runtime.logits([1, 2, 3])).all()

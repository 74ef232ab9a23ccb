"""Loading maps a file's quantized weights instead of copying them: the process's anonymous
memory hardly grows while a model loads, whatever its size (its file pages are the page
cache's, shared and given back under pressure, as llama.cpp's mmap is)."""

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


def anonymous_bytes() -> int:
    """RssAnon of this process: memory that is not a mapped file."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_a_q4_k_m_file_loads_without_copying_its_weights(tmp_path):
    synthetic = _synthetic()
    vocabulary = write_tiny_model(tmp_path / "vocabulary.gguf", TinyModel())
    # Qwen2-shaped, Q4_K with Q6_K values, down projections and head: about 100 MB.
    shape = synthetic.Shape(dim=2048, layers=4, heads=16, kv_heads=2, ffn=5632, tied=False)
    path = tmp_path / "model.gguf"
    synthetic.write(shape, path, vocabulary)
    size = path.stat().st_size
    assert size > 90e6
    gc.collect()
    before = anonymous_bytes()
    runtime = TorchRuntime(path, n_ctx=256, spec="off")
    grown = anonymous_bytes() - before
    # Bound: a fifth of the file (the norms, biases, caches and buffers). Converting the
    # weights (MINIAPP_GGML_DIRECT=0: the int4 layout) grows it by more than the file.
    assert grown < 0.2 * size, (grown, size)
    assert np.isfinite(runtime.logits([1, 2, 3])).all()

"""scripts/gpu_check.sh, kept working on a machine without a GPU: a simulated CUDA device
computes on the CPU, so every GPU path must agree with the CPU (the int4 paths exactly)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

from tiny_gguf import LLAMA, write_tiny_model

SCRIPT = Path(__file__).parents[1] / "scripts" / "gpu_check.sh"


def test_gpu_check_measures_every_path_and_prints_its_table(tmp_path):
    wide_heads = replace(LLAMA, head_dim=32)  # q4 keys need heads of 32
    model = write_tiny_model(tmp_path / "tiny.gguf", wide_heads)
    out = tmp_path / "check.json"
    env = {**os.environ, "MINIAPP_SIMULATE_GPU": "cuda:Sim:24:8.9"}
    done = subprocess.run(
        [
            str(SCRIPT),
            "--model",
            str(model),
            "--tokens",
            "12",
            "--runs",
            "1",
            "--threads",
            "2",
            "--json",
            str(out),
            "--profile",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {row["path"]: row for row in json.loads(out.read_text())["rows"]}
    paths = {"cpu", "gpu int4", "gpu int4, uncompiled", "gpu int4, q4 kv", "gpu bf16"}
    assert set(rows) == paths | {"gpu split"}
    assert rows["gpu int4, uncompiled"]["top1"] == 1.0
    assert rows["gpu int4"]["top1"] == 1.0 and rows["gpu int4"]["kl"] < 1e-9
    assert rows["gpu split"]["top1"] == 1.0 and 0 < rows["gpu split"]["gpu_layers"] < 2
    assert rows["gpu bf16"]["weights"] == "bf16" and rows["gpu bf16"]["top1"] >= 0.9
    # Bit-identical speculation needs row-independent kernels: the int4 kernel is; a bf16
    # GEMM may round a batch of rows differently from one row, so that path is only reported.
    assert all(rows[path]["spec_identical"] for path in ("cpu", "gpu int4", "gpu split"))
    assert "| gpu split | cuda:0, int4, 1, q8 |" in done.stdout  # a simulated GPU's cache
    # --profile prints torch.profiler's table of decode steps once, for the first GPU path.
    assert done.stdout.count("profile of 4 decode steps") == 1 and "Self CPU" in done.stdout
    # A whole-model GPU path also decodes op by op, for the graph's gain.
    assert "fixed-shape" in rows["gpu int4"]["decode_step"]
    assert rows["gpu int4"]["tok_s_eager_steps"] > 0 and rows["gpu int4"]["graphs_captured"] >= 1
    assert "tok_s_eager_steps" not in rows["gpu split"]
    # Each path also decodes with every step queued only after the previous one's token
    # is read: the overlap's gain, on a GPU.
    assert all(row["tok_s_one_after_another"] > 0 for row in rows.values())
    # q4 keys in tiles take their own fixed-shape step; their quantization moves the logits.
    q4 = rows["gpu int4, q4 kv"]
    assert "fixed-shape" in q4["decode_step"] and q4["graphs_captured"] >= 1
    assert q4["top1"] >= 0.9 and q4["tok_s_eager_steps"] > 0
    # Serving on the int4 path: 1, 4 and 16 sequences together, a 2,000-token TTFT, and
    # the kernels a step launches (counted only where CUDA runs them); llama.cpp beside it,
    # or why not.
    ours, llama = json.loads(out.read_text())["serving"]
    assert all(ours[f"tok_s_batch_{b}"] > 0 for b in (1, 4, 16))
    assert 0 < ours["ttft_2000_s"] and ours["kernels_per_step"] is None
    assert llama["engine"] == "llama.cpp" and ("error" in llama or llama["tok_s_batch_1"] > 0)
    assert "| miniapp (torch) |" in done.stdout and "TTFT 2,000 tok" in done.stdout

from __future__ import annotations

import json
import subprocess

from miniapp.app.bench import bench_prompt


def test_bench_json_reports_both_backends(miniapp_exe):
    done = subprocess.run(
        [
            miniapp_exe,
            "bench",
            "--prompt-tokens",
            "32",
            "--tokens",
            "8",
            "--repeat",
            "1",
            "--threads",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    for backend in ("torch", "llamacpp"):
        row = report[backend]
        assert row["backend"] == backend
        assert row["prompt_tokens"] == 32 and row["generated_tokens"] == 8
        for key in ("prefill_tok_s", "ttft_s", "decode_tok_s", "peak_rss_mb"):
            assert row[key] > 0, (backend, key, row[key])
    # Each backend ran in its own process: llama.cpp's process never loaded torch (~200 MB).
    assert report["llamacpp"]["peak_rss_mb"] < report["torch"]["peak_rss_mb"]


def test_bench_prompt_from_samples_and_from_file(torch_runtime, tmp_path):
    tokenizer = torch_runtime.tokenizer
    synthetic = bench_prompt(tokenizer, 5000, None)  # longer than the samples: repeats them
    assert len(synthetic) == 5000
    text = tmp_path / "prompt.txt"
    text.write_text("The keeper lit the lamp at six.")
    assert bench_prompt(tokenizer, 128, str(text)) == tokenizer.encode(
        "The keeper lit the lamp at six.", parse_special=False
    )

from __future__ import annotations

import json
import subprocess


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

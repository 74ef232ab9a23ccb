from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from miniapp.app.bench import bench_prompt
from miniapp.app.bench_serve import find_llama_server
from miniapp.app.worker_process import exit_description
from miniapp.engine.errors import MiniappError
from miniapp.engine.kv.types import DEFAULT_KV_TYPE, bytes_per_token, kv_type


def test_bench_json_reports_both_backends_beside_the_bandwidth_floor(miniapp_exe):
    """`bench --models`: the side-by-side run for each model listed, with the bytes a decode
    step reads (ours and the file's) and the floor they set at the measured bandwidth."""
    done = subprocess.run(
        [
            miniapp_exe,
            "bench",
            "--models",
            "smollm2-135m-instruct",
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
    assert report["read_gb_s"] > 0.5
    (model,) = report["models"]
    for backend in ("torch", "llamacpp"):
        row = model[backend]
        assert row["backend"] == backend
        assert row["prompt_tokens"] == 32 and row["generated_tokens"] == 8
        for key in ("prefill_tok_s", "ttft_s", "decode_tok_s", "peak_rss_mb", "load_s"):
            assert row[key] > 0, (backend, key, row[key])
    # Each backend's own KV cache type, left out of the command line.
    torch_row, llama_row = model["torch"], model["llamacpp"]
    assert (torch_row["kv_type"], llama_row["kv_type"]) == (DEFAULT_KV_TYPE, "f16")
    # Each backend ran in its own process: llama.cpp's process never loaded torch (~200 MB),
    # and neither carries the bandwidth probe's gigabyte.
    assert llama_row["peak_rss_mb"] < torch_row["peak_rss_mb"] < 900
    # The Q4_1 layers are packed at the file's 5 bits a weight, the Q8_0 head read as it is.
    file_bytes = model["file_bytes_per_token"]
    assert 0.98 * file_bytes <= torch_row["weight_bytes_per_token"] <= 1.01 * file_bytes
    assert model["floor_tok_s"] == pytest.approx(report["read_gb_s"] * 1e9 / file_bytes)


def test_bench_prompt_from_samples_and_from_file(torch_runtime, tmp_path):
    tokenizer = torch_runtime.tokenizer
    synthetic = bench_prompt(tokenizer, 5000, None)  # longer than the samples: repeats them
    assert len(synthetic) == 5000
    text = tmp_path / "prompt.txt"
    text.write_text("The keeper lit the lamp at six.")
    assert bench_prompt(tokenizer, 128, str(text)) == tokenizer.encode(
        "The keeper lit the lamp at six.", parse_special=False
    )


def _worker_of(parent: int, backend: str) -> int | None:
    """The pid of `parent`'s bench worker for `backend`, once it has started."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == parent and b"miniapp.app.bench_worker" in argv and backend.encode() in argv:
            return int(entry.name)
    return None


def test_a_worker_that_crashes_is_one_line_and_exit_2(miniapp_exe):
    """llama.cpp's worker dies by SIGSEGV (sent to it, as a native crash would raise it): the
    parent names the backend, the signal and what it was doing, and exits 2."""
    bench = subprocess.Popen(
        [
            miniapp_exe,
            "bench",
            "--prompt-tokens",
            "32",
            "--tokens",
            "64",
            "--repeat",
            "200",
            "--threads",
            "1",
            "--spec",
            "off",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        worker = None
        while worker is None and time.monotonic() < deadline and bench.poll() is None:
            worker = _worker_of(bench.pid, "llamacpp")
            time.sleep(0.05)
        assert worker is not None, "the llama.cpp worker never started"
        time.sleep(3)  # loaded, or still loading: either is a phase the message names
        os.kill(worker, signal.SIGSEGV)
        out, err = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
    assert bench.returncode == 2, err
    assert err.count("\n") == 1, err
    assert re.fullmatch(
        r"miniapp: error: llama\.cpp crashed \(SIGSEGV\) while "
        r"(loading the model|generating \(run \d+\)); see miniapp doctor\n",
        err,
    ), err
    assert out == ""


def test_exit_descriptions():
    assert exit_description(-signal.SIGSEGV) == "SIGSEGV"
    assert exit_description(-signal.SIGKILL) == "SIGKILL, perhaps out of memory"
    assert exit_description(3) == "exit code 3"


def test_bench_serve_reports_each_client_count_as_json(miniapp_exe):
    done = subprocess.run(
        [
            miniapp_exe,
            "bench",
            "serve",
            "--clients",
            "2,1",
            "--requests",
            "1",
            "--tokens",
            "4",
            "--threads",
            "2",
            "--ctx",
            "1024",
            "--backend",
            "torch",
            "--http",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert list(report["torch"]) == ["1", "2"] and report["identical_output"] is True
    # --http: the same clients through `miniapp serve`, every answer its lone client's
    assert list(report["torch-http"]) == ["1", "2"]
    for count, row in report["torch-http"].items():
        assert row["identical_output"] and row["requests"] == int(count)
        assert row["aggregate_tok_s"] > 0 and row["peak_rss_mb"] > 0
    # SmolLM2's layers, as the default KV cache type stores them
    assert report["kv_type"] == DEFAULT_KV_TYPE
    assert report["kv_bytes_per_token"] == bytes_per_token(kv_type(DEFAULT_KV_TYPE), 30, 3, 64)
    for count, row in report["torch"].items():
        assert row["clients"] == int(count) and row["requests"] == int(count)
        for key in ("aggregate_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "peak_rss_mb"):
            assert row[key] > 0, (count, key, row[key])
        assert row["ttft_p99_s"] >= row["ttft_p50_s"] and row["itl_p99_s"] >= row["itl_p50_s"]


def test_bench_serve_refuses_bad_client_counts(miniapp_exe):
    done = subprocess.run(
        [miniapp_exe, "bench", "serve", "--clients", "two"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "miniapp: error: --clients 'two': give client counts like 1,2,4,8"
    ]


def test_bench_serve_without_llama_server_is_one_line_and_exit_2(miniapp_exe, tmp_path):
    missing = tmp_path / "llama-server"
    done = subprocess.run(
        [miniapp_exe, "bench", "serve", "--clients", "1", "--requests", "1", "--tokens", "4"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "MINIAPP_LLAMA_SERVER": str(missing), "PATH": str(tmp_path)},
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"miniapp: error: llama-server not found at MINIAPP_LLAMA_SERVER={missing}: point it "
        "at one (`make llama-server` builds one), or pass --backend torch"
    ]
    assert done.stdout == ""


def test_llama_server_is_looked_for_in_the_environment_the_build_then_path(tmp_path):
    def executable(path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
        return path

    on_path = executable(tmp_path / "bin" / "llama-server")
    built = tmp_path / "build" / "llama-server"
    configured = executable(tmp_path / "mine" / "llama-server")
    path = {"PATH": str(on_path.parent)}
    assert find_llama_server(path, built) == on_path
    assert find_llama_server(path, executable(built)) == built
    assert find_llama_server({**path, "MINIAPP_LLAMA_SERVER": str(configured)}, built) == configured
    with pytest.raises(
        MiniappError,
        match=r"^llama-server not found: run `make llama-server` "
        r"\(or set MINIAPP_LLAMA_SERVER\), or pass --backend torch$",
    ):
        find_llama_server({"PATH": str(tmp_path / "empty")}, tmp_path / "absent")

"""`miniapp models`: list, info and rm on the models folder; pull over real HTTP from a
loopback server in the Hub's layout (huggingface_hub is pointed at it with HF_ENDPOINT)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from hub_server import FakeHub, HubRepo
from image_fixtures import TinyProjector, write_tiny_projector
from tiny_gguf import LLAMA, write_tiny_model

REPO = "someone/tiny-GGUF"


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, bytes]:
    folder = tmp_path_factory.mktemp("hub-files")
    model = write_tiny_model(folder / "tiny.gguf", LLAMA).read_bytes()
    projector = write_tiny_projector(folder / "mmproj.gguf", TinyProjector(text_dim=LLAMA.dim))
    return {
        "tiny-Q4_K_M.gguf": model,
        "tiny-Q8_0.gguf": model + b"",
        "mmproj-tiny-f16.gguf": projector.read_bytes(),
        "README.md": b"# tiny\n",
    }


def _run(exe: str, models: os.PathLike, *args: str, endpoint: str | None = None, **env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_ENDPOINT")}
    env.update(
        MINIAPP_MODELS_DIR=str(models),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HOME=str(models.parent / "hf-home"),
        **env_extra,
    )
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    return subprocess.run(
        [exe, "models", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_pull_picks_the_quant_and_the_projector_and_checks_them(miniapp_exe, tmp_path, tiny_files):
    models = tmp_path / "models"
    with FakeHub({REPO: HubRepo(dict(tiny_files))}) as hub:
        done = _run(miniapp_exe, models, "pull", REPO, endpoint=hub.url)
    assert done.returncode == 0, done.stderr
    assert (models / "tiny-Q4_K_M.gguf").read_bytes() == tiny_files["tiny-Q4_K_M.gguf"]
    assert (models / "mmproj-tiny-f16.gguf").exists() and not (models / "tiny-Q8_0.gguf").exists()
    listed = json.loads(_run(miniapp_exe, models, "list", "--json").stdout)
    mine = next(e for e in listed if e["name"] == "tiny-Q4_K_M.gguf")
    assert mine["architecture"] == "llama" and mine["projector"] == "mmproj-tiny-f16.gguf"
    assert mine["quant_types"].startswith("Q4_1")
    # The speech model is listed too: missing here, and a user's faster-whisper folder found.
    whisper = next(e for e in listed if e["name"] == "whisper-tiny.en")
    assert whisper["bundled"] and not whisper["installed"]
    speech = models / "whisper-small"
    speech.mkdir()
    for name in ("model.bin", "config.json", "tokenizer.json"):
        (speech / name).write_bytes(b"x" * 1000)
    listed = json.loads(_run(miniapp_exe, models, "list", "--json").stdout)
    mine = next(e for e in listed if e["name"] == "whisper-small")
    assert mine["architecture"].startswith("whisper") and mine["installed"]
    assert mine["size_mb"] == 0.003


def test_pull_resumes_an_interrupted_download(miniapp_exe, tmp_path):
    models = tmp_path / "models"
    # huggingface_hub writes in 10 MB chunks, so a cut must fall past the first of them.
    data = os.urandom(24 * 2**20)
    cut = 12 * 2**20
    repo = HubRepo({"big-Q8_0.gguf": data}, cut_after={"big-Q8_0.gguf": (cut, 1)})
    with FakeHub({REPO: repo}) as hub:
        done = _run(miniapp_exe, models, "pull", f"{REPO}:q8_0", endpoint=hub.url)
        ranges = [r for method, _, r in hub.requests if method == "GET" and r]
    assert done.returncode == 0, done.stderr
    assert (models / "big-Q8_0.gguf").read_bytes() == data
    # The second request asked only for the rest: what arrived before the cut was kept.
    assert ranges and all(int(r[6:].split("-")[0]) >= 10 * 2**20 for r in ranges), ranges
    assert "Error while downloading" not in done.stderr


def test_pull_rejects_a_file_whose_hash_does_not_match(miniapp_exe, tmp_path, tiny_files):
    models = tmp_path / "models"
    repo = HubRepo(
        {"tiny-Q4_K_M.gguf": tiny_files["tiny-Q4_K_M.gguf"]}, wrong_hash={"tiny-Q4_K_M.gguf"}
    )
    with FakeHub({REPO: repo}) as hub:
        done = _run(miniapp_exe, models, "pull", REPO, endpoint=hub.url)
    assert done.returncode == 2 and "SHA-256" in done.stderr
    assert done.stderr.count("\n") == 1
    assert not (models / "tiny-Q4_K_M.gguf").exists()


@pytest.mark.parametrize(
    "spec,message",
    [
        ("someone/missing", "no such repository"),
        (f"{REPO}:Q2_K", "has no Q2_K GGUF (quants there: Q4_K_M, Q8_0)"),
        ("not a repo", "is not a repository"),
    ],
)
def test_pull_errors_are_one_line(miniapp_exe, tmp_path, tiny_files, spec, message):
    with FakeHub({REPO: HubRepo(dict(tiny_files))}) as hub:
        done = _run(miniapp_exe, tmp_path / "models", "pull", spec, endpoint=hub.url)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1


def test_pull_says_it_needs_the_network(miniapp_exe, tmp_path):
    offline = _run(miniapp_exe, tmp_path / "models", "pull", REPO, HF_HUB_OFFLINE="1")
    assert offline.returncode == 2 and "needs the network" in offline.stderr
    unreachable = _run(
        miniapp_exe,
        tmp_path / "models",
        "pull",
        REPO,
        endpoint="http://127.0.0.1:9",
        HF_HUB_DOWNLOAD_RETRIES="0",
    )
    assert unreachable.returncode == 2 and "needs the network" in unreachable.stderr
    assert unreachable.stderr.count("\n") == 1


def test_info_prints_metadata_and_the_sanitised_template(miniapp_exe, default_model, tmp_path):
    done = _run(miniapp_exe, default_model.parent, "info", default_model.name)
    assert done.returncode == 0, done.stderr
    assert "general.architecture = llama" in done.stdout
    assert "renders in the sandbox" in done.stdout and "<|im_start|>" in done.stdout
    as_json = json.loads(
        _run(miniapp_exe, default_model.parent, "info", default_model.name, "--json").stdout
    )
    assert as_json["metadata"]["llama.block_count"] == 30


def test_rm_removes_only_files_in_the_models_folder(miniapp_exe, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    write_tiny_model(models / "tiny.gguf", LLAMA)
    outside = write_tiny_model(tmp_path / "outside.gguf", LLAMA)
    refused = _run(miniapp_exe, models, "rm", str(outside))
    assert refused.returncode == 2 and outside.exists()
    done = _run(miniapp_exe, models, "rm", "tiny.gguf")
    assert done.returncode == 0 and not (models / "tiny.gguf").exists()
    assert _run(miniapp_exe, models, "rm", "tiny.gguf").returncode == 2

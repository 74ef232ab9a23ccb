"""`miniapp models list|pull|rm|info`: the models folder and what is in each file."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from miniapp.engine.api import (
    ASR_REQUIRED_FILES,
    BUNDLED,
    BUNDLED_FOLDERS,
    ChatTemplate,
    GGUFFile,
    Message,
    MiniappError,
    ModelFileError,
    fallback_template,
    list_server_models,
    models_dir,
    resolve_model,
)

LONG_ARRAY = 8  # metadata arrays longer than this are summarised, not printed
LONG_TEXT = 200
SPEECH = "whisper (faster-whisper)"  # how a speech-recognition folder is listed


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: str
    size_mb: float
    architecture: str
    quant_types: str  # the main type first, then the others
    projector: str | None  # an mmproj GGUF beside it
    bundled: bool
    installed: bool


def run_models(args: argparse.Namespace) -> int:
    handlers = {"list": _list, "pull": _pull, "rm": _remove, "info": _info}
    return handlers[args.models_command](args)


# ------------------------------------------------------------------ list


def list_models() -> list[ModelEntry]:
    folder = models_dir()
    entries = []
    bundled_files = {m.filename: name for name, m in BUNDLED.items()}
    for name, model in BUNDLED.items():
        path = folder / model.filename
        if not path.exists():
            entries.append(
                ModelEntry(name, str(path), model.size / 1e6, "?", "?", None, True, False)
            )
    for path in sorted(folder.glob("*.gguf")) if folder.is_dir() else []:
        if "mmproj" in path.name.lower():
            continue
        name = bundled_files.get(path.name, path.name)
        entries.append(_describe(path, name, bundled=path.name in bundled_files))
    return entries + _speech_models(folder)


def _speech_models(folder: Path) -> list[ModelEntry]:
    """Speech-recognition models: folders of faster-whisper files (the bundled one too)."""
    entries = []
    for name, bundle in BUNDLED_FOLDERS.items():
        if not (folder / bundle.folder).is_dir():
            size = sum(f.size for f in bundle.files) / 1e6
            entries.append(
                ModelEntry(name, str(folder / bundle.folder), size, SPEECH, "-", None, True, False)
            )
    bundled = {bundle.folder for bundle in BUNDLED_FOLDERS.values()}
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        if path.is_dir() and all((path / f).is_file() for f in ASR_REQUIRED_FILES):
            size = sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / 1e6
            entries.append(
                ModelEntry(
                    path.name,
                    str(path),
                    size,
                    SPEECH,
                    "CTranslate2",
                    None,
                    path.name in bundled,
                    True,
                )
            )
    return entries


def _describe(path: Path, name: str, bundled: bool) -> ModelEntry:
    size = path.stat().st_size / 1e6
    try:
        gguf = GGUFFile(path)
    except ModelFileError as exc:
        return ModelEntry(
            name, str(path), size, f"unreadable: {exc.reason}", "", None, bundled, True
        )
    return ModelEntry(
        name,
        str(path),
        size,
        gguf.architecture,
        _quant_types(gguf),
        _projector_beside(path),
        bundled,
        True,
    )


def _quant_types(gguf: GGUFFile) -> str:
    """Tensor types by the bytes they hold: 'Q4_1 (+Q8_0, F32)'."""
    weight: Counter[str] = Counter()
    for info in gguf.tensors.values():
        weight[info.ggml_type.name] += info.nbytes
    ranked = [name for name, _ in weight.most_common()]
    return ranked[0] + (f" (+{', '.join(ranked[1:])})" if ranked[1:] else "") if ranked else "-"


def _projector_beside(path: Path) -> str | None:
    found = sorted(p.name for p in path.parent.glob("*.gguf") if "mmproj" in p.name.lower())
    return ", ".join(found) or None


def _list(args: argparse.Namespace) -> int:
    if getattr(args, "base_url", None):
        return _list_remote(args)
    entries = list_models()
    if args.json:
        print(json.dumps([asdict(e) for e in entries], indent=1))
        return 0
    print(f"models folder: {models_dir()}")
    rows = [("NAME", "SIZE", "ARCH", "QUANT", "PROJECTOR")]
    for e in entries:
        name = e.name + (" (bundled)" if e.bundled else "") + ("" if e.installed else " [missing]")
        rows.append(
            (name, f"{e.size_mb:.0f} MB", e.architecture, e.quant_types, e.projector or "-")
        )
    _print_rows(rows)
    return 0


def _list_remote(args: argparse.Namespace) -> int:
    """A server's models (`--base-url`), as its /v1/models lists them."""
    from .host.remote import remote_config

    server = remote_config(args)
    if not server.base_url:
        server.check()  # the one line that asks for --base-url
    listed = list_server_models(server.base_url, server.api_key)
    if args.json:
        print(json.dumps([asdict(m) for m in listed], indent=1))
        return 0
    print(f"server: {server.base_url}")
    rows = [("NAME", "CONTEXT", "OWNED BY")]
    rows += [(m.id, str(m.context or "?"), m.owned_by or "-") for m in listed]
    _print_rows(rows)
    return 0


def _print_rows(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))


# ------------------------------------------------------------------ pull, rm


def _pull(args: argparse.Namespace) -> int:
    from miniapp.engine.api import pull

    for path in pull(args.spec):
        print(path)
    return 0


def _remove(args: argparse.Namespace) -> int:
    path = _in_models_folder(args.name)
    path.unlink()
    print(f"removed {path}")
    if args.name in BUNDLED or path.name in {m.filename for m in BUNDLED.values()}:
        print("(a bundled model: `make setup` installs it again)")
    return 0


def _in_models_folder(name: str) -> Path:
    """Only files inside the models folder can be removed, never a path elsewhere."""
    folder = models_dir().resolve()
    path = (resolve_model(name) if name in BUNDLED else folder / name).resolve()
    if path.parent != folder:
        raise MiniappError(f"{name}: not a file in the models folder ({folder})")
    if not path.is_file():
        raise MiniappError(f"{name}: no such model in {folder}")
    return path


# ------------------------------------------------------------------ info


def _info(args: argparse.Namespace) -> int:
    path = resolve_model(args.name)
    gguf = GGUFFile(path)
    template, note = sanitised_template(gguf)
    if args.json:
        metadata = {key: _short(value) for key, value in gguf.metadata.items()}
        print(
            json.dumps(
                {
                    "path": str(path),
                    "metadata": metadata,
                    "quant_types": _quant_types(gguf),
                    "chat_template": template,
                    "chat_template_note": note,
                },
                indent=1,
                default=str,
            )
        )
        return 0
    print(f"{path} ({path.stat().st_size / 1e6:.0f} MB)")
    print(f"tensors: {len(gguf.tensors)}, types {_quant_types(gguf)}")
    for key, value in gguf.metadata.items():
        if key != "tokenizer.chat_template":
            print(f"  {key} = {_short(value)}")
    print(f"chat template ({note}):")
    print(template)
    return 0


def _short(value):
    if isinstance(value, list) and len(value) > LONG_ARRAY:
        return f"[{len(value)} items: {', '.join(map(str, value[:3]))}, ...]"
    if isinstance(value, str) and len(value) > LONG_TEXT:
        return value[:LONG_TEXT] + f"... ({len(value)} chars)"
    return value


def sanitised_template(gguf: GGUFFile) -> tuple[str, str]:
    """The chat template as miniapp uses it: control characters other than newlines and tabs
    removed, line endings normalised, and checked to render in the sandboxed environment."""
    source = gguf.metadata.get("tokenizer.chat_template")
    if not source:
        return fallback_template(gguf.architecture), "none in the file: miniapp's fallback"
    text = source.replace("\r\n", "\n").replace("\r", "\n")
    cleaned = "".join(ch for ch in text if ch in "\n\t" or ch.isprintable())
    removed = len(text) - len(cleaned)
    note = "as in the file" if not removed else f"{removed} control characters removed"
    try:
        template = ChatTemplate(cleaned, architecture=gguf.architecture)
        template.render([Message("system", "s"), Message("user", "u")])
    except Exception as exc:  # noqa: BLE001 - a template error is a fact to report here
        note += f"; it does not render in the sandbox: {type(exc).__name__}: {exc}"
    else:
        note += "; renders in the sandbox"
    return cleaned, note

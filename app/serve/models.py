"""`GET /v1/models`: the loaded model first, then the models folder's other GGUFs, each with
its context length (the loaded one's as it runs, the others' as trained)."""

from __future__ import annotations

from pathlib import Path

from miniapp.engine.errors import MiniappError
from miniapp.engine.gguf_file import GGUFFile

from ..models_cmd import SPEECH, list_models


def model_listing(served) -> list[dict]:
    runtime = served.host.runtime
    loaded_path = Path(runtime.model_path).resolve() if runtime is not None else None
    listed = [_entry(served.model_id, runtime.n_ctx if runtime else None, loaded=True,
                     created=_created(loaded_path))]  # fmt: skip
    for entry in list_models():
        if not entry.installed or entry.architecture == SPEECH:
            continue
        path = Path(entry.path).resolve()
        if path == loaded_path:
            continue
        listed.append(_entry(entry.name, _trained_context(path), loaded=False,
                             created=_created(path)))  # fmt: skip
    return listed


def _entry(name: str, context: int | None, loaded: bool, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "miniapp",
            "context_length": context, "loaded": loaded}  # fmt: skip


def _created(path: Path | None) -> int:
    try:
        return int(path.stat().st_mtime) if path else 0
    except OSError:
        return 0


def _trained_context(path: Path) -> int | None:
    try:
        value = GGUFFile(path).arch_value("context_length", None)
    except (MiniappError, OSError):
        return None
    return int(value) if value is not None else None

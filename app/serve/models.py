"""`GET /v1/models`: the loaded model first, then its loaded LoRA adapters (each a model a
request may name, with `parent`: the base, as vLLM lists them), then the models folder's
other GGUFs, each with its context length (the loaded one's as it runs, the others' as
trained).

Each file's context length is read once (per size and modification time), by a scan that
stops at that key, off the event loop; the server reads them in the background as it
starts."""

from __future__ import annotations

import threading
from functools import lru_cache
from pathlib import Path

from miniapp.engine.api import MiniappError, installed_models, read_scalar

from .lora import served_adapters


def model_listing(served) -> list[dict]:
    runtime = served.host.runtime
    loaded = Path(runtime.model_path).resolve() if runtime is not None else None
    context = runtime.n_ctx if runtime else None
    listed = [_entry(served.model_id, context, True, loaded)]
    for adapter in served_adapters(served, runtime):
        entry = _entry(adapter.name, context, True, adapter.path)
        listed.append(entry | {"parent": served.model_id, "root": str(adapter.path)})
    for name, path in installed_models():
        if path.resolve() != loaded:
            listed.append(_entry(name, _trained_context(path), False, path))
    return listed


def warm_listing() -> None:
    """Read every listed file's context length now, in a background thread."""
    threading.Thread(
        target=lambda: [_trained_context(p) for _, p in installed_models()],
        name="models-listing",
        daemon=True,
    ).start()


def _entry(name: str, context: int | None, loaded: bool, path: Path | None) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": _created(path),
        "owned_by": "miniapp",
        "context_length": context,
        "loaded": loaded,
    }


def _created(path: Path | None) -> int:
    try:
        return int(path.stat().st_mtime) if path else 0
    except OSError:
        return 0


def _trained_context(path: Path) -> int | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return _context_of(str(path), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=256)
def _context_of(path: str, _mtime_ns: int, _size: int) -> int | None:
    try:
        architecture = read_scalar(path, "general.architecture")
        value = read_scalar(path, f"{architecture}.context_length") if architecture else None
    except MiniappError:
        return None
    return int(value) if isinstance(value, int) else None

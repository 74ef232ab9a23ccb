"""`GET /v1/models`: the default model first, then its loaded LoRA adapters (each a model a
request may name, with `parent`: the base, as vLLM lists them), then the other installed
models (bundled, and the models folder's GGUFs), which a request may name too: each with its
context length (a resident model's as it runs, the others' as trained), `loaded` and
`state` ("loaded", "loading" or "not-loaded", as LM Studio says).

Each file's context length is read once (per size and modification time), by a scan that
stops at that key, off the event loop; the server reads them in the background as it
starts."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path

from miniapp.engine.api import MiniappError, installed_models, read_scalar, resolve_model

from ..host.model_host import LoadState
from .lora import served_adapters

_STATES = {LoadState.READY: "loaded", LoadState.LOADING: "loading"}


def model_listing(served) -> list[dict]:
    states = {
        resolve_model(spec.model).resolve(): state
        for spec, state in served.host.resident_specs().items()
    }
    runtime = served.host.runtime
    default = served.model_path.resolve()
    context = runtime.n_ctx if runtime else None
    listed = [_entry(served.model_id, context, states.get(default), default)]
    for adapter in served_adapters(served, runtime):
        entry = _entry(adapter.name, context, states.get(default), adapter.path)
        listed.append(entry | {"parent": served.model_id, "root": str(adapter.path)})
    for name, path in installed_models():
        resolved = path.resolve()
        if resolved != default:
            listed.append(_entry(name, _trained_context(path), states.get(resolved), path))
    return listed


def anthropic_listing(listed: list[dict]) -> dict:
    """The same models as a page of Anthropic's GET /v1/models (its clients, Claude Code's
    model picker, send `anthropic-version`)."""
    data = [
        {
            "type": "model",
            "id": entry["id"],
            "display_name": entry["id"],
            "created_at": datetime.fromtimestamp(entry["created"], UTC).isoformat(),
            "lifecycle": "active",
            "max_input_tokens": entry["context_length"],
        }
        for entry in listed
    ]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"data": data, "has_more": False, "first_id": first, "last_id": last}


def warm_listing() -> None:
    """Read every listed file's context length now, in a background thread."""
    threading.Thread(
        target=lambda: [_trained_context(p) for _, p in installed_models()],
        name="models-listing",
        daemon=True,
    ).start()


def _entry(name: str, context: int | None, state: LoadState | None, path: Path) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": _created(path),
        "owned_by": "miniapp",
        "context_length": context or _trained_context(path),
        "loaded": state is LoadState.READY,
        "state": _STATES.get(state, "not-loaded"),
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

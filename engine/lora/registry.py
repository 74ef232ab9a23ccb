"""The adapters a running model has loaded, by name: loaded and unloaded while it serves,
resolved per request, kept within a memory budget.

An adapter is read and checked once (adapter.py), then bound to the model (`Binder`: its
A and B laid out for the model's fused projections, see bound.py) and kept under its name.
Past the budget, the adapters used least recently are let go (their name, file and scale
stay known) and read again from their file on their next use, as vLLM's CPU LoRA cache
does. Unloading forgets the name at once; answers already running with the adapter hold
their own reference to its weights and finish with it: an unload never breaks them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..errors import MiniappError
from ..modelfile.gguf_file import GGUFFile
from ..tokens.sampling import LoraChoice
from .adapter import AdapterError, LoraAdapter, read_adapter


class UnknownAdapterError(MiniappError):
    """A request named an adapter that is not loaded."""


class AdapterNameError(MiniappError):
    """A load under a name already taken, or a name that cannot be one."""


@dataclass(frozen=True)
class LoraSpec:
    """An adapter to load when the model opens: `--lora NAME=PATH[:SCALE]`."""

    name: str
    path: Path
    scale: float = 1.0


class BoundAdapter(Protocol):
    """An adapter laid out for one model (bound.py)."""

    name: str
    nbytes: int
    rank: int


Binder = Callable[[str, LoraAdapter], BoundAdapter]


@dataclass(frozen=True)
class AdapterInfo:
    """What an interface shows about a loaded adapter."""

    name: str
    path: Path
    scale: float  # the default, when a request gives none
    rank: int
    nbytes: int  # its A and B, as kept (no copy of the base)
    load_seconds: float  # the latest read from its file
    loads: int  # times read from its file (more than one: let go past the budget, reread)
    resident: bool  # in memory now


@dataclass(frozen=True)
class AdapterSet:
    """The adapters one answer runs with, in order, each with its scale s (the user's;
    bound.py applies alpha / rank). `key` names the set for the prefix pool: cached KV is
    reused only under the same adapters at the same scales."""

    entries: tuple[tuple[BoundAdapter, float], ...]

    @property
    def key(self) -> tuple[tuple[int, float], ...]:
        return tuple((id(adapter), scale) for adapter, scale in self.entries)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(adapter.name for adapter, _ in self.entries)


@dataclass
class _Entry:
    name: str
    path: Path
    scale: float
    rank: int
    nbytes: int
    load_seconds: float
    loads: int
    bound: BoundAdapter | None
    used: float


def check_name(name: str) -> str:
    """An adapter's name is how requests pick it (`model`): plain, printable, not empty."""
    if not name or len(name) > 128 or not name.isprintable() or name != name.strip():
        raise AdapterNameError(f"{name!r} cannot name an adapter (1-128 printable characters)")
    return name


MAX_SCALE = 100.0  # |scale| past this is a mistake, not a fine-tune's strength


def check_scale(scale: float) -> float:
    if not isinstance(scale, int | float) or isinstance(scale, bool) or scale != scale:
        raise MiniappError(f"LoRA scale {scale!r} is not a number")
    if abs(scale) > MAX_SCALE:
        raise MiniappError(f"LoRA scale {scale} is out of range (-{MAX_SCALE:g}..{MAX_SCALE:g})")
    return float(scale)


class LoraRegistry:
    """Loaded adapters of one base model (`base`, its GGUF). `budget_bytes`: what the
    resident adapters may hold together (None: no bound); the one just used always stays."""

    def __init__(
        self,
        base: GGUFFile,
        binder: Binder,
        budget_bytes: int | None = None,
        on_release: Callable[[], None] | None = None,
    ):
        """`on_release`: called after an adapter is unloaded or let go past the budget (the
        engine drops what it kept of it)."""
        self.base, self.binder, self.budget_bytes = base, binder, budget_bytes
        self.on_release = on_release
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def load(self, name: str, path: Path | str, scale: float = 1.0) -> AdapterInfo:
        """Read, check and bind the adapter at `path` under `name`. AdapterError (one line)
        for a file that is not an adapter for this model; AdapterNameError for a name
        already loaded."""
        check_name(name)
        scale = check_scale(scale)
        path = Path(path)
        with self._lock:
            if name in self._entries:
                raise AdapterNameError(f"an adapter named {name!r} is already loaded")
        bound, seconds = self._read(name, path)
        with self._lock:
            if name in self._entries:  # loaded meanwhile by another request
                raise AdapterNameError(f"an adapter named {name!r} is already loaded")
            entry = _Entry(
                name, path, scale, bound.rank, bound.nbytes, seconds, 1, bound, time.monotonic()
            )
            self._entries[name] = entry
            let_go = self._keep_within_budget(entry)
            info = _info(entry)
        if let_go:
            self._released()
        return info

    def unload(self, name: str) -> AdapterInfo:
        """Forget the adapter; answers running with it finish with it."""
        with self._lock:
            entry = self._entries.pop(name, None)
        if entry is None:
            raise UnknownAdapterError(f"no adapter named {name!r} is loaded")
        self._released()
        return _info(entry)

    def _released(self) -> None:
        if self.on_release is not None:
            self.on_release()

    def list(self) -> list[AdapterInfo]:
        with self._lock:
            return [_info(entry) for entry in self._entries.values()]

    def get(self, name: str) -> AdapterInfo | None:
        with self._lock:
            entry = self._entries.get(name)
            return None if entry is None else _info(entry)

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._entries

    def holds(self, adapters: AdapterSet) -> bool:
        """Whether every adapter of the set is still loaded and resident as it was bound."""
        with self._lock:
            bound = {id(e.bound) for e in self._entries.values() if e.bound is not None}
        return all(id(adapter) in bound for adapter, _ in adapters.entries)

    @property
    def resident_bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values() if e.bound is not None)

    def resolve(self, choices: Sequence[LoraChoice]) -> AdapterSet | None:
        """The bound adapters of a request's choices (None for none), read again from their
        files where the budget let them go. UnknownAdapterError names one not loaded."""
        if not choices:
            return None
        entries = []
        for choice in choices:
            entry = self._use(choice.name)
            scale = entry.scale if choice.scale is None else check_scale(choice.scale)
            entries.append((self._bound(entry), scale))
        return AdapterSet(tuple(entries))

    def _use(self, name: str) -> _Entry:
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                known = ", ".join(sorted(self._entries)) or "none"
                raise UnknownAdapterError(f"no adapter named {name!r} is loaded (loaded: {known})")
            entry.used = time.monotonic()
            return entry

    def _bound(self, entry: _Entry) -> BoundAdapter:
        bound = entry.bound
        if bound is not None:
            return bound
        bound, seconds = self._read(entry.name, entry.path)  # let go past the budget
        with self._lock:
            let_go = False
            if entry.bound is None:
                entry.bound, entry.load_seconds = bound, seconds
                entry.loads += 1
                let_go = self._keep_within_budget(entry)
            bound = entry.bound
        if let_go:
            self._released()
        return bound

    def _read(self, name: str, path: Path) -> tuple[BoundAdapter, float]:
        start = time.perf_counter()
        adapter = read_adapter(path, self.base)
        bound = self.binder(name, adapter)
        return bound, time.perf_counter() - start

    def _keep_within_budget(self, keep: _Entry) -> bool:
        """Let the least recently used resident adapters go until the rest fit (called
        under the lock); whether any went."""
        if self.budget_bytes is None:
            return False
        resident = sorted(
            (e for e in self._entries.values() if e.bound is not None and e is not keep),
            key=lambda e: e.used,
        )
        total, let_go = keep.nbytes + sum(e.nbytes for e in resident), False
        for entry in resident:
            if total <= self.budget_bytes:
                break
            entry.bound, let_go = None, True
            total -= entry.nbytes
        return let_go


def _info(entry: _Entry) -> AdapterInfo:
    return AdapterInfo(
        entry.name,
        entry.path,
        entry.scale,
        entry.rank,
        entry.nbytes,
        entry.load_seconds,
        entry.loads,
        entry.bound is not None,
    )


def parse_lora_flag(text: str) -> LoraSpec:
    """`NAME=PATH[:SCALE]` (serve's --lora), or a bare PATH named after its file. A scale
    follows the last colon only where it reads as a number (a Windows drive letter or a
    colon in a file name stays part of the path)."""
    name, sep, rest = text.partition("=")
    if not sep:
        name, rest = "", text
    path, scale = rest, 1.0
    head, colon, tail = rest.rpartition(":")
    if colon and head:
        try:
            scale = float(tail)
            path = head
        except ValueError:
            pass
    if not path:
        raise MiniappError(f"--lora {text!r}: give NAME=PATH[:SCALE]")
    path_obj = Path(path).expanduser()
    name = name or path_obj.stem
    return LoraSpec(check_name(name), path_obj, check_scale(scale))


__all__ = [
    "AdapterError",
    "AdapterInfo",
    "AdapterNameError",
    "AdapterSet",
    "LoraRegistry",
    "LoraSpec",
    "MAX_SCALE",
    "UnknownAdapterError",
    "parse_lora_flag",
]

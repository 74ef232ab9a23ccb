"""Per-model early-exit settings: measured by `miniapp calibrate`, stored in the user cache
directory under the model file's SHA-256, loaded by the torch runtime at start-up.

A setting names the exit layer, the longest draft worth making, whether drafting is predicted
to beat plain decoding at all, and optionally a trained exit adapter stored beside it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import platformdirs

from ..models.decoder import DecoderModel
from .adapter import ExitAdapterModule
from .draft_head import DraftHead, HeadWeights
from .shallow_head import BlockWeights, ShallowBlock

CACHE_DIR_ENV = "MINIAPP_CACHE_DIR"
DEFAULT_MAX_DRAFT = 4


@dataclass
class ExitSetting:
    layer: int
    max_draft: int
    pays: bool  # calibration predicted a speed-up over plain decoding
    predicted_speedup: float = 0.0
    acceptance: dict[str, float] = field(default_factory=dict)  # exit layer -> top-1 agreement
    adapter_file: str | None = None  # beside the setting, in the cache directory
    adapter: ExitAdapterModule | None = field(default=None, repr=False, compare=False)

    @property
    def measured_acceptance(self) -> float | None:
        """Calibration's top-1 agreement for this layer (with its adapter, if any)."""
        key = f"{self.layer}+adapter" if self.adapter_file else str(self.layer)
        return self.acceptance.get(key)

    def to_json(self) -> dict:
        data = asdict(self)
        data.pop("adapter")
        return data


def cache_dir() -> Path:
    root = os.environ.get(CACHE_DIR_ENV) or platformdirs.user_cache_dir("miniapp")
    return Path(root) / "calibration"


def file_hash(path: Path) -> str:
    """SHA-256 of the file, remembered per (path, size, mtime) so start-up hashes once."""
    stat = path.stat()
    memo_path = cache_dir() / "hashes.json"
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    memo = _read_json(memo_path) or {}
    if key in memo:
        return memo[key]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    memo[key] = digest.hexdigest()
    try:
        _write_json_atomic(memo_path, memo)
    except OSError:
        pass  # a read-only cache folder only costs hashing again next time
    return memo[key]


def default_exit_setting(model: DecoderModel) -> ExitSetting:
    """Uncalibrated `--spec early-exit`: exit halfway, short drafts."""
    return ExitSetting(layer=model.config.n_layers // 2, max_draft=DEFAULT_MAX_DRAFT, pays=False)


def setting_path(model_path: Path) -> Path:
    return cache_dir() / f"{file_hash(model_path)}.json"


def load_exit_setting(model_path: Path, model: DecoderModel) -> ExitSetting | None:
    """The stored setting for this file, or None (never calibrated, or unreadable)."""
    data = _read_json(setting_path(model_path))
    if not data:
        return None
    try:
        setting = ExitSetting(**data)
    except TypeError:
        return None  # written by an incompatible version: as if never calibrated
    if not 0 < setting.layer < model.config.n_layers:
        return None
    if setting.adapter_file:
        adapter_path = cache_dir() / setting.adapter_file
        setting.adapter = ExitAdapterModule.load(adapter_path, model.config.dim)
    return setting


def save_exit_setting(model_path: Path, setting: ExitSetting) -> Path:
    path = setting_path(model_path)
    if setting.adapter is not None:
        setting.adapter_file = path.with_suffix(".adapter.pt").name
        setting.adapter.save(cache_dir() / setting.adapter_file)
    _write_json_atomic(path, setting.to_json())
    return path


def head_path(model_path: Path) -> Path:
    return cache_dir() / f"{file_hash(model_path)}.head.pt"


def load_head_weights(model_path: Path, model: DecoderModel) -> tuple[HeadWeights, dict] | None:
    """The head's weights trained for this file, with its measurements, or None. A head
    whose recorded hash is not this file's is ignored."""
    loaded = HeadWeights.load(head_path(model_path), model.config.dim)
    if loaded is None:
        return None
    weights, meta = loaded
    if meta.get("sha256") != file_hash(model_path):
        return None
    if int(weights.vocab.max()) >= model.config.vocab_size:
        return None
    return weights, meta


def load_draft_head(model_path: Path, model: DecoderModel) -> tuple[DraftHead, dict] | None:
    """The head trained for this file, ready to draft with its measured policy, or None."""
    loaded = load_head_weights(model_path, model)
    if loaded is None:
        return None
    weights, meta = loaded
    rows = model.head_rows(weights.vocab)
    policy = float(meta.get("threshold", 0.0)), meta.get("max_draft")
    return DraftHead(weights, rows, model.config.final_logit_softcap, *policy), meta


def shallow_path(model_path: Path) -> Path:
    return cache_dir() / f"{file_hash(model_path)}.shallow.pt"


def load_shallow_weights(model_path: Path, model: DecoderModel) -> tuple[BlockWeights, dict] | None:
    """The shallow-exit block trained for this file, with its measurements, or None."""
    config = model.config
    loaded = BlockWeights.load(shallow_path(model_path), config.dim, config.n_layers)
    if loaded is None:
        return None
    weights, meta = loaded
    if meta.get("sha256") != file_hash(model_path) or int(weights.vocab.max()) >= config.vocab_size:
        return None
    return weights, meta


def load_shallow_block(model_path: Path, model: DecoderModel) -> tuple[ShallowBlock, dict] | None:
    """The shallow-exit block for this file, ready to draft with its measured policy."""
    loaded = load_shallow_weights(model_path, model)
    if loaded is None:
        return None
    weights, meta = loaded
    policy = float(meta.get("threshold", 0.0)), meta.get("max_draft")
    return ShallowBlock(weights, model, model.head_rows(weights.vocab), *policy), meta


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)

"""`miniapp models pull`: one GGUF (and its vision projector) from a Hugging Face repository.

The only place miniapp touches the network after set-up, and only when asked. The file is
chosen by its quantization tag in the name, downloaded with huggingface_hub straight into
the models folder (an interrupted download resumes), and checked against the size and
SHA-256 the Hub lists for it. `HF_ENDPOINT` points it at another server (the tests use a
loopback one).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import MiniappError
from .store import models_dir, sha256_of

DEFAULT_QUANT = "Q4_K_M"
_SPLIT_PART = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
_REPO = re.compile(r"^[\w.-]+/[\w.-]+$")


class PullError(MiniappError):
    pass


class NeedsNetworkError(PullError):
    pass


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int | None
    sha256: str | None  # the Hub lists it for files stored with Git LFS


@dataclass(frozen=True)
class PullPlan:
    repo: str
    revision: str | None  # the commit the listing came from, so every file matches it
    model: RemoteFile
    projector: RemoteFile | None


def parse_spec(spec: str) -> tuple[str, str]:
    """'owner/name[:QUANT]' -> (repo, quant)."""
    repo, _, quant = spec.partition(":")
    if not _REPO.match(repo):
        raise PullError(f"'{spec}' is not a repository (expected owner/name[:QUANT])")
    return repo, (quant or DEFAULT_QUANT).upper()


def choose_files(
    repo: str, quant: str, files: list[RemoteFile]
) -> tuple[RemoteFile, RemoteFile | None]:
    """The GGUF whose name carries the quant tag, and a projector if the repo has one."""
    ggufs = [f for f in files if f.name.lower().endswith(".gguf")]
    projectors = [f for f in ggufs if "mmproj" in Path(f.name).name.lower()]
    models = [f for f in ggufs if f not in projectors]
    tag = re.compile(rf"(^|[-_.]){re.escape(quant)}([-_.]|$)", re.IGNORECASE)
    matches = [f for f in models if tag.search(Path(f.name).stem)]
    if not matches:
        available = sorted({_quant_tag(f.name) for f in models} - {""}) or ["none"]
        raise PullError(f"{repo} has no {quant} GGUF (quants there: {', '.join(available)})")
    whole = [f for f in matches if not _SPLIT_PART.search(f.name)]
    if not whole:
        raise PullError(
            f"{repo}: the {quant} GGUF is split into parts, which miniapp cannot load yet"
        )
    model = min(whole, key=lambda f: len(f.name))  # the plainest name, e.g. not an "-imat" copy
    # A full-precision projector keeps the picture encoder's accuracy; it is small anyway.
    projector = min(projectors, key=lambda f: ("f16" not in f.name.lower(), f.name), default=None)
    return model, projector


def _quant_tag(name: str) -> str:
    found = re.search(r"(I?Q\d[\w]*?|F16|BF16|F32)(?=\.gguf$|[-.])", Path(name).name, re.I)
    return found.group(1).upper() if found else ""


def plan_pull(spec: str) -> PullPlan:
    repo, quant = parse_spec(spec)
    _require_network()
    from huggingface_hub import HfApi
    from huggingface_hub.utils import logging as hub_logging

    # It logs each retry over several lines; the progress bar shows a resumed download, and
    # a failure is reported as one line.
    hub_logging.set_verbosity_error()

    try:
        info = HfApi().model_info(repo, files_metadata=True)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one named line
        raise _as_pull_error(repo, exc) from None
    files = [
        RemoteFile(s.rfilename, s.size, s.lfs.sha256 if s.lfs else None)
        for s in info.siblings or []
    ]
    model, projector = choose_files(repo, quant, files)
    return PullPlan(repo, info.sha, model, projector)


def pull(spec: str, log: Callable[[str], None] = print) -> list[Path]:
    """Download and check the plan's files into the models folder; returns their paths."""
    plan = plan_pull(spec)
    wanted = [plan.model] + ([plan.projector] if plan.projector else [])
    return [_download(plan, remote, log) for remote in wanted]


def _download(plan: PullPlan, remote: RemoteFile, log: Callable[[str], None]) -> Path:
    from huggingface_hub import hf_hub_download

    folder = models_dir()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / Path(remote.name).name
    if target.exists() and _intact(target, remote):
        log(f"{target.name}: already here, intact")
        return target
    size = f" ({remote.size / 1e6:.0f} MB)" if remote.size else ""
    log(f"downloading {plan.repo}/{remote.name}{size}")
    try:
        path = Path(
            hf_hub_download(plan.repo, remote.name, revision=plan.revision, local_dir=folder)
        )
    except Exception as exc:  # noqa: BLE001
        raise _as_pull_error(plan.repo, exc) from None
    if path != target:  # a file in a sub-folder of the repo lands in the same sub-folder
        path.replace(target)
    problem = _check(target, remote)
    if problem:
        target.unlink()
        raise PullError(f"{remote.name}: {problem}; the download was removed")
    log(f"installed {target}")
    return target


def _check(path: Path, remote: RemoteFile) -> str | None:
    size = path.stat().st_size
    if remote.size is not None and size != remote.size:
        return f"size {size} bytes, but the Hub lists {remote.size}"
    if remote.sha256 is not None:
        actual = sha256_of(path)
        if actual != remote.sha256:
            return f"SHA-256 {actual} does not match the Hub's {remote.sha256}"
    return None


def _intact(path: Path, remote: RemoteFile) -> bool:
    return _check(path, remote) is None


def _require_network() -> None:
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise NeedsNetworkError(
            "models pull needs the network, and HF_HUB_OFFLINE is set; unset it to download"
        )


def _as_pull_error(repo: str, exc: Exception) -> PullError:
    """huggingface_hub's and the HTTP client's errors, as one line a user can act on."""
    name = type(exc).__name__
    first = (str(exc).strip().splitlines() or [name])[0]
    if name in ("RepositoryNotFoundError", "GatedRepoError"):
        return PullError(f"{repo}: no such repository, or it needs a login ({first})")
    if name in ("EntryNotFoundError", "RevisionNotFoundError"):
        return PullError(f"{repo}: {first}")
    if name in (
        "LocalEntryNotFoundError",
        "ConnectError",
        "ConnectTimeout",
        "ReadTimeout",
        "RemoteProtocolError",
        "ReadError",
        "OfflineModeIsEnabled",
    ):
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
        return NeedsNetworkError(
            f"models pull needs the network: cannot reach {endpoint} ({name}: {first})"
        )
    return PullError(f"{repo}: download failed ({name}: {first})")

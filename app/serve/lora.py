"""LoRA adapters on the API (issue 51).

A request picks adapters by `model` (vLLM's way: an adapter's name runs the base model with
it) or by llama-server's `lora` field, `[{"id" or "name", "scale"}]`, several at once;
adapters loaded at start (`--lora`) apply only to the requests that pick them. vLLM's
`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` load and unload them while the
server runs, from the adapters folder only (`--lora-dir`, else the models folder's
`adapters/`); llama-server's `GET /lora-adapters` lists them, numbered as the `id`s.

The torch engine keeps adapters by name and applies each request's own (rows of one batch
may differ). An unload forgets the name at once; answers already running with the adapter
finish with it. llama.cpp applies the one adapter it was opened with to every answer:
naming that adapter is fine, anything else that needs adapters chosen while it runs is a
400.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse

from miniapp.engine.api import (
    AdapterNameError,
    LoraChoice,
    LoraRegistry,
    MiniappError,
    Runtime,
    UnknownAdapterError,
    models_dir,
)

from .errors import ApiError, bad_request
from .protocol import LoadLoraRequest, LoraPick, UnloadLoraRequest
from .service import ServedModel

ADAPTERS_FOLDER = "adapters"  # under the models folder, unless --lora-dir names another


def adapters_folder(lora_dir: str | Path | None) -> Path:
    """Where run-time loads may read adapters from: `--lora-dir`, else the models folder's
    `adapters/`, with symbolic links resolved."""
    folder = Path(lora_dir).expanduser() if lora_dir else models_dir() / ADAPTERS_FOLDER
    return folder.resolve()


def allowed_path(folder: Path, given: str) -> Path:
    """`given` (absolute, or relative to the folder) with links and `..` resolved; 403 for
    anything that then lies outside the folder."""
    try:
        path = Path(given).expanduser()
        resolved = (path if path.is_absolute() else folder / path).resolve()
    except (OSError, ValueError, RuntimeError) as exc:  # a NUL byte, a loop of links
        raise bad_request(
            f"{given!r}: not a usable path ({exc})", "lora_path", code="invalid_adapter"
        ) from None
    if not resolved.is_relative_to(folder):
        raise ApiError(
            403,
            f"{given}: adapters are loaded only from {folder} (--lora-dir names another folder)",
            kind="permission_error",
            code="path_not_allowed",
            param="lora_path",
        )
    return resolved


@dataclass(frozen=True)
class ServedAdapter:
    """A loaded adapter as the API shows it; its position in the list is its `id`."""

    name: str
    path: Path
    scale: float


def served_adapters(served: ServedModel, runtime: Runtime | None) -> list[ServedAdapter]:
    """The adapters requests may pick, in load order: the torch engine's loaded ones, or the
    one llama.cpp was opened with."""
    if runtime is None:
        return []
    if runtime.lora is not None:
        return [ServedAdapter(a.name, a.path, a.scale) for a in runtime.lora.list()]
    specs = {spec.name: spec for spec in served.spec.lora}
    return [
        ServedAdapter(name, Path(specs[name].path), specs[name].scale)
        for name in runtime.info().adapters
        if name in specs
    ]


@dataclass(frozen=True)
class Picked:
    """The adapters a request's answers run with."""

    choices: tuple[LoraChoice, ...] = ()  # for SamplingParams.lora (the torch engine)
    names: tuple[str, ...] = ()  # every adapter applied (metrics): llama.cpp's too
    asked: bool = False  # the request named adapters (by `model` or a non-empty `lora`)
    model: str | None = None  # the adapter `model` named: the responses' model


def pick_adapters(
    served: ServedModel, runtime: Runtime, model: str, field: list[LoraPick] | None
) -> Picked:
    """The adapters a request asks for by `model` and `lora`. Models' names come first
    (the default's, or another installed model's); an adapter not loaded (by name or id)
    is a 404, a name given twice a 400."""
    loaded = served_adapters(served, runtime)
    by_model = None
    if served.spec_for(model) is None:  # not a model's name: an adapter's
        if model not in {adapter.name for adapter in loaded}:
            served.check_model(model, [adapter.name for adapter in loaded])
        by_model = model
    wanted: dict[str, float | None] = {} if by_model is None else {by_model: None}
    from_field: set[str] = set()
    for number, pick in enumerate(field or ()):
        name = _picked_name(pick, loaded, f"lora.{number}")
        if name in from_field:
            raise bad_request(f"the adapter '{name}' is given twice", f"lora.{number}")
        from_field.add(name)
        wanted[name] = pick.scale  # for the adapter `model` names too: this scale
    asked = bool(wanted)
    if runtime.lora is None:
        return _opened_with(loaded, wanted, asked, by_model)
    applied = {name: scale for name, scale in wanted.items() if scale != 0}  # 0: not applied
    choices = tuple(LoraChoice(name, scale) for name, scale in applied.items())
    return Picked(choices, tuple(applied), asked, by_model)


def _picked_name(pick: LoraPick, loaded: list[ServedAdapter], param: str) -> str:
    if pick.name is not None:
        if pick.name not in {adapter.name for adapter in loaded}:
            raise _unknown(f"no adapter named '{pick.name}' is loaded{_known(loaded)}", param)
        return pick.name
    if pick.id >= len(loaded):
        raise _unknown(f"no adapter has id {pick.id}{_known(loaded)}", param + ".id")
    return loaded[pick.id].name


def _known(loaded: list[ServedAdapter]) -> str:
    if not loaded:
        return " (none is loaded)"
    return " (loaded: " + ", ".join(f"{i} {a.name}" for i, a in enumerate(loaded)) + ")"


def _unknown(message: str, param: str | None) -> ApiError:
    return ApiError(404, message, code="model_not_found", param=param)


def _opened_with(
    loaded: list[ServedAdapter], wanted: dict[str, float | None], asked: bool, by_model: str | None
) -> Picked:
    """llama.cpp: the adapter it was opened with applies to every answer at the scale it was
    opened with, so a request may name it (at that scale), and nothing else."""
    by_name = {adapter.name: adapter for adapter in loaded}
    for name, scale in wanted.items():
        adapter = by_name[name]
        if scale not in (None, adapter.scale):
            raise bad_request(
                f"the llamacpp backend applies the adapter '{name}' at scale "
                f"{adapter.scale:g} to every answer; other scales need --backend torch",
                "lora",
                code="unsupported_parameter",
            )
    return Picked((), tuple(by_name), asked, by_model)


def lora_router(served: ServedModel, folder: Path) -> APIRouter:
    """vLLM's load and unload endpoints and llama-server's list. Plain functions: FastAPI
    runs them on worker threads (a load reads the file)."""
    router = APIRouter()

    @router.post("/v1/load_lora_adapter")
    def load_adapter(body: LoadLoraRequest) -> PlainTextResponse:
        registry = _registry(served)
        if body.lora_name in served.aliases:
            raise bad_request(
                f"'{body.lora_name}' is the base model's name: name the adapter otherwise",
                "lora_name",
                code="invalid_adapter_name",
            )
        if body.load_inplace:
            raise bad_request(
                "load_inplace is not supported: unload the adapter, then load it again",
                "load_inplace",
                code="unsupported_parameter",
            )
        path = allowed_path(folder, body.lora_path)
        scale = 1.0 if body.scale is None else body.scale
        try:
            registry.load(body.lora_name, path, scale)
        except AdapterNameError as exc:
            raise bad_request(str(exc), "lora_name", code="invalid_adapter_name") from None
        except MiniappError as exc:  # AdapterError, ModelFileError: one line naming the file
            raise bad_request(str(exc), "lora_path", code="invalid_adapter") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    def unload_adapter(body: UnloadLoraRequest) -> PlainTextResponse:
        registry = _registry(served)
        try:
            registry.unload(body.lora_name)
        except UnknownAdapterError as exc:
            raise _unknown(str(exc), "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @router.get("/lora-adapters")
    def list_adapters() -> JSONResponse:
        listed = served_adapters(served, served.host.runtime)
        return JSONResponse(
            [
                {"id": i, "name": a.name, "path": str(a.path), "scale": a.scale}
                for i, a in enumerate(listed)
            ]
        )

    return router


def _registry(served: ServedModel) -> LoraRegistry:
    runtime = served.runtime()
    if runtime.lora is None:
        raise bad_request(
            f"the {runtime.backend} backend applies the adapter it was opened with (--lora) "
            "to every answer; loading and unloading adapters while serving needs --backend "
            "torch",
            code="unsupported_parameter",
        )
    return runtime.lora

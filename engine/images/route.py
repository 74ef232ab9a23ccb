"""Which way an attached image goes: to a vision model through llama.cpp, or to OCR.

A vision model is a text model plus a multimodal projector ("mmproj") GGUF: the projector
turns pixels into embeddings the text model reads. We use one when it is named with
--mmproj or lies beside the model; otherwise images are described as text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from ..errors import ModelFileError
from ..modelfile.gguf_file import GGUFFile

PROJECTOR_ARCHITECTURE = "clip"  # llama.cpp's name for every multimodal projector file
VISION_BACKEND = "llamacpp"

# Tensors whose shape gives the projector's output width, which must equal the text model's
# embedding width: (name, axis in our rows-first order). Other projector types are left to
# llama.cpp, which checks the same thing when it loads the pair.
_OUTPUT_WIDTH_TENSORS = (
    ("mm.input_projection.weight", -1),  # gemma3: stored [vision, text]
    ("mm.2.weight", 0),  # LLaVA-style MLP, Qwen-VL mergers, pixtral, LFM2
    ("mm.model.fc.weight", 0),  # idefics3 / SmolVLM
)
# File-name parts that say how a file is stored, not which model it belongs to.
_STORAGE_WORDS = re.compile(r"^(mmproj|model|f16|f32|bf16|fp16|fp32|q\d+|k|m|s|l|xs|xxs|\d)$")


class ImagePath(StrEnum):
    VISION_MODEL = "vision_model"  # llama.cpp's multimodal path (MTMD) sees the pixels
    OCR_FALLBACK = "ocr_fallback"  # text extracted from the image goes into the prompt


@dataclass(frozen=True)
class MmprojSearch:
    path: Path | None
    reason: str  # why this one, or why none


@dataclass(frozen=True)
class ImageRoute:
    """The decision for a chat's images, with its reason in words the UI can show."""

    path: ImagePath
    reason: str
    mmproj: Path | None = None
    switches_backend: bool = False  # image turns must move from the torch engine to llama.cpp

    def summary(self) -> str:
        if self.path == ImagePath.VISION_MODEL:
            text = f"images: vision model ({self.reason})"
            if self.switches_backend:
                text += "; image turns run on llama.cpp, the torch engine has no vision path"
            return text
        return f"images: read as text by OCR, with size, colours and EXIF ({self.reason})"


def choose_route(
    model_path: Path | str,
    backend: str,
    mmproj: Path | str | None = None,
    allow_backend_switch: bool = True,
) -> ImageRoute:
    """Where this chat's images go. An explicit `mmproj` that is unusable raises
    ModelFileError; a projector found automatically is only used if it fits the model."""
    search = find_mmproj(model_path, mmproj)
    if search.path is None:
        return ImageRoute(ImagePath.OCR_FALLBACK, search.reason)
    if backend != VISION_BACKEND and not allow_backend_switch:
        reason = (
            f"{search.reason}, but the {backend} backend has no vision path; use --backend llamacpp"
        )
        return ImageRoute(ImagePath.OCR_FALLBACK, reason)
    return ImageRoute(
        ImagePath.VISION_MODEL,
        search.reason,
        mmproj=search.path,
        switches_backend=backend != VISION_BACKEND,
    )


def remote_route(accepts_images: bool) -> ImageRoute:
    """Where images go on a server's model (--backend openai): as pictures when the server
    says its model takes them, else as text by OCR here."""
    if accepts_images:
        return ImageRoute(ImagePath.VISION_MODEL, "the server's model takes pictures")
    return ImageRoute(ImagePath.OCR_FALLBACK, "the server's model does not say it takes pictures")


def find_mmproj(model_path: Path | str, explicit: Path | str | None = None) -> MmprojSearch:
    """The projector for a model: `explicit` if given (checked, errors raised), else a GGUF
    beside the model with "mmproj" in its name that is a vision projector of the right width."""
    model_path = Path(model_path)
    if explicit is not None:
        explicit = Path(explicit)
        problem = projector_problem(explicit, _embedding_width(model_path))
        if problem:
            raise ModelFileError(explicit, problem)
        return MmprojSearch(explicit, f"projector {explicit.name} from --mmproj")
    candidates = sorted(
        p for p in model_path.parent.glob("*.gguf") if "mmproj" in p.name.lower() and p.is_file()
    )
    if not candidates:
        return MmprojSearch(None, "no mmproj GGUF beside the model")
    # Reading the model's header parses its whole vocabulary: only when there is a candidate.
    width = _embedding_width(model_path)
    usable, rejected = [], []
    for candidate in candidates:
        problem = projector_problem(candidate, width)
        (rejected if problem else usable).append((candidate, problem))
    if not usable:
        name, problem = rejected[0]
        return MmprojSearch(None, f"{name.name} beside the model is unusable: {problem}")
    matching = [path for path, _ in usable if _names_match(path, model_path)]
    if matching:
        return MmprojSearch(matching[0], f"projector {matching[0].name} beside the model")
    if _only_model_in_folder(model_path):
        return MmprojSearch(usable[0][0], f"projector {usable[0][0].name} beside the model")
    names = ", ".join(path.name for path, _ in usable)
    return MmprojSearch(
        None, f"{names} beside the model may belong to another model; pass --mmproj to use it"
    )


def projector_problem(path: Path, model_width: int | None = None) -> str | None:
    """Why `path` cannot serve as a vision projector (for a text model of `model_width`),
    or None if it can as far as its metadata shows."""
    try:
        gguf = GGUFFile(path)
    except ModelFileError as exc:
        return exc.reason
    arch = gguf.metadata.get("general.architecture")
    if arch != PROJECTOR_ARCHITECTURE:
        return f"not a multimodal projector (general.architecture is {arch!r}, not 'clip')"
    if not gguf.metadata.get("clip.has_vision_encoder"):
        return "projector has no vision encoder (audio only?)"
    output = _projector_output_width(gguf)
    if model_width and output and output != model_width:
        return (
            f"projector outputs {output}-wide embeddings, the model takes {model_width}: "
            "it belongs to another model"
        )
    return None


def _embedding_width(model_path: Path) -> int | None:
    width = GGUFFile(model_path).arch_value("embedding_length")
    return int(width) if isinstance(width, int) else None


def _projector_output_width(gguf: GGUFFile) -> int | None:
    for name, axis in _OUTPUT_WIDTH_TENSORS:
        info = gguf.tensors.get(name)
        if info is not None and len(info.shape) == 2:
            return info.shape[axis]
    return None


def _name_core(path: Path, drop_storage: bool) -> str:
    words = re.split(r"[-_. ]+", path.stem.lower())
    if drop_storage:
        words = [w for w in words if not _STORAGE_WORDS.match(w)]
    return "".join(words)


def _names_match(projector: Path, model: Path) -> bool:
    """'mmproj-gemma-3-4b-it-f16' goes with 'gemma-3-4b-it-Q4_K_M', not with 'SmolLM2'."""
    core = _name_core(projector, drop_storage=True)
    return bool(core) and core in _name_core(model, drop_storage=False)


def _only_model_in_folder(model: Path) -> bool:
    """A folder holding one model (and its projector) needs no name matching."""
    others = [
        p
        for p in model.parent.glob("*.gguf")
        if "mmproj" not in p.name.lower() and p.resolve() != model.resolve()
    ]
    return not others

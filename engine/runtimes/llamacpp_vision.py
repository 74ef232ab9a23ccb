"""llama.cpp with a vision projector (mmproj GGUF): prompts with pictures, through llama.cpp's
multimodal path (MTMD) and llama-cpp-python's MTMDChatHandler.

The conversation (engine/chat/conversation.py) renders the chat with the model's own template,
llama.cpp's media marker where each picture goes; MTMD cuts that text at the markers into
chunks (text tokens, and one chunk per picture) and we feed them to the model in order,
encoding each picture with the projector. So `--show-prompt` shows exactly what ran.

Each prefill evaluates only what changed: the prompt's chunks are compared with what the
context already holds (text token by token, pictures by a hash of their pixels), and
evaluation starts after the common prefix. Encoding a picture is the slow part on a CPU, so a
follow-up question about a picture does not pay for the picture again. The answer is then
decoded as on the text runtime (its llama.cpp sampler, our generation loop).
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import itertools
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from llama_cpp import mtmd_cpp
from llama_cpp.llama_chat_format import MTMDChatHandler

from ..errors import MiniappError, ModelFileError
from ..images.route import projector_problem
from ..kv.cache import common_prefix
from ..llamacpp.library import Llama, OpenedModel, llama_cpp, llama_supports_gpu_offload, open_model
from ..modelfile.gguf_file import GGUFFile
from ..platform.devices import DeviceProbe
from .base import DEFAULT_CTX, Prefill, VisionRuntime
from .llamacpp_runtime import BATCH, LlamaCppRuntime

log = logging.getLogger("miniapp.llamacpp")

# Image embeddings are decoded in batches of BATCH positions: some projectors (Gemma 3) need
# all of one image's tokens in one batch, and 512 holds the largest common ones (256).

# llama.cpp rounds the context up to a multiple of this, while llama-cpp-python sizes its
# token buffer to the number asked for; the handler then overruns that buffer near the end.
# Asking for a multiple of it keeps the two equal.
CONTEXT_PAD = 256
MARKER = mtmd_cpp.mtmd_default_marker().decode("utf-8")  # "<__media__>"
_GGML_WARN, _GGML_ERROR = 3, 4  # ggml_log_level

# llama.cpp's projector loader reports why it failed only through its log; the last few
# warnings and errors are kept to name the cause in a one-line error.
_recent_problems: collections.deque[str] = collections.deque(maxlen=8)


@llama_cpp.llama_log_callback
def _route_mtmd_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    message = text.decode("utf-8", "replace").strip()
    if not message:
        return
    log.debug("mtmd: %s", message)
    if level in (_GGML_WARN, _GGML_ERROR):
        _recent_problems.append(message)


mtmd_cpp.mtmd_log_set(_route_mtmd_log, ctypes.c_void_p(0))
mtmd_cpp.mtmd_helper_log_set(_route_mtmd_log, ctypes.c_void_p(0))


@dataclass(frozen=True)
class _ImageUnit:
    """An image's place in the context: its pixels' hash and the positions it takes."""

    key: bytes
    n_pos: int


_Unit = int | _ImageUnit  # a text token, or a whole image
_UNNAMED = itertools.count()


def _positions(units: Sequence[_Unit]) -> int:
    return sum(u.n_pos if isinstance(u, _ImageUnit) else 1 for u in units)


class _Chunks:
    """The conversation cut into MTMD chunks (tokenized text, preprocessed images), and the
    units they make; freed on exit."""

    def __init__(self, handler: MTMDChatHandler, text: str, pictures: Sequence[bytes]):
        self.handler, self.text, self.pictures = handler, text, pictures
        self.units: list[_Unit] = []
        self.image_chunks: dict[int, object] = {}  # unit index -> its image chunk

    def __enter__(self) -> _Chunks:
        self._bitmaps = []
        self._chunks = mtmd_cpp.mtmd_input_chunks_init()
        try:
            self._tokenize()
        except (ValueError, MiniappError) as exc:
            self.__exit__()
            raise MiniappError(f"llama.cpp could not read the images ({exc})") from exc
        return self

    def _tokenize(self) -> None:
        for png in self.pictures:
            bitmap = self.handler._create_bitmap_from_bytes(png)
            self._bitmaps.append(bitmap)
            mtmd_cpp.mtmd_bitmap_set_id(bitmap, hashlib.sha256(png).hexdigest()[:32].encode())
        text = mtmd_cpp.mtmd_input_text()
        encoded = self.text.encode("utf-8")
        text.text, text.text_len = encoded, len(encoded)
        text.add_special = text.parse_special = True
        bitmaps = (mtmd_cpp.mtmd_bitmap_p_ctypes * len(self._bitmaps))(*self._bitmaps)
        status = mtmd_cpp.mtmd_tokenize(
            self.handler.mtmd_ctx, self._chunks, ctypes.byref(text), bitmaps, len(self._bitmaps)
        )
        if status != 0:
            raise MiniappError(f"tokenize error {status}")
        for i in range(mtmd_cpp.mtmd_input_chunks_size(self._chunks)):
            self._add(mtmd_cpp.mtmd_input_chunks_get(self._chunks, i))

    def _add(self, chunk) -> None:
        if mtmd_cpp.mtmd_input_chunk_get_type(chunk) == mtmd_cpp.MTMD_INPUT_CHUNK_TYPE_TEXT:
            count = ctypes.c_size_t()
            tokens = mtmd_cpp.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
            self.units.extend(tokens[i] for i in range(count.value))
            return
        # An image without an id matches nothing, so it is never taken for another.
        key = mtmd_cpp.mtmd_input_chunk_get_id(chunk) or f"unnamed-{next(_UNNAMED)}".encode()
        self.image_chunks[len(self.units)] = chunk
        self.units.append(_ImageUnit(key, mtmd_cpp.mtmd_input_chunk_get_n_pos(chunk)))

    def __exit__(self, *_exc) -> None:
        mtmd_cpp.mtmd_input_chunks_free(self._chunks)
        for bitmap in self._bitmaps:
            mtmd_cpp.mtmd_bitmap_free(bitmap)


class _ProjectorHandler(MTMDChatHandler):
    """llama-cpp-python's MTMD handler, used for what it owns: the projector's context
    (freed with the model) and turning PNG bytes into bitmaps. We evaluate the chunks
    ourselves (`LlamaCppVisionRuntime.prefill`), keeping what the context already holds."""

    def __init__(self, mmproj_path: Path, use_gpu: bool):
        super().__init__(clip_model_path=str(mmproj_path), verbose=False, use_gpu=use_gpu)

    def open(self, llama: Llama) -> None:
        """Load the projector now (the handler would wait for the first message)."""
        self._init_mtmd_context(llama)


class LlamaCppVisionRuntime(LlamaCppRuntime, VisionRuntime):
    """A vision model (text GGUF + mmproj GGUF) on llama.cpp."""

    media_marker = MARKER
    marker_stand_in = "<_media_>"

    def __init__(
        self,
        model_path: Path | str,
        mmproj_path: Path | str,
        n_ctx: int = DEFAULT_CTX,
        threads: int | None = None,
        probe: DeviceProbe | None = None,
    ):
        self.mmproj_path = Path(mmproj_path)
        width = GGUFFile(model_path).arch_value("embedding_length")
        problem = projector_problem(self.mmproj_path, width if isinstance(width, int) else None)
        if problem:
            raise ModelFileError(self.mmproj_path, problem)
        self._handler = _ProjectorHandler(self.mmproj_path, llama_supports_gpu_offload())
        super().__init__(
            model_path, n_ctx=-(-n_ctx // CONTEXT_PAD) * CONTEXT_PAD, threads=threads, probe=probe
        )
        self._open_projector()
        # What the context holds, as evaluated by the last prefill (answers come after it).
        self._in_context: list[_Unit] = []

    def _open(self, gguf: GGUFFile, n_ctx: int, probe: DeviceProbe | None, **params) -> OpenedModel:
        params.update(n_ubatch=min(n_ctx, BATCH), chat_handler=self._handler)
        return open_model(gguf, n_ctx, probe, **params)

    def _open_projector(self) -> None:
        _recent_problems.clear()
        try:
            self._handler.open(self._llm)
        except ValueError as exc:
            self._llm.close()
            cause = _native_cause(list(_recent_problems)) or str(exc)
            raise ModelFileError(
                self.mmproj_path, f"llama.cpp could not load this projector ({cause})"
            ) from exc

    def prefill(self, text: str, pictures: Sequence[bytes]) -> Prefill | None:
        start = time.perf_counter()
        with _Chunks(self._handler, self._evaluated_text(text), pictures) as chunks:
            wanted = chunks.units
            # At least the last unit is evaluated again: the answer needs fresh logits.
            keep = min(common_prefix(self._held_units(), wanted), len(wanted) - 1)
            reused = _positions(wanted[:keep])
            if reused + _positions(wanted[keep:]) > self.n_ctx:
                return None
            self._llm._ctx.kv_cache_seq_rm(-1, reused, -1)
            self._llm.n_tokens = reused
            self._in_context = wanted[:keep]  # what stays valid if evaluation fails
            self._eval_units(wanted, keep, chunks.image_chunks)
        self._in_context = wanted
        prompt = self._llm.input_ids[: self._llm.n_tokens].tolist()
        self.last_prefill = Prefill(prompt, text, reused, time.perf_counter() - start)
        return self.last_prefill

    def prefill_logits(self) -> np.ndarray:
        """The logits after the latest prefill's last position, fp32 [vocab]: what the
        answer's first token is drawn from (shows whether the pictures reach the model)."""
        row = llama_cpp.llama_get_logits_ith(self._llm.ctx, -1)
        return np.ctypeslib.as_array(row, shape=(self.tokenizer.n_vocab,)).copy()

    def reusable_prefix(self, prompt: Sequence[int]) -> int:
        return len(prompt)  # all of it: a prefill evaluated it just before

    def _evaluated_text(self, rendered: str) -> str:
        # MTMD adds the BOS token itself; a template that writes it too would give two.
        bos = self.tokenizer.bos_text
        if self.tokenizer.add_bos and bos and rendered.startswith(bos):
            return rendered[len(bos) :]
        return rendered

    def _held_units(self) -> list[_Unit]:
        """What the context holds now: the last prefill, then the tokens decoded after it."""
        prefilled = _positions(self._in_context)
        if self._llm.n_tokens < prefilled:  # reset, or cut short
            return []
        decoded = self._llm.input_ids[prefilled : self._llm.n_tokens].tolist()
        return [*self._in_context, *decoded]

    def _eval_units(self, units: list[_Unit], start: int, image_chunks: dict) -> None:
        """Evaluate units[start:], text tokens in runs and each picture through MTMD."""
        llm = self._llm
        run: list[int] = []
        for index in range(start, len(units)):
            unit = units[index]
            if not isinstance(unit, _ImageUnit):
                run.append(unit)
                continue
            if run:
                llm.eval(run)
                run = []
            n_past = llama_cpp.llama_pos(0)
            status = mtmd_cpp.mtmd_helper_eval_chunk_single(
                self._handler.mtmd_ctx,
                llm._ctx.ctx,
                image_chunks[index],
                llama_cpp.llama_pos(llm.n_tokens),
                llama_cpp.llama_seq_id(0),
                llm.n_batch,
                False,
                ctypes.byref(n_past),
            )
            if status != 0:
                raise MiniappError(f"llama.cpp could not run an image (error {status})")
            llm.n_tokens = n_past.value
        if run:
            llm.eval(run)

    def reset(self) -> None:
        self._in_context = []
        self._llm.reset()

    def close(self) -> None:
        self._llm.close()  # frees the projector too (the handler registered it there)


def _native_cause(lines: list[str]) -> str:
    """The specific reason among llama.cpp's log lines, without its function-name prefixes:
    "clip_init: failed to load model 'x': operator(): unable to find tensor v.blk.0..."
    becomes "unable to find tensor v.blk.0...". The first line is the specific one; the
    ones after it only say that loading failed."""
    if not lines:
        return ""
    text = re.sub(r"^\w+: (error: )?", "", lines[0])
    text = re.sub(r"^failed to load model '[^']*': ", "", text)
    text = text.replace("operator(): ", "")
    return " ".join(text.split())[:200]

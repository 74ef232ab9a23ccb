"""A chat that shows images to a vision model: llama.cpp's multimodal path (MTMD) through
llama-cpp-python's MTMDChatHandler.

We render the conversation with the model's own chat template ourselves (the same renderer
as text chats, fallbacks included), with llama.cpp's media marker where each image goes;
MTMD then cuts the text at the markers into chunks (text tokens, and one chunk per image) and
we feed them to the model in order, encoding each image with the projector. So
`--show-prompt` shows exactly what ran.

Each turn evaluates only what changed: the conversation's chunks are compared with what the
context already holds (text token by token, images by a hash of their pixels), and
evaluation starts after the common prefix. Encoding an image is the slow part on a CPU, so a
follow-up question about a picture does not pay for the picture again.
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import itertools
import logging
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from llama_cpp import mtmd_cpp
from llama_cpp.llama_chat_format import MTMDChatHandler

from ..chat_template import ChatTemplate, Message
from ..errors import ContextFullError, MiniappError, ModelFileError
from ..events import Finished, GenerationEvent, GenerationStats, TextDelta
from ..generation import GenerationRequest, generate
from ..gguf_file import GGUFFile
from ..llamacpp_lib import Llama, llama_cpp, llama_supports_gpu_offload, open_model
from ..runtimes.base import (
    DEFAULT_CTX,
    LOGIT_BLOCK,
    Runtime,
    RuntimeInfo,
    common_prefix,
    default_threads,
)
from ..runtimes.llamacpp_runtime import sample_with_llamacpp
from ..sampling import SamplingParams
from ..tokenizer import Tokenizer
from .loading import LoadedImage
from .route import projector_problem

log = logging.getLogger("miniapp.llamacpp")

# Image embeddings are decoded in batches of this many positions. Some projectors (Gemma 3)
# need all of one image's tokens in one batch; 512 holds the largest common ones (256).
VISION_BATCH = 512
# llama.cpp rounds the context up to a multiple of this, while llama-cpp-python sizes its
# token buffer to the number asked for; the handler then overruns that buffer near the end.
# Asking for a multiple of it keeps the two equal.
CONTEXT_PAD = 256
MARKER = mtmd_cpp.mtmd_default_marker().decode("utf-8")  # "<__media__>"
MARKER_STAND_IN = "<_media_>"  # typed text must never be mistaken for an image position
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
        status = mtmd_cpp.mtmd_tokenize(self.handler.mtmd_ctx, self._chunks, ctypes.byref(text),
                                        bitmaps, len(self._bitmaps))  # fmt: skip
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


@dataclass(frozen=True)
class VisionMessage:
    role: str  # "user" | "assistant"
    text: str
    images: tuple[bytes, ...] = ()  # PNG files, shown before the text in this order


class _ProjectorHandler(MTMDChatHandler):
    """llama-cpp-python's MTMD handler, used for what it owns: the projector's context
    (freed with the model) and turning PNG bytes into bitmaps. We evaluate the chunks
    ourselves (`LlamaCppVisionChat._evaluate`), keeping what the context already holds."""

    def __init__(self, mmproj_path: Path, use_gpu: bool):
        super().__init__(clip_model_path=str(mmproj_path), verbose=False, use_gpu=use_gpu)

    def open(self, llama: Llama) -> None:
        """Load the projector now (the handler would wait for the first message)."""
        self._init_mtmd_context(llama)


class _PrefilledRuntime(Runtime):
    """The text-generation side of a vision chat, for engine.generation's loop: the prompt
    (images included) is already in the context, so llama.cpp samples straight away."""

    backend = "llamacpp"

    def __init__(self, chat: LlamaCppVisionChat):
        self._llama = chat.llama
        self.model_path = chat.model_path
        self.tokenizer = chat.tokenizer
        self.n_ctx = chat.n_ctx
        self.chat_template = chat.template.source
        self.architecture = chat.architecture

    def reusable_prefix(self, prompt: Sequence[int]) -> int:
        return len(prompt)  # all of it: _prefill evaluated it just before

    def generate_tokens(self, prompt: Sequence[int], params: SamplingParams) -> Iterator[int]:
        return sample_with_llamacpp(self._llama, prompt, params)

    def reset(self) -> None:
        self._llama.reset()

    def logit_blocks(self, tokens, first=0, block=LOGIT_BLOCK):
        raise MiniappError("a vision chat does not score text; use the llamacpp runtime")


class LlamaCppVisionChat:
    """A conversation with a vision model (text GGUF + mmproj GGUF) on llama.cpp."""

    backend = "llamacpp"

    def __init__(
        self,
        model_path: Path | str,
        mmproj_path: Path | str,
        n_ctx: int = DEFAULT_CTX,
        threads: int | None = None,
        system_prompt: str | None = None,
        request: GenerationRequest | None = None,
        history: Sequence[Message] = (),
    ):
        self.model_path, self.mmproj_path = Path(model_path), Path(mmproj_path)
        gguf = GGUFFile(self.model_path)
        width = gguf.arch_value("embedding_length")
        problem = projector_problem(self.mmproj_path, width if isinstance(width, int) else None)
        if problem:
            raise ModelFileError(self.mmproj_path, problem)
        self.n_ctx = -(-n_ctx // CONTEXT_PAD) * CONTEXT_PAD
        self.system_prompt = system_prompt
        self.request = request or GenerationRequest()
        self._handler = _ProjectorHandler(self.mmproj_path, llama_supports_gpu_offload())
        self.llama = self._load_model(gguf, threads or default_threads())
        self._open_projector()
        self.tokenizer = Tokenizer(self.model_path, llama=self.llama)
        source = gguf.metadata.get("tokenizer.chat_template")
        self.architecture = gguf.architecture
        self.template = ChatTemplate.for_model(source, self.tokenizer, self.architecture)
        self._runtime = _PrefilledRuntime(self)
        self.messages: list[VisionMessage] = [
            VisionMessage(m.role, m.content) for m in history if m.role != "system"
        ]
        self.last_prompt = ""  # the rendered prompt of the latest turn, markers included
        self.last_stats: GenerationStats | None = None
        self.dropped_turns = 0
        # What the context holds, as evaluated by the last prefill (answers come after it).
        self._in_context: list[_Unit] = []
        self.last_reused = 0  # positions of the latest prompt found already in the context

    def _load_model(self, gguf: GGUFFile, threads: int) -> Llama:
        return open_model(
            gguf, self.n_ctx, n_batch=min(self.n_ctx, VISION_BATCH),
            n_ubatch=min(self.n_ctx, VISION_BATCH), n_threads=threads, n_threads_batch=threads,
            chat_handler=self._handler,
        ).llama  # fmt: skip

    def _open_projector(self) -> None:
        _recent_problems.clear()
        try:
            self._handler.open(self.llama)
        except ValueError as exc:
            self.llama.close()
            cause = _native_cause(list(_recent_problems)) or str(exc)
            raise ModelFileError(
                self.mmproj_path, f"llama.cpp could not load this projector ({cause})"
            ) from exc

    # -- prompt -----------------------------------------------------------------------------

    def render_prompt(self, text: str | None = None, images: int = 0) -> str:
        """The conversation as the model reads it, each image shown as the media marker;
        with `text`, as it would be after sending that message with `images` pictures."""
        messages = list(self.messages)
        if text is not None:
            messages.append(_user_message(text, (b"",) * images))
        chat = [Message(m.role, _content(m)) for m in messages]
        if self.system_prompt:
            chat.insert(0, Message("system", self.system_prompt))
        return self.template.render(chat)

    def _evaluated_text(self, rendered: str) -> str:
        # MTMD adds the BOS token itself; a template that writes it too would give two.
        bos = self.tokenizer.bos_text
        if self.tokenizer.add_bos and bos and rendered.startswith(bos):
            return rendered[len(bos) :]
        return rendered

    # -- chat -------------------------------------------------------------------------------

    def send(
        self,
        text: str,
        images: Sequence[LoadedImage] = (),
        request: GenerationRequest | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> Iterator[GenerationEvent]:
        """Add a user message with its images and stream the answer (kept, even partial)."""
        request = request or self.request
        self._add_user_message(text, images)
        try:
            prompt, prefill_s = self._prefill(min(request.max_tokens, self.n_ctx // 4))
        except Exception:
            self.messages.pop()
            raise
        answer: list[str] = []
        try:
            for event in generate(self._runtime, prompt, request, should_stop):
                if isinstance(event, TextDelta):
                    answer.append(event.text)
                elif isinstance(event, Finished):
                    stats = _with_prefill(event.stats, prefill_s, self.last_reused)
                    event = Finished(event.reason, stats)
                    self.last_stats = event.stats
                yield event
        finally:
            self.messages.append(VisionMessage("assistant", "".join(answer)))

    def next_token_logits(self, text: str, images: Sequence[LoadedImage] = ()) -> np.ndarray:
        """Evaluate the conversation plus this message (not kept) and return the logits of
        the answer's first token, fp32 [vocab]: shows whether the pictures reach the model."""
        self._add_user_message(text, images)
        try:
            self._prefill()
            row = llama_cpp.llama_get_logits_ith(self.llama.ctx, -1)
            return np.ctypeslib.as_array(row, shape=(self.tokenizer.n_vocab,)).copy()
        finally:
            self.messages.pop()

    def _add_user_message(self, text: str, images: Sequence[LoadedImage]) -> None:
        # PNG: llama.cpp decodes images with stb_image, which reads it.
        pictures = tuple(image.png_bytes() for image in images)
        self.messages.append(_user_message(text, pictures))

    def _prefill(self, reserve: int = 0) -> tuple[list[int], float]:
        """Evaluate the conversation, text and images, after what the context already
        holds of it; returns the prompt as the context now holds it and the seconds it took.
        Drops the oldest turns while the conversation leaves fewer than `reserve` tokens to
        answer in (as ChatSession does). The answer is decoded by our own loop
        (engine.generation), as on the text path."""
        while True:
            start = time.perf_counter()
            fits = self._evaluate()
            alone = len(self.messages) <= 1
            if fits and (self.llama.n_tokens + reserve <= self.n_ctx or alone):
                if self.llama.n_tokens < self.n_ctx:  # at least one token of answer
                    prompt = self.llama.input_ids[: self.llama.n_tokens].tolist()
                    return prompt, time.perf_counter() - start
            if not self._drop_oldest_turn():
                raise ContextFullError(
                    f"this message and its images do not fit the context of {self.n_ctx} "
                    "tokens; raise --ctx"
                )

    def _evaluate(self) -> bool:
        """Bring the context up to the current conversation; False if it would overflow
        (the context is then left as it was)."""
        self.last_prompt = self.render_prompt()
        text = self._evaluated_text(self.last_prompt)
        pictures = [png for message in self.messages for png in message.images]
        with _Chunks(self._handler, text, pictures) as chunks:
            wanted = chunks.units
            # At least the last unit is evaluated again: the answer needs fresh logits.
            keep = min(common_prefix(self._held_units(), wanted), len(wanted) - 1)
            start = _positions(wanted[:keep])
            if start + _positions(wanted[keep:]) > self.n_ctx:
                return False
            self.llama._ctx.kv_cache_seq_rm(-1, start, -1)
            self.llama.n_tokens = start
            self._in_context = wanted[:keep]  # what stays valid if evaluation fails
            self._eval_units(wanted, keep, chunks.image_chunks)
        self._in_context = wanted
        self.last_reused = start
        return True

    def _held_units(self) -> list[_Unit]:
        """What the context holds now: the last prefill, then the tokens decoded after it."""
        prefilled = _positions(self._in_context)
        if self.llama.n_tokens < prefilled:  # reset, or cut short
            return []
        decoded = self.llama.input_ids[prefilled : self.llama.n_tokens].tolist()
        return [*self._in_context, *decoded]

    def _eval_units(self, units: list[_Unit], start: int, image_chunks: dict) -> None:
        """Evaluate units[start:], text tokens in runs and each image through MTMD."""
        run: list[int] = []
        for index in range(start, len(units)):
            unit = units[index]
            if not isinstance(unit, _ImageUnit):
                run.append(unit)
                continue
            if run:
                self.llama.eval(run)
                run = []
            n_past = llama_cpp.llama_pos(0)
            status = mtmd_cpp.mtmd_helper_eval_chunk_single(
                self._handler.mtmd_ctx, self.llama._ctx.ctx, image_chunks[index],
                llama_cpp.llama_pos(self.llama.n_tokens), llama_cpp.llama_seq_id(0),
                self.llama.n_batch, False, ctypes.byref(n_past),
            )  # fmt: skip
            if status != 0:
                raise MiniappError(f"llama.cpp could not run an image (error {status})")
            self.llama.n_tokens = n_past.value
        if run:
            self.llama.eval(run)

    def _drop_oldest_turn(self) -> bool:
        """Remove the first exchange (user message and its answer); False if only the new
        message is left."""
        if len(self.messages) <= 1:
            return False
        del self.messages[0]
        while len(self.messages) > 1 and self.messages[0].role != "user":
            del self.messages[0]
        self.dropped_turns += 1
        return True

    def reset(self) -> None:
        self.messages.clear()
        self.last_stats = None
        self.dropped_turns = 0
        self._in_context = []
        self.llama.reset()

    def info(self) -> RuntimeInfo:
        return RuntimeInfo(self.backend, self.model_path)

    def close(self) -> None:
        self.llama.close()  # frees the projector too (the handler registered it there)


def _user_message(text: str, pictures: tuple[bytes, ...]) -> VisionMessage:
    return VisionMessage("user", text.replace(MARKER, MARKER_STAND_IN), pictures)


def _content(message: VisionMessage) -> str:
    markers = "".join(f"{MARKER}\n" for _ in message.images)
    return markers + message.text


def _with_prefill(stats: GenerationStats, prefill_s: float, reused: int) -> GenerationStats:
    """The loop saw the prompt as cached; all but `reused` positions of it were evaluated
    (with the images) just before."""
    evaluated = stats.prompt_tokens - reused
    return replace(
        stats,
        cached_prompt_tokens=reused,
        ttft_s=prefill_s + stats.ttft_s,
        prefill_tok_s=evaluated / prefill_s if prefill_s > 0 else 0.0,
    )


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

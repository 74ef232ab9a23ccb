"""llama.cpp through llama-cpp-python: our correctness oracle and speed yardstick."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from ..errors import MiniappError
from ..kv.cache import common_prefix
from ..kv.types import KVSetting
from ..llamacpp.library import Llama, OpenedModel, open_model
from ..lora.adapter import AdapterError, read_adapter
from ..lora.registry import LoraSpec
from ..modelfile.checks import check_model_file
from ..modelfile.gguf_file import GGUFFile
from ..platform.devices import DeviceProbe
from ..tokens.constraints import TokenGuide, token_guide
from ..tokens.sampling import SamplingParams, TokenLogprob
from ..tokens.stream import GeneratedTokens, TokenStream
from ..tokens.tokenizer import Tokenizer
from .base import (
    DEFAULT_CTX,
    LOGIT_BLOCK,
    Runtime,
    RuntimeInfo,
    default_threads,
)

BATCH = 512  # prompt positions per llama.cpp batch
# ggml's type numbers for our KV types (llama.cpp's q8_0 and q4_1 are the same maths).
GGML_KV_TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8": 8, "q4": 3}


def _lora_params(gguf: GGUFFile, lora: Sequence[LoraSpec]) -> dict:
    """llama-cpp-python's adapter arguments, after our own checks of the file: one line for
    an adapter that is not one for this model, or that llama.cpp would crash on."""
    if not lora:
        return {}
    if len(lora) > 1:
        raise MiniappError(
            "the llamacpp backend takes one LoRA adapter (llama-cpp-python loads one); "
            "the torch backend takes several"
        )
    spec = lora[0]
    adapter = read_adapter(spec.path, gguf)
    if adapter.from_f64:
        raise AdapterError(
            spec.path,
            "it holds F64 tensors, which crash llama.cpp; the torch backend reads it "
            "(or convert it to F32/F16)",
        )
    return {"lora_path": str(spec.path), "lora_scale": spec.scale}


class LlamaCppRuntime(Runtime):
    backend = "llamacpp"

    def __init__(
        self,
        model_path: Path | str,
        n_ctx: int = DEFAULT_CTX,
        threads: int | None = None,
        logits_all: bool = False,
        probe: DeviceProbe | None = None,
        kv: KVSetting | None = None,
        lora: Sequence[LoraSpec] = (),
    ):
        """`kv`: llama.cpp's KV cache type (None: its default, f16); a quantized V cache
        needs llama.cpp's flash attention, which is switched on for it. `lora`: at most one
        adapter (llama-cpp-python takes one, at load), applied to every answer."""
        self.model_path = Path(model_path)
        # Our own reader first: it names the problem in a bad file more clearly than llama.cpp.
        gguf = GGUFFile(self.model_path)
        check_model_file(gguf)  # before llama.cpp reads it: a bad file stops here, in Python
        self.chat_template = gguf.metadata.get("tokenizer.chat_template")
        self.architecture = gguf.architecture
        threads = threads or default_threads()
        cache_params = {}
        if kv is not None:
            cache_params = {
                "type_k": GGML_KV_TYPES[kv.key.name],
                "type_v": GGML_KV_TYPES[kv.value.name],
                "flash_attn": kv.blocked,  # llama.cpp needs it for a quantized V cache
            }
        self.kv_type = kv.name if kv is not None else "f16"
        lora_params = _lora_params(gguf, lora)
        self.adapters = tuple(spec.name for spec in lora)
        opened = self._open(
            gguf,
            n_ctx,
            probe,
            n_batch=min(n_ctx, BATCH),
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=logits_all,
            **cache_params,
            **lora_params,
        )
        self._llm, self.offload = opened.llama, opened.offload
        self.gpu_layers, self.fallbacks = opened.gpu_layers, opened.fallbacks
        self.tokenizer = Tokenizer(self.model_path, llama=self._llm)
        self.n_ctx = n_ctx
        self._logits_all = logits_all

    def _open(self, gguf: GGUFFile, n_ctx: int, probe: DeviceProbe | None, **params) -> OpenedModel:
        """Open llama.cpp on this file (a subclass adds its own parameters)."""
        return open_model(gguf, n_ctx, probe, **params)

    @property
    def held_positions(self) -> int:
        """Positions the context holds now: the prompt and the answer so far."""
        return self._llm.n_tokens

    def reusable_prefix(self, prompt: Sequence[int]) -> int:
        cached = self._llm.input_ids[: self._llm.n_tokens].tolist()
        return min(common_prefix(cached, prompt), len(prompt) - 1)

    def generate_tokens(self, prompt: Sequence[int], params: SamplingParams) -> TokenStream:
        cached = self.reusable_prefix(prompt)
        stream = GeneratedTokens(cached_prompt_tokens=cached)
        if params.logprobs is not None:
            stream.logprobs = []
        guide = None
        if params.constraint is not None:  # compiled here: a bad schema fails the call
            guide = token_guide(params.constraint, self.tokenizer, len(prompt))
        tokens = sample_with_llamacpp(self._llm, prompt, params, stream.logprobs, guide)
        return stream.feeding(tokens)

    def reset(self) -> None:
        self._llm.reset()

    def info(self) -> RuntimeInfo:
        return RuntimeInfo(
            self.backend, self.model_path, kv_type=self.kv_type, adapters=self.adapters
        )

    def logit_blocks(
        self, tokens: Sequence[int], first: int = 0, block: int = LOGIT_BLOCK
    ) -> Iterator[tuple[int, np.ndarray]]:
        if not self._logits_all:
            raise RuntimeError("open the llamacpp runtime with logits_all=True to read logits")
        self._llm.reset()
        self._llm.eval(list(tokens))
        scores = self._llm.scores  # llama-cpp-python's own [n_ctx, vocab] buffer: no copy
        for start in range(first, len(tokens), block):
            yield start, scores[start : min(start + block, len(tokens))]

    def close(self) -> None:
        self._llm.close()


def sample_with_llamacpp(
    llm: Llama,
    prompt: Sequence[int],
    params: SamplingParams,
    logprobs: list[TokenLogprob] | None = None,
    guide: TokenGuide | None = None,
) -> Iterator[int]:
    """Tokens after `prompt` from llama.cpp's own sampler, with our sampling parameters;
    each one's log-probability goes into `logprobs` first, when given. `guide` masks the
    tokens the answer's constraint forbids, before llama.cpp's sampler sees the logits."""
    seed = params.seed if params.seed is not None else random.randrange(2**31)
    llm.set_seed(seed)
    tokens = llm.generate(
        list(prompt),
        temp=max(params.temperature, 0.0),
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        repeat_penalty=params.repeat_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logits_processor=None if guide is None else [guide.mask_scores],
    )
    try:
        for token in tokens:
            if logprobs is not None:
                logprobs.append(_last_logprob(llm, token, params.logprobs or 0))
            yield token
    finally:
        tokens.close()


def _last_logprob(llm: Llama, token: int, top: int) -> TokenLogprob:
    """From the logits llama.cpp just sampled `token` from (its last output row)."""
    row = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))
    shifted = row.astype(np.float64) - row.max()
    logprobs = shifted - np.log(np.exp(shifted).sum())
    best = np.argsort(-logprobs)[:top] if top > 0 else []
    return TokenLogprob(
        token, float(logprobs[token]), tuple((int(t), float(logprobs[t])) for t in best)
    )

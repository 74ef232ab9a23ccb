"""The engine's public API: what an interface (app/) needs to open a model, hold a
conversation and read what comes back. The interfaces import the engine from here (and from
the rooms README's layout table names for them: voice, images, and the measurement tools);
the rest of the engine may change its insides without touching them.

- `RuntimeConfig`: every option an interface passes when it opens a model, in one place,
  with its checks (`check`); `open_runtime(config)` opens it on its backend.
- `Conversation` (turns, the context they fill) and `generate` (one answer from a prompt).
- The events a generation yields (`TextDelta`, `ReasoningDelta`, `Finished`), the settings
  it takes (`GenerationRequest`, `SamplingParams`, `OutputConstraint`), and the errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .batching import QueueFullError
from .chat.conversation import Conversation
from .chat.generation import generate
from .chat.relevance import judgement_prompt, relevance
from .errors import (
    ContextFullError,
    DeviceUnavailableError,
    InputFileError,
    MiniappError,
    ModelFileError,
    UnsupportedModelError,
)
from .kv.policies import KV_POLICIES, WINDOW_POLICY, check_kv_policy
from .kv.types import DEFAULT_KV_TYPE, KV_TYPE_NAMES, kv_type
from .lora.adapter import AdapterError, read_adapter
from .lora.registry import (
    MAX_SCALE as MAX_LORA_SCALE,
)
from .lora.registry import (
    AdapterInfo,
    AdapterNameError,
    AdapterSet,
    LoraRegistry,
    LoraSpec,
    UnknownAdapterError,
    check_scale,
    parse_lora_flag,
)
from .modelfile.checks import check_model_file
from .modelfile.gguf_file import GGUFFile, read_scalar
from .modelfile.hub import pull
from .modelfile.store import (
    ASR_REQUIRED_FILES,
    BUNDLED,
    BUNDLED_FOLDERS,
    DEFAULT_ASR_MODEL,
    DEFAULT_MODEL,
    installed_models,
    models_dir,
    resolve_model,
)
from .modelfile.template import ChatTemplate, Message, fallback_template
from .models import check_supported
from .platform.compute_thread import ComputeThread
from .platform.devices import DEVICE_CHOICES
from .runtimes import (
    BACKENDS,
    LOCAL_BACKENDS,
    REMOTE_BACKEND,
    open_local_runtime,
    open_vision_runtime,
    plan_torch_cache_and_device,
)
from .runtimes.base import (
    DEFAULT_CTX,
    DEFAULT_PARALLEL,
    DEFAULT_SINKS,
    SAMPLING_FIELDS,
    MessageRuntime,
    Runtime,
    RuntimeInfo,
    VisionRuntime,
    default_threads,
)
from .runtimes.embedding import POOLING_CHOICES, Pooling
from .tokens.constraints import ConstraintError, ConstraintKind, OutputConstraint, closing_reserve
from .tokens.events import (
    Finished,
    FinishReason,
    GenerationEvent,
    GenerationStats,
    ReasoningDelta,
    SpeculationStats,
    TextDelta,
)
from .tokens.sampling import GREEDY, GenerationRequest, LoraChoice, SamplingParams, TokenLogprob
from .tokens.spec_modes import SPEC_MODES, SpecMode
from .tokens.stream import TokenStream
from .tokens.tokenizer import Tokenizer


@dataclass(frozen=True)
class RuntimeConfig:
    """What opening a model takes, for every interface: a change to any of these opens it
    again. `model` is a GGUF path or a bundled model's name, or with the openai backend the
    server's name for its model (empty: its first)."""

    model: str
    backend: str = BACKENDS[0]
    device: str = "auto"
    spec: str = SpecMode.AUTO
    ctx: int = DEFAULT_CTX
    window: int | None = None  # torch engine: recent tokens kept once the context is full
    sinks: int | None = None  # torch engine: first tokens kept (None: DEFAULT_SINKS)
    kv_policy: str = WINDOW_POLICY  # torch engine: which tokens a full cache keeps
    threads: int | None = None
    parallel: int = 1  # generations at once (the torch engine batches them)
    kv_type: str | None = None  # the KV cache's storage (None: the backend's own default)
    max_queue: int | None = None  # batching: requests that may wait (None: the engine's)
    logits_all: bool = False  # llama.cpp: keep every row's logits (perplexity, the oracle)
    # --backend openai: the server, its key, and the sampling settings it is sent (None:
    # all of them; the others are left to the server's defaults).
    base_url: str | None = None
    api_key: str | None = field(default=None, repr=False)
    send_sampling: tuple[str, ...] | None = None
    # LoRA adapters loaded with the model (--lora): the torch engine keeps them by name for
    # requests to pick and may load more while it runs; llama.cpp applies them to every
    # answer. `lora_budget_mb`: memory the torch engine's resident adapters may hold.
    lora: tuple[LoraSpec, ...] = ()
    lora_budget_mb: int | None = None
    # A mixture of experts on a GPU keeps its experts on the CPU (llama.cpp's --cpu-moe).
    cpu_moe: bool = False

    @property
    def remote(self) -> bool:
        return self.backend == REMOTE_BACKEND

    @property
    def label(self) -> str:
        """How the interfaces name the model."""
        if self.remote:
            return f"{self.model or 'the model'} at {self.base_url}"
        return Path(self.model).name

    def check(self) -> None:
        """One line (MiniappError) for an option the chosen backend does not take, before
        anything loads."""
        if self.backend not in BACKENDS:
            choices = ", ".join(BACKENDS)
            raise MiniappError(f"unknown backend '{self.backend}' (choose from {choices})")
        if self.kv_type is not None:
            kv_type(self.kv_type)  # a bad name is one line
        check_kv_policy(self.kv_policy)
        if self.remote:
            self._check_remote()

    def _check_remote(self) -> None:
        asked = [
            flag
            for flag, given in (
                ("--window", self.window is not None),
                ("--sinks", self.sinks is not None),
                ("--kv-policy", self.kv_policy != WINDOW_POLICY),
                ("--spec " + str(self.spec), self.spec not in (SpecMode.AUTO, SpecMode.OFF)),
                ("--device " + self.device, self.device != "auto"),
                ("--kv-type", self.kv_type is not None),
                ("--lora", bool(self.lora)),
                ("--cpu-moe", self.cpu_moe),
            )
            if given
        ]
        if asked:
            raise MiniappError(
                f"{', '.join(asked)}: local backends only; with --backend openai the "
                "server keeps its own cache, drafting and devices"
            )
        if not self.base_url:
            raise MiniappError(
                "--backend openai needs --base-url URL, the server's address "
                "(e.g. http://host:8000/v1)"
            )


def open_runtime(config: RuntimeConfig) -> Runtime | MessageRuntime:
    """The model the config names, opened on its backend: a Runtime for a local GGUF, a
    MessageRuntime for a server's model. Errors are one line (MiniappError and its kinds)."""
    config.check()
    if config.remote:
        from .runtimes.remote import RemoteEndpoint, RemoteRuntime

        endpoint = RemoteEndpoint(config.base_url, config.api_key)
        sampling = SAMPLING_FIELDS if config.send_sampling is None else config.send_sampling
        return RemoteRuntime(endpoint, config.model or None, sampling)
    return open_local_runtime(
        config.backend,
        resolve_model(config.model),
        n_ctx=config.ctx,
        threads=config.threads,
        logits_all=config.logits_all,
        sinks=config.sinks,
        window=config.window,
        kv_policy=config.kv_policy,
        spec=config.spec,
        device=config.device,
        parallel=config.parallel,
        kv=config.kv_type,
        max_queue=config.max_queue,
        lora=config.lora,
        lora_budget_mb=config.lora_budget_mb,
        cpu_moe=config.cpu_moe,
    )


def estimate_memory(config: RuntimeConfig) -> int | None:
    """Bytes of memory opening this model would take, from its file alone (its weights as
    stored and a full context's KV cache); None for a server's model, or an unreadable
    file (opening it then says why)."""
    if config.remote:
        return None
    from .kv.footprint import estimate_footprint

    try:
        gguf = GGUFFile(resolve_model(config.model))
        footprint = estimate_footprint(gguf, config.ctx, kv_type(config.kv_type or "f16"))
    except (MiniappError, OSError, ValueError):
        return None
    return footprint.int4_bytes + footprint.kv_bytes


def free_memory() -> int | None:
    """Memory the OS could give this process now, or None where unknown."""
    from .platform.memory import available_memory_bytes

    return available_memory_bytes()


def release_memory() -> None:
    """After a model is let go: collect its objects (its parts refer to each other, so only
    the cycle collector frees them) and give the freed pages back to the OS."""
    import gc

    from .platform.memory import return_free_memory

    gc.collect()
    return_free_memory()


def list_server_models(base_url: str, api_key: str | None = None) -> list:
    """The models an OpenAI-compatible server lists (RemoteModel: id, context length where
    the server says it). An unreachable server or a refused key is one line."""
    from .runtimes.remote import RemoteEndpoint, list_models

    return list_models(RemoteEndpoint(base_url, api_key))


__all__ = [
    "POOLING_CHOICES",
    "estimate_memory",
    "judgement_prompt",
    "relevance",
    "free_memory",
    "release_memory",
    "Pooling",
    "AdapterError",
    "AdapterInfo",
    "AdapterNameError",
    "AdapterSet",
    "LoraChoice",
    "LoraRegistry",
    "LoraSpec",
    "MAX_LORA_SCALE",
    "UnknownAdapterError",
    "check_scale",
    "parse_lora_flag",
    "read_adapter",
    "QueueFullError",
    "pull",
    "check_model_file",
    "DEFAULT_ASR_MODEL",
    "BUNDLED_FOLDERS",
    "ASR_REQUIRED_FILES",
    "BACKENDS",
    "BUNDLED",
    "ChatTemplate",
    "ComputeThread",
    "ConstraintError",
    "ConstraintKind",
    "ContextFullError",
    "Conversation",
    "DEFAULT_CTX",
    "DEFAULT_KV_TYPE",
    "DEFAULT_MODEL",
    "DEFAULT_PARALLEL",
    "DEFAULT_SINKS",
    "KV_POLICIES",
    "check_kv_policy",
    "WINDOW_POLICY",
    "DEVICE_CHOICES",
    "DeviceUnavailableError",
    "Finished",
    "FinishReason",
    "GenerationEvent",
    "GenerationRequest",
    "GenerationStats",
    "GGUFFile",
    "GREEDY",
    "InputFileError",
    "KV_TYPE_NAMES",
    "LOCAL_BACKENDS",
    "Message",
    "MessageRuntime",
    "MiniappError",
    "ModelFileError",
    "OutputConstraint",
    "REMOTE_BACKEND",
    "ReasoningDelta",
    "Runtime",
    "RuntimeConfig",
    "RuntimeInfo",
    "SAMPLING_FIELDS",
    "SPEC_MODES",
    "SamplingParams",
    "SpecMode",
    "SpeculationStats",
    "TextDelta",
    "TokenLogprob",
    "TokenStream",
    "Tokenizer",
    "UnsupportedModelError",
    "VisionRuntime",
    "check_supported",
    "closing_reserve",
    "default_threads",
    "fallback_template",
    "generate",
    "installed_models",
    "kv_type",
    "list_server_models",
    "models_dir",
    "open_runtime",
    "open_vision_runtime",
    "plan_torch_cache_and_device",
    "read_scalar",
    "resolve_model",
]

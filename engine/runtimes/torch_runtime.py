"""Our own engine: a torch model built from the GGUF, with an explicit KV cache."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from ..batching import DEFAULT_QUEUE, UNLIMITED, BatchConfig, BatchScheduler
from ..batching.runner import ModelRunner, SequenceCaches
from ..errors import MiniappError
from ..kv.cache import Cache
from ..kv.footprint import estimate_footprint
from ..kv.policies import WINDOW_POLICY, check_kv_policy
from ..kv.types import BF16, KVSetting, bytes_per_token, default_kv_type, kv_type
from ..lora.adapter import LoraAdapter
from ..lora.bound import BoundLora
from ..lora.registry import LoraRegistry, LoraSpec
from ..modelfile.gguf_file import GGUFFile
from ..models import (
    CachePolicy,
    DecoderModel,
    Placement,
    attention_backends,
    build_model,
    check_supported,
)
from ..models.loading import lora_layout
from ..models.placement import CPU
from ..models.static_step import StaticDecodeStep
from ..platform.compute_thread import ComputeThread
from ..platform.devices import (
    DevicePlan,
    DeviceProbe,
    Fallback,
    GpuPathUnavailable,
    decode_step_path,
    default_probe,
    plan_device,
)
from ..platform.memory import available_memory_bytes, limit_heap_fragmentation
from ..speculative import (
    DraftController,
    EarlyExitDrafter,
    SpecMode,
    SpeculativeDecoder,
    build_drafters,
)
from ..speculative.calibration import (
    default_exit_setting,
    load_draft_head,
    load_exit_setting,
    load_shallow_block,
)
from ..speculative.draft_head import HEAD_ACCEPTANCE_MEMORY, DraftHead, HeadDrafter
from ..speculative.shallow_head import ShallowBlock, ShallowExitDrafter
from ..tokens.events import SpeculationStats
from ..tokens.sampler import Sampler, sampler_for
from ..tokens.sampling import LoraChoice, SamplingParams
from ..tokens.stream import TokenStream
from ..tokens.tokenizer import Tokenizer
from .base import (
    DEFAULT_CTX,
    DEFAULT_SINKS,
    LOGIT_BLOCK,
    Runtime,
    RuntimeInfo,
    default_threads,
)
from .embedding import PooledRows, Pooling

log = logging.getLogger("miniapp.engine")


class TorchRuntime(Runtime):
    """Streams: once a conversation outgrows --ctx, the caches keep `sinks` first tokens plus
    the most recent `window` (default ctx - sinks) and generation goes on.

    Every generation runs through the continuous-batching scheduler (engine/batching), up to
    `parallel` at once (one slot by default, as a terminal chat has), each with caches of its
    own; finished ones leave their caches for a later prompt with the same start (the next
    turn of a chat). The scheduler's model runner replays a graph of the decode step on a
    GPU; this class builds the model where the device plan says, moves it to the CPU when
    the GPU runs out of memory, and keeps what drafting learns across answers."""

    backend = "torch"
    slides_past_ctx = True

    def __init__(
        self,
        model_path: Path | str,
        n_ctx: int = DEFAULT_CTX,
        threads: int | None = None,
        gguf: GGUFFile | None = None,
        sinks: int = DEFAULT_SINKS,
        window: int | None = None,
        kv_policy: str = WINDOW_POLICY,
        spec: SpecMode | str = SpecMode.AUTO,
        device: str = "auto",
        probe: DeviceProbe | None = None,
        parallel: int = 1,
        max_queue: int = DEFAULT_QUEUE,
        kv: KVSetting | str | None = None,
        lora: Sequence[LoraSpec] = (),
        lora_budget_mb: int | None = None,
        cpu_moe: bool = False,
    ):
        if parallel < 1:
            raise MiniappError(f"--parallel {parallel}: run at least one generation at a time")
        asked = None if kv is None else kv_type(kv)  # None: the default for the model
        self.model_path = Path(model_path)
        limit_heap_fragmentation()
        torch.set_num_threads(threads or default_threads())
        gguf = gguf or GGUFFile(self.model_path)
        self.gguf = gguf  # kept (memory-mapped) to rebuild the model on a fallback
        self.probe = probe or default_probe()
        self.config = check_supported(gguf)  # a bad file is refused before any use
        self.kv_type, self.device_plan = plan_cache_and_device(
            gguf, n_ctx, device, self.probe, asked, cpu_moe
        )
        self.model = self._load()
        self._weight_bytes = self.model.weight_bytes_per_token()
        self.chat_template = gguf.metadata.get("tokenizer.chat_template")
        self.architecture = gguf.architecture
        self.tokenizer = Tokenizer(self.model_path)
        self.n_ctx = n_ctx
        self.policy = CachePolicy(
            n_ctx,
            sinks=sinks,
            window=window,
            kv_type=self.kv_type,
            kv_policy=check_kv_policy(kv_policy),
        )
        self.spec_mode = SpecMode(spec)
        # Kept across answers: what drafting costs and earns is learned as the chat goes.
        self.draft_controller = DraftController()
        self.early_exit = self._early_exit_drafter()
        self.draft_head = self._draft_head()
        # LoRA adapters by name, bound to this model's fused projections on first load.
        self._lora_layout = None
        budget = None if lora_budget_mb is None else lora_budget_mb << 20
        self.lora = LoraRegistry(gguf, self._bind_adapter, budget, self._adapters_released)
        self.parallel = parallel
        graphs, note = decode_step_path(
            self.probe, self.device_plan, self.config.n_layers, self.config.experts is not None
        )
        self.runner = ModelRunner(self.model, self.policy, graphs, note)
        self.runner.on_graph_failure = self._record_graph_failure
        config = BatchConfig(
            slots=parallel,
            pooled_prefixes=parallel,
            max_queue=max_queue,
            kv_budget_bytes=_kv_budget(),
        )
        self.scheduler = BatchScheduler(
            self.model, self.policy, config, self._lone_decoder, self.runner, self._recover_from_oom
        )
        self._last_stream: TokenStream | None = None
        for spec in lora:  # after the scheduler: past the budget, loads let others go
            self.lora.load(spec.name, spec.path, spec.scale)

    def _placement(self) -> Placement:
        plan = self.device_plan
        if not plan.on_gpu:
            return Placement()
        gpu = torch.device(self.probe.torch_device(plan))
        dense = plan.weights == "bf16"
        return Placement(gpu, plan.gpu_layers, dense, experts_on_cpu=plan.experts_on_cpu)

    def _load(self) -> DecoderModel:
        """Build the model where the plan says, falling back to the CPU if that fails."""
        plan = self.device_plan
        if not plan.on_gpu:
            return self._build()
        try:
            return self._build()
        except torch.OutOfMemoryError as exc:
            step, reason = f"loading on {plan.device}", f"out of memory at load: {exc}"
        except (GpuPathUnavailable, RuntimeError, ValueError) as exc:
            step, reason = f"{plan.weights} weights on {plan.device}", _first_line(exc)
        return self._fall_back_to_cpu(step, reason)

    def _build(self) -> DecoderModel:
        model = build_model(self.gguf, self._placement(), self.config)
        self.probe.watch(model, self.device_plan)
        return model

    def _fall_back_to_cpu(self, step: str, reason: str) -> DecoderModel:
        log.warning("falling back to the CPU from %s: %s", step, reason)
        fallbacks = [*self.device_plan.fallbacks, Fallback(step, reason)]
        self.device_plan = DevicePlan("cpu", "int4", 0, f"fell back: {reason}", fallbacks)
        self.model = None  # let the GPU copy go before building the CPU one
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return self._build()

    @property
    def static_step(self) -> StaticDecodeStep | None:
        """The fixed-shape decode step the last graph-replayed step went through (None: the
        steps run eagerly)."""
        return self.runner.latest_static_step if self.runner.graphs is not None else None

    @property
    def decode_step_note(self) -> str:
        """How decode steps run, in words (doctor and the device report)."""
        return self.runner.graph_note

    @property
    def caches(self) -> list[Cache] | None:
        """The caches of the generation running or finished last."""
        latest = self.scheduler.latest_sequence()
        return None if latest is None else latest[1]

    @property
    def last_speculation(self) -> SpeculationStats | None:
        """What drafting did in the last generation (None: it did not draft)."""
        return None if self._last_stream is None else self._last_stream.speculation

    def _recover_from_oom(self, exc: torch.OutOfMemoryError) -> bool:
        """Out of memory mid-step on a GPU: go on with the same generations on the CPU (the
        scheduler rebuilds their caches there). False on the CPU: nowhere left to go."""
        if not self.device_plan.on_gpu:
            return False
        step = f"decoding on {self.device_plan.device}"
        self.runner.use_model(None, None, "eager steps on the CPU")  # the GPU copy goes first
        self.model = self._fall_back_to_cpu(step, f"out of memory during decode: {exc}")
        self.early_exit = self._early_exit_drafter()  # it drafts with the model's layers
        self.draft_head = self._draft_head()
        self.runner.use_model(self.model, None, "eager steps on the CPU")
        return True

    def _record_graph_failure(self, reason: str) -> None:
        self.device_plan.fallbacks.append(Fallback("graph of the decode step", reason))

    def _draft_head(self) -> DraftHead | ShallowBlock | None:
        """The trained drafting head for this file, in whichever form calibration predicted
        faster (the last-state head or the shallow-exit block), where one is stored and (for
        `auto`) it pays. It runs beside a head on the CPU only (the shallow block beside
        layers there too). A shallow block taps the model's exit layer from now on, so that
        it sees every position fed."""
        self.model.exit_tap = None
        model = self.model
        if self.spec_mode not in (SpecMode.AUTO, SpecMode.HEAD) or model.head_device != CPU:
            return None
        candidates = [load_draft_head(self.model_path, model)]
        if all(device == CPU for device in model.layer_devices):
            candidates.append(load_shallow_block(self.model_path, model))
        candidates = [loaded for loaded in candidates if loaded is not None]
        if not candidates and self.spec_mode is SpecMode.HEAD:
            raise MiniappError(
                f"--spec head: no drafting head trained for {self.model_path.name}; "
                f"run `miniapp calibrate --train-head --model {self.model_path}`"
            )
        if self.spec_mode is SpecMode.AUTO:
            candidates = [(head, meta) for head, meta in candidates if meta.get("pays", False)]
        if not candidates:
            return None
        head, meta = max(candidates, key=lambda loaded: loaded[1].get("predicted_speedup", 0.0))
        # What its gate lets through is accepted more often than its first drafts overall
        # (a head measured before that was recorded: the overall rate, a safe underestimate).
        acceptance = meta.get("gated_acceptance", meta.get("acceptance"))
        name = ShallowExitDrafter.name if isinstance(head, ShallowBlock) else HeadDrafter.name
        if acceptance is not None:
            self.draft_controller.set_prior(name, acceptance, HEAD_ACCEPTANCE_MEMORY)
        if isinstance(head, ShallowBlock):
            model.exit_tap = head
        return head

    def _early_exit_drafter(self) -> EarlyExitDrafter | None:
        if self.spec_mode not in (SpecMode.AUTO, SpecMode.EARLY_EXIT):
            return None
        setting = load_exit_setting(self.model_path, self.model)
        if setting is None:
            if self.spec_mode is SpecMode.AUTO:
                return None  # untrained early exit loses on ordinary checkpoints
            setting = default_exit_setting(self.model)
        elif self.spec_mode is SpecMode.AUTO and not setting.pays:
            return None
        drafter = EarlyExitDrafter(self.model, setting.layer, setting.adapter, setting.max_draft)
        if setting.measured_acceptance is not None:
            self.draft_controller.set_prior(drafter.name, setting.measured_acceptance)
        return drafter

    def reusable_prefix(self, prompt: Sequence[int]) -> int:
        return self.scheduler.reusable_prefix(prompt)

    def generate_tokens(self, prompt: Sequence[int], params: SamplingParams) -> TokenStream:
        # The constraint compiles here, so a bad schema fails the call, not the stream; an
        # adapter not loaded fails it too (UnknownAdapterError).
        adapters = self.lora.resolve(params.lora)
        sampler = sampler_for(params, self.tokenizer, len(prompt))
        stream = self.scheduler.submit(
            prompt, params, max_new=UNLIMITED, guide=sampler.guide, adapters=adapters
        )
        self._last_stream = stream
        return stream

    def _adapters_released(self) -> None:
        """An adapter was unloaded or let go: drop what still holds it (pooled prompts
        computed with it); answers running with it keep it."""
        self.scheduler.drop_adapters(self.lora.holds)

    def _bind_adapter(self, name: str, adapter: LoraAdapter) -> BoundLora:
        if self._lora_layout is None:
            self._lora_layout = lora_layout(self.gguf, self.config)
        return BoundLora(name, adapter, self._lora_layout)

    def run_steps_on(self, compute: ComputeThread) -> None:
        self.scheduler.driver = compute

    def _lone_decoder(
        self, caches: list[Cache], fed: list[int], sampler: Sampler
    ) -> SpeculativeDecoder | None:
        """The scheduler's speculative decoder for a sequence running alone."""
        if self.spec_mode is SpecMode.OFF:
            return None
        drafters = build_drafters(self.spec_mode, self.model, self.early_exit, self.draft_head)
        return SpeculativeDecoder(
            self.model,
            caches,
            fed,
            sampler,
            self.draft_controller,
            drafters,
            mode=self.spec_mode.value,
            decode_one=self.runner.stepper(caches),
            verify_rows=self.runner.verifier(caches),
        )

    def info(self) -> RuntimeInfo:
        policy, c = self.policy, self.model.config
        per_token = bytes_per_token(self.kv_type, c.n_layers, c.n_kv_heads, c.head_dim)
        return RuntimeInfo(
            self.backend,
            self.model_path,
            self.device_plan,
            self.spec_mode.value,
            policy.sinks,
            policy.window_size,
            self.kv_type.name,
            per_token,
            weight_bytes_per_token=self._weight_bytes,
            kv_policy=policy.kv_policy,
        )

    def reset(self) -> None:
        self.scheduler.reset()

    def forget(self, start: int, end: int) -> bool:
        """Drop fed tokens start..end-1 from the last finished generation's caches without
        evaluating anything again (chat turn eviction). False if the caches can no longer do
        it (they have rotated)."""
        return self.scheduler.forget(start, end)

    @torch.inference_mode()
    def logit_blocks(
        self,
        tokens: Sequence[int],
        first: int = 0,
        block: int = LOGIT_BLOCK,
        lora: Sequence[LoraChoice] = (),
    ) -> Iterator[tuple[int, np.ndarray]]:
        """`lora`: adapters to run with (loaded ones, by name), as a request picks them."""
        policy = CachePolicy(len(tokens), streaming=False, kv_type=self.kv_type)
        caches = SequenceCaches(self.model.make_caches(policy))
        caches.lora = self.lora.resolve(lora)
        hidden = torch.cat(list(self._hidden_chunks(tokens, caches)))
        # Only the rows asked for go through the output head, the costliest matmul here.
        for start in range(first, len(tokens), block):
            yield start, self.model.logits(hidden[start : start + block]).numpy()

    @torch.inference_mode()
    def stream_blocks(self, tokens: Sequence[int]) -> Iterator[tuple[int, np.ndarray]]:
        caches = self.model.make_caches(self.policy)
        row = 0
        for hidden in self._hidden_chunks(tokens, caches):
            yield row, self.model.logits(hidden).numpy()
            row += len(hidden)

    @torch.inference_mode()
    def embed(self, prompts: Sequence[Sequence[int]], pooling: Pooling) -> np.ndarray:
        """Prompts share passes (up to EMBED_PASS_ROWS rows a pass): each feeds its next
        chunk as exact rows, so each row comes out as the prompt alone would compute it."""
        if any(not p for p in prompts):
            raise MiniappError("an empty text has no embedding")
        dim = self.model.config.dim
        pooled = [PooledRows(pooling, dim) for _ in prompts]
        order = iter(range(len(prompts)))
        running: list[tuple[int, list[Cache]]] = []  # (prompt, its caches) being fed
        fed = [0] * len(prompts)
        while True:
            rows = sum(len(prompts[i]) - fed[i] for i, _ in running)
            for index in order:  # admit prompts while the pass has room
                policy = CachePolicy(len(prompts[index]), streaming=False, kv_type=self.kv_type)
                running.append((index, SequenceCaches(self.model.make_caches(policy))))
                rows += len(prompts[index])
                if rows >= EMBED_PASS_ROWS:
                    break
            if not running:
                break
            segments = []
            for index, caches in running:
                size = self.model.max_chunk(caches, exact_rows=True)
                segments.append((list(prompts[index][fed[index] : fed[index] + size]), caches))
            hidden = self._exact_rows(segments).float().cpu().numpy()
            first = 0
            for (index, _), (tokens, _) in zip(running, segments, strict=True):
                pooled[index].add(hidden[first : first + len(tokens)])
                first += len(tokens)
                fed[index] += len(tokens)
            running = [(i, c) for i, c in running if fed[i] < len(prompts[i])]
        return np.stack([p.vector() for p in pooled])

    def _exact_rows(self, segments: list[tuple[list[int], list[Cache]]]) -> torch.Tensor:
        if len(segments) == 1:
            tokens, caches = segments[0]
            return self.model.hidden_states(torch.tensor(tokens), caches, exact_rows=True)
        return self.model.hidden_segments(segments)

    def _hidden_chunks(self, tokens: Sequence[int], caches) -> Iterator[torch.Tensor]:
        """Final hidden states for `tokens` (perplexity: the whole text at once), in chunks
        the caches can take at once."""
        done = 0
        while done < len(tokens):
            size = self.model.max_chunk(caches)
            chunk = torch.tensor(tokens[done : done + size])
            yield self.model.hidden_states(chunk, caches)
            done += len(chunk)


EMBED_PASS_ROWS = 512  # rows one embedding pass feeds at most (a few texts share it)


def plan_cache_and_device(
    gguf: GGUFFile,
    n_ctx: int,
    device: str,
    probe: DeviceProbe,
    asked: KVSetting | None = None,
    cpu_moe: bool = False,
) -> tuple[KVSetting, DevicePlan]:
    """The KV cache type and the device plan a torch runtime takes (doctor reports the
    same): the type asked for, else the default for the model's heads, with the plan for
    that footprint. A GPU that holds the whole model keeps the cache in bf16 by default,
    where it fits too: without Triton, attention there is torch's, which would decode
    quantized rows into a bf16 copy in every layer and step (more bytes moved than bf16 rows
    read as stored, and several kernels a layer more), while SDPA reads bf16 rows as they
    are, as llama.cpp's f16 and vLLM's bf16 caches are read. Our Triton kernels read and
    write q8 rows in as many kernels a step as bf16's; whether q8's halved reads pay for
    its decoding in registers is for a GPU to measure before q8 becomes its default. The
    CPU keeps q8, which its native attention reads as it is."""
    config = check_supported(gguf)
    kind = asked or default_kv_type(config.head_dim)
    kind.check(config.head_dim)
    plan = plan_device(device, probe, estimate_footprint(gguf, n_ctx, kind), cpu_moe)
    if asked is not None or not _attends_in_16_bits(plan, probe, config.n_layers):
        return kind, plan
    wide = plan_device(device, probe, estimate_footprint(gguf, n_ctx, BF16), cpu_moe)
    same = (wide.device, wide.weights, wide.gpu_layers) == (
        plan.device,
        plan.weights,
        plan.gpu_layers,
    )
    return (BF16, wide) if same else (kind, plan)


def _attends_in_16_bits(plan: DevicePlan, probe: DeviceProbe, n_layers: int) -> bool:
    """Whether every layer runs on a device whose attention reads 16-bit rows in 16 bits (a
    simulated GPU computes on the CPU, with the CPU's attention)."""
    whole = plan.gpu_layers >= n_layers and not plan.experts_on_cpu
    device = torch.device(probe.torch_device(plan))
    return plan.on_gpu and whole and attention_backends.reduced_precision(device)


def _kv_budget() -> int | None:
    """KV memory the batching scheduler may use: half of what is free at load (the rest is
    for the OS, other programs and the engine's own working memory)."""
    free = available_memory_bytes()
    return free // 2 if free else None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

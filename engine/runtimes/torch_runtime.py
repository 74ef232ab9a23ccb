"""Our own engine: a torch model built from the GGUF, with an explicit KV cache."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from ..batching import DEFAULT_QUEUE, UNLIMITED, BatchConfig, BatchScheduler
from ..cache import Cache, keep_first, reusable_length
from ..compute_thread import ComputeThread
from ..devices import (
    DevicePlan,
    DeviceProbe,
    Fallback,
    GpuPathUnavailable,
    decode_step_path,
    default_probe,
    estimate_footprint,
    plan_device,
)
from ..errors import MiniappError
from ..gguf_file import GGUFFile
from ..kv_types import KVSetting, bytes_per_token, default_kv_type, kv_type
from ..memory import available_memory_bytes, limit_heap_fragmentation
from ..models import CachePolicy, DecoderModel, Placement, build_model, check_supported
from ..models.placement import CPU
from ..models.static_step import StaticDecodeStep
from ..sampling import SamplingParams
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
from ..token_stream import GeneratedTokens, TokenStream
from ..tokenizer import Tokenizer
from ..torch_sampler import Sampler, sampler_for, token_logprob
from .base import (
    DEFAULT_CTX,
    DEFAULT_SINKS,
    LOGIT_BLOCK,
    Runtime,
    RuntimeInfo,
    default_threads,
)

log = logging.getLogger("miniapp.engine")


class TorchRuntime(Runtime):
    """Streams: once a conversation outgrows --ctx, the caches keep `sinks` first tokens plus
    the most recent `window` (default ctx - sinks) and generation goes on.

    With `parallel` above 1, generations run through a continuous-batching scheduler
    (engine/batching), up to `parallel` at once, each with caches of its own; finished ones
    leave their caches for a later prompt with the same start. With 1, one generation at a
    time runs over the runtime's own caches (and, on a GPU, a replayed graph of the step)."""

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
        spec: SpecMode | str = SpecMode.AUTO,
        device: str = "auto",
        probe: DeviceProbe | None = None,
        parallel: int = 1,
        max_queue: int = DEFAULT_QUEUE,
        kv: KVSetting | str | None = None,
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
        head_dim = self.config.head_dim
        self.kv_type = asked or default_kv_type(head_dim)
        self.kv_type.check(head_dim)
        footprint = estimate_footprint(gguf, n_ctx, self.kv_type)
        self.device_plan = plan_device(device, self.probe, footprint)
        self.model = self._load()
        self._weight_bytes = self.model.weight_bytes_per_token()
        self.chat_template = gguf.metadata.get("tokenizer.chat_template")
        self.architecture = gguf.architecture
        self.tokenizer = Tokenizer(self.model_path)
        self.n_ctx = n_ctx
        self.policy = CachePolicy(n_ctx, sinks=sinks, window=window, kv_type=self.kv_type)
        self._new_caches()
        self._tokens: list[int] = []  # every token fed, in order (the caches may keep fewer)
        # The spans of `_tokens` that went in as prompt chunks (torch's batched attention);
        # the rest went in as decode steps or their exact equal. A rebuild replays both alike.
        self._prompt_chunks: list[tuple[int, int]] = []
        self.spec_mode = SpecMode(spec)
        # Kept across answers: what drafting costs and earns is learned as the chat goes.
        self.draft_controller = DraftController()
        self.early_exit = self._early_exit_drafter()
        self.draft_head = self._draft_head()
        self.parallel = parallel
        self.scheduler = None
        if parallel > 1:
            config = BatchConfig(slots=parallel, pooled_prefixes=parallel, max_queue=max_queue,
                                 kv_budget_bytes=_kv_budget())  # fmt: skip
            self.scheduler = BatchScheduler(self.model, self.policy, config, self._lone_decoder)

    def _placement(self) -> Placement:
        plan = self.device_plan
        if not plan.on_gpu:
            return Placement()
        gpu = torch.device(self.probe.torch_device(plan))
        return Placement(gpu, plan.gpu_layers, dense_on_gpu=plan.weights == "bf16")

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

    def _new_caches(self) -> None:
        """Fresh caches for the model, and the fixed-shape decode step over them when the
        device replays one as a graph (its caches are allocated in full, once)."""
        self.caches, self.static_step = [], None  # the old ones go first (GPU memory)
        self.caches = self.model.make_caches(self.policy)
        runner, self.decode_step_note = decode_step_path(
            self.probe, self.device_plan, self.model.config.n_layers
        )
        if runner is not None:
            for cache in self.caches:
                cache.reserve()
            self.static_step = StaticDecodeStep(self.model, self.caches, runner)

    def _recover_from_oom(self, exc: torch.OutOfMemoryError) -> None:
        """Out of memory mid-decode: continue on the CPU with the same conversation. The
        caches are rebuilt there from the tokens fed so far."""
        step = f"decoding on {self.device_plan.device}"
        self.caches, self.static_step = [], None
        self.model = self._fall_back_to_cpu(step, f"out of memory during decode: {exc}")
        self.early_exit = self._early_exit_drafter()  # it drafts with the model's layers
        self.draft_head = self._draft_head()
        fed, chunks = list(self._tokens), list(self._prompt_chunks)
        self._new_caches()
        self._replay(fed, chunks)

    @torch.inference_mode()
    def _replay(self, fed: list[int], chunks: list[tuple[int, int]]) -> None:
        """Feed `fed` into fresh caches as it went in the first time: each prompt chunk as
        that chunk, every other token through the exact-rows path (bit for bit a decode
        step), so the rebuilt caches hold what the lost ones held on this device."""
        self._tokens[:], self._prompt_chunks = fed, chunks
        done = 0
        for start, end in [*chunks, (len(fed), len(fed))]:
            if done < start:
                for _ in self._hidden_chunks(fed[done:start], self.caches, exact_rows=True):
                    pass
            if start < end:
                self.model.hidden_states(torch.tensor(fed[start:end]), self.caches)
            done = end

    def _decode_one(self, token: int) -> torch.Tensor:
        """One decode step (the token is not recorded in `_tokens`); fp32 logits [vocab]."""
        step = self.static_step
        if step is not None and step.ready():
            try:
                return step(token)[0]
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as exc:  # capture failed: ordinary steps from now on
                self._give_up_static_steps(exc)
        hidden = self.model.hidden_states(torch.tensor([token]), self.caches)
        return self.model.logits(hidden)[0]

    def _give_up_static_steps(self, exc: RuntimeError) -> None:
        reason = _first_line(exc)
        log.warning("decode steps run eagerly from now on: the graph failed: %s", reason)
        self.static_step = None
        self.decode_step_note = f"eager steps: the graph failed: {reason}"
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
        if self.scheduler is not None:
            return self.scheduler.reusable_prefix(prompt)
        return reusable_length(self.caches, self._tokens, prompt)

    def generate_tokens(self, prompt: Sequence[int], params: SamplingParams) -> TokenStream:
        # The constraint compiles here, so a bad schema fails the call, not the stream.
        sampler = sampler_for(params, self.tokenizer, len(prompt))
        if self.scheduler is not None:
            return self.scheduler.submit(prompt, params, max_new=UNLIMITED, guide=sampler.guide)
        stream = GeneratedTokens(cached_prompt_tokens=self.reusable_prefix(prompt))
        return stream.feeding(self._generate_alone(prompt, sampler, stream))

    def run_steps_on(self, compute: ComputeThread) -> None:
        if self.scheduler is not None:
            self.scheduler.driver = compute

    def _generate_alone(
        self, prompt: Sequence[int], sampler: Sampler, stream: GeneratedTokens
    ) -> Iterator[int]:
        history = list(prompt)
        while True:
            try:
                yield from self._generate(history, sampler, stream)
                return
            except torch.OutOfMemoryError as exc:
                if not self.device_plan.on_gpu:
                    raise
                # The tokens yielded so far are in `history`: go on from there, same sampler.
                self._recover_from_oom(exc)

    def _generate(
        self, history: list[int], sampler: Sampler, stream: GeneratedTokens
    ) -> Iterator[int]:
        """Yields tokens after `history`, appending each to it."""
        prompt = list(history)
        reuse = self.reusable_prefix(prompt)
        self._truncate(reuse)
        logits = self._feed(prompt[reuse:])
        self.last_speculation = None
        if self.spec_mode is not SpecMode.OFF and sampler.params.logprobs is None:
            drafters = build_drafters(self.spec_mode, self.model, self.early_exit, self.draft_head)
            decoder = SpeculativeDecoder(
                self.model, self.caches, self._tokens, sampler, self.draft_controller,
                drafters, mode=self.spec_mode.value, decode_one=self._decode_one,
            )  # fmt: skip
            self.last_speculation = stream.speculation = decoder.stats
            yield from decoder.run(logits, history)
            return
        if sampler.params.logprobs is not None and stream.logprobs is None:
            stream.logprobs = []  # kept across a retry after running out of GPU memory
        while True:
            token = sampler(logits, history)
            if stream.logprobs is not None:
                stream.logprobs.append(token_logprob(logits, token, sampler.params.logprobs))
            yield token
            history.append(token)
            logits = self._feed([token])

    def _lone_decoder(
        self, caches: list[Cache], fed: list[int], sampler: Sampler
    ) -> SpeculativeDecoder | None:
        """The scheduler's speculative decoder for a sequence running alone."""
        if self.spec_mode is SpecMode.OFF:
            return None
        drafters = build_drafters(self.spec_mode, self.model, self.early_exit, self.draft_head)
        return SpeculativeDecoder(self.model, caches, fed, sampler, self.draft_controller,
                                  drafters, mode=self.spec_mode.value)  # fmt: skip

    def info(self) -> RuntimeInfo:
        policy, c = self.policy, self.model.config
        per_token = bytes_per_token(self.kv_type, c.n_layers, c.n_kv_heads, c.head_dim)
        return RuntimeInfo(self.backend, self.model_path, self.device_plan, self.spec_mode.value,
                           policy.sinks, policy.window_size, self.kv_type.name,
                           per_token, weight_bytes_per_token=self._weight_bytes)  # fmt: skip

    def reset(self) -> None:
        # Under the scheduler there is no one context to forget: pooled prefixes serve
        # whichever prompt starts with them, and age out.
        self._truncate(0)

    @torch.inference_mode()  # caches grown during a forward pass hold inference tensors
    def forget(self, start: int, end: int) -> bool:
        """Drop fed tokens start..end-1 from every cache without evaluating anything again
        (chat turn eviction). False if the caches can no longer do it (they have rotated)."""
        if self.scheduler is not None or not 0 < start <= end <= len(self._tokens):
            return False
        if not all(cache.can_forget(start) for cache in self.caches):
            return False
        for cache in self.caches:
            cache.forget(start, end)
        del self._tokens[start:end]
        gone = end - start  # chunks after the span move back; one cut by it is no longer whole
        self._prompt_chunks = [
            (a - gone, b - gone) if a >= end else (a, b)
            for a, b in self._prompt_chunks
            if b <= start or a >= end
        ]
        return True

    @torch.inference_mode()
    def logit_blocks(
        self, tokens: Sequence[int], first: int = 0, block: int = LOGIT_BLOCK
    ) -> Iterator[tuple[int, np.ndarray]]:
        policy = CachePolicy(len(tokens), streaming=False, kv_type=self.kv_type)
        caches = self.model.make_caches(policy)
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

    def _hidden_chunks(
        self, tokens: Sequence[int], caches, exact_rows: bool = False
    ) -> Iterator[torch.Tensor]:
        """Final hidden states for `tokens`, in chunks the caches can take at once (with
        `exact_rows`, each row as a decode step computes it)."""
        if len(tokens) == 1:  # decoding: every cache takes one token
            yield self.model.hidden_states(torch.tensor(tokens), caches)
            return
        done = 0
        while done < len(tokens):
            size = self.model.max_chunk(caches)
            chunk = torch.tensor(tokens[done : done + size])
            yield self.model.hidden_states(chunk, caches, exact_rows)
            done += len(chunk)

    @torch.inference_mode()
    def _feed(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append tokens to the caches; returns fp32 logits [vocab] after the last one.

        The last token goes in as a decode step, the rest in prompt chunks: a later prompt
        that keeps all but that token (a regenerate) evaluates it again exactly as the
        first time, so a greedy answer comes out the same."""
        done = 0
        for hidden in self._hidden_chunks(tokens[:-1], self.caches):
            start = len(self._tokens)
            self._tokens.extend(tokens[done : done + len(hidden)])
            self._prompt_chunks.append((start, len(self._tokens)))
            done += len(hidden)
        logits = self._decode_one(tokens[-1])
        self._tokens.append(tokens[-1])
        return logits

    @torch.inference_mode()
    def _truncate(self, n: int) -> None:
        """Keep the first n tokens."""
        del self._tokens[n:]
        self._prompt_chunks = [(a, min(b, n)) for a, b in self._prompt_chunks if a < n]
        keep_first(self.caches, n)


def _kv_budget() -> int | None:
    """KV memory the batching scheduler may use: half of what is free at load (the rest is
    for the OS, other programs and the engine's own working memory)."""
    free = available_memory_bytes()
    return free // 2 if free else None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

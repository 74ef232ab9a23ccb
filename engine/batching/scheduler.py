"""Many sequences at once on the torch engine: continuous batching.

The scheduler owns the sequences: waiting in a queue, or running in one of `slots` slots. A
free slot goes to the waiting sequence with the most urgent priority (the lowest number, as
vLLM's), then to the client (a server's API key) admitted least recently, so that clients
take turns; within one client, first come, first served.

Each step is one forward pass over the rows of every running sequence: the next token of
each decoding sequence, plus a bounded chunk of the prompts still being evaluated (chunked
prefill), so a long prompt never freezes the streams that are running. Every sequence has
its own caches, sampler and limits.

Each row is computed exactly as a decode step of its sequence alone would compute it (the
matmuls are row-exact, attention runs each sequence over its own keys, prompt chunks go
through the exact-rows path of speculative verification), so a sequence's tokens never depend
on which others share its steps, on how its prompt was chunked, or on a reused prefix.

A finished sequence leaves its caches in a small pool; a later prompt that starts with the
same tokens (the next turn of a chat, the same system prompt, a regenerate) takes them over
and evaluates only the rest.

A sequence that runs alone (nothing else running or waiting) may decode speculatively:
drafts verified in one pass cost little more than a step when one row is all the step has,
but beside other sequences' rows every verified row costs nearly a full row of the int4
matmuls, so batched steps never draft (docs/BENCHMARKS.md has the figures).

Where tokens are drawn on a GPU, a decode step of the same sequences is queued before the
previous step's tokens are read (`overlap_steps`), fed them on the device: the host's work
overlaps the GPU's. When the batch then changes, that step is taken back (`_settle`), so
nothing it computed is seen, and the sequences' samplers draw again what it drew. A
sequence speculating alone takes its plain steps the same way; its decoder takes the queued
step back before it verifies drafts.

Every torch generation runs here, one slot or many: the terminal chat's, the GUI's and the
server's alike, so they all give the same answer to the same prompt. The steps themselves
run in the model runner (runner.py); when the device runs out of memory, `recover` moves the
model to the CPU and each running sequence's caches are rebuilt there from its tokens.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..errors import MiniappError
from ..kv.cache import Cache, common_prefix, keep_first, reusable_length
from ..kv.policies import WINDOW_POLICY, check_kv_policy
from ..kv.scored import close_prompts, open_prompts
from ..kv.types import KVSetting, bytes_per_token
from ..lora.registry import AdapterSet
from ..models import CachePolicy, DecoderModel
from ..models.static_step import DrawnTokens
from ..platform.faults import check_injected_fault
from ..speculative import SpeculativeDecoder
from ..speculative.speculative_decoder import PlainDraw
from ..tokens.constraints import TokenGuide
from ..tokens.device_sampler import SamplingTensors, penalizes
from ..tokens.events import SpeculationStats
from ..tokens.sampler import Sampler, token_logprob
from ..tokens.sampling import SamplingParams
from ..tokens.stream import TokenStream
from .runner import ModelRunner, SequenceCaches, device_sampling_inputs

log = logging.getLogger(__name__)

DEFAULT_SLOTS = 4
DEFAULT_QUEUE = 64  # requests that may wait for a slot before new ones are refused
# Prompt rows one sequence feeds per step. Small, so that a step carrying prompt rows beside
# the decode rows costs little more than a decode step (the int4 kernel's cost grows with rows).
PREFILL_CHUNK = 16
# Rows a step carries while sequences decode: their decode rows, then prompt rows up to this
# (at least MIN_PREFILL_ROWS, so a waiting prompt always moves). A step's cost grows with its
# rows, and every decoding stream waits for the whole step: this bounds the gap between two
# tokens (a token budget per step, as vLLM's chunked prefill has).
STEP_ROWS = 16
MIN_PREFILL_ROWS = 4
# Prompt rows a step may carry when no sequence is decoding: no stream waits on that step, so
# prompts go in as fast as the kernels allow (rows are exact at any chunk size).
IDLE_PREFILL_ROWS = 256


class SamplingError(MiniappError):
    """A sequence's next token could not be drawn with its settings (a request's fault,
    never its batch's: the other sequences of the step go on)."""


class QueueFullError(MiniappError):
    """More requests wait than the queue holds; try again shortly (a server answers 503 with
    Retry-After)."""


@dataclass(frozen=True)
class BatchConfig:
    slots: int = DEFAULT_SLOTS
    max_queue: int = DEFAULT_QUEUE
    prefill_chunk: int = PREFILL_CHUNK
    step_rows: int = STEP_ROWS
    min_prefill_rows: int = MIN_PREFILL_ROWS
    idle_prefill_rows: int = IDLE_PREFILL_ROWS
    pooled_prefixes: int = DEFAULT_SLOTS  # finished sequences whose caches are kept for reuse
    # KV memory for running sequences and pooled prefixes together (None: no bound). A
    # sequence is admitted when its reservation fits: its prompt and token limit, at most a
    # full context; pooled prefixes are let go first, least recently used first.
    kv_budget_bytes: int | None = None
    # Queue a decode step before the previous one's tokens are read (a GPU's captured
    # steps): the host's work for step n+1 overlaps the GPU's step n.
    overlap_steps: bool = True


DRIVER_CHECK_S = 1.0  # how often a waiting consumer checks that some thread still steps
UNLIMITED = 2**62  # tokens a sequence may generate when its consumer decides when to stop
_END = object()

# Builds the speculative decoder for a sequence about to run alone, over its caches, its
# record of the tokens fed and its sampler; None when drafting is off.
DecoderFactory = Callable[[list[Cache], list[int], Sampler], SpeculativeDecoder | None]
# Called when a step ran out of device memory: moves the model to the CPU (the runner's
# `use_model`) and returns True, or False when there is nowhere left to go.
Recovery = Callable[[torch.OutOfMemoryError], bool]


class StepDriver(Protocol):
    """The thread that should run the steps (an engine loop on the process's main thread,
    such as engine.compute_thread.ComputeThread)."""

    @property
    def serving(self) -> bool: ...

    @property
    def on_serving_thread(self) -> bool:
        """Whether the caller is the driver's own thread (a consumer there steps itself)."""
        ...

    def post(self, job: Callable[[], None]) -> bool:
        """Run `job` there soon; False if nothing serves (consumers then step)."""
        ...


class SequenceStream(TokenStream):
    """The tokens of one submitted sequence, as the scheduler samples them. Closing the
    stream cancels the sequence: its slot is free at the next step."""

    def __init__(self, scheduler: BatchScheduler):
        self._scheduler = scheduler
        self._items: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        self.submitted_at = time.perf_counter()
        self.queued_s = 0.0  # time waiting for a slot (set when it gets one)
        self.cached_prompt_tokens = 0  # prompt tokens found in a pooled prefix
        self.speculation: SpeculationStats | None = None  # once it has drafted alone

    def __next__(self) -> int:
        while True:
            if self._items.empty() and not self._scheduler.driven:
                self._scheduler.pull(self)
            try:
                item = self._items.get(timeout=DRIVER_CHECK_S)
                break
            except queue.Empty:  # still driven? (a driver that stopped leaves it to us)
                continue
        if item is _END:
            self._items.put(_END)  # later calls end too
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    @property
    def queue_position(self) -> int:
        """1 for the next to get a slot; 0 once running (or done)."""
        return self._scheduler.queue_position(self)

    def close(self) -> None:
        self.cancelled.set()
        self._scheduler.wake()


@dataclass
class _Sequence:
    stream: SequenceStream
    prompt: list[int]
    sampler: Sampler
    max_new: int
    stop_ids: frozenset[int]
    caches: list[Cache] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)  # tokens in the caches, in order
    pending: list[int] = field(default_factory=list)  # to feed next (prompt rest, or a token)
    history: list[int] = field(default_factory=list)  # prompt and sampled tokens
    generated: int = 0
    decoder: SpeculativeDecoder | None = None  # while it runs alone and drafts
    drafts: bool = True  # False once the factory said drafting is off (or logprobs are asked)
    adapters: AdapterSet | None = None  # its LoRA adapters; its caches carry them
    priority: int = 0  # lower goes first (params.priority)
    client: str | None = None  # whose turn it is (params.client)
    kv_policy: str | None = None  # which tokens its caches keep (None: the runtime's)

    @property
    def prefilling(self) -> bool:
        return len(self.pending) > 1 or len(self.fed) + len(self.pending) <= len(self.prompt)


@dataclass
class _Ahead:
    """A decode step queued before the host read the tokens of the step before (which it
    is fed, on the device): `sequences` in its rows' order; `rewinds` put their samplers'
    random streams back where they were before its draws."""

    drawn: DrawnTokens
    sequences: list[_Sequence]
    rewinds: list[Callable[[], None]]

    def continues(self, batch: list[tuple[_Sequence, list[int]]]) -> bool:
        """Whether `batch` is this step's: the same sequences, in order, one token each
        (the one the step before drew, which this step was fed)."""
        return len(batch) == len(self.sequences) and all(
            s is mine and len(tokens) == 1
            for (s, tokens), mine in zip(batch, self.sequences, strict=True)
        )


@dataclass
class _Pooled:
    tokens: list[int]
    caches: list[Cache]


class BatchScheduler:
    """Runs submitted sequences on `model` in batched steps."""

    def __init__(
        self,
        model: DecoderModel,
        policy: CachePolicy,
        config: BatchConfig | None = None,
        decoder_factory: DecoderFactory | None = None,
        runner: ModelRunner | None = None,
        recover: Recovery | None = None,
    ):
        self.runner = runner or ModelRunner(model, policy)
        self.policy, self.recover = policy, recover
        self.config = config or BatchConfig()
        self.decoder_factory = decoder_factory
        self.driver: StepDriver | None = None
        self._driven = False  # the driver holds a job that steps until no work is left
        self._lock = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._admissions = 0  # sequences admitted so far
        self._last_turn: dict[str | None, int] = {}  # client -> its latest admission's number
        self._running: list[_Sequence] = []
        self._pool: list[_Pooled] = []  # most recently finished last
        self._stepping = threading.Lock()  # held by the thread running a step
        self.serving = False  # a thread runs `serve`: consumers wait instead of stepping
        self.kv_bytes_per_token = kv_bytes_per_token(model, policy.kv_type)
        # Whether a pooled prefix's adapters may still be picked (None: all may).
        self.adapters_live: Callable[[AdapterSet], bool] | None = None
        self._ahead: _Ahead | None = None  # a step queued ahead (`overlap_steps`)
        self.steps = 0  # forward passes run (for tests and figures)
        self.overlapped = 0  # of which were queued before the tokens they feed were read
        self.peak_batch = 0  # most sequences in one step

    @property
    def model(self) -> DecoderModel:
        return self.runner.model

    @property
    def driven(self) -> bool:
        """Another thread runs the steps: consumers wait for their tokens."""
        driver = self.driver
        if self.serving:
            return True
        if driver is None or getattr(driver, "on_serving_thread", False):
            return False  # a consumer on the driver's thread would wait for itself
        return self._driven and driver.serving

    # Read-only figures for monitoring (a server's /metrics), read from any thread: under the
    # lock, so a scrape never sees a queue half-changed by a step.

    @property
    def running_count(self) -> int:
        """Sequences in a slot: evaluating their prompt or decoding."""
        with self._lock:
            return len(self._running)

    @property
    def waiting_count(self) -> int:
        """Sequences submitted that have no slot yet."""
        with self._lock:
            return len(self._waiting)

    # -- the caller's side ------------------------------------------------------------------

    def submit(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        max_new: int,
        stop_ids: frozenset[int] = frozenset(),
        guide: TokenGuide | None = None,
        adapters: AdapterSet | None = None,
    ) -> SequenceStream:
        """Queue a sequence; its tokens come from the returned stream. Raises QueueFullError
        when `max_queue` sequences are already waiting. `guide`: the matcher of the answer's
        constraint (params.constraint), built by the caller, which has the tokenizer.
        `adapters`: the LoRA adapters its rows run with (None: the base model)."""
        if not prompt:
            raise ValueError("empty prompt")
        if params.kv_policy is not None:
            check_kv_policy(params.kv_policy)
        stream = SequenceStream(self)
        sequence = _Sequence(
            stream,
            list(prompt),
            Sampler(params, guide),
            max(1, max_new),
            frozenset(stop_ids),
            history=list(prompt),
            drafts=params.logprobs is None,
            adapters=adapters,
            priority=params.priority,
            client=params.client,
            kv_policy=params.kv_policy,
        )
        if params.logprobs is not None:
            stream.logprobs = []
        with self._lock:
            # Sequences submitted but not yet admitted to a free slot do not wait for one.
            free = max(0, self.config.slots - len(self._running))
            waiting = len(self._waiting) - free
            if waiting >= self.config.max_queue:
                raise QueueFullError(
                    f"{waiting} requests are already waiting for one of "
                    f"{self.config.slots} slots; try again shortly"
                )
            self._waiting.append(sequence)
            self._lock.notify_all()
            driver = self.driver
            if not self.driven and driver is not None:
                # From the driver's own thread (a GUI answering one message at a time on
                # it) the consumer steps; posted, the job would wait behind that consumer.
                if not getattr(driver, "on_serving_thread", False):
                    self._driven = driver.post(self._drain)
        return stream

    def reusable_prefix(self, prompt: Sequence[int], adapters: AdapterSet | None = None) -> int:
        """Prompt tokens a pooled prefix would give a sequence submitted now."""
        with self._lock:
            return self._best_prefix(prompt, adapters)[1]

    @torch.inference_mode()  # caches grown during a forward pass hold inference tensors
    def forget(self, start: int, end: int) -> bool:
        """Drop fed tokens start..end-1 from the most recently finished sequence's caches
        without evaluating anything again (a chat's oldest turns let go: its next prompt
        lacks them). False if no such sequence is pooled, or its caches can no longer do it
        (a ring that has rotated)."""
        with self._stepping, self._lock:
            self._drop_cancelled()  # a stream its reader closed: pooled now, not next step
            for pooled in reversed(self._pool):
                if not 0 < start <= end <= len(pooled.tokens):
                    continue
                if not all(cache.can_forget(start) for cache in pooled.caches):
                    return False
                for cache in pooled.caches:
                    cache.forget(start, end)
                del pooled.tokens[start:end]
                return True
        return False

    @torch.inference_mode()
    def reset(self) -> None:
        """Forget every pooled prefix: the next prompts are evaluated from scratch. The
        pooled caches stay, emptied, for new sequences to take (their storage, and any graphs
        captured over it, serve again)."""
        with self._stepping, self._lock:
            self._drop_cancelled()
            for pooled in self._pool:
                keep_first(pooled.caches, 0)
                pooled.tokens = []

    def drop_adapters(self, live: Callable[[AdapterSet], bool]) -> None:
        """Let go the pooled prefixes computed under adapters that are no longer `live`
        (unloaded: no request can pick them again, and they hold the adapter's memory),
        and pool none such from now on."""
        with self._lock:
            self.adapters_live = live
            self._pool = [pooled for pooled in self._pool if self._poolable(pooled.caches)]

    def _poolable(self, caches) -> bool:
        adapters = getattr(caches, "lora", None)
        return adapters is None or self.adapters_live is None or self.adapters_live(adapters)

    def latest_sequence(self) -> tuple[list[int], list[Cache]] | None:
        """The tokens fed and the caches of the sequence running or finished last (for
        tests and figures), between steps: taken during one, the caches could already hold
        tokens `fed` does not list yet."""
        with self._stepping, self._lock:
            self._drop_cancelled()  # a stream its reader closed: pooled now, not next step
            self._settle()  # the caches hold just what `fed` lists
            if self._running:
                return self._running[-1].fed, self._running[-1].caches
            return (self._pool[-1].tokens, self._pool[-1].caches) if self._pool else None

    def queue_position(self, stream: SequenceStream) -> int:
        with self._lock:
            for index, sequence in enumerate(self._waiting):
                if sequence.stream is stream:
                    return index + 1
        return 0

    def wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    # -- running steps ----------------------------------------------------------------------
    # Steps run on whichever thread drives them: a stream's consumer waiting for its next
    # token (`pull`), or one thread in `serve` (a server's engine loop). Only one thread
    # steps at a time. OpenMP regions started from Python's main thread run about 3x faster
    # than from any other thread here (libgomp), so the main thread should drive.

    def pull(self, stream: SequenceStream) -> None:
        """Run steps until `stream` has a token (or has ended)."""
        while stream._items.empty():
            with self._stepping:
                if stream._items.empty():
                    self.step()

    def serve(self, stop: threading.Event) -> None:
        """Run steps as work arrives until `stop` is set (an engine loop)."""
        self.serving = True
        try:
            self._serve_until(stop)
        finally:
            self.serving = False

    def _drain(self) -> None:
        """The driver's job: steps until nothing runs or waits (a later submit hands the
        driver a new one)."""
        try:
            while True:
                with self._lock:
                    if not (self._running or self._waiting):
                        self._driven = False
                        return
                with self._stepping:
                    self.step()
                if self._behind_other_work():
                    return
        except BaseException:
            with self._lock:
                self._driven = False  # consumers step for themselves again
            raise

    def _behind_other_work(self) -> bool:
        """Whether this job went to the back of the driver's queue, behind work that waits
        there (another model's steps, an embedding pass): one step each in turn, rather than
        this model's answers holding the thread until they are all done."""
        driver = self.driver
        if driver is None or not getattr(driver, "has_waiting_work", False):
            return False
        return driver.post(self._drain)  # still driven: the job carries on from there

    def _serve_until(self, stop: threading.Event) -> None:
        while not stop.is_set():
            with self._lock:
                if not (self._running or self._waiting):
                    self._lock.wait(timeout=0.1)
                    continue
            with self._stepping:
                self.step()

    @torch.inference_mode()  # caches (pooled ones too) hold inference tensors
    def step(self) -> None:
        """One forward pass over every running sequence (admitting waiting ones first)."""
        with self._lock:
            self._drop_cancelled()
            self._admit()
            if not self._running:
                return
            alone = self._drafting_alone()
            batch = [(alone, alone.pending)] if alone else self._next_batch()
        ahead = self._ahead
        if ahead is not None and not (
            ahead.continues(batch) and (alone is None or alone.decoder.plain_steps_drawn)
        ):
            self._settle()
        try:
            check_injected_fault()
            if alone is not None:
                self._run_alone(alone)
            else:
                self._run(batch)
        except torch.OutOfMemoryError as exc:
            if self.recover is None or not self.recover(exc):
                self._fail(batch, exc)
                return
            with self._lock:
                self._rebuild_caches()
        except Exception as exc:  # noqa: BLE001 - reported to every stream in the step
            self._fail(batch, exc)
        except BaseException as exc:  # Ctrl-C inside a pass: the step's sequences end
            self._fail(batch, exc, interrupted=True)
            raise

    def _fail(
        self,
        batch: list[tuple[_Sequence, list[int]]],
        exc: BaseException,
        interrupted: bool = False,
    ) -> None:
        """End the step's sequences with `exc`. An interrupted pass left some layers' caches
        a token ahead of the others: they are pooled all the same (a prompt that reuses them
        trims each cache by its own offset), as a chat goes on after Ctrl-C."""
        with self._lock:
            for sequence, _ in batch:
                self._finish(sequence, exc, pool=interrupted)

    def _rebuild_caches(self) -> None:
        """After the model moved to another device: every running sequence's caches made
        again there from the tokens it had fed (exact rows, so they hold what was lost), and
        the pool let go. A step cut short is taken again: its tokens are pending once more."""
        self._settle()
        self._pool.clear()
        for sequence in self._running:
            kept = common_prefix(sequence.fed, sequence.history)  # drafts not yet accepted out
            del sequence.fed[kept:]
            sequence.caches = self.runner.make_caches(sequence.kv_policy)
            self.runner.replay(sequence.fed, sequence.caches)
            sequence.pending = sequence.history[kept:]
            sequence.decoder = None  # its drafters ran on the old model

    def _drop_cancelled(self) -> None:
        for sequence in [s for s in self._running if s.stream.cancelled.is_set()]:
            self._finish(sequence)
        for sequence in [s for s in self._waiting if s.stream.cancelled.is_set()]:
            self._waiting.remove(sequence)
            sequence.stream._items.put(_END)

    def _admit(self) -> None:
        """The next in turn (`_next_in_turn`), while a slot is free and its KV fits."""
        while self._waiting and len(self._running) < self.config.slots:
            sequence = self._next_in_turn()
            if not self._room_for(sequence):
                return
            self._waiting.remove(sequence)
            self._admissions += 1
            self._last_turn[sequence.client] = self._admissions
            sequence.stream.queued_s = time.perf_counter() - sequence.stream.submitted_at
            self._give_caches(sequence)
            self._running.append(sequence)

    def _next_in_turn(self) -> _Sequence:
        """The most urgent priority's waiting sequences; of those, the first of the client
        whose latest admission is the oldest (a client never admitted goes first)."""
        urgent = min(sequence.priority for sequence in self._waiting)
        first_of_client: dict[str | None, _Sequence] = {}
        for sequence in self._waiting:  # in arrival order
            if sequence.priority == urgent:
                first_of_client.setdefault(sequence.client, sequence)
        return min(first_of_client.values(), key=lambda s: self._last_turn.get(s.client, 0))

    def kv_bytes_reserved(self) -> int:
        """KV memory the running sequences may reach, and what pooled prefixes hold. Safe
        from any thread (the lock is reentrant: admission calls it holding the lock)."""
        with self._lock:
            running = sum(self._reservation(s.prompt, s.max_new) for s in self._running)
            pooled = sum(self._held_bytes(len(p.tokens)) for p in self._pool)
            return running + pooled

    def _reservation(self, prompt: list[int], max_new: int) -> int:
        return self._held_bytes(len(prompt) + max_new)

    def _held_bytes(self, tokens: int) -> int:
        # Past the context the caches are rings: they hold at most a context's worth.
        return self.kv_bytes_per_token * min(tokens, self.policy.ctx)

    def _room_for(self, sequence: _Sequence) -> bool:
        """Whether `sequence` may start now, letting pooled prefixes go to make room (the
        one it would reuse last). A sequence alone always starts: it cannot wait for room."""
        budget = self.config.kv_budget_bytes
        if budget is None:
            return True
        need = self._reservation(sequence.prompt, sequence.max_new)
        running = sum(self._reservation(s.prompt, s.max_new) for s in self._running)
        if running + need > budget and self._running:
            return False
        reused = self._best_prefix(sequence.prompt, sequence.adapters)[0]
        for pooled in sorted(self._pool, key=lambda p: p is reused):  # oldest first
            if self.kv_bytes_reserved() + need <= budget:
                break
            self._pool.remove(pooled)
        return True

    def _best_prefix(
        self, prompt: Sequence[int], adapters: AdapterSet | None, kv_policy: str | None = None
    ) -> tuple[_Pooled | None, int]:
        """The pooled caches sharing the longest prefix with the prompt, computed under the
        same adapters at the same scales (keys and values under other adapters differ:
        llama.cpp once reused them across adapters, #26207), and keeping tokens by the same
        KV policy."""
        best, shared = None, 0
        key = _adapter_key(adapters)
        for pooled in self._pool:
            if _adapter_key(getattr(pooled.caches, "lora", None)) != key:
                continue
            if self._policy_of(pooled.caches) != (kv_policy or self.policy.kv_policy):
                continue
            length = reusable_length(pooled.caches, pooled.tokens, prompt)
            if length > shared:
                best, shared = pooled, length
        return best, shared

    def _give_caches(self, sequence: _Sequence) -> None:
        """The pooled caches holding the longest prefix of the prompt, trimmed to it, or
        fresh ones. At least the prompt's last token is fed again (its logits are needed)."""
        prompt = sequence.prompt
        best, shared = self._best_prefix(prompt, sequence.adapters, sequence.kv_policy)
        if best is None:
            sequence.caches = self._fresh_caches(sequence.kv_policy)
        else:
            self._pool.remove(best)
            keep_first(best.caches, shared)
            sequence.caches, sequence.fed = best.caches, best.tokens[:shared]
        if isinstance(sequence.caches, SequenceCaches):
            sequence.caches.lora = sequence.adapters  # the passes read the adapters here
            sequence.caches.lora_pass = None
        if self._policy_of(sequence.caches) != WINDOW_POLICY:
            open_prompts(sequence.caches)
        sequence.pending = prompt[shared:]
        sequence.stream.cached_prompt_tokens = shared

    def _fresh_caches(self, kv_policy: str | None = None) -> list[Cache]:
        """Empty caches: the oldest pooled prefix's, cleared, when the pool is full (their
        storage, and any graphs captured over it, serve again, if they keep tokens by the
        same policy), else new ones."""
        if self._pool and len(self._pool) >= self.config.pooled_prefixes:
            caches = self._pool.pop(0).caches
            if self._policy_of(caches) == (kv_policy or self.policy.kv_policy):
                keep_first(caches, 0)
                return caches
        return self.runner.make_caches(kv_policy)

    def _policy_of(self, caches: list[Cache]) -> str:
        return getattr(caches, "kv_policy", None) or self.policy.kv_policy

    def _next_batch(self) -> list[tuple[_Sequence, list[int]]]:
        """Every decoding sequence's next token, and prompt chunks while the step's prompt
        budget lasts: what is left of `step_rows` beside decode rows, large when nothing
        decodes."""
        config = self.config
        batch = [(s, s.pending[:1]) for s in self._running if not s.prefilling]
        budget = max(config.min_prefill_rows, config.step_rows - len(batch))
        chunk_rows = config.prefill_chunk
        if not batch:
            budget = chunk_rows = config.idle_prefill_rows
        # The most urgent prompts first (a stable sort: then in order of admission).
        for sequence in sorted(self._running, key=lambda s: s.priority):
            if sequence.prefilling and budget > 0:
                limit = min(chunk_rows, budget, self.runner.max_chunk(sequence.caches))
                chunk = sequence.pending[:limit]
                batch.append((sequence, chunk))
                budget -= len(chunk)
        return batch

    def _drafting_alone(self) -> _Sequence | None:
        """The one running sequence, when nothing waits, it is decoding, and it drafts."""
        if len(self._running) != 1 or self._waiting or self.decoder_factory is None:
            return None
        sequence = self._running[0]
        if sequence.prefilling or not sequence.drafts:
            return None
        if sequence.decoder is None:
            sequence.decoder = self.decoder_factory(sequence.caches, sequence.fed, sequence.sampler)
            if sequence.decoder is None:
                sequence.drafts = False
                return None
            sequence.decoder.draw_one = self._lone_draw(sequence)
            sequence.decoder.before_verify = self._settle
            stats = sequence.stream.speculation or sequence.decoder.stats
            sequence.decoder.stats = sequence.stream.speculation = stats
            sequence.decoder.observe(sequence.history[:-1])  # the last one is pending
        return sequence

    def _run_alone(self, sequence: _Sequence) -> None:
        """A speculative step: the pending token, and the drafts it keeps, in one pass."""
        assert sequence.decoder is not None
        new = sequence.decoder.advance(sequence.history)
        sequence.pending = []
        self.steps += 1
        self.peak_batch = max(self.peak_batch, 1)
        for token in new:
            if self._emit(sequence, token):
                return

    def _run(self, batch: list[tuple[_Sequence, list[int]]]) -> None:
        rows, wanting, at = [], [], 0
        for sequence, tokens in batch:
            at += len(tokens)
            if len(tokens) == len(sequence.pending):  # its prompt's end, or its last token
                rows.append(at - 1)
                wanting.append(sequence)
        step_rows = [(tokens, s.caches) for s, tokens in batch]
        drawn = None
        if len(wanting) == len(batch) == at:  # one token a sequence, each wanting the next
            drawn = self._draw_on_device(wanting, step_rows)
        logits = None if drawn is not None else self.runner.logits(step_rows, rows)
        self.steps += 1
        self.peak_batch = max(self.peak_batch, len(batch))
        for sequence, tokens in batch:
            sequence.decoder = None  # its drafters missed these tokens: a new one later
            sequence.fed.extend(tokens)
            del sequence.pending[: len(tokens)]
        for sequence in wanting:  # a prompt's end: caches that choose by attention choose
            if self._policy_of(sequence.caches) != WINDOW_POLICY:
                close_prompts(sequence.caches)
        if drawn is not None:
            for sequence, token in zip(wanting, drawn, strict=True):
                sequence.history.append(token)
                self._emit(sequence, token)
            return
        assert logits is not None
        for sequence, row in zip(wanting, logits, strict=True):
            try:
                self._sample(sequence, row)
            except Exception as exc:  # noqa: BLE001 - its own settings: the others go on
                with self._lock:
                    self._finish(
                        sequence, SamplingError(f"this answer could not be sampled: {exc}")
                    )

    def _lone_draw(self, sequence: _Sequence) -> PlainDraw:
        """A speculating sequence's plain steps: drawn inside the step as a batch's are, the
        next one queued ahead. If its drafters then draft, the decoder takes that step back
        first (`before_verify`): a GPU step wasted on each verification, against the host's
        time saved on every plain step (drafts are rare where they do not pay)."""

        def draw(token: int, history: Sequence[int]) -> int | None:
            rows = [([token], sequence.caches)]
            drawn = self._draw_on_device([sequence], rows, sequence.decoder)
            return None if drawn is None else drawn[0]

        return draw

    def _draw_on_device(
        self,
        wanting: list[_Sequence],
        step_rows: list[tuple[list[int], list[Cache]]],
        decoder: SpeculativeDecoder | None = None,
    ) -> list[int] | None:
        """The sequences' next tokens drawn inside their decode step (None: sample on the
        host). The step queued ahead last time, if any, is this one. Before waiting for
        its tokens, the next step is queued, fed them on the device, where nothing about
        the sequences depends on them (`_overlappable`); a speculating sequence's `decoder`
        must take plain steps through here."""
        settings = functools.partial(self._device_settings, wanting)
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            launched: DrawnTokens | None = ahead.drawn
            self.overlapped += 1
        else:
            launched = self.runner.launch_decode(step_rows, settings)
        if launched is None:
            return None
        overlap = self.config.overlap_steps and all(_overlappable(s) for s in wanting)
        if overlap and (decoder is None or decoder.plain_steps_drawn):
            rewinds = [s.sampler.rewind_point() for s in wanting if not s.sampler.params.greedy]
            following = self.runner.launch_after(launched, settings)
            if following is not None:
                self._ahead = _Ahead(following, wanting, rewinds)
            else:  # not taken (or it failed): draws it made are drawn again next step
                for rewind in rewinds:
                    rewind()
        return launched.ids()

    def _settle(self) -> None:
        """Undo the step queued ahead, if any: its sequences' caches forget the token it
        fed (it was not read yet, so nothing else knows of it) and their samplers take
        back its draws. Before anything changes which sequences run, or reads their
        caches."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        try:
            ahead.drawn.step.take_back()
        except Exception as exc:  # noqa: BLE001 - the step that failed reports it itself
            log.warning("a decode step queued ahead failed: %s", exc)
        for rewind in ahead.rewinds:
            rewind()

    def _device_settings(
        self, sequences: list[_Sequence]
    ) -> tuple[SamplingTensors, list[float]] | None:
        """The sequences' sampling settings for a step that draws their tokens on the device,
        and one uniform each from its own sampler's random stream; None where one must be
        sampled on the host: it asks for log-probabilities (read off the logits), or its
        grammar's mask could not be had (the host sampler then reports the error)."""
        if any(s.stream.logprobs is not None for s in sequences):
            return None
        samplers = [s.sampler for s in sequences]
        histories = [s.history for s in sequences]
        return device_sampling_inputs(samplers, histories, self.model.config.vocab_size)

    def _sample(self, sequence: _Sequence, logits: torch.Tensor) -> None:
        token = sequence.sampler(logits, sequence.history)
        logprobs = sequence.stream.logprobs
        if logprobs is not None:  # before the token reaches the stream's reader
            logprobs.append(token_logprob(logits, token, sequence.sampler.params.logprobs))
        sequence.history.append(token)
        self._emit(sequence, token)

    def _emit(self, sequence: _Sequence, token: int) -> bool:
        """Hand a sampled token (already in `history`) to the stream; True if that ends
        the sequence, else it is the next to feed."""
        sequence.generated += 1
        sequence.stream._items.put(token)
        if token in sequence.stop_ids or sequence.generated >= sequence.max_new:
            with self._lock:
                self._finish(sequence)
            return True
        sequence.pending = [token]
        return False

    def _finish(
        self, sequence: _Sequence, error: BaseException | None = None, pool: bool = False
    ) -> None:
        """End the sequence's stream and free its slot; its caches go to the prefix pool
        (after an error only with `pool`)."""
        self._settle()  # a step queued ahead fed it a token its caches must not keep
        if sequence in self._running:
            self._running.remove(sequence)
        sequence.stream._items.put(error if error is not None else _END)
        whole = len(sequence.fed) == _offset(sequence)
        poolable = sequence.caches and self._poolable(sequence.caches)
        if (error is None or pool) and poolable and (whole or pool):
            self._pool.append(_Pooled(sequence.fed, sequence.caches))
            del self._pool[: max(0, len(self._pool) - self.config.pooled_prefixes)]
        sequence.caches = []


def _overlappable(sequence: _Sequence) -> bool:
    """Whether the sequence's next step may be queued before its token is read: its
    sampling settings do not depend on that token (no penalties, no grammar; log
    probabilities are read off the logits on the host), and it will want the token after
    (its limit not reached, not cancelled)."""
    sampler = sequence.sampler
    return (
        sampler.guide is None
        and not penalizes(sampler.params)
        and sequence.stream.logprobs is None
        and sequence.generated + 1 < sequence.max_new
        and not sequence.stream.cancelled.is_set()
    )


def _adapter_key(adapters: AdapterSet | None) -> tuple:
    return () if adapters is None else adapters.key


def kv_bytes_per_token(model: DecoderModel, kind: KVSetting) -> int:
    """Bytes of keys and values one token takes over all layers, stored as `kind` (the
    policy's kv type; a local layer's ring is smaller, so this errs on the safe side)."""
    c = model.config
    return bytes_per_token(kind, c.n_layers, c.n_kv_heads, c.head_dim)


def _offset(sequence: _Sequence) -> int:
    """Tokens the caches hold (a step cut short leaves them ahead of `fed`)."""
    return sequence.caches[0].offset

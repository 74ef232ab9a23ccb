"""The model runner: runs one step's rows on the device, for the scheduler that composed it.

A step is a list of (tokens, caches) pairs, one per sequence: a decode row, a prompt chunk,
or (through a drafter) verification rows. The runner only computes: it never decides which
sequence runs, and it keeps no sequence's state beyond the caches it is handed. What it owns
is how rows reach the device:

- one sequence alone goes through the model's single-sequence pass (its fused layer takes a
  decode row or a short chunk in one native call a layer);
- several go through one batched pass, each over its own caches;
- decode rows, on a device that replays graphs, go through a fixed-shape step
  (models/static_step.py): a sequence alone through the one built over its caches and kept
  with them, several through one built over all their caches, one row each (padding a
  batch to a bucket of rows with repeated sequences would save no compilation: torch
  compiles a padded batch apart from a full one). There the step can also draw the rows'
  tokens (`sample_decode`), so that only their ids come back from the device.

Every row comes out as a decode step of its sequence alone would compute it (prompt chunks
take the exact-rows path), so a sequence's tokens do not depend on how its prompt was
chunked, on which sequences shared its steps, or on which of these routes a row took. One
exception, for speed: on a GPU a long prompt chunk attends in one fused call
(`attention_backends.fuses_prefixes`), equal to the row-by-row result up to rounding.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

import torch

from ..kv.cache import Cache
from ..lora.registry import AdapterSet
from ..models import CachePolicy, DecoderModel
from ..models.static_step import (
    DrawnTokens,
    StaticDecodeStep,
    StaticVerifyStep,
    static_step_unsupported,
)
from ..platform.graphs import Runner, batched_runner, verifying_runner
from ..speculative.speculative_decoder import RowsVerifier
from ..tokens.constraints import TokenGuide
from ..tokens.device_sampler import SamplingTensors
from ..tokens.sampler import Sampler

log = logging.getLogger("miniapp.engine")

Rows = Sequence[tuple[Sequence[int], list[Cache]]]
T = TypeVar("T")
# Batched fixed-shape steps kept (each holds its own graphs): the sets of sequences decoding
# together change as they come and go.
BATCH_STEPS_KEPT = 4


class SequenceCaches(list):
    """One sequence's caches, one per layer, with the fixed-shape step built over them (a
    GPU's captured graphs), so the step travels with the caches through the prefix pool."""

    static_step: StaticDecodeStep | None = None
    # Speculative verification's fixed-shape steps, by row count (drafts + 1).
    verify_steps: dict[int, StaticVerifyStep] | None = None
    # The LoRA adapters its tokens were computed with (engine/lora; None: the base alone):
    # every pass over these caches applies them, and the prefix pool reuses the caches only
    # for the same adapters.
    lora: AdapterSet | None = None
    lora_pass: tuple | None = None  # the last pass's grouping of adapters (engine/lora/rows.py)
    kv_policy: str | None = None  # which tokens its caches keep once full (CachePolicy)


class ModelRunner:
    """Runs steps of `model` over caches made by the policy. `graphs`: the device's runner
    for fixed-shape decode steps (None: every step eager, as on a CPU)."""

    def __init__(
        self,
        model: DecoderModel,
        policy: CachePolicy,
        graphs: Runner | None = None,
        graph_note: str = "eager steps",
    ):
        self.model, self.policy = model, policy
        self.graphs, self.graph_note = graphs, graph_note
        self.latest_static_step: StaticDecodeStep | None = None
        self._batch_steps: dict[tuple[int, ...], StaticDecodeStep] = {}
        self.verifications = 0  # drafts verified through a fixed-shape step
        # Told why graphs were given up (the runtime records it as a device fallback).
        self.on_graph_failure: Callable[[str], None] | None = None

    def use_model(self, model: DecoderModel, graphs: Runner | None, graph_note: str) -> None:
        """Run another model from now on (a fallback to the CPU); caches made for the old
        one are no longer valid."""
        self.model, self.graphs, self.graph_note = model, graphs, graph_note
        self.latest_static_step = None
        self._batch_steps.clear()

    def stop_graphs(self, note: str) -> None:
        """Every step eager from now on (the GPU check's comparison of the two)."""
        self.graphs, self.latest_static_step, self.graph_note = None, None, note
        self._batch_steps.clear()

    def make_caches(self, kv_policy: str | None = None) -> SequenceCaches:
        """Fresh caches for one sequence (allocated in full where steps replay graphs: the
        graph reads fixed addresses), keeping tokens as `kv_policy` says (None: the
        policy's own)."""
        policy = self.policy
        if kv_policy is not None and kv_policy != policy.kv_policy:
            policy = replace(policy, kv_policy=kv_policy)
        caches = SequenceCaches(self.model.make_caches(policy))
        caches.kv_policy = policy.kv_policy
        if self.graphs is not None:
            for cache in caches:
                cache.reserve()
        return caches

    def max_chunk(self, caches: list[Cache]) -> int:
        """Prompt rows one sequence may feed in the next step (as exact rows)."""
        return self.model.max_chunk(caches, exact_rows=True)

    @torch.inference_mode()
    def logits(self, rows: Rows, wanted: Sequence[int]) -> torch.Tensor:
        """Run one step: each (tokens, caches) pair appends its tokens to its caches. Returns
        fp32 logits [len(wanted), vocab] of the rows `wanted` (indices over all rows)."""
        decode_rows = all(len(tokens) == 1 for tokens, _ in rows)
        if decode_rows and list(wanted) == list(range(len(rows))):
            if len(rows) == 1:
                return self.decode_one(rows[0][0][0], rows[0][1])[None]
            replayed = self._replay_batch(rows)
            if replayed is not None:
                return replayed
        if len(rows) == 1:
            tokens, caches = rows[0]
            hidden = self.model.hidden_states(torch.tensor(list(tokens)), caches, True)
        else:
            hidden = self.model.hidden_segments(rows)
        if not wanted:
            return hidden.new_empty(0, 0)
        return self.model.logits(hidden[list(wanted)])

    @torch.inference_mode()
    def sample_decode(
        self, rows: Rows, settings: Callable[[], tuple[SamplingTensors, list[float]] | None]
    ) -> list[int] | None:
        """Decode rows (one token each) through their fixed-shape step with each row's next
        token drawn on the device: the ids, one a row, with only them read back. `settings`
        gives the rows' sampling settings and uniforms (None: sample on the host after
        all); it is called only once the step can run, so that no random draw is spent on a
        step that does not. None where no token was drawn (a CPU, caches not in their
        steady state): the caller runs `logits` and samples on the host instead."""
        launched = self.launch_decode(rows, settings)
        return None if launched is None else launched.ids()

    @torch.inference_mode()
    def launch_decode(
        self, rows: Rows, settings: Callable[[], tuple[SamplingTensors, list[float]] | None]
    ) -> DrawnTokens | None:
        """`sample_decode`, returning as soon as the step is queued: the caller may queue
        the next one (`launch_after`) before it waits for these ids."""
        if self.graphs is None or any(len(tokens) != 1 for tokens, _ in rows):
            return None
        sequences = [caches for _, caches in rows]
        step = self._static_step(sequences[0]) if len(rows) == 1 else self._batch_step(sequences)
        if step is None or not step.ready():
            return None
        inputs = settings()
        if inputs is None:
            return None
        tensors, uniforms = inputs
        return self._through(step, lambda s: s.launch([t[0] for t, _ in rows], tensors, uniforms))

    @torch.inference_mode()
    def launch_after(
        self,
        drawn: DrawnTokens,
        settings: Callable[[], tuple[SamplingTensors, list[float]] | None],
    ) -> DrawnTokens | None:
        """The same sequences' next step, fed the tokens `drawn` will bring, queued before
        the host has them: the host's work for step n+1 overlaps the GPU's step n. The
        settings must not depend on those tokens. None where the step cannot be taken
        (graphs given up, the caches out of their steady state)."""
        step = drawn.step
        if self.graphs is None or step.model is not self.model or not step.ready():
            return None
        inputs = settings()
        if inputs is None:
            return None
        tensors, uniforms = inputs
        return self._through(step, lambda s: s.launch(None, tensors, uniforms))

    def verifier(self, caches: list[Cache]) -> RowsVerifier:
        """`verify_rows` bound to one sequence's caches (a speculative decoder's
        verifications of drafts from tokens)."""
        return lambda tokens: self.verify_rows(tokens, caches)

    @torch.inference_mode()
    def verify_rows(
        self, tokens: Sequence[int], caches: list[Cache]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Feed one sequence's `tokens` ([pending, *drafts]) through its fixed-shape
        verification step: each row as its decode step computes it. Returns the rows'
        final-normed states [rows, dim] and fp32 logits [rows, vocab]; None where graphs are
        off or the caches cannot take the rows in one step (the caller verifies op by op)."""
        step = self._verify_step(caches, len(tokens))
        if step is None or not step.ready():
            return None
        verified = self._through(step, lambda s: s.verify(list(tokens)), latest=False)
        self.verifications += verified is not None
        return verified

    def _verify_step(self, caches: list[Cache], rows: int) -> StaticVerifyStep | None:
        if rows < 2 or self._static_step(caches) is None:
            return None  # also: no graphs, adapters, caches without fixed-shape steps
        assert isinstance(caches, SequenceCaches)
        steps = caches.verify_steps
        if steps is None or any(step.model is not self.model for step in steps.values()):
            steps = caches.verify_steps = {}
        if rows not in steps:
            runner = verifying_runner(self.graphs, rows)
            steps[rows] = StaticVerifyStep(self.model, caches, rows, runner)
        return steps[rows]

    def stepper(self, caches: list[Cache]) -> Callable[[int], torch.Tensor]:
        """`decode_one` bound to one sequence's caches (a drafting decoder's plain steps)."""
        return lambda token: self.decode_one(token, caches)

    @torch.inference_mode()
    def decode_one(self, token: int, caches: list[Cache]) -> torch.Tensor:
        """One decode step of one sequence; fp32 logits [vocab]. Through its fixed-shape
        step where the device replays graphs and the caches are in their steady state."""
        step = self._static_step(caches)
        if step is not None and step.ready():
            logits = self._through(step, lambda s: s(token)[0])
            if logits is not None:
                return logits
        hidden = self.model.hidden_states(torch.tensor([token]), caches)
        return self.model.logits(hidden)[0]

    def _replay_batch(self, rows: Rows) -> torch.Tensor | None:
        """Decode rows of several sequences through their fixed-shape batched step (a
        graph per span bucket, as a lone step has); None when graphs are off or a sequence's
        caches are not in their steady state (the eager batched pass runs instead)."""
        step = self._batch_step([caches for _, caches in rows])
        if step is None or not step.ready():
            return None
        return self._through(step, lambda s: s.step([tokens[0] for tokens, _ in rows]))

    def _through(
        self, step: StaticDecodeStep, run: Callable[[StaticDecodeStep], T], latest: bool = True
    ) -> T | None:
        """`run(step)`; None where the step failed (its capture, say): every step runs
        as ordinary code from then on, this one included. `latest`: a decode step, which
        `latest_static_step` then names."""
        try:
            if latest:
                self.latest_static_step = step
            return run(step)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as exc:
            self._give_up_graphs(exc)
            return None

    def _batch_step(self, sequences: list[list[Cache]]) -> StaticDecodeStep | None:
        """The batched step over these sequences' caches, built on first use and kept for
        the next steps with the same sequences (the most recent few sets)."""
        if self.graphs is None or not all(isinstance(c, SequenceCaches) for c in sequences):
            return None
        if any(caches.lora is not None for caches in sequences):
            return None  # adapters run eagerly (no captured graph holds them)
        key = tuple(id(caches) for caches in sequences)
        step = self._batch_steps.pop(key, None)
        same = step is not None and all(
            a is b for a, b in zip(step.sequences, sequences, strict=True)
        )
        if not same or step.model is not self.model:
            if any(self._static_step(caches) is None for caches in sequences):
                return None  # the caches cannot take fixed-shape steps (the reason is noted)
            runner = batched_runner(self.graphs, len(sequences))
            step = StaticDecodeStep(self.model, runner=runner, batch=sequences)
        self._batch_steps[key] = step  # most recent last
        while len(self._batch_steps) > BATCH_STEPS_KEPT:
            del self._batch_steps[next(iter(self._batch_steps))]
        return step

    def _static_step(self, caches: list[Cache]) -> StaticDecodeStep | None:
        if self.graphs is None or not isinstance(caches, SequenceCaches):
            return None
        if caches.lora is not None:
            return None  # adapters run eagerly (no captured graph holds them)
        if caches.static_step is None or caches.static_step.model is not self.model:
            reason = static_step_unsupported(self.model, caches)
            if reason is not None:
                self.graphs, self.graph_note = None, f"eager steps: {reason}"
                return None
            caches.static_step = StaticDecodeStep(self.model, caches, self.graphs)
        return caches.static_step

    def _give_up_graphs(self, exc: RuntimeError) -> None:
        reason = _first_line(exc)
        log.warning("decode steps run eagerly from now on: the graph failed: %s", reason)
        self.stop_graphs(f"eager steps: the graph failed: {reason}")
        if self.on_graph_failure is not None:
            self.on_graph_failure(reason)

    @torch.inference_mode()
    def replay(self, tokens: Sequence[int], caches: list[Cache]) -> None:
        """Feed `tokens` into caches as the steps that first fed them computed them (exact
        rows, whatever the chunks): caches rebuilt on another device hold what was lost."""
        done = 0
        while done < len(tokens):
            chunk = list(tokens[done : done + self.max_chunk(caches)])
            self.model.hidden_states(torch.tensor(chunk), caches, exact_rows=True)
            done += len(chunk)


def device_sampling_inputs(
    samplers: Sequence[Sampler], histories: Sequence[Sequence[int]], vocab: int
) -> tuple[SamplingTensors, list[float]] | None:
    """Settings for a step that draws each row's next token on the device, one row a sampler
    after its history, and one uniform each from the sampler's own random stream; None where
    a grammar's mask could not be had (the host sampler then reports the error)."""
    try:
        masks = [_grammar_mask(s.guide, h, vocab) for s, h in zip(samplers, histories, strict=True)]
    except Exception:  # noqa: BLE001 - raised again, for this sequence only, on the host
        return None
    allowed = None
    if any(mask is not None for mask in masks):
        every = torch.ones(vocab, dtype=torch.bool)
        allowed = torch.stack([every if mask is None else mask for mask in masks])
    params = [sampler.params for sampler in samplers]
    settings = SamplingTensors.build(params, histories, vocab, allowed)
    # Greedy rows draw nothing, as the host sampler does not.
    uniforms = [0.0 if s.params.greedy else s.uniform() for s in samplers]
    return settings, uniforms


def _grammar_mask(
    guide: TokenGuide | None, history: Sequence[int], vocab: int
) -> torch.Tensor | None:
    """bool [vocab]: the tokens the grammar allows next (None: there is none); tokens past
    the grammar's own vocabulary are not allowed, as the host sampler masks them."""
    if guide is None:
        return None
    allowed = torch.from_numpy(guide.allowed_after(history))[:vocab]
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[: len(allowed)] = allowed
    return mask


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

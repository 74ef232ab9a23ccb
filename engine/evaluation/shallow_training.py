"""Training the shallow-exit block (`miniapp calibrate --train-head --head-form shallow`).

It learns from the same corpus as the last-state head (`head_training`: the model's own
answers with its top probabilities at every step), so a run that trains both collects once.

1. Exit states: each prompt and answer goes through the model's first `layer` layers in
   prompt chunks (teacher-forced), keeping the last `window` prompt positions as context.
2. Self-distillation: the block, over a sequence's exit states, learns the model's
   distribution at every answer position (cross-entropy against the teacher's top
   probabilities within the draft vocabulary).
3. Held out: on the bench's chat questions, the block's choice and confidence at every
   position of the model's greedy answers. A chain of drafts reads true exit states (the
   first layers run for real), so the teacher-forced per-position agreement gives every
   chain's length at once.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import MiniappError
from ..models import CachePolicy
from ..models.decoder import DecoderModel
from ..runtimes.torch_runtime import TorchRuntime
from ..speculative.drafter import Draft
from ..speculative.shallow_head import (
    WINDOW,
    BlockWeights,
    ShallowBlock,
    ShallowExitDrafter,
    block_rope,
)
from ..tokens.sampling import GREEDY
from .head_training import (
    Answer,
    ChainLink,
    HeadTrainingPlan,
    Progress,
    best_policy,
    coverage,
    dense_head_rows,
    draft_vocabulary,
    first_link_agreement,
    hidden_width,
    policy_record,
    record_answer,
)

SHALLOW_VOCAB = 8192  # draft vocabulary (the last-state head's measured choice on SmolLM2)
SEQUENCES_PER_STEP = 2


def default_exit_layer(n_layers: int) -> int:
    """About a tenth of the depth (Kangaroo exits after 2 of 32 layers): the first layers
    must cost little, since every draft runs them."""
    return max(1, round(n_layers / 10))


@dataclass
class ExitSequence:
    """One prompt and answer at the exit: states of positions first..first+n-1, and the
    teacher's top ids / probabilities for the rows from `answer_from` on."""

    first: int
    states: torch.Tensor  # bf16 [n, dim]
    answer_from: int
    top_ids: torch.Tensor  # int32 [answer rows, TEACHER_TOP]
    top_probs: torch.Tensor  # f16


@torch.inference_mode()
def exit_sequence(
    model: DecoderModel, prompt: list[int], answer: Answer, layer: int, window: int
) -> ExitSequence:
    """Answer row r is the state after feeding `answer.fed[r]` (its row 0 is the prompt's
    last token), at position len(prompt) - 1 + r."""
    rows = answer.states.shape[0]
    tokens = [*prompt, *answer.fed[1:rows]]
    caches = model.make_caches(CachePolicy(len(tokens) + 1, streaming=False))
    states = []
    for start in range(0, len(tokens), model.max_chunk(caches)):
        chunk = tokens[start : start + model.max_chunk(caches)]
        x = model.embed_tokens(torch.tensor(chunk))
        states.append(model.run_layers(x, caches, 0, layer).to(torch.bfloat16))
    first = max(0, len(prompt) - window)
    return ExitSequence(
        first, torch.cat(states)[first:], len(prompt) - 1 - first, answer.top_ids, answer.top_probs
    )


@dataclass(frozen=True)
class BlockTraining:
    steps: int = 1500
    learning_rate: float = 1e-3
    weight_decay: float = 0.1
    seed: int = 0


def train_block(
    model: DecoderModel,
    sequences: Sequence[ExitSequence],
    vocab: torch.Tensor,
    layer: int,
    config: BlockTraining = BlockTraining(),
    report: Callable[[int, float], None] = lambda step, loss: None,
    window: int = WINDOW,
    weights: BlockWeights | None = None,
) -> BlockWeights:
    """Self-distillation of the block over whole sequences, on one cosine schedule, from
    `weights` when given (else a block that passes the exit state through)."""
    dim = model.config.dim
    weights = weights or BlockWeights.initial(
        dim, hidden_width(dim), vocab, layer, window, config.seed
    )
    target = _Targets(vocab, model.config.vocab_size)
    head, cap = dense_head_rows(model, vocab), model.config.final_logit_softcap
    rope = block_rope()
    params = weights.parameters()
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    generator = torch.Generator().manual_seed(config.seed)
    for step in range(config.steps):
        lr = config.learning_rate * 0.5 * (1 + math.cos(math.pi * step / config.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        picks = torch.randint(len(sequences), (SEQUENCES_PER_STEP,), generator=generator)
        loss = sum(
            _sequence_loss(model, weights, rope, head, cap, target, sequences[int(i)])
            for i in picks
        ) / len(picks)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        report(step, loss.item())
    for p in params:
        p.requires_grad_(False)
    return weights


class _Targets:
    """Teacher ids mapped into the draft vocabulary (probability 0 outside it)."""

    def __init__(self, vocab: torch.Tensor, vocab_size: int):
        self.index = torch.full((vocab_size,), -1, dtype=torch.long)
        self.index[vocab] = torch.arange(len(vocab))

    def __call__(self, sequence: ExitSequence) -> tuple[torch.Tensor, torch.Tensor]:
        mapped = self.index[sequence.top_ids.long()]
        return mapped.clamp_min(0), sequence.top_probs.float() * (mapped >= 0)


def block_logits(model, weights: BlockWeights, rope, head, cap, sequence: ExitSequence):
    """Draft-vocabulary logits at the sequence's answer rows [rows, len(vocab)]."""
    x = weights.forward(sequence.states.float(), rope, sequence.first)
    x = x[sequence.answer_from : sequence.answer_from + sequence.top_ids.shape[0]]
    norm = model.norm
    logits = F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps) @ head.T
    return torch.tanh(logits / cap) * cap if cap else logits


def _sequence_loss(model, weights, rope, head, cap, target, sequence) -> torch.Tensor:
    log_q = torch.log_softmax(block_logits(model, weights, rope, head, cap, sequence), -1)
    ids, probs = target(sequence)
    return -(probs * log_q.gather(1, ids)).sum(-1).mean()


# ------------------------------------------------------------------------- held out


@torch.inference_mode()
def held_out_chains(
    model: DecoderModel,
    block: ShallowBlock,
    prompts: Sequence[list[int]],
    answers: Sequence[Answer],
    depth: int,
) -> list[list[ChainLink]]:
    """From every row of greedy answers, the chain of drafts the block would make: its
    links up to the first disagreement (included) or `depth`. The block runs as drafting
    runs it (int4, its memory filled by the model's tap), over teacher-forced positions."""
    chains = []
    for prompt, answer in zip(prompts, answers, strict=True):
        caches = model.make_caches(CachePolicy(len(prompt) + len(answer.fed) + 1, streaming=False))
        drafter = ShallowExitDrafter(model, block)
        previous, model.exit_tap = model.exit_tap, block
        try:
            model.run_layers(model.embed_tokens(torch.tensor(prompt[:-1])), caches, 0, block.layer)
            links = []
            for token, following in zip(answer.fed[:-1], answer.fed[1:], strict=True):
                logits = block.draft_logits(
                    drafter.early_state(token, caches), caches[block.layer - 1]
                )
                probs = torch.softmax(logits, -1)
                best = int(probs.argmax())
                links.append(ChainLink(float(probs[best]), int(block.vocab[best]) == following))
        finally:
            model.exit_tap = previous
        for r in range(len(links)):
            chain = []
            for link in links[r : r + depth]:
                chain.append(link)
                if not link.agrees:
                    break
            chains.append(chain)
    return chains


@dataclass(frozen=True)
class ShallowCosts:
    plain_s: float
    row_cost: float  # each draft's first-layer pass plus its verified row above, in steps
    draft_cost: float  # one block pass and its draft logits, in plain steps


@torch.inference_mode()
def measure_shallow_costs(
    runtime: TorchRuntime, block: ShallowBlock, context: list[int], depth: int
) -> ShallowCosts:
    """After `context`: a plain step, the block's pass, and verifications of 1..depth
    drafts through the upper layers (each draft also pays its first-layer pass), timed in
    interleaved rounds; the row cost is the least-squares slope in plain steps."""
    from .head_training import COST_ROUNDS

    model = runtime.model
    caches = model.make_caches(runtime.policy)
    previous, model.exit_tap = model.exit_tap, block
    drafter = ShallowExitDrafter(model, block)
    try:
        model.hidden_states(torch.tensor(context), caches)
        token = context[-1]
        samples: dict[int, list[float]] = {n: [] for n in range(0, depth + 1)}
        block_s = []
        for _ in range(COST_ROUNDS):
            for drafts in samples:
                start = time.perf_counter()
                if drafts == 0:
                    model.logits(model.hidden_states(torch.tensor([token]), caches))
                else:
                    states = [drafter.early_state(token, caches) for _ in range(drafts + 1)]
                    drafter.verify(caches, Draft([token] * drafts, None, torch.cat(states)))
                samples[drafts].append(time.perf_counter() - start)
                for cache in caches:
                    cache.trim(drafts + 1)
            state = drafter.early_state(token, caches)
            start = time.perf_counter()
            block.draft_logits(state, caches[block.layer - 1])
            block_s.append(time.perf_counter() - start)
            for cache in caches[: block.layer]:
                cache.trim(1)
    finally:
        model.exit_tap = previous
    medians = [statistics.median(samples[n]) for n in samples]
    plain = medians[0]
    slope = medians[1] - plain
    if depth > 1:
        slope = statistics.linear_regression(range(1, depth + 1), medians[1:]).slope
    return ShallowCosts(plain, slope / plain, statistics.median(block_s) / plain)


# ------------------------------------------------------------------------- the whole run


def train_shallow_block(
    runtime: TorchRuntime,
    work: Path,
    plan: HeadTrainingPlan,
    progress: Progress,
    layer: int | None = None,
) -> tuple[BlockWeights, dict]:
    """Collect (or reuse the corpus in `work`, shared with the last-state head), compute
    exit states, train, measure."""
    from ...assets import training_prompts
    from .calibrate import prompt_tokens
    from .head_training import _collect

    start = time.perf_counter()
    model = runtime.model
    layer = layer or default_exit_layer(model.config.n_layers)
    if not 0 < layer < model.config.n_layers:
        raise MiniappError(
            f"--exit-layer: {runtime.model_path.name} has layers 1..{model.config.n_layers - 1} "
            "to exit at"
        )
    questions = training_prompts()[: plan.prompts]
    progress.phase(f"collecting the model's answers to {len(questions)} training requests")
    answers = _collect(runtime, questions, plan.answer_tokens, work, progress)
    prompts = [prompt_tokens(runtime, question) for question in questions]
    vocab = draft_vocabulary(answers, model.config.vocab_size, SHALLOW_VOCAB)
    progress.phase(f"exit states after layer {layer} for {len(answers)} answers")
    sequences = []
    for i, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
        sequences.append(exit_sequence(model, prompt, answer, layer, WINDOW))
        progress.advance(i + 1, len(answers), "answers")
    losses: list[float] = []

    def report(step: int, loss: float) -> None:
        losses.append(loss)
        if step % 25 == 0 or step == plan.steps - 1:
            recent = sum(losses[-50:]) / len(losses[-50:])
            progress.advance(step + 1, plan.steps, f"steps, loss {recent:.3f}")

    weights = train_block(model, sequences, vocab, layer, BlockTraining(plan.steps), report)
    meta = measure_block(runtime, weights, plan, progress)
    meta.update(
        trained_rows=sum(a.states.shape[0] for a in answers),
        training_answers=len(answers),
        steps=plan.steps,
        minutes=(time.perf_counter() - start) / 60,
    )
    return weights, meta


@torch.inference_mode()
def measure_block(
    runtime: TorchRuntime, weights: BlockWeights, plan: HeadTrainingPlan, progress: Progress
) -> dict:
    """The block's held-out acceptance (and the untrained exit's, for comparison), its
    costs here, and the threshold and chain length they make best."""
    from ...assets import chat_prompts
    from ..speculative.calibration import file_hash
    from .calibrate import prompt_tokens

    model = runtime.model
    progress.phase(f"measuring on {plan.held_out} held-out chat questions")
    eog = runtime.tokenizer.eog_ids
    prompts = [prompt_tokens(runtime, q) for q in chat_prompts()[: plan.held_out]]
    held = [record_answer(model, p, GREEDY, 128, eog) for p in prompts]
    rows = model.head_rows(weights.vocab)
    untrained = BlockWeights.initial(
        model.config.dim, weights.w_down.shape[1], weights.vocab, weights.layer, weights.window
    )
    before = held_out_chains(model, ShallowBlock(untrained, model, rows), prompts, held, 1)
    block = ShallowBlock(weights, model, rows)
    chains = held_out_chains(model, block, prompts, held, plan.depth)
    progress.phase("timing plain steps, verifications and block passes")
    costs = measure_shallow_costs(runtime, block, held[0].fed, plan.depth)
    policy = best_policy(chains, costs.row_cost, costs.draft_cost, plan.depth)
    return {
        "form": "shallow",
        "layer": weights.layer,
        "sha256": file_hash(runtime.model_path),
        "model": runtime.model_path.name,
        "acceptance": first_link_agreement(chains),
        "untrained_acceptance": first_link_agreement(before),
        "held_out_coverage": coverage(held, weights.vocab),
        "vocab_size": len(weights.vocab),
        **policy_record(policy, costs),
    }

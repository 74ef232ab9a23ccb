"""Training the drafting head (`miniapp calibrate --train-head`) on the model's own text.

1. A corpus: the model answers varied chat requests (`assets.training_prompts`), greedily
   or sampled, one token a step as the runtime decodes. Every row records its final-normed
   state and the model's top probabilities there: exactly what the head sees and must
   predict.
2. A draft vocabulary: the answers' most frequent tokens, as many as the measured costs and
   the coverage of answers not counted say pay best (`choose_vocab_size`).
3. Self-distillation: the head learns, from (state_t, token t+1), the model's distribution
   at t+1 and its state there; a second, chained step from its own estimate teaches the
   chain. Loss: cross-entropy against the teacher's top probabilities (within the draft
   vocabulary) plus a smooth-L1 pull of the estimate toward the true state.
4. Held-out acceptance: on the bench's own chat questions (never trained on), how long a
   greedy chain of drafts agrees with the model, and how sure the head was, so a
   confidence threshold can be chosen from measured costs.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..models import CachePolicy
from ..models.decoder import DecoderModel
from ..ops.quant import dequantize_rows
from ..runtimes.torch_runtime import TorchRuntime
from ..speculative.draft_head import DraftHead, HeadWeights
from ..tokens.sampler import Sampler
from ..tokens.sampling import GREEDY, SamplingParams

TEACHER_TOP = 32  # teacher probabilities kept per row
SAMPLED_SHARE = 3  # every third answer is sampled (temperature below), the rest greedy
SAMPLE_TEMPERATURE = 0.7
HIDDEN_MULTIPLE = 1  # the head's feed-forward width in model dims
FEATURE_WEIGHT = 1.0
CHAIN_WEIGHT = 0.5  # weight of the chained second step's losses


@dataclass
class Answer:
    """One answer's decode rows: row r is the state after feeding `fed[r]` (row 0: the
    prompt's last token); `fed[r + 1]` is the token the model chose there."""

    fed: list[int]
    states: torch.Tensor  # bf16 [rows, dim]
    top_ids: torch.Tensor  # int32 [rows, TEACHER_TOP]
    top_probs: torch.Tensor  # f16 [rows, TEACHER_TOP]


@torch.inference_mode()
def record_answer(
    model: DecoderModel,
    prompt: list[int],
    params: SamplingParams,
    limit: int,
    eog_ids: frozenset[int],
) -> Answer:
    """The model's answer to `prompt` (up to `limit` tokens, or its end-of-generation
    token), decoded one token a step as the runtime does, with every step's state and top
    probabilities recorded from the prompt's last token on."""
    return record_answers(model, [(prompt, params)], limit, eog_ids)[0]


@dataclass
class _Recording:
    """One answer being decoded inside a batch of them."""

    index: int
    caches: list
    sampler: Sampler
    history: list[int]
    fed: list[int]
    states: list[torch.Tensor] = field(default_factory=list)
    ids: list[torch.Tensor] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)

    def observe(self, state, logits, top_ids, top_probs, limit: int, eog_ids) -> bool:
        """Records one row and samples the token fed next; True once the answer is done."""
        self.states.append(state.to(torch.bfloat16))
        self.ids.append(top_ids.to(torch.int32))
        self.probs.append(top_probs.to(torch.float16))
        token = self.sampler(logits, self.history)
        self.fed.append(token)
        self.history.append(token)
        return token in eog_ids or len(self.fed) > limit

    def answer(self) -> Answer:
        return Answer(
            self.fed, torch.stack(self.states), torch.stack(self.ids), torch.stack(self.probs)
        )


def record_answers(
    model: DecoderModel,
    requests: Sequence[tuple[list[int], SamplingParams]],
    limit: int,
    eog_ids: frozenset[int],
    width: int = 1,
) -> list[Answer]:
    """`record_answer` for each (prompt, params), in order, decoding up to `width` at once."""
    done = dict(recorded_answers(model, requests, limit, eog_ids, width))
    return [done[i] for i in range(len(requests))]


@torch.inference_mode()
def recorded_answers(
    model: DecoderModel,
    requests: Sequence[tuple[list[int], SamplingParams]],
    limit: int,
    eog_ids: frozenset[int],
    width: int,
) -> Iterator[tuple[int, Answer]]:
    """(request index, answer) as each answer finishes, decoding up to `width` answers at
    once: one pass feeds every running answer its next token (`hidden_segments`, whose rows
    come out exactly as one sequence's steps would), so the weights are read once for all
    of them. A finished answer's place goes to the next request."""
    waiting = list(enumerate(requests))[::-1]
    running: list[_Recording] = []
    states = torch.empty(0, model.config.dim)
    while waiting or running:
        while waiting and len(running) < width:
            index, (prompt, params) = waiting.pop()
            caches = model.make_caches(CachePolicy(len(prompt) + limit + 1, streaming=False))
            state = _prefill(model, prompt, caches)
            running.append(_Recording(index, caches, Sampler(params), list(prompt), [prompt[-1]]))
            states = torch.cat([states, state])
        logits = model.logits(states)
        top_probs, top_ids = torch.softmax(logits, -1).topk(TEACHER_TOP, dim=-1)
        still = []
        for row, recording in enumerate(running):
            args = states[row], logits[row], top_ids[row], top_probs[row], limit, eog_ids
            if recording.observe(*args):
                yield recording.index, recording.answer()
            else:
                still.append(row)
        running = [running[row] for row in still]
        if len(running) == 1:  # the one-sequence step takes the fused layers; same rows
            only = running[0]
            states = model.hidden_states(torch.tensor(only.fed[-1:]), only.caches)
        elif running:
            states = model.hidden_segments([([r.fed[-1]], r.caches) for r in running])
        else:
            states = states[:0]


def _prefill(model: DecoderModel, tokens: list[int], caches) -> torch.Tensor:
    """Feeds `tokens` in chunks the caches take; the last token's state [1, dim]."""
    done = 0
    while done < len(tokens):
        chunk = tokens[done : done + model.max_chunk(caches)]
        hidden = model.hidden_states(torch.tensor(chunk), caches)
        done += len(chunk)
    return hidden[-1:]


def sampling_for(index: int) -> SamplingParams:
    """Every `SAMPLED_SHARE`-th training answer is sampled, for varied contexts."""
    if index % SAMPLED_SHARE:
        return GREEDY
    return SamplingParams(temperature=SAMPLE_TEMPERATURE, seed=index)


# ------------------------------------------------------------------------- vocabulary


def draft_vocabulary(answers: Sequence[Answer], vocab_size: int, size: int) -> torch.Tensor:
    """`size` token ids: those the answers use, most frequent first, then the lowest ids
    they do not use (byte-pair vocabularies number their most common merges first)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for answer in answers:
        counts += torch.bincount(torch.tensor(answer.fed[1:]), minlength=vocab_size)
    # Ties (every unused token) keep id order, so unused tokens follow by id.
    order = counts.argsort(descending=True, stable=True)
    return order[: min(size, vocab_size)].clone()


def coverage(answers: Sequence[Answer], vocab: torch.Tensor) -> float:
    """Share of the answers' tokens inside `vocab`."""
    inside = set(vocab.tolist())
    tokens = [t for answer in answers for t in answer.fed[1:]]
    return sum(t in inside for t in tokens) / max(len(tokens), 1)


# ------------------------------------------------------------------------- training


@dataclass
class _Rows:
    """Every answer's rows, concatenated; `starts` are rows two steps of a chain can start
    from (rows r with r + 2 still in the same answer)."""

    states: torch.Tensor  # bf16 [n, dim]
    next_token: torch.Tensor  # int64 [n]: the token fed after each row
    targets: torch.Tensor  # int64 [n, TEACHER_TOP]: teacher ids mapped into the draft vocab
    target_probs: torch.Tensor  # fp32 [n, TEACHER_TOP] (0 where the id is outside it)
    starts: torch.Tensor  # int64

    @classmethod
    def of(cls, answers: Sequence[Answer], vocab: torch.Tensor, vocab_size: int) -> _Rows:
        index = torch.full((vocab_size,), -1, dtype=torch.long)
        index[vocab] = torch.arange(len(vocab))
        states, nexts, ids, probs, starts = [], [], [], [], []
        offset = 0
        for answer in answers:
            rows = answer.states.shape[0]
            states.append(answer.states)
            nexts.append(torch.tensor(answer.fed[1 : rows + 1]))
            ids.append(answer.top_ids.long())
            probs.append(answer.top_probs.float())
            starts.append(torch.arange(offset, offset + max(rows - 2, 0)))
            offset += rows
        mapped = index[torch.cat(ids)]
        target_probs = torch.cat(probs) * (mapped >= 0)
        return cls(
            torch.cat(states),
            torch.cat(nexts),
            mapped.clamp_min(0),
            target_probs,
            torch.cat(starts),
        )


@dataclass(frozen=True)
class TrainingConfig:
    steps: int = 3000
    batch: int = 256
    learning_rate: float = 1e-3
    weight_decay: float = 0.1
    hidden_multiple: float = HIDDEN_MULTIPLE
    seed: int = 0


def hidden_width(dim: int, multiple: float = HIDDEN_MULTIPLE) -> int:
    """The head's feed-forward width: a multiple of 32, as the int4 kernel's groups."""
    return max(32, int(multiple * dim) // 32 * 32)


def dense_head_rows(model: DecoderModel, vocab: torch.Tensor) -> torch.Tensor:
    """The output head's rows for `vocab`, fp32 [n, dim] (training multiplies them dense)."""
    raw, ggml_type = model.head_weight
    return dequantize_rows(raw.index_select(0, vocab), ggml_type, model.config.dim)


def train_head(
    model: DecoderModel,
    answers: Sequence[Answer],
    vocab: torch.Tensor,
    config: TrainingConfig = TrainingConfig(),
    report: Callable[[int, float, HeadWeights], None] = lambda step, loss, weights: None,
    weights: HeadWeights | None = None,
    first_step: int = 0,
) -> HeadWeights:
    """Self-distillation of the head (see the module's docstring): steps `first_step` up
    to `config.steps` of one cosine learning-rate schedule, from `weights` when given
    (resuming). `report(step, loss, weights)` after every step."""
    dim = model.config.dim
    rows = _Rows.of(answers, vocab, model.config.vocab_size)
    head = dense_head_rows(model, vocab)
    cap = model.config.final_logit_softcap
    hidden = hidden_width(dim, config.hidden_multiple)
    weights = weights or HeadWeights.initial(dim, hidden, vocab, config.seed)
    params = weights.parameters()
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    generator = torch.Generator().manual_seed(config.seed + first_step)
    for step in range(first_step, config.steps):
        lr = config.learning_rate * 0.5 * (1 + math.cos(math.pi * step / config.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        pick = rows.starts[torch.randint(len(rows.starts), (config.batch,), generator=generator)]
        loss = _chain_loss(model, weights, head, cap, rows, pick)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        report(step, loss.item(), weights)
    for p in params:
        p.requires_grad_(False)
    return weights


def _chain_loss(model, weights: HeadWeights, head, cap, rows: _Rows, pick) -> torch.Tensor:
    """Two links of a chain from rows `pick`: the head's estimate of the next state, its
    logits against the teacher's, then the same again from its own estimate."""
    x = rows.states[pick].float()
    loss = torch.zeros(())
    for link, weight in enumerate((1.0, CHAIN_WEIGHT)):
        at = pick + link
        with torch.no_grad():
            embedded = model.embed_tokens(rows.next_token[at])
        x = weights.forward(x, embedded)
        logits = x @ head.T
        if cap:
            logits = torch.tanh(logits / cap) * cap
        log_q = torch.log_softmax(logits, -1)
        target = at + 1
        cross = -(rows.target_probs[target] * log_q.gather(1, rows.targets[target])).sum(-1)
        feature = F.smooth_l1_loss(x, rows.states[target].float())
        loss = loss + weight * (cross.mean() + FEATURE_WEIGHT * feature)
    return loss


# ------------------------------------------------------------------------- held out


@dataclass(frozen=True)
class ChainLink:
    sure: float  # the head's probability for its own token
    agrees: bool  # it is the model's greedy token


@torch.inference_mode()
def held_out_chains(
    model: DecoderModel, head: DraftHead, answers: Sequence[Answer], depth: int
) -> list[list[ChainLink]]:
    """From every row of greedy answers, the head's greedy chain: its links up to the first
    disagreement (included) or `depth`. Teacher-forced: while the chain agrees, its tokens
    are the answer's."""
    chains = []
    for answer in answers:
        rows = answer.states.shape[0]
        fed = torch.tensor(answer.fed)
        live = torch.arange(rows - 1)  # the last row has no next row to compare with
        x = answer.states[:-1].float()
        links: list[list[ChainLink]] = [[] for _ in range(rows - 1)]
        for step in range(depth):
            x = head.state(x, model.embed_tokens(fed[live + step + 1]))
            probs = torch.softmax(head.draft_logits(x), -1)
            sure, best = probs.max(-1)
            drafted = head.vocab[best]
            agrees = drafted == fed[live + step + 2]
            for i, row in enumerate(live.tolist()):
                links[row].append(ChainLink(float(sure[i]), bool(agrees[i])))
            keep = agrees & (live + step + 3 < len(fed))
            live, x = live[keep], x[keep]
            if not len(live):
                break
        chains += links
    return chains


def first_link_agreement(chains: Sequence[Sequence[ChainLink]]) -> float:
    return sum(c[0].agrees for c in chains if c) / max(len(chains), 1)


@dataclass(frozen=True)
class Policy:
    threshold: float
    max_draft: int
    predicted_speedup: float
    tokens_per_step: float
    # Per drafted token, as the draft controller counts it: accepted / (accepted + chains
    # that ended in a rejection), over the chains the gate let through.
    acceptance: float = 0.0


def best_policy(
    chains: Sequence[Sequence[ChainLink]], row_cost: float, draft_cost: float, depth: int
) -> Policy:
    """The confidence threshold and chain length with the best predicted speed-up, where a
    verification of n drafts costs 1 + n * row_cost plain steps and every head pass (also
    one that ends the chain) costs `draft_cost`."""
    best = Policy(1.0, 0, 1.0, 1.0)
    for threshold in [i / 20 for i in range(0, 20)]:
        for k in range(1, depth + 1):
            tokens = cost = accepted_all = trials = 0.0
            for chain in chains:
                drafted = accepted = passes = 0
                for link in chain[:k]:
                    passes += 1
                    if link.sure < threshold:
                        break
                    drafted += 1
                    if not link.agrees:
                        break
                    accepted += 1
                tokens += accepted + 1
                cost += 1 + drafted * row_cost + passes * draft_cost
                accepted_all += accepted
                trials += accepted + (accepted < drafted)
            speedup = tokens / cost
            if speedup > best.predicted_speedup:
                acceptance = accepted_all / trials if trials else 0.0
                best = Policy(threshold, k, speedup, tokens / len(chains), acceptance)
    return best


# ------------------------------------------------------------------------- the whole run


@dataclass(frozen=True)
class HeadTrainingPlan:
    prompts: int = 900  # training answers (collecting them: about 18 minutes, SmolLM2, 2 cores)
    answer_tokens: int = 192
    steps: int = 3000
    depth: int = 4  # longest chain measured and allowed
    held_out: int = 8  # the bench's chat questions, measured on, never trained on


class Progress:
    """What a long run reports: phases as lines, and counts within a phase (a bar)."""

    def phase(self, text: str) -> None: ...

    def advance(self, done: int, total: int, note: str = "") -> None: ...


def train_drafting_head(
    runtime: TorchRuntime, work: Path, plan: HeadTrainingPlan, progress: Progress
) -> tuple[HeadWeights, dict]:
    """Collect, train, measure. `work` keeps the corpus shards and training checkpoints, so
    an interrupted run resumes where it stopped; the caller stores the result and removes
    `work`."""
    from ...assets import training_prompts

    start = time.perf_counter()
    model = runtime.model
    questions = training_prompts()[: plan.prompts]
    progress.phase(f"collecting the model's answers to {len(questions)} training requests")
    answers = _collect(runtime, questions, plan.answer_tokens, work, progress)
    rows = sum(a.states.shape[0] for a in answers)
    progress.phase("timing plain steps, verifications and head passes")
    sizes = _vocab_sizes(model.config.vocab_size)
    costs = measure_costs(runtime, sizes, answers[0].fed, plan.depth)
    size, cover = choose_vocab_size(answers, model.config.vocab_size, costs)
    costs, vocab = costs[size], draft_vocabulary(answers, model.config.vocab_size, size)
    progress.phase(
        f"draft vocabulary: {size} tokens ({cover:.1%} of unseen answers' tokens); "
        f"training on {rows} rows"
    )
    weights = _train_resumable(model, answers, vocab, plan, work, progress)
    meta = measure_head(runtime, weights, plan, progress, costs)
    meta.update(
        trained_rows=rows,
        training_answers=len(answers),
        steps=plan.steps,
        minutes=(time.perf_counter() - start) / 60,
    )
    return weights, meta


@torch.inference_mode()
def measure_head(
    runtime: TorchRuntime,
    weights: HeadWeights,
    plan: HeadTrainingPlan,
    progress: Progress,
    costs: Costs | None = None,
) -> dict:
    """A head's held-out acceptance, its costs on this machine and engine (timed now unless
    given) and the confidence threshold and chain length they make best: what `--spec
    auto` reads. Costs change with the engine, not with the head, so a head trained once
    is measured again (`calibrate --measure-head`) without training it again."""
    from ...assets import chat_prompts
    from ..speculative.calibration import file_hash
    from .calibrate import prompt_tokens

    model, vocab = runtime.model, weights.vocab
    progress.phase(f"measuring on {plan.held_out} held-out chat questions")
    eog = runtime.tokenizer.eog_ids
    held = [
        record_answer(model, prompt_tokens(runtime, question), GREEDY, 128, eog)
        for question in chat_prompts()[: plan.held_out]
    ]
    if costs is None:
        progress.phase("timing plain steps, verifications and head passes")
        costs = measure_costs(runtime, [len(vocab)], held[0].fed, plan.depth)[len(vocab)]
    head = DraftHead(weights, model.head_rows(vocab), model.config.final_logit_softcap)
    chains = held_out_chains(model, head, held, plan.depth)
    policy = best_policy(chains, costs.row_cost, costs.draft_cost, plan.depth)
    return {
        "form": "last",
        "sha256": file_hash(runtime.model_path),
        "model": runtime.model_path.name,
        "acceptance": first_link_agreement(chains),
        "held_out_coverage": coverage(held, vocab),
        "vocab_size": len(vocab),
        **policy_record(policy, costs),
    }


def policy_record(policy: Policy, costs) -> dict:
    """What `--spec auto` reads of a head's measurement: its chain policy and the costs it
    was chosen from (`costs`: plain_s, row_cost and draft_cost)."""
    from ..speculative.controller import MIN_GAIN

    return {
        "threshold": policy.threshold,
        "max_draft": policy.max_draft,
        "gated_acceptance": policy.acceptance,
        "predicted_speedup": policy.predicted_speedup,
        "tokens_per_step": policy.tokens_per_step,
        "pays": policy.predicted_speedup >= MIN_GAIN,
        "plain_step_ms": costs.plain_s * 1000,
        "row_cost": costs.row_cost,
        "draft_cost": costs.draft_cost,
    }


VOCAB_SIZES = (4096, 8192, 16384)
ASSUMED_ACCEPTANCE = 0.5  # of covered tokens, to weigh coverage against the head's cost


def _vocab_sizes(vocab_size: int) -> list[int]:
    return sorted({min(size, vocab_size) for size in VOCAB_SIZES})


def choose_vocab_size(
    answers: Sequence[Answer], vocab_size: int, costs: dict[int, Costs]
) -> tuple[int, float]:
    """The draft vocabulary size with the best predicted one-draft speed-up, from the
    coverage of answers it was not counted on (the last tenth) and each size's measured
    costs; with the coverage it reached."""
    split = max(1, len(answers) * 9 // 10)
    counted, unseen = answers[:split], answers[split:] or answers[:1]

    def gain(size: int) -> tuple[float, float]:
        cover = coverage(unseen, draft_vocabulary(counted, vocab_size, size))
        c = costs[size]
        return (1 + ASSUMED_ACCEPTANCE * cover) / (1 + c.row_cost + c.draft_cost), cover

    scored = {size: gain(size) for size in costs}
    best = max(scored, key=lambda size: scored[size][0])
    return best, scored[best][1]


def _collect(runtime, questions, limit, work: Path, progress: Progress) -> list[Answer]:
    """Answers to `questions`, saved in shards of `SHARD` as each shard completes, so a
    rerun skips what is done. One stream decodes all missing answers `COLLECT_WIDTH` at a
    time, so no shard waits for its slowest answer with the batch half empty."""
    from .calibrate import prompt_tokens

    firsts = range(0, len(questions), SHARD)
    shards = {first: _load(work / f"answers-{first:05d}.pt") for first in firsts}
    missing = [
        i
        for first, shard in shards.items()
        if shard is None
        for i in range(first, min(first + SHARD, len(questions)))
    ]
    requests = [(prompt_tokens(runtime, questions[i]), sampling_for(i)) for i in missing]
    collected: dict[int, Answer] = {}
    done = len(questions) - len(missing)
    progress.advance(done, len(questions), "answers")
    eog = runtime.tokenizer.eog_ids
    for j, answer in recorded_answers(runtime.model, requests, limit, eog, COLLECT_WIDTH):
        collected[missing[j]] = answer
        done += 1
        progress.advance(done, len(questions), "answers")
        first = missing[j] // SHARD * SHARD
        members = range(first, min(first + SHARD, len(questions)))
        if all(i in collected for i in members):
            shards[first] = [collected.pop(i) for i in members]
            _save(work / f"answers-{first:05d}.pt", shards[first])
    return [answer for first in firsts for answer in shards[first]]


def _train_resumable(model, answers, vocab, plan, work: Path, progress) -> HeadWeights:
    """Training that saves its weights every `CHECKPOINT_STEPS` and resumes from the last
    save (the optimizer's moments start afresh then; the schedule does not)."""
    path = work / "head-checkpoint.pt"
    saved = _load(path)
    if saved is not None and not torch.equal(saved["vocab"], vocab):
        saved = None  # the corpus changed under it: start again
    losses: list[float] = []

    def report(step: int, loss: float, weights: HeadWeights) -> None:
        losses.append(loss)
        if step % 50 == 0 or step == plan.steps - 1:
            recent = sum(losses[-50:]) / len(losses[-50:])
            progress.advance(step + 1, plan.steps, f"steps, loss {recent:.3f}")
        if (step + 1) % CHECKPOINT_STEPS == 0:
            _save(path, {"weights": weights, "step": step + 1, "vocab": vocab})

    return train_head(
        model,
        answers,
        vocab,
        TrainingConfig(steps=plan.steps),
        report,
        saved["weights"] if saved else None,
        saved["step"] if saved else 0,
    )


SHARD = 25
COLLECT_WIDTH = 16  # answers decoded together while collecting
COST_ROUNDS = 15  # timing rounds of every verification length
CHECKPOINT_STEPS = 500


def _load(path: Path):
    try:
        return torch.load(path, weights_only=False)
    except (OSError, RuntimeError, EOFError, ValueError):
        return None


def _save(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(data, tmp)
    tmp.replace(path)


# ------------------------------------------------------------------------- costs


@dataclass(frozen=True)
class Costs:
    plain_s: float
    row_cost: float  # each extra verified row, in plain steps
    draft_cost: float  # one head pass, in plain steps


@torch.inference_mode()
def measure_costs(
    runtime: TorchRuntime, vocab_sizes: Sequence[int], context: list[int], depth: int
) -> dict[int, Costs]:
    """After `context`: a plain step and verifications of 1..depth drafts, timed in
    interleaved rounds (a drift in the machine's speed hits every length alike); the row
    cost is the least-squares slope of their medians, in plain steps. Then one pass of a
    head with each of `vocab_sizes` draft tokens (its weights do not change its cost)."""
    from .calibrate import _median_time

    model = runtime.model
    caches = model.make_caches(runtime.policy)
    model.hidden_states(torch.tensor(context), caches)
    token = context[-1]
    lengths = range(1, depth + 2)
    samples: dict[int, list[float]] = {n: [] for n in lengths}
    for _ in range(COST_ROUNDS):
        for n in lengths:
            start = time.perf_counter()
            model.logits(model.hidden_states(torch.tensor([token] * n), caches, n > 1))
            samples[n].append(time.perf_counter() - start)
            for cache in caches:
                cache.trim(n)
    medians = torch.tensor([statistics.median(samples[n]) for n in lengths])
    ns = torch.tensor(list(lengths), dtype=medians.dtype)
    slope = float(
        ((ns - ns.mean()) * (medians - medians.mean())).sum() / ((ns - ns.mean()) ** 2).sum()
    )
    plain = float(medians[0])
    state = model.hidden_states(torch.tensor([token]), caches)
    embedded = model.embed_tokens(torch.tensor([token]))
    dim = model.config.dim
    costs = {}
    for size in vocab_sizes:
        vocab = torch.arange(size)
        weights = HeadWeights.initial(dim, hidden_width(dim), vocab)
        head = DraftHead(weights, model.head_rows(vocab), model.config.final_logit_softcap)
        draft = _median_time(
            lambda head=head: head.draft_logits(head.state(state, embedded)), lambda: None
        )
        costs[size] = Costs(plain, slope / plain, draft / plain)
    return costs

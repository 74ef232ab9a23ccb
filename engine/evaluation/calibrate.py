"""`miniapp calibrate`: how well each exit layer drafts for this model, what drafting costs
here, and so which setting (if any) makes early-exit speculation pay.

Acceptance comes from the model's own greedy answers to built-in prompts, teacher-forced:
a greedy draft of k tokens from position t is accepted up to the first position where the
exit layer's choice differs from the full model's, so the run of agreeing positions from t
gives the accepted count for every k at once. Costs are timed on this machine: a plain
step, one early-exit draft step per layer, one verification per layer and draft length.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...assets import chat_prompts
from ..modelfile.template import ChatTemplate, Message
from ..models import CachePolicy
from ..runtimes.torch_runtime import TorchRuntime
from ..speculative.adapter import ExitAdapterModule
from ..speculative.calibration import ExitSetting
from ..speculative.controller import MIN_GAIN
from ..speculative.drafter import Draft
from ..speculative.early_exit import EarlyExitDrafter
from ..tokens.sampling import GREEDY

CALIBRATION_PROMPTS = 8  # the first prompts measure; the rest train the adapter
ANSWER_TOKENS = 96
DRAFT_LENGTHS = (1, 2, 3, 4, 6, 8)
TIMING_REPEATS = 7


@dataclass(frozen=True)
class LayerResult:
    layer: int
    agreement: float  # top-1 agreement with the full model, teacher-forced
    draft_s: float  # one draft step
    speedup: dict[int, float]  # predicted, by draft length


@dataclass(frozen=True)
class CalibrationResult:
    plain_step_s: float
    layers: list[LayerResult]
    setting: ExitSetting
    adapter_agreement: tuple[float, float] | None = None  # held-out, (before, after)


def candidate_layers(n_layers: int) -> list[int]:
    """About every sixth of the depth, from a fifth to five sixths."""
    step = max(1, n_layers // 6)
    return list(range(max(1, n_layers // 5), n_layers, step))


def prompt_tokens(runtime: TorchRuntime, question: str) -> list[int]:
    template = ChatTemplate.for_model(
        runtime.chat_template, runtime.tokenizer, runtime.architecture
    )
    return runtime.tokenizer.encode_chat(template.render([Message("user", question)]))


def greedy_answers(
    runtime: TorchRuntime, questions: Sequence[str], answer_tokens: int = ANSWER_TOKENS
) -> list[tuple[int, list[int]]]:
    """(prompt length, prompt + greedy answer) per question, by plain decoding."""
    sequences = []
    for question in questions:
        prompt = prompt_tokens(runtime, question)
        runtime.reset()
        answer: list[int] = []
        tokens = runtime.generate_tokens(prompt, GREEDY)
        try:
            for token in tokens:
                answer.append(token)
                if token in runtime.tokenizer.eog_ids or len(answer) >= answer_tokens:
                    break
        finally:
            tokens.close()
        sequences.append((len(prompt), prompt + answer))
    runtime.reset()
    return sequences


@torch.inference_mode()
def exit_states(
    runtime: TorchRuntime, tokens: Sequence[int], layers: Sequence[int]
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Residual streams after each of `layers` and the full model's logits, every position."""
    model = runtime.model
    caches = model.make_caches(CachePolicy(len(tokens), streaming=False))
    x = model.embed_tokens(torch.tensor(tokens))
    states, done = {}, 0
    for layer in sorted(layers):
        x = model.run_layers(x, caches, done, layer)
        states[layer], done = x.to("cpu", copy=True), layer
    x = model.run_layers(x, caches, done, model.config.n_layers)
    return states, model.logits(model.final_norm(x))


def agreement_runs(draft_choice: torch.Tensor, target_choice: torch.Tensor) -> list[int]:
    """For each start, how many consecutive positions the draft agrees with the target."""
    agree = (draft_choice == target_choice).tolist()
    runs = [0] * (len(agree) + 1)
    for i in range(len(agree) - 1, -1, -1):
        runs[i] = runs[i + 1] + 1 if agree[i] else 0
    return runs[:-1]


def calibrate(
    runtime: TorchRuntime,
    layers: Sequence[int] | None = None,
    train_adapter: bool = False,
    report: Callable[[str], None] = lambda _: None,
    n_prompts: int = CALIBRATION_PROMPTS,
    answer_tokens: int = ANSWER_TOKENS,
) -> CalibrationResult:
    model = runtime.model
    layers = sorted(layers or candidate_layers(model.config.n_layers))
    questions = chat_prompts()[: min(n_prompts, CALIBRATION_PROMPTS)]
    report(f"generating greedy answers to {len(questions)} built-in prompts")
    sequences = greedy_answers(runtime, questions, answer_tokens)
    runs: dict[int, list[int]] = {layer: [] for layer in layers}
    agree_counts = dict.fromkeys(layers, 0)
    positions = 0
    for prompt_len, tokens in sequences:
        states, logits = exit_states(runtime, tokens, layers)
        rows = slice(prompt_len - 1, len(tokens) - 1)  # the rows that predicted the answer
        target = logits[rows].argmax(-1)
        positions += len(target)
        for layer in layers:
            drafter = EarlyExitDrafter(model, layer)
            choice = drafter.exit_logits(states[layer][rows]).argmax(-1)
            runs[layer] += agreement_runs(choice, target)
            agree_counts[layer] += int((choice == target).sum())
    report("timing plain steps, drafts and verifications")
    timing_prompt = sequences[0][1]
    plain_s = _time_plain(runtime, timing_prompt)
    results = []
    for layer in layers:
        drafter = EarlyExitDrafter(model, layer)
        draft_s, verify_s = _time_drafter(runtime, drafter, timing_prompt)
        speedup = _predicted_speedup(runs[layer], plain_s, draft_s, verify_s)
        results.append(LayerResult(layer, agree_counts[layer] / positions, draft_s, speedup))
        report(
            f"exit after layer {layer}: agreement {results[-1].agreement:.2f}, "
            f"best predicted speed-up {max(speedup.values()):.2f}"
        )
    best = max(results, key=lambda r: max(r.speedup.values()))
    best_k = max(best.speedup, key=best.speedup.get)
    setting = ExitSetting(
        layer=best.layer,
        max_draft=best_k,
        pays=best.speedup[best_k] >= MIN_GAIN,
        predicted_speedup=best.speedup[best_k],
        acceptance={str(r.layer): r.agreement for r in results},
    )
    adapter_agreement = None
    if train_adapter:
        setting, adapter_agreement = _with_adapter(
            runtime, setting, sequences, report, answer_tokens, plain_s
        )
    return CalibrationResult(plain_s, results, setting, adapter_agreement)


# ------------------------------------------------------------------------------ timing


def _median_time(action: Callable[[], object], undo: Callable[[], object]) -> float:
    samples = []
    for _ in range(TIMING_REPEATS):
        start = time.perf_counter()
        action()
        samples.append(time.perf_counter() - start)
        undo()
    return statistics.median(samples)


@torch.inference_mode()
def _time_plain(runtime: TorchRuntime, context: Sequence[int]) -> float:
    model = runtime.model
    caches = model.make_caches(runtime.policy)
    model.hidden_states(torch.tensor(context), caches)

    def step():
        model.logits(model.hidden_states(torch.tensor([context[-1]]), caches))

    return _median_time(step, lambda: [c.trim(1) for c in caches])


@torch.inference_mode()
def _time_drafter(
    runtime: TorchRuntime, drafter: EarlyExitDrafter, context: Sequence[int]
) -> tuple[float, dict[int, float]]:
    """(one draft step, verification by draft length) after `context`."""
    model = runtime.model
    caches = model.make_caches(runtime.policy)
    model.hidden_states(torch.tensor(context), caches)
    token = context[-1]
    draft_s = _median_time(
        lambda: drafter.exit_logits(drafter.early_state(token, caches)),
        lambda: [c.trim(1) for c in caches[: drafter.layer]],
    )
    verify_s = {}
    for k in DRAFT_LENGTHS:
        states = torch.cat([drafter.early_state(token, caches) for _ in range(k)])
        draft = Draft([token] * k, None, states)
        verify_s[k] = _median_time(
            lambda draft=draft: drafter.verify(caches, draft),
            lambda k=k: [c.trim(k + 1 if i >= drafter.layer else 1) for i, c in enumerate(caches)],
        )
        for cache in caches[: drafter.layer]:
            cache.trim(k)
    return draft_s, verify_s


# ------------------------------------------------------------------------------ adapter

ADAPTER_HIDDEN = 4  # the adapter's hidden width in multiples of the model's (at most 2048)
ADAPTER_STEPS = 300
ADAPTER_BATCH = 256
TEACHER_TOP = 64  # teacher probabilities kept per position (the rest of the mass is tiny)


def _predicted_speedup(
    runs: Sequence[int], plain_s: float, draft_s: float, verify_s: dict[int, float]
) -> dict[int, float]:
    """By draft length k: tokens per verification (kept drafts + 1) over its cost, in
    plain steps."""
    return {
        k: statistics.fmean(min(r, k) + 1 for r in runs) * plain_s / (k * draft_s + verify_s[k])
        for k in DRAFT_LENGTHS
    }


def _with_adapter(runtime, setting, sequences, report, answer_tokens, plain_s):
    """Train an adapter for the exit layer that the adapter would help most: the layer
    whose predicted speed-up is best if agreement rose, which in practice is the middle."""
    model = runtime.model
    layer = setting.layer if setting.pays else model.config.n_layers // 2
    train_questions = chat_prompts()[CALIBRATION_PROMPTS:]
    report(f"generating {len(train_questions)} training answers for the exit adapter")
    train = greedy_answers(runtime, train_questions, answer_tokens)
    report(f"training the exit adapter at layer {layer}")
    adapter = train_exit_adapter(runtime, layer, [t for _, t in train], report)
    runs = _held_out_runs(runtime, layer, sequences, adapter)
    before = _agreement(_held_out_runs(runtime, layer, sequences, None))
    after = _agreement(runs)
    report(f"held-out agreement at layer {layer}: {before:.2f} without, {after:.2f} with adapter")
    drafter = EarlyExitDrafter(model, layer, adapter)
    draft_s, verify_s = _time_drafter(runtime, drafter, sequences[0][1])
    speedup = _predicted_speedup(runs, plain_s, draft_s, verify_s)
    best_k = max(speedup, key=speedup.get)
    if speedup[best_k] > setting.predicted_speedup or not setting.pays:
        acceptance = dict(setting.acceptance, **{f"{layer}+adapter": after})
        setting = ExitSetting(
            layer=layer,
            max_draft=best_k,
            pays=speedup[best_k] >= MIN_GAIN,
            predicted_speedup=speedup[best_k],
            acceptance=acceptance,
            adapter=adapter,
        )
    return setting, (before, after)


def _held_out_runs(runtime, layer, sequences, adapter) -> list[int]:
    drafter = EarlyExitDrafter(runtime.model, layer, adapter)
    runs: list[int] = []
    for prompt_len, tokens in sequences:
        states, logits = exit_states(runtime, tokens, [layer])
        rows = slice(prompt_len - 1, len(tokens) - 1)
        with torch.inference_mode():
            choice = drafter.exit_logits(states[layer][rows]).argmax(-1)
        runs += agreement_runs(choice, logits[rows].argmax(-1))
    return runs


def _agreement(runs: Sequence[int]) -> float:
    """Top-1 agreement: the share of positions that start a run of at least one."""
    return sum(1 for r in runs if r > 0) / len(runs)


def train_exit_adapter(
    runtime: TorchRuntime,
    layer: int,
    sequences: Sequence[Sequence[int]],
    report: Callable[[str], None] = lambda _: None,
    steps: int = ADAPTER_STEPS,
    seed: int = 0,
) -> ExitAdapterModule:
    """Self-distillation: the adapter learns to make the exit layer's output distribution
    match the full model's on every position of the model's own text."""
    model = runtime.model
    inputs, teacher_ids, teacher_probs = [], [], []
    for tokens in sequences:
        states, logits = exit_states(runtime, tokens, [layer])
        probs, ids = torch.softmax(logits, -1).topk(TEACHER_TOP, dim=-1)
        inputs.append(states[layer])
        teacher_ids.append(ids)
        teacher_probs.append(probs / probs.sum(-1, keepdim=True))
    # Tensors made under inference mode cannot enter autograd; these copies can.
    x_all, ids_all, p_all = torch.cat(inputs), torch.cat(teacher_ids), torch.cat(teacher_probs)
    x_all, ids_all, p_all = x_all.clone(), ids_all.clone(), p_all.clone()
    head = _dense_head(runtime).clone()
    dim = model.config.dim
    adapter = ExitAdapterModule.initial(dim, min(ADAPTER_HIDDEN * dim, 2048), seed)
    params = adapter.parameters()
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    norm_weight, eps = model.norm.weight.cpu(), model.config.norm_eps  # training runs on the CPU
    for step in range(steps):
        batch = torch.randint(0, len(x_all), (ADAPTER_BATCH,), generator=generator)
        hidden = adapter.forward(x_all[batch])
        normed = F.rms_norm(hidden, (dim,), norm_weight, eps)
        log_q = torch.log_softmax(normed @ head.T, dim=-1)
        loss = -(p_all[batch] * log_q.gather(1, ids_all[batch])).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            report(f"  step {step}: distillation loss {loss.item():.3f}")
    for p in params:
        p.requires_grad_(False)
    return adapter


@torch.inference_mode()
def _dense_head(runtime: TorchRuntime) -> torch.Tensor:
    """The output head as a dense fp32 [vocab, dim] matrix (read back through its kernel)."""
    dim = runtime.model.config.dim
    eye = torch.eye(dim, device=runtime.model.head_device)
    return runtime.model.output.forward(eye).float().T.cpu().contiguous().clone()

"""Speculative decoding: lossless (greedy token for token, sampling in distribution), with an
exact roll-back, on the real default model and on a tiny random-weight model."""

from __future__ import annotations

import json
import subprocess
from collections import Counter

import pytest
import torch
from generation_helpers import first_tokens
from tiny_gguf import TinyModel, write_tiny_model

from miniapp.engine.evaluation.calibrate import agreement_runs, prompt_tokens
from miniapp.engine.kv.cache import RotatingKVCache
from miniapp.engine.kv.types import DEFAULT_KV_TYPE, KV_TYPES, Q4, Q8, KVPair
from miniapp.engine.models import CachePolicy
from miniapp.engine.runtimes.torch_runtime import TorchRuntime
from miniapp.engine.speculative import DraftController, EarlyExitDrafter
from miniapp.engine.speculative.acceptance import Verdict, accept_greedy, accept_sampled
from miniapp.engine.speculative.controller import MAX_PROBE_OVERHEAD, PROBE_EVERY
from miniapp.engine.speculative.lookup import PromptLookup
from miniapp.engine.tokens.sampler import Sampler
from miniapp.engine.tokens.sampling import GREEDY, SamplingParams

QUESTIONS = [
    "Why is the sky blue?",
    "Write two sentences about a cat. Then write the same two sentences again.",
    "List the days of the week, then list them again.",
]


def _generate(runtime: TorchRuntime, prompt: list[int], n: int, params=GREEDY) -> list[int]:
    runtime.reset()
    return first_tokens(runtime, prompt, n, params)


def _force(runtime: TorchRuntime, mode: str, layer: int | None = None, drafts: int = 4) -> None:
    """Draft on every step (a controller that never declines), with the given drafter."""
    runtime.spec_mode = runtime.spec_mode.__class__(mode)
    runtime.draft_controller = DraftController(max_draft=drafts, min_gain=0.0)
    runtime.early_exit = (
        EarlyExitDrafter(runtime.model, layer, max_draft=drafts) if layer is not None else None
    )


@pytest.fixture(scope="module")
def smol(default_model):
    return TorchRuntime(default_model, n_ctx=1024, threads=2, spec="off")


@pytest.mark.parametrize(
    ("mode", "layer", "drafts"),
    [("lookup", None, 6), ("early-exit", 4, 3), ("early-exit", 20, 5), ("auto", 12, 2)],
)
def test_greedy_output_is_token_identical_to_plain_decoding(smol, mode, layer, drafts):
    prompts = [prompt_tokens(smol, q) for q in QUESTIONS]
    _force(smol, "off")
    plain = [_generate(smol, p, 40) for p in prompts]
    _force(smol, mode, layer, drafts)
    spec = [_generate(smol, p, 40) for p in prompts]
    stats = smol.last_speculation
    assert stats is not None and stats.drafted > 0, "nothing was drafted: the test is vacuous"
    assert spec == plain


@pytest.mark.parametrize(
    ("mode", "layer", "kv"),
    [
        ("early-exit", 8, DEFAULT_KV_TYPE),
        ("lookup", None, DEFAULT_KV_TYPE),
        ("lookup", None, "f32"),
        ("early-exit", 8, "q4"),
    ],
)
def test_greedy_identical_while_the_rotating_cache_wraps(default_model, mode, layer, kv):
    # ctx 96: 4 sinks + a 92-token window in a ring of 156; 220 generated tokens wrap it.
    runtime = TorchRuntime(default_model, n_ctx=96, threads=2, spec="off", kv=kv)
    prompt = prompt_tokens(runtime, QUESTIONS[2])
    plain = _generate(runtime, prompt, 220)
    _force(runtime, mode, layer, 4)
    spec = _generate(runtime, prompt, 220)
    assert runtime.caches[0].wrapped
    assert runtime.last_speculation.drafted > 0
    assert spec == plain


def _cache_fields(cache):
    names = ("offset", "sinks_held", "ring_count", "ring_head", "wrapped", "frame")
    return {n: getattr(cache, n) for n in names if hasattr(cache, n)}


def _assert_same_visible_state(drafted, clean):
    assert _cache_fields(drafted) == _cache_fields(clean)
    if not isinstance(clean, RotatingKVCache):
        n = clean.offset
        assert torch.equal(drafted.keys[:, :, :n], clean.keys[:, :, :n])
        assert torch.equal(drafted.values[:, :, :n], clean.values[:, :, :n])
        return
    held = 2 * clean.sinks
    assert torch.equal(drafted.keys[:, :, :held], clean.keys[:, :, :held])
    same = drafted.ring_pos == clean.ring_pos
    # A slot the drafts overwrote is empty now; its old token was outside every window.
    lost = (drafted.ring_pos == -1) & (clean.ring_pos >= 0)
    assert bool((same | lost).all())
    assert bool((clean.ring_pos[lost] <= clean.offset - clean.window).all())
    kept = same & (clean.ring_pos >= 0)
    slots = torch.nonzero(kept).flatten() + held
    assert torch.equal(drafted.keys[:, :, slots], clean.keys[:, :, slots])
    assert torch.equal(drafted.values[:, :, slots], clean.values[:, :, slots])


@pytest.mark.parametrize(
    ("policy", "fed"),
    [
        (CachePolicy(512, streaming=False), 150),  # the full cache
        (CachePolicy(96, sinks=4), 150),  # ring of 156: the drafts make it wrap the first time
        (CachePolicy(96, sinks=4), 400),  # a ring that wrapped long ago
        (CachePolicy(96, sinks=4, kv_type=Q4), 400),  # ... storing 4-bit rotated keys
        (CachePolicy(96, sinks=4, kv_type=KVPair(Q8, Q4)), 150),  # keys and values apart
        (CachePolicy(512, streaming=False, kv_type=Q8), 150),
    ],
)
@torch.inference_mode()
def test_rollback_leaves_the_cache_as_if_nothing_was_drafted(smol, policy, fed):
    model = smol.model
    tokens = torch.tensor([(i * 37) % 4000 + 100 for i in range(fed + 1)])
    drafted, clean = model.make_caches(policy), model.make_caches(policy)
    for caches in (drafted, clean):
        done = 0
        while done < fed:  # in chunks the ring can take
            size = min(model.max_chunk(caches), fed - done)
            model.hidden_states(tokens[done : done + size], caches)
            done += size
    model.hidden_states(torch.arange(900, 908), drafted, exact_rows=True)  # 8 rows verified
    for cache in drafted:
        cache.trim(8)
    for a, b in zip(drafted, clean, strict=True):
        _assert_same_visible_state(a, b)
    next_token = tokens[fed:]
    after_drafted = model.logits(model.hidden_states(next_token, drafted))
    after_clean = model.logits(model.hidden_states(next_token, clean))
    assert torch.equal(after_drafted, after_clean)


@pytest.mark.parametrize("kind", [*KV_TYPES.values(), KVPair(Q8, Q4)], ids=[*KV_TYPES, "q8/q4"])
@torch.inference_mode()
def test_verification_rows_are_bit_identical_to_decode_steps(smol, kind):
    model = smol.model
    caches = model.make_caches(CachePolicy(512, streaming=False, kv_type=kind))
    model.hidden_states(torch.arange(100, 200), caches)
    rows = torch.tensor([500, 501, 502, 503, 504])
    one_by_one = torch.cat(
        [model.logits(model.hidden_states(rows[i : i + 1], caches)) for i in range(5)]
    )
    for cache in caches:
        cache.trim(5)
    batched = model.logits(model.hidden_states(rows, caches, exact_rows=True))
    assert torch.equal(batched, one_by_one)
    for cache in caches:
        cache.trim(5)
    # Without exact rows, torch's attention rounds a batch differently: the reason exact rows
    # exist. (The native kernel attends each row on its own even in a plain batch.)
    natives = [block.attention.native_backend for block in model.layers]
    for block in model.layers:
        block.attention.native_backend = None
    try:
        plain_batch = model.logits(model.hidden_states(rows, caches))
    finally:
        for block, native in zip(model.layers, natives, strict=True):
            block.attention.native_backend = native
    assert not torch.equal(plain_batch, one_by_one)


# ------------------------------------------------------------------ sampling keeps p


def _homogeneity_p_value(a: Counter, b: Counter) -> float:
    """Two-sample chi-square test that a and b come from one distribution; bins with small
    expected counts are pooled."""
    total_a, total_b = sum(a.values()), sum(b.values())
    bins, pooled = [], [0, 0]
    for token in set(a) | set(b):
        if a[token] + b[token] >= 10:
            bins.append((a[token], b[token]))
        else:
            pooled[0] += a[token]
            pooled[1] += b[token]
    if sum(pooled):
        bins.append(tuple(pooled))
    n = total_a + total_b
    stat = 0.0
    for count_a, count_b in bins:
        row = count_a + count_b
        for observed, column in ((count_a, total_a), (count_b, total_b)):
            expected = row * column / n
            stat += (observed - expected) ** 2 / expected
    dof = len(bins) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


SEEDS = 1500
# Random tiny weights give very peaked logits; a high temperature spreads them out.
TINY_SAMPLING = SamplingParams(temperature=10.0, top_k=6, top_p=1.0, min_p=0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("spec") / "tiny.gguf", TinyModel(n_layers=4))
    return TorchRuntime(path, n_ctx=64, threads=1, spec="off")


def _second_and_third(runtime, prompt, seed):
    params = SamplingParams(**{**TINY_SAMPLING.__dict__, "seed": seed})
    tokens = _generate(runtime, prompt, 3, params)
    return tokens[1], tokens[2]


def test_rejection_sampling_keeps_the_distribution_of_plain_sampling(tiny):
    prompt = [1, 72, 101, 108, 108, 111]
    _force(tiny, "off")
    plain = [_second_and_third(tiny, prompt, seed) for seed in range(SEEDS)]
    _force(tiny, "early-exit", layer=1, drafts=2)
    spec = [_second_and_third(tiny, prompt, seed + SEEDS) for seed in range(SEEDS)]
    assert tiny.last_speculation.drafted > 0
    for position in (0, 1):  # the 2nd and 3rd tokens come out of verification
        p = _homogeneity_p_value(
            Counter(t[position] for t in plain), Counter(t[position] for t in spec)
        )
        assert p > 1e-3, f"token {position + 2}: p = {p:.2g}"
    # The test has power: the drafter's own distribution is told apart from the target's.
    drafter = EarlyExitDrafter(tiny.model, 1)
    drafts = Counter()
    for seed in range(SEEDS):
        params = SamplingParams(**{**TINY_SAMPLING.__dict__, "seed": seed})
        first = _generate(tiny, prompt, 1, params)[0]
        with torch.inference_mode():
            draft = drafter.draft(tiny.caches, first, 1, Sampler(params), [*prompt, first])
        drafts[draft.tokens[0]] += 1
    assert _homogeneity_p_value(Counter(t[0] for t in plain), drafts) < 1e-3


def test_accept_sampled_follows_the_target_distribution():
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.1, 0.1, 0.2, 0.6])
    counts = Counter()
    for _ in range(20000):
        draft = int(torch.multinomial(q, 1, generator=generator))
        verdict = accept_sampled(
            [draft],
            [q],
            lambda j: p,
            lambda: float(torch.rand((), generator=generator)),
            lambda probs: int(torch.multinomial(probs, 1, generator=generator)),
        )
        counts[draft if verdict.accepted else verdict.next_token] += 1
    freq = torch.tensor([counts[i] / 20000 for i in range(4)])
    assert torch.allclose(freq, p, atol=0.015), freq
    assert counts[3] == 0  # never emits what the target rules out


def test_accept_greedy_stops_at_the_first_disagreement():
    targets = [5, 6, 7, 8]
    assert accept_greedy([5, 6, 9], lambda j: targets[j]) == Verdict(2, 7)
    assert accept_greedy([5, 6, 7], lambda j: targets[j]) == Verdict(3, 8)  # all kept, plus a bonus
    assert accept_greedy([1], lambda j: targets[j]) == Verdict(0, 5)


# ------------------------------------------------------------------ drafters and control


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    lookup = PromptLookup(max_ngram=3, min_ngram=2)
    lookup.extend([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2])
    assert lookup.propose(3) == ([3, 7, 8], 2)  # the latest "1 2" was followed by 3 7 8
    lookup.extend([3])
    assert lookup.propose(2) == ([7, 8], 3)  # "1 2 3" matches longest, latest first
    lookup.extend([42, 43])
    assert lookup.propose(4) == ([], 0)


def test_controller_stops_drafting_that_does_not_pay_and_probes_later():
    controller = DraftController(max_draft=6)
    for _ in range(5):
        controller.record_plain(0.01)
    assert controller.draft_length("lookup", 6) > 0  # optimistic before any evidence
    for _ in range(20):  # every draft rejected, verification twice a plain step
        controller.record_draft("lookup", 4, 0, 0.0, 0.02)
    assert controller.draft_length("lookup", 6) == 0
    for _ in range(PROBE_EVERY):
        controller.record_plain(0.01)
    assert controller.draft_length("lookup", 6) == 1  # a probe
    for _ in range(20):  # everything accepted, cheap verification
        controller.record_draft("lookup", 6, 6, 0.0, 0.015)
    assert controller.draft_length("lookup", 6) == 6


def test_another_drafters_drafts_do_not_starve_a_probe():
    # Lookup stopped paying; meanwhile the head drafts on most steps. Lookup's probe comes
    # after PROBE_EVERY steps of its own silence, whatever the head does.
    controller = DraftController(max_draft=6)
    controller.record_plain(0.01)
    for _ in range(20):
        controller.record_draft("lookup:3", 4, 0, 0.0, 0.02)
    assert controller.draft_length("lookup:3", 6) == 0
    for step in range(PROBE_EVERY):
        assert controller.draft_length("lookup:3", 6) == 0, step
        controller.record_draft("head", 1, 1, 0.0005, 0.012)
    assert controller.draft_length("lookup:3", 6) == 1


def test_controller_goes_by_the_measured_cost_of_each_draft_length():
    # Rows cost more each past a few (a CPU's verification): 8 drafts verified in 4 steps,
    # 4 drafts in 1.7. A straight line through both would favour 8; the measured costs say 4.
    controller = DraftController(max_draft=8)
    for _ in range(5):
        controller.record_plain(0.01)
    for _ in range(10):
        controller.record_draft("lookup", 8, 8, 0.0, 0.040)
        controller.record_draft("lookup", 4, 4, 0.0, 0.017)
    assert controller.draft_length("lookup", 8) == 4


def test_agreement_runs_count_consecutive_matches():
    draft = torch.tensor([1, 2, 3, 0, 5, 6])
    target = torch.tensor([1, 2, 3, 4, 5, 6])
    assert agreement_runs(draft, target) == [3, 2, 1, 0, 2, 1]


# ------------------------------------------------------------------ calibration and CLI


def test_exit_adapter_training_brings_the_exit_closer_to_the_full_model(tiny):
    from miniapp.engine.evaluation.calibrate import exit_states, train_exit_adapter

    generator = torch.Generator().manual_seed(3)
    sequences = [torch.randint(3, 259, (48,), generator=generator).tolist() for _ in range(6)]

    def divergence(adapter) -> float:
        """Mean KL(full model || exit) per position, in nats."""
        drafter = EarlyExitDrafter(tiny.model, 1, adapter)
        total = 0.0
        for tokens in sequences:
            states, logits = exit_states(tiny, tokens, [1])
            with torch.inference_mode():
                log_q = torch.log_softmax(drafter.exit_logits(states[1]), -1)
            log_p = torch.log_softmax(logits, -1)
            total += float((log_p.exp() * (log_p - log_q)).sum(-1).mean())
        return total / len(sequences)

    before = divergence(None)
    adapter = train_exit_adapter(tiny, 1, sequences, steps=150)
    assert divergence(adapter) < 0.5 * before


def test_calibrate_stores_a_setting_the_runtime_uses(miniapp_exe, default_model):
    done = subprocess.run(
        [
            miniapp_exe,
            "calibrate",
            "--layers",
            "6,20",
            "--prompts",
            "1",
            "--answer-tokens",
            "12",
            "--threads",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [row["layer"] for row in report["layers"]] == [6, 20]
    for row in report["layers"]:
        assert 0.0 <= row["agreement"] <= 1.0 and row["draft_step_ms"] > 0
    stored = report["setting"]
    assert stored["layer"] in (6, 20)
    runtime = TorchRuntime(default_model, n_ctx=256, spec="early-exit")
    assert runtime.early_exit is not None and runtime.early_exit.layer == stored["layer"]
    auto = TorchRuntime(default_model, n_ctx=256, spec="auto")
    assert (auto.early_exit is not None) == stored["pays"]


def test_calibrate_rejects_a_layer_the_model_lacks(miniapp_exe):
    done = subprocess.run(
        [miniapp_exe, "calibrate", "--layers", "30"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "layers 1..29" in done.stderr


def test_chat_reports_acceptance_in_its_stats(miniapp_exe):
    done = subprocess.run(
        [
            miniapp_exe,
            "chat",
            "--spec",
            "lookup",
            "--stats",
            "--temperature",
            "0",
            "--max-tokens",
            "40",
        ],
        input="List the days of the week twice.",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "speculative (lookup)" in done.stderr and "drafts accepted" in done.stderr


def test_spec_modes_other_than_auto_need_the_torch_backend(miniapp_exe):
    done = subprocess.run(
        [miniapp_exe, "chat", "--backend", "llamacpp", "--spec", "lookup"],
        input="hi",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "torch backend only" in done.stderr and done.stderr.count("\n") == 1


def test_bench_reports_plain_and_spec_with_identical_output(miniapp_exe):
    done = subprocess.run(
        [
            miniapp_exe,
            "bench",
            "--task",
            "quote",
            "--spec",
            "lookup",
            "--tokens",
            "24",
            "--repeat",
            "1",
            "--threads",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    for name in ("plain", "spec"):
        for key in ("decode_tok_s", "acceptance_rate", "tokens_per_step"):
            assert key in report[name]
    assert report["plain"]["spec"] == "off" and report["spec"]["spec"] == "lookup"
    # Tokens per full pass: 1.0 when every step is plain (the controller may not probe
    # lookup within 24 tokens); never fewer.
    assert report["spec"]["tokens_per_step"] >= 1.0
    assert report["identical_output"] is True
    assert report["spec_vs_plain"] > 0


def test_controller_probes_less_often_while_probes_keep_failing():
    controller = DraftController(max_draft=4)
    controller.record_plain(0.01)
    for _ in range(20):
        controller.record_draft("early-exit", 2, 0, 0.005, 0.02)
    waits = []
    for _ in range(3):
        steps = 0
        while controller.draft_length("early-exit") == 0:
            controller.record_plain(0.01)
            steps += 1
        controller.record_draft("early-exit", 1, 0, 0.005, 0.02)  # the probe fails
        waits.append(steps)
    assert waits[1] > waits[0] and waits[2] > waits[1]


def test_a_verification_dearer_than_plain_steps_is_probed_seldom():
    # An H200: plain steps replay a CUDA graph (7.7 ms), verifying one draft runs op by op
    # (about 8 steps). Probes every PROBE_EVERY steps made decoding 24-34% slower than with
    # drafting off, although every probe's draft was accepted.
    controller = DraftController(max_draft=4)
    controller.record_plain(0.0077)
    controller.record_draft("lookup", 1, 1, 0.0, 0.064)
    steps = 0
    while controller.draft_length("lookup", 4) == 0:
        controller.record_plain(0.0077)
        steps += 1
    assert controller.draft_length("lookup", 4) == 1  # a probe, not a full draft
    overhead = (0.064 - 0.0077) / (steps * 0.0077)
    assert overhead <= MAX_PROBE_OVERHEAD < (0.064 - 0.0077) / (PROBE_EVERY * 0.0077), steps


def test_a_one_off_stall_does_not_price_the_steps_to_come():
    # A GPU compiles a verification row count's step once (tens of seconds), and a plain
    # step can stall on a page-in: averaged in, either would switch drafting off for good.
    stalled, steady = DraftController(max_draft=4), DraftController(max_draft=4)
    for controller in (stalled, steady):
        for _ in range(5):
            controller.record_plain(0.001)
        for _ in range(5):
            controller.record_draft("lookup", 2, 2, 0.0, 0.0015)
    stalled.record_draft("lookup", 2, 2, 0.0, 30.0)  # the step compiled
    steady.record_draft("lookup", 2, 2, 0.0, 0.0015)
    stalled.record_plain(20.0)  # a page-in
    steady.record_plain(0.001)
    assert stalled.predicted_gain("lookup", 2) == pytest.approx(steady.predicted_gain("lookup", 2))
    assert stalled.draft_length("lookup", 4) == steady.draft_length("lookup", 4) > 0
    before = stalled.predicted_gain("lookup", 2)
    stalled.record_draft("lookup", 2, 2, 0.0, 0.004)  # dearer, but a real cost: counted
    steady.record_draft("lookup", 2, 2, 0.0, 0.0015)
    assert stalled.predicted_gain("lookup", 2) < steady.predicted_gain("lookup", 2)
    assert stalled.predicted_gain("lookup", 2) < before


def test_prompt_lookups_match_lengths_share_one_probe_clock():
    # Each match length drafts under its own name ("lookup:2", "lookup:3"); probing each
    # apart cost one probe per length in every interval (3 verifications in 128 tokens).
    controller = DraftController(max_draft=4)
    controller.record_plain(0.0077)
    controller.record_draft("lookup:2", 1, 1, 0.0, 0.064)
    for _ in range(controller._probe_spacing("lookup:2")):
        assert controller.draft_length("lookup:3", 4) == 0
        controller.record_plain(0.0077)
    controller.record_draft("lookup:3", 1, 1, 0.0, 0.064)  # the family's probe
    assert controller.draft_length("lookup:2", 4) == 0


def test_failed_probes_back_off_the_whole_family():
    # A probe under one match length that fails doubles the wait of the other lengths too:
    # each backing off only from its own failures, the family kept probing every 24 steps.
    controller = DraftController(max_draft=4)
    controller.record_plain(0.01)
    for length in (2, 3):
        controller.set_prior(f"lookup:{length}", 0.0)

    def plain_steps_until_a_probe(drafter: str) -> int:
        steps = 0
        while controller.draft_length(drafter, 4) == 0:
            controller.record_plain(0.01)
            steps += 1
        return steps

    assert plain_steps_until_a_probe("lookup:2") == controller.probe_every - 1
    controller.record_draft("lookup:2", 1, 0, 0.0, 0.012)  # rejected
    assert plain_steps_until_a_probe("lookup:3") == 2 * controller.probe_every
    controller.record_draft("lookup:3", 1, 0, 0.0, 0.012)
    assert plain_steps_until_a_probe("lookup:2") == 4 * controller.probe_every


class _ReplayDrafter:
    """A drafter written against the interface alone: it proposes what plain decoding said
    comes next, with every other proposal's last token wrong, so both paths of a verdict run."""

    name = "replay"

    def __init__(self, model, prompt_length: int, expected: list[int]):
        self.model, self.prompt_length, self.expected = model, prompt_length, expected
        self.observed: list[int] = []
        self.proposals = 0

    def observe(self, tokens):
        self.observed.extend(tokens)

    def propose(self, pending, controller, caches, sampler, history):
        from miniapp.engine.speculative import Draft

        done = len(history) - self.prompt_length  # generated so far, `pending` included
        tokens = self.expected[done : done + controller.draft_length(self.name, 3)]
        if not tokens:
            return None
        self.proposals += 1
        if self.proposals % 2 == 0:
            tokens[-1] = (tokens[-1] + 1) % self.model.config.vocab_size
        return Draft(tokens, pending=pending, key=self.name)

    def verify(self, caches, draft):
        from miniapp.engine.speculative.drafter import Verified

        rows = torch.tensor([draft.pending, *draft.tokens])
        states = self.model.hidden_states(rows, caches, exact_rows=True)
        return Verified(states, self.model.logits(states))


def test_a_new_drafter_needs_only_the_interface(smol):
    prompt = prompt_tokens(smol, QUESTIONS[0])
    _force(smol, "off")
    plain = _generate(smol, prompt, 30)
    _force(smol, "early-exit")
    drafter = _ReplayDrafter(smol.model, len(prompt), plain + [0] * 8)
    smol.early_exit = drafter  # the runtime's slot for the calibrated drafter
    assert _generate(smol, prompt, 30) == plain
    stats = smol.last_speculation
    assert stats.verifications >= 5 and 0 < stats.accepted < stats.drafted
    assert drafter.observed[: len(prompt)] == prompt  # it saw the prompt, then the answer
    assert drafter.observed[len(prompt) :][:20] == plain[:20]
    _force(smol, "off")

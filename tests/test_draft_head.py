"""The trained drafting head: it learns the model's next distribution, drafting with it leaves
greedy output token for token and sampled output in distribution, and it is stored for, and
only used with, the file it was trained on."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import Counter

import pytest
import torch
from test_speculative import SEEDS, TINY_SAMPLING, _generate, _homogeneity_p_value
from tiny_gguf import TinyModel, write_tiny_model

from miniapp.engine.evaluation import head_training as ht
from miniapp.engine.runtimes.torch_runtime import TorchRuntime
from miniapp.engine.speculative import DraftController
from miniapp.engine.speculative.calibration import file_hash, head_path, load_draft_head
from miniapp.engine.speculative.draft_head import DraftHead, HeadWeights
from miniapp.engine.tokens.sampling import GREEDY, SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("head") / "tiny.gguf", TinyModel(n_layers=4))
    return TorchRuntime(path, n_ctx=128, threads=1, spec="off")


def _answers(runtime, count=12, length=40, seed=1, greedy=False) -> list[ht.Answer]:
    """Continuations of random prompts (sampled: a random model's greedy text soon loops),
    teacher-forced into training rows."""
    generator = torch.Generator().manual_seed(seed)
    answers = []
    for i in range(count):
        prompt = torch.randint(3, 259, (6,), generator=generator).tolist()
        params = GREEDY if greedy else SamplingParams(**{**TINY_SAMPLING.__dict__, "seed": i})
        answers.append(ht.record_answer(runtime.model, prompt, params, length, frozenset()))
    return answers


@pytest.fixture(scope="module")
def trained(tiny):
    answers = _answers(tiny) + _answers(tiny, count=4, seed=2, greedy=True)
    vocab = ht.draft_vocabulary(answers, tiny.model.config.vocab_size, 128)
    config = ht.TrainingConfig(steps=300, batch=64, learning_rate=2e-3, weight_decay=0.0)
    weights = ht.train_head(tiny.model, answers, vocab, config)
    return weights, answers


def _runtime_head(runtime, weights: HeadWeights, threshold: float = 0.0) -> DraftHead:
    model = runtime.model
    rows = model.head_rows(weights.vocab)
    return DraftHead(weights, rows, model.config.final_logit_softcap, threshold)


def test_recorded_answers_are_the_runtimes_answers_with_their_states(tiny):
    prompt = [1, 72, 101, 108]
    answer = ht.record_answer(tiny.model, prompt, GREEDY, 12, frozenset())
    assert answer.states.shape[0] == len(answer.fed) - 1 == 12
    assert answer.fed[1:] == _generate(tiny, prompt, 12)
    # Greedy answers: the teacher's most likely token at each row is the token fed next.
    assert answer.top_ids[:, 0].tolist() == answer.fed[1:]


def test_answers_recorded_together_are_those_recorded_one_by_one(tiny):
    """Collecting decodes several answers a pass; each must come out as if decoded alone,
    however the batch around it starts and finishes (sampled, greedy, cut by an end token)."""
    generator = torch.Generator().manual_seed(3)
    requests = []
    for i in range(7):
        prompt = torch.randint(3, 259, (3 + 2 * i,), generator=generator).tolist()
        params = GREEDY if i % 3 == 1 else SamplingParams(**{**TINY_SAMPLING.__dict__, "seed": i})
        requests.append((prompt, params))
    alone = [ht.record_answer(tiny.model, p, params, 20, frozenset()) for p, params in requests]
    # An end token this data uses, so some answers stop early and free their place.
    end = frozenset({Counter(t for a in alone for t in a.fed[1:8]).most_common(1)[0][0]})
    alone = [ht.record_answer(tiny.model, p, params, 20, end) for p, params in requests]
    assert len({len(a.fed) for a in alone}) > 1  # the batch really changes size midway
    for width in (1, 3):
        together = ht.record_answers(tiny.model, requests, 20, end, width)
        _assert_same_answers(alone, together)


def test_collection_saves_each_shard_when_done_and_keeps_saved_ones(tiny, tmp_path, monkeypatch):
    from miniapp.engine.evaluation.calibrate import prompt_tokens

    monkeypatch.setattr(ht, "SHARD", 2)
    monkeypatch.setattr(ht, "COLLECT_WIDTH", 3)
    questions = ["one", "two", "three", "four", "five"]
    saved = _answers(tiny, count=2, length=4, seed=13)  # an interrupted run's shard
    ht._save(tmp_path / "answers-00002.pt", saved)
    answers = ht._collect(tiny, questions, 6, tmp_path, ht.Progress())
    assert [a.fed for a in answers[2:4]] == [a.fed for a in saved]
    eog = tiny.tokenizer.eog_ids
    for i in (0, 1, 4):
        prompt = prompt_tokens(tiny, questions[i])
        alone = ht.record_answer(tiny.model, prompt, ht.sampling_for(i), 6, eog)
        _assert_same_answers([alone], [answers[i]])
    shards = sorted(path.name for path in tmp_path.iterdir())
    assert shards == ["answers-00000.pt", "answers-00002.pt", "answers-00004.pt"]
    assert [a.fed for a in ht._load(tmp_path / "answers-00004.pt")] == [answers[4].fed]


def _assert_same_answers(alone, together) -> None:
    assert len(alone) == len(together)
    for one, batched in zip(alone, together, strict=True):
        assert batched.fed == one.fed
        for name in ("states", "top_ids", "top_probs"):
            assert torch.equal(getattr(batched, name), getattr(one, name)), name


def test_training_teaches_the_head_the_models_distribution_on_unseen_text(tiny, trained):
    weights, _ = trained
    held = _answers(tiny, count=4, seed=7)
    model, vocab = tiny.model, weights.vocab
    rows = ht._Rows.of(held, vocab, model.config.vocab_size)
    head = ht.dense_head_rows(model, vocab)

    def loss(w: HeadWeights) -> float:
        with torch.no_grad():
            return float(ht._chain_loss(model, w, head, 0.0, rows, rows.starts))

    before, after = loss(HeadWeights.initial(64, ht.hidden_width(64), vocab)), loss(weights)
    assert after < 0.6 * before, (before, after)


def test_draft_vocabulary_takes_the_most_frequent_tokens_then_the_lowest_ids(tiny, trained):
    _, answers = trained
    counts = Counter(t for a in answers for t in a.fed[1:])
    used = len(counts)
    vocab = ht.draft_vocabulary(answers, tiny.model.config.vocab_size, used + 5).tolist()
    assert [counts[t] for t in vocab[:used]] == sorted(counts.values(), reverse=True)
    assert vocab[used:] == sorted(set(range(used + 5 + used)) - set(counts))[:5]
    assert ht.coverage(answers, torch.tensor(vocab)) == 1.0
    few = ht.draft_vocabulary(answers, tiny.model.config.vocab_size, 4)
    assert ht.coverage(answers, few) < 1.0


def _force_head(runtime, weights, threshold=0.0, drafts=3) -> None:
    """Draft with the head whenever it is sure enough (a controller that never declines)."""
    runtime.spec_mode = runtime.spec_mode.__class__("head")
    runtime.draft_controller = DraftController(max_draft=drafts, min_gain=0.0)
    runtime.early_exit = None
    runtime.draft_head = _runtime_head(runtime, weights, threshold)


def _plain(runtime):
    runtime.spec_mode = runtime.spec_mode.__class__("off")
    runtime.draft_head = runtime.model.exit_tap = None


def test_greedy_output_with_the_head_is_identical_to_plain(tiny, trained):
    weights, _ = trained
    prompts = [[1, 40 + i, 99, 7 * i + 3] for i in range(4)]
    _plain(tiny)
    plain = [_generate(tiny, p, 40) for p in prompts]
    _force_head(tiny, weights)
    drafted, accepted = [], 0
    for prompt in prompts:
        drafted.append(_generate(tiny, prompt, 40))
        accepted += tiny.last_speculation.accepted
    assert accepted > 0, "nothing accepted: the test is vacuous"
    assert drafted == plain


@pytest.mark.parametrize("threshold", [0.0, 0.3])
def test_sampling_with_the_head_keeps_the_distribution_of_plain_sampling(tiny, trained, threshold):
    """Also with confidence gating (0.3: some steps draft, some do not), which must decide
    from the head's distribution, not from the token it drew."""
    weights, _ = trained
    check_sampling_keeps_plain_distribution(
        tiny, lambda: _force_head(tiny, weights, threshold=threshold, drafts=2), gated=threshold > 0
    )


def check_sampling_keeps_plain_distribution(runtime, force, gated: bool) -> None:
    """Tokens 2 and 3 sampled over many seeds, plainly and after `force()` made a drafter
    draft: the same distribution (chi-square homogeneity), with drafts verified (and, when
    `gated`, plain steps where the gate closed)."""
    prompt = [1, 72, 101, 108, 108, 111]
    counts = Counter()

    def second_and_third(seed):
        params = SamplingParams(**{**TINY_SAMPLING.__dict__, "seed": seed})
        tokens = _generate(runtime, prompt, 3, params)
        if (stats := runtime.last_speculation) is not None:
            counts["verified"] += stats.verifications
            counts["plain"] += stats.steps - stats.verifications
        return tokens[1], tokens[2]

    _plain(runtime)
    plain = [second_and_third(seed) for seed in range(SEEDS)]
    force()
    try:
        spec = [second_and_third(seed + SEEDS) for seed in range(SEEDS)]
    finally:
        _plain(runtime)
    # Vacuity guards: enough verified (and, gated, plain) steps for the test to mean
    # something. Not an exact share: the head's confidences move with the kernels' rounding.
    assert counts["verified"] > SEEDS // 20
    if gated:
        assert counts["plain"] > SEEDS // 20, "the gate never closed: the test is vacuous"
    for position in (0, 1):
        p = _homogeneity_p_value(
            Counter(t[position] for t in plain), Counter(t[position] for t in spec)
        )
        assert p > 1e-3, f"token {position + 2}: p = {p:.2g}"


def test_confidence_threshold_stops_the_chain(tiny, trained):
    weights, _ = trained
    prompts = [[1, 40 + i, 99, 7 * i + 3] for i in range(4)]
    _force_head(tiny, weights, threshold=1.01)  # the head is never that sure
    for prompt in prompts:
        _generate(tiny, prompt, 20)
        assert tiny.last_speculation.drafted == 0


def test_a_head_is_used_only_with_the_file_it_was_trained_for(tiny, trained, tmp_path):
    weights, _ = trained
    model_path = tiny.model_path
    weights.save(head_path(model_path), {"sha256": "0" * 64, "pays": True})
    assert load_draft_head(model_path, tiny.model) is None
    meta = {"sha256": file_hash(model_path), "pays": True, "threshold": 0.0, "acceptance": 0.5}
    weights.save(head_path(model_path), meta)
    loaded = load_draft_head(model_path, tiny.model)
    assert loaded is not None and loaded[1]["threshold"] == 0.0
    assert torch.equal(loaded[0].vocab, weights.vocab)
    runtime = TorchRuntime(model_path, n_ctx=64, threads=1, spec="auto")
    assert runtime.draft_head is not None
    weights.save(head_path(model_path), {**meta, "pays": False})
    assert TorchRuntime(model_path, n_ctx=64, threads=1, spec="auto").draft_head is None
    assert TorchRuntime(model_path, n_ctx=64, threads=1, spec="head").draft_head is not None
    head_path(model_path).write_bytes(b"not a head")  # a damaged file: as if never trained
    assert load_draft_head(model_path, tiny.model) is None
    head_path(model_path).unlink()


def test_spec_head_without_a_trained_head_is_one_line(miniapp_exe, tmp_path):
    path = write_tiny_model(tmp_path / "untrained.gguf", TinyModel())
    done = subprocess.run(
        [miniapp_exe, "chat", "--model", str(path), "--spec", "head", "--threads", "1"],
        input="hi\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no drafting head trained for untrained.gguf" in lines[0]


def test_calibrate_trains_stores_and_resumes(miniapp_exe, tiny):
    command = [
        miniapp_exe,
        "calibrate",
        "--train-head",
        "--model",
        str(tiny.model_path),
        "--head-prompts",
        "3",
        "--head-steps",
        "30",
        "--threads",
        "1",
        "--json",
    ]
    work = head_path(tiny.model_path).with_suffix(".work")
    # A corpus shard already collected (an interrupted run) is used, not collected again.
    ht._save(work / "answers-00000.pt", _answers(tiny, count=3, length=20, seed=11))
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["training_answers"] == 3 and report["trained_rows"] == 60
    assert report["sha256"] == file_hash(tiny.model_path)
    assert 0.0 <= report["acceptance"] <= 1.0 and report["row_cost"] >= 0
    assert 0.0 <= report["threshold"] <= 1.0 and report["max_draft"] >= 0
    assert 0.0 <= report["gated_acceptance"] <= 1.0
    assert not work.exists()
    assert load_draft_head(tiny.model_path, tiny.model) is not None
    # Measured again without training: the training's record is kept, the costs are new,
    # and the work of a training run interrupted since is left for its rerun.
    ht._save(work / "answers-00000.pt", _answers(tiny, count=1, length=5, seed=12))
    measure = [
        miniapp_exe,
        "calibrate",
        "--measure-head",
        "--model",
        str(tiny.model_path),
        "--threads",
        "1",
        "--json",
    ]
    done = subprocess.run(measure, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    again = json.loads(done.stdout)
    assert again["training_answers"] == 3 and again["command"] == report["command"]
    assert again["plain_step_ms"] != report["plain_step_ms"]  # timed anew
    assert (work / "answers-00000.pt").exists()
    shutil.rmtree(work)
    assert (
        load_draft_head(tiny.model_path, tiny.model)[1]["plain_step_ms"] == again["plain_step_ms"]
    )
    head_path(tiny.model_path).unlink()
    done = subprocess.run(measure, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "miniapp: error: --measure-head: no drafting head is trained for tiny.gguf; "
        "run `miniapp calibrate --train-head` first"
    )


def test_the_heads_acceptance_prior_outlasts_a_few_rejections():
    # The head's own gate picks where it drafts: three rejections in a row after a good
    # calibration must not switch it off as they would a drafter with the default memory,
    # while a long run of rejections still does.
    from miniapp.engine.speculative.draft_head import HEAD_ACCEPTANCE_MEMORY

    def controller(memory=None) -> DraftController:
        made = DraftController()
        for _ in range(3):
            made.record_plain(0.010)
        if memory is None:
            made.set_prior("head", 0.65)
        else:
            made.set_prior("head", 0.65, memory)
        made.record_draft("head", 1, 1, 0.0005, 0.0125)  # a row costs a quarter of a step
        return made

    short, long = controller(), controller(HEAD_ACCEPTANCE_MEMORY)
    for made in (short, long):
        for _ in range(3):
            made.record_draft("head", 1, 0, 0.0005, 0.0125)
    assert short.draft_length("head", 4) == 0
    assert long.draft_length("head", 4) >= 1
    for _ in range(60):
        long.record_draft("head", 1, 0, 0.0005, 0.0125)
    assert long.draft_length("head", 4) == 0

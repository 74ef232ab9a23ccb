"""The shallow-exit block (Kangaroo-style): it learns the model's distribution from a
shallow layer, its memory holds every position however it was fed, drafting with it leaves
greedy output token for token and sampled output in distribution, and the runtime picks the
faster of the two trained forms, for the file it was trained on only."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from test_draft_head import _answers, _plain, check_sampling_keeps_plain_distribution
from test_speculative import TINY_SAMPLING, _generate
from tiny_gguf import TinyModel, write_tiny_model

from miniapp.engine.evaluation import head_training as ht
from miniapp.engine.evaluation import shallow_training as st
from miniapp.engine.runtimes.torch_runtime import TorchRuntime
from miniapp.engine.speculative import DraftController
from miniapp.engine.speculative.calibration import (
    file_hash,
    head_path,
    load_shallow_block,
    shallow_path,
)
from miniapp.engine.speculative.shallow_head import (
    BlockWeights,
    ShallowBlock,
    block_rope,
)
from miniapp.engine.tokens.sampling import SamplingParams

EXIT = 2  # of the tiny model's 4 layers


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("shallow") / "tiny.gguf", TinyModel(n_layers=4))
    return TorchRuntime(path, n_ctx=128, threads=1, spec="off")


def _sequences(runtime, answers, seed) -> list[st.ExitSequence]:
    """The prompts `_answers` drew (6 random tokens each, same seed), at the exit."""
    generator = torch.Generator().manual_seed(seed)
    sequences = []
    for answer in answers:
        prompt = torch.randint(3, 259, (6,), generator=generator).tolist()
        assert prompt[-1] == answer.fed[0]
        sequences.append(st.exit_sequence(runtime.model, prompt, answer, EXIT, 8))
    return sequences


@pytest.fixture(scope="module")
def trained(tiny):
    answers = _answers(tiny, count=16, seed=1)
    vocab = ht.draft_vocabulary(answers, tiny.model.config.vocab_size, 128)
    config = st.BlockTraining(steps=200, learning_rate=3e-3, weight_decay=0.0)
    sequences = _sequences(tiny, answers, seed=1)
    for sequence in sequences:  # the memory's window in these tests is 8
        assert sequence.first == 0
    return st.train_block(tiny.model, sequences, vocab, EXIT, config, window=8)


def _block(runtime, weights: BlockWeights, threshold: float = 0.0) -> ShallowBlock:
    return ShallowBlock(weights, runtime.model, runtime.model.head_rows(weights.vocab), threshold)


def _scrambled(vocab: torch.Tensor) -> BlockWeights:
    """A block whose outputs are noise: on a random tiny model the untrained exit already
    agrees with the full model (its residual stream is mostly the token's embedding), so
    learning shows as recovering from noise."""
    weights = BlockWeights.initial(64, ht.hidden_width(64), vocab, EXIT, window=8)
    generator = torch.Generator().manual_seed(5)
    weights.w_o = torch.randn(weights.w_o.shape, generator=generator)
    weights.w_down = torch.randn(weights.w_down.shape, generator=generator) / 4
    return weights


def test_training_teaches_the_block_the_models_distribution_on_unseen_text(tiny, trained):
    model = tiny.model
    train = _sequences(tiny, _answers(tiny, count=16, seed=1), seed=1)
    held = _sequences(tiny, _answers(tiny, count=4, seed=7), seed=7)
    target = st._Targets(trained.vocab, model.config.vocab_size)
    head, rope = ht.dense_head_rows(model, trained.vocab), block_rope()

    def loss(weights: BlockWeights) -> float:
        with torch.no_grad():
            return sum(
                float(st._sequence_loss(model, weights, rope, head, 0.0, target, s)) for s in held
            )

    before = loss(_scrambled(trained.vocab))
    config = st.BlockTraining(steps=150, learning_rate=3e-3, weight_decay=0.0)
    after = loss(
        st.train_block(
            model, train, trained.vocab, EXIT, config, window=8, weights=_scrambled(trained.vocab)
        )
    )
    assert after < 0.5 * before, (before, after)


def _force_shallow(runtime, weights, threshold=0.0, drafts=3) -> ShallowBlock:
    """Draft with the block whenever it is sure enough (a controller that never declines)."""
    runtime.spec_mode = runtime.spec_mode.__class__("head")
    runtime.draft_controller = DraftController(max_draft=drafts, min_gain=0.0)
    runtime.early_exit = None
    runtime.draft_head = runtime.model.exit_tap = _block(runtime, weights, threshold)
    return runtime.draft_head


def test_the_memory_holds_every_position_however_it_was_fed(tiny, trained):
    """After a generation of a prompt chunk, drafts, rejections and plain steps (the gate
    closes on some), the memory holds exactly what feeding the same tokens the plain way
    gives: the prompt as one chunk of exact rows, then one token a step."""
    block = _force_shallow(tiny, trained, threshold=0.3)
    params = SamplingParams(**{**TINY_SAMPLING.__dict__, "seed": 3})
    prompt = [1, 72, 101, 108, 108, 111, 44, 32]
    tokens = _generate(tiny, prompt, 40, params)
    stats = tiny.last_speculation
    assert stats.drafted > stats.accepted > 0 and stats.steps > stats.verifications
    fed, live_caches = tiny.scheduler.latest_sequence()
    assert fed == [*prompt, *tokens][: len(fed)]
    live = block.memory(live_caches[EXIT - 1])
    model = tiny.model
    caches = model.make_caches(tiny.policy)
    model.hidden_states(torch.tensor(prompt), caches, exact_rows=True)
    for token in fed[len(prompt) :]:
        model.hidden_states(torch.tensor([token]), caches)
    _plain(tiny)
    clean = block.memory(caches[EXIT - 1])
    # What the next token's query reads beside its own row: the 7 positions before it. (A
    # draft rejected last may have left its row in the ring, over the 8th: never read.)
    read = list(range(len(fed) - 7, len(fed)))
    rows = []
    for memory in (live, clean):
        slots = [memory.positions.tolist().index(position) for position in read]
        rows.append((memory.keys[slots], memory.values[slots]))
    assert torch.equal(rows[0][0], rows[1][0]) and torch.equal(rows[0][1], rows[1][1])


def test_greedy_output_with_the_shallow_block_is_identical_to_plain(tiny, trained):
    prompts = [[1, 40 + i, 99, 7 * i + 3] for i in range(4)]
    _plain(tiny)
    plain = [_generate(tiny, p, 40) for p in prompts]
    _force_shallow(tiny, trained)
    drafted, accepted = [], 0
    for prompt in prompts:
        drafted.append(_generate(tiny, prompt, 40))
        accepted += tiny.last_speculation.accepted
    _plain(tiny)
    assert accepted > 0, "nothing accepted: the test is vacuous"
    assert drafted == plain


@pytest.mark.parametrize("threshold", [0.0, 0.3])
def test_sampling_with_the_shallow_block_keeps_the_distribution(tiny, trained, threshold):
    check_sampling_keeps_plain_distribution(
        tiny,
        lambda: _force_shallow(tiny, trained, threshold=threshold, drafts=2),
        gated=threshold > 0,
    )


def test_the_runtime_takes_the_faster_form_for_its_own_file(tiny, trained, tmp_path):
    from test_draft_head import _answers as answers_for_head

    # A file of its own (other tests' tiny models share the cache folder and their hashes).
    path = write_tiny_model(tmp_path / "own.gguf", TinyModel(n_layers=4, ffn_dim=128))
    runtime = TorchRuntime(path, n_ctx=64, threads=1, spec="off")
    vocab = trained.vocab
    head = ht.train_head(
        runtime.model,
        answers_for_head(runtime, count=2, length=8),
        vocab,
        ht.TrainingConfig(steps=2),
    )
    own = {"sha256": file_hash(path), "pays": True, "threshold": 0.0, "acceptance": 0.5}
    head.save(head_path(path), {**own, "predicted_speedup": 1.2})
    trained.save(shallow_path(path), {**own, "predicted_speedup": 1.3})

    def chosen(spec: str):
        made = TorchRuntime(path, n_ctx=64, threads=1, spec=spec)
        tap = made.model.exit_tap
        return type(made.draft_head).__name__, tap is not None and tap is made.draft_head

    try:
        assert chosen("auto") == ("ShallowBlock", True)
        trained.save(shallow_path(path), {**own, "predicted_speedup": 1.1})
        assert chosen("auto") == ("DraftHead", False)
        trained.save(shallow_path(path), {**own, "predicted_speedup": 1.4, "pays": False})
        assert chosen("auto") == ("DraftHead", False)
        assert chosen("head") == ("ShallowBlock", True)
        assert chosen("off") == ("NoneType", False)
        trained.save(shallow_path(path), {**own, "sha256": "0" * 64, "predicted_speedup": 2.0})
        assert load_shallow_block(path, runtime.model) is None
        shallow_path(path).write_bytes(b"not a block")
        assert load_shallow_block(path, runtime.model) is None
    finally:
        head_path(path).unlink(missing_ok=True)
        shallow_path(path).unlink(missing_ok=True)


def test_calibrate_trains_and_stores_the_shallow_form(miniapp_exe, tiny):
    command = [
        miniapp_exe,
        "calibrate",
        "--train-head",
        "--head-form",
        "shallow",
        "--exit-layer",
        str(EXIT),
        "--model",
        str(tiny.model_path),
        "--head-prompts",
        "3",
        "--head-steps",
        "20",
        "--threads",
        "1",
        "--json",
    ]
    work = head_path(tiny.model_path).with_suffix(".work")
    ht._save(work / "answers-00000.pt", _answers(tiny, count=3, length=20, seed=11))
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["form"] == "shallow" and report["layer"] == EXIT
    assert report["training_answers"] == 3 and report["sha256"] == file_hash(tiny.model_path)
    for key in ("acceptance", "untrained_acceptance", "gated_acceptance", "threshold"):
        assert 0.0 <= report[key] <= 1.0, key
    assert report["row_cost"] > 0 and report["draft_cost"] > 0
    assert not work.exists()
    loaded = load_shallow_block(tiny.model_path, tiny.model)
    assert loaded is not None and loaded[0].layer == EXIT
    shallow_path(tiny.model_path).unlink()
    bad = [*command[:6], "9", *command[7:]]
    done = subprocess.run(bad, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "miniapp: error: --exit-layer: tiny.gguf has layers 1..3 to exit at"
    )

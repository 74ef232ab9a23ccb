"""The device sampler (engine/tokens/device_sampler.py): the host Sampler's maths on fixed
shapes, for batches of mixed rows, with nothing coming back to the host."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from miniapp.engine.tokens.device_sampler import SamplingTensors, distribution, sample
from miniapp.engine.tokens.sampler import Sampler
from miniapp.engine.tokens.sampling import SamplingParams

VOCAB = 500
PENALTIES = dict(repeat_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3)
GREEDY = SamplingParams(temperature=0.0)


def _settings_grid(penalties: bool) -> list[SamplingParams]:
    extra = PENALTIES if penalties else {}
    greedy = [SamplingParams(temperature=0.0, top_k=k, **extra) for k in (0, 1, 40)]
    grid = itertools.product((0.7, 1.3), (0, 1, 40), (1.0, 0.9, 0.3, 0.0), (0, 0.05, 0.2))
    sampled = [
        SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, **extra) for t, k, p, m in grid
    ]
    return greedy + sampled


def _history(logits_row: torch.Tensor, g: torch.Generator) -> list[int]:
    """80 tokens, mostly the row's likely ones and repeated: longer than the penalty window."""
    likely = logits_row.topk(20).indices[torch.randint(20, (60,), generator=g)]
    tokens = torch.cat([likely, torch.randint(VOCAB, (20,), generator=g)])
    return tokens[torch.randperm(80, generator=g)].tolist()


def _case(params, seed, masked=True):
    """Random logits, histories and (optionally) a grammar mask for one row per params."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(params), VOCAB, generator=g) * 3
    histories = [_history(row, g) for row in logits]
    allowed = torch.rand(logits.shape, generator=g) < 0.3 if masked else None
    return logits, histories, allowed, g


@pytest.mark.parametrize("masked", [False, True], ids=["free", "grammar"])
@pytest.mark.parametrize("penalties", [False, True], ids=["no_penalties", "penalties"])
def test_distribution_and_greedy_choice_match_the_host_sampler(penalties, masked):
    params = _settings_grid(penalties) * 3  # each setting on three different logits
    logits, histories, allowed, g = _case(params, seed=1 + 2 * penalties + masked, masked=masked)
    settings = SamplingTensors.build(params, histories, VOCAB, allowed)
    probs = distribution(logits, settings)
    tokens = sample(logits, settings, torch.rand(len(params), generator=g))
    host_logits = logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))
    for row, p in enumerate(params):
        host = Sampler(p)
        if p.greedy:
            best = host(host_logits[row], histories[row])
            assert tokens[row] == best and probs[row, best] == 1 and probs[row].sum() == 1
        else:
            want = host.distribution(host_logits[row], histories[row])
            torch.testing.assert_close(probs[row], want, atol=1e-6, rtol=0)
            assert want[tokens[row]] > 0


def test_a_tiny_temperature_shifts_the_logits_before_dividing():
    """100 / 1e-37 overflows fp32: unshifted, the two tied best tokens would be NaN."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = logits[0, 4] = 100.0
    params = SamplingParams(temperature=1e-37, top_k=0, top_p=1.0, min_p=0.0)
    probs = distribution(logits, SamplingTensors.build([params], [[]], VOCAB))[0]
    torch.testing.assert_close(probs, Sampler(params).distribution(logits[0], []))
    assert probs[3] == probs[4] == 0.5


def test_sample_takes_the_token_where_the_uniform_falls_in_the_sorted_cumulative_mass():
    params = SamplingParams(temperature=1.3, top_k=50, top_p=0.95, min_p=0.0)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5)) * 2
    probs = distribution(logits, SamplingTensors.build([params], [[]], VOCAB))[0]
    order = logits[0].argsort(descending=True)  # no penalties: the sampler's order
    mass = probs[order]
    n = int((mass > 0).sum())
    cdf = mass[:n].cumsum(0)
    # The middle of each candidate's interval, both ends of [0, 1), and a uniform that
    # rounding (a float64 one cast to float32) carried up to 1: still the last candidate.
    uniforms = torch.cat([cdf - mass[:n] / 2, torch.tensor([0.0, 1 - 2**-24, 1.0])])
    want = torch.cat([order[:n], order[[0, n - 1, n - 1]]])
    rows = len(uniforms)
    settings = SamplingTensors.build([params] * rows, [[]] * rows, VOCAB)
    assert torch.equal(sample(logits.expand(rows, -1), settings, uniforms), want)


def test_draws_follow_the_distribution():
    params = SamplingParams(temperature=1.3, top_k=40, top_p=0.9, min_p=0.02, **PENALTIES)
    (logits,), (history,), _, g = _case([params], seed=7, masked=False)
    want = distribution(logits[None], SamplingTensors.build([params], [history], VOCAB))[0]
    draws = 20_000
    settings = SamplingTensors.build([params] * draws, [history] * draws, VOCAB)
    tokens = sample(logits.expand(draws, -1), settings, torch.rand(draws, generator=g))
    seen = torch.bincount(tokens, minlength=VOCAB).double()
    expected = want.double() * draws
    sigma = (expected * (1 - want.double())).sqrt()
    assert (want > 0).sum() > 5  # a distribution worth testing
    assert ((seen - expected).abs() <= 5 * sigma + 1).all()
    assert seen[want == 0].sum() == 0


def test_each_row_of_a_mixed_batch_gets_what_it_gets_alone():
    params = [
        GREEDY,
        SamplingParams(temperature=0.0, **PENALTIES),
        SamplingParams(temperature=0.7, top_k=40, top_p=1.0, min_p=0.0),
        SamplingParams(temperature=1.3, top_k=0, top_p=0.3, min_p=0.0, **PENALTIES),
        SamplingParams(temperature=1e-4, top_k=1, top_p=0.9, min_p=0.2),
        SamplingParams(temperature=1.3, top_k=0, top_p=1.0, min_p=0.05, **PENALTIES),
    ]
    logits, histories, allowed, g = _case(params, seed=11)
    uniforms = torch.rand(len(params), generator=g)
    batch = SamplingTensors.build(params, histories, VOCAB, allowed)
    tokens, probs = sample(logits, batch, uniforms), distribution(logits, batch)
    for row, p in enumerate(params):
        one = slice(row, row + 1)
        alone = SamplingTensors.build([p], [histories[row]], VOCAB, allowed[one])
        assert torch.equal(sample(logits[one], alone, uniforms[one]), tokens[one])
        assert torch.equal(distribution(logits[one], alone), probs[one])


class _OpsRun(TorchDispatchMode):
    """Notes every aten op that runs, and whether any index used a boolean mask."""

    def __init__(self):
        super().__init__()
        self.ran = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ran.add(func.overloadpacket)
        if func.overloadpacket is torch.ops.aten.index:
            if any(i is not None and i.dtype == torch.bool for i in args[1]):
                self.ran.add("boolean indexing")
        return func(*args, **(kwargs or {}))


HOST_BOUND = {
    torch.ops.aten._local_scalar_dense,  # .item(), int(tensor), .tolist(): a sync
    torch.ops.aten.lift_fresh,  # torch.tensor(python data): a copy from the host
    torch.ops.aten.lift_fresh_copy,
    torch.ops.aten.nonzero,  # shapes that depend on values
    torch.ops.aten.masked_select,
    "boolean indexing",
}


def test_sample_and_distribution_make_no_host_sync_and_no_tensor_from_python_data():
    params = _settings_grid(penalties=True)
    logits, histories, allowed, g = _case(params, seed=13)
    settings = SamplingTensors.build(params, histories, VOCAB, allowed)
    uniforms = torch.rand(len(params), generator=g)
    with _OpsRun() as ops:
        sample(logits, settings, uniforms)
        distribution(logits, settings)
    assert torch.ops.aten.sort in ops.ran  # the recorder saw the work
    assert not ops.ran & HOST_BOUND


def test_fill_writes_into_the_same_buffers_and_changes_the_result():
    params = [SamplingParams(temperature=1.3, top_p=0.9, **PENALTIES), GREEDY]
    logits, histories, allowed, _ = _case(params, seed=17)
    static = SamplingTensors.buffers(2, VOCAB)
    before = distribution(logits, static)
    buffers = ("scalars", "counts", "allowed")
    addresses = [getattr(static, name).data_ptr() for name in buffers]
    new = SamplingTensors.build(params, histories, VOCAB, allowed)
    assert static.fill_(new) is static
    assert [getattr(static, name).data_ptr() for name in buffers] == addresses
    after = distribution(logits, static)
    assert torch.equal(after, distribution(logits, new)) and not torch.equal(after, before)
    static.fill_(SamplingTensors.build(params, histories, VOCAB))  # no grammar: all allowed
    assert static.allowed.all() and static.counts.any()
    assert static.neutral == {"allowed"}  # counts were written, the mask reset
    static.fill_(SamplingTensors.build([GREEDY] * 2, histories, VOCAB))  # no penalties
    assert not static.counts.any() and static.allowed.all()
    # Both buffers neutral now: the next fill without counts or a mask leaves them be.
    assert static.neutral == {"counts", "allowed"}
    static.counts[0, 0] = 5.0  # (only to see that it is not written again)
    static.fill_(SamplingTensors.build([GREEDY] * 2, histories, VOCAB))
    assert static.counts[0, 0] == 5.0

from __future__ import annotations

from dataclasses import replace

import torch

from miniapp.engine.tokens.sampler import Sampler, apply_presence_frequency, apply_repeat_penalty
from miniapp.engine.tokens.sampling import SamplingParams


def test_greedy_is_argmax():
    logits = torch.randn(1000)
    assert Sampler(SamplingParams(temperature=0))(logits, []) == int(logits.argmax())


def test_top_k_one_is_greedy_at_any_temperature():
    logits = torch.randn(1000)
    sampler = Sampler(SamplingParams(temperature=5.0, top_k=1, seed=3))
    assert {sampler(logits, []) for _ in range(20)} == {int(logits.argmax())}


def test_seed_reproduces_and_differs():
    logits = torch.zeros(500)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    s1, s2 = Sampler(params), Sampler(params)
    seq1 = [s1(logits, []) for _ in range(30)]
    seq2 = [s2(logits, []) for _ in range(30)]
    assert seq1 == seq2
    other = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7))
    assert [other(logits, []) for _ in range(30)] != seq1


def test_unfiltered_sampling_follows_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1))
    counts = torch.bincount(torch.tensor([sampler(logits, []) for _ in range(4000)]), minlength=4)
    expected = torch.softmax(logits, 0) * 4000
    # 5 standard deviations of a binomial count: a wrong distribution fails, noise does not.
    sd = (expected * (1 - expected / 4000)).sqrt()
    assert ((counts - expected).abs() <= 5 * sd).all(), (counts, expected)


def test_top_p_and_min_p_cut_the_tail():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    top_p = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=0.75, min_p=0.0, seed=0))
    assert {top_p(logits, []) for _ in range(300)} == {0, 1}
    min_p = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.25, seed=0))
    assert {min_p(logits, []) for _ in range(300)} == {0, 1, 2}


def test_repeat_penalty_follows_llama_cpp_rule():
    logits = torch.tensor([2.0, -2.0, 1.0])
    out = apply_repeat_penalty(logits, [0, 1, 1], penalty=2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]
    assert logits.tolist() == [2.0, -2.0, 1.0]  # input untouched


def test_presence_and_frequency_penalties_follow_openais_rule_over_the_recent_tokens():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    out = apply_presence_frequency(logits, [0, 1, 1, 1], presence=0.5, frequency=0.25)
    assert out.tolist() == [2.0 - 0.75, -2.0 - 1.25, 1.0, 0.5]
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.5]  # input untouched
    # Through the sampler: only the last repeat_last_n tokens count; a strong presence
    # penalty turns greedy away from a token it just produced.
    params = SamplingParams(temperature=0, presence_penalty=2.0, repeat_last_n=2)
    assert Sampler(params)(torch.tensor([3.0, 2.0, 0.0]), [0]) == 1
    assert Sampler(params)(torch.tensor([3.0, 2.0, 0.0]), [0, 2, 2]) == 0  # 0 is out of range


def test_settings_at_the_edge_of_float32_still_draw_the_likely_token():
    # Found by fuzzing the API: each of these once made every draw fail (a 500).
    logits = torch.tensor([30.0, 29.0, -5.0, 12.0])
    edges = [
        SamplingParams(temperature=1.0, top_k=0, top_p=5e-324, min_p=0.0),  # rounds to 0
        SamplingParams(temperature=1e-40, top_k=0, top_p=1.0, min_p=0.0),  # logits overflow
        SamplingParams(temperature=1.0, top_k=1, repeat_penalty=5e-324),  # divides by ~0
    ]
    for params in edges:
        assert Sampler(replace(params, seed=1))(logits, [0]) == 0, params

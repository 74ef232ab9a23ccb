"""StreamingLLM's finding on our engine, at test scale: a sliding window with attention sinks
stays close to recomputing every window, and without sinks it falls apart."""

from __future__ import annotations

import json
import subprocess

from miniapp.assets import sample_texts
from miniapp.engine.evaluation.perplexity import recompute_perplexity, streaming_perplexity
from miniapp.engine.runtimes.torch_runtime import TorchRuntime

WINDOW = 48


def test_sinks_stay_near_recompute_and_no_sinks_do_not(default_model):
    text = sample_texts()[0] + "\n\n" + sample_texts()[1]  # > 20 windows of 48 tokens
    with_sinks = streaming_perplexity(
        TorchRuntime(default_model, n_ctx=4 + WINDOW, sinks=4, window=WINDOW), text, 4, WINDOW
    )
    without = streaming_perplexity(
        TorchRuntime(default_model, n_ctx=WINDOW, sinks=0, window=WINDOW), text, 0, WINDOW
    )
    baseline = recompute_perplexity(TorchRuntime(default_model, n_ctx=WINDOW), text, WINDOW, 8)
    assert with_sinks.text_tokens >= 20 * WINDOW
    assert with_sinks.tokens == without.tokens == baseline.tokens == with_sinks.text_tokens - WINDOW
    # Near means not worse by more than 10%. Here the window with sinks scores about 10%
    # better than the baseline, whose scored tokens see 40-47 tokens of context against its
    # 52, so a two-sided bound would fail on an improvement.
    assert with_sinks.ppl < 1.10 * baseline.ppl, (with_sinks, baseline)
    assert without.ppl > 1.3 * baseline.ppl, (without, baseline)


def test_eval_ppl_json_reports_its_settings(miniapp_exe, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(sample_texts()[2])
    done = subprocess.run(
        [miniapp_exe, "eval", "ppl", str(text), "--window", "64", "--sinks", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["mode"] == "streaming" and report["window"] == 64 and report["sinks"] == 2
    assert report["ctx"] == 66 and report["ppl"] > 1


# A ring of 16 + 64 (the roll-back slack), 128 with q4 keys' whole tiles: 20 wraps in 2600
# tokens.
RING_WINDOW = 16


def test_quantized_rings_that_wrap_20_times_stay_within_their_bounds_of_f32(default_model):
    """Streaming through 4 sinks and a window of 16, the ring wraps 20 times and the sinks
    are re-rotated on every token; 8-bit keys and values must not drift from f32 by more
    than 0.5%, 4-bit (keys in tiles re-encoded as the ring overwrites them) by more than 2%."""
    text = "\n\n".join(sample_texts())[:12_500]  # ~2700 tokens
    results, rings = {}, {}
    for kind in ("f32", "q8", "q4"):
        runtime = TorchRuntime(
            default_model, n_ctx=4 + RING_WINDOW, sinks=4, window=RING_WINDOW, kv=kind
        )
        results[kind] = streaming_perplexity(runtime, text, 4, RING_WINDOW)
        rings[kind] = runtime.model.make_caches(runtime.policy)[0].ring_capacity
    for kind, bound in (("q8", 0.005), ("q4", 0.02)):
        assert results[kind].text_tokens >= 20 * rings[kind] + RING_WINDOW, results[kind]
        drift = abs(results[kind].ppl - results["f32"].ppl) / results["f32"].ppl
        assert drift < bound, (results[kind], results["f32"])

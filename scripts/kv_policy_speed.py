"""Decode speed of each --kv-policy at one budget, side by side in one process.

A prompt of twice the budget (README.md's text), then budget + 256 tokens greedy without
drafting, so that the cache is full and evicting for most of the answer; runs interleaved
across policies, medians printed with the ratio to the window policy.

    python scripts/kv_policy_speed.py --model smollm2-135m-instruct --budget 512 --runs 3
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from miniapp.engine.api import KV_POLICIES, WINDOW_POLICY, resolve_model
from miniapp.engine.chat.generation import generate
from miniapp.engine.runtimes.torch_runtime import TorchRuntime
from miniapp.engine.tokens.events import Finished
from miniapp.engine.tokens.sampling import GREEDY, GenerationRequest

TEXT = Path(__file__).resolve().parents[1] / "README.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--budget", type=int, default=256, help="sinks + window")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-type", default=None)
    args = parser.parse_args()
    model = resolve_model(args.model)
    runtimes = {
        policy: TorchRuntime(
            model,
            n_ctx=8192,
            threads=args.threads,
            sinks=args.sinks,
            window=args.budget - args.sinks,
            kv_policy=policy,
            spec="off",
            kv=args.kv_type,
        )
        for policy in KV_POLICIES
    }
    tokenizer = runtimes[WINDOW_POLICY].tokenizer
    prompt = tokenizer.encode(TEXT.read_text()[:20000], parse_special=False)[: 2 * args.budget]
    request = GenerationRequest(args.budget + 256, GREEDY, ignore_end_of_turn=True)
    speeds: dict[str, list[float]] = {policy: [] for policy in runtimes}
    for _ in range(args.runs):
        for policy, runtime in runtimes.items():
            runtime.reset()
            events = list(generate(runtime, prompt, request))
            finished = events[-1]
            assert isinstance(finished, Finished)
            speeds[policy].append(finished.stats.decode_tok_s)
    window = statistics.median(speeds[WINDOW_POLICY])
    for policy, runs in speeds.items():
        median = statistics.median(runs)
        listed = ", ".join(f"{s:.1f}" for s in runs)
        print(
            f"{model.name} budget {args.budget} {policy}: {median:.1f} tok/s "
            f"(runs {listed}), {median / window:.2f}x window"
        )


if __name__ == "__main__":
    main()

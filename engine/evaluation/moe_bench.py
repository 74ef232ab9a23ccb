"""`miniapp bench moe`: what a mixture-of-experts model's steps read and cost.

For decode steps of 1, 2, 4 and 8 sequences at once, and for a verification of several
rows of one sequence (speculative decoding), each step's time (median), the experts its rows
chose (distinct per layer), and the bytes of weights it read: the shared weights (attention,
routers, any shared expert, the output head) plus each chosen expert once, however many rows
chose it, since the native kernel groups rows by expert. Beside them, what reading each row's
experts separately would cost, and the step's bandwidth floor (its bytes over the measured
read bandwidth, given by the caller).

The tokens are random, so rows choose experts as a well-balanced router would: little overlap
between rows, the hard case for batching (a real model's routing overlaps more where its rows
are similar text).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..modelfile.gguf_file import GGUFFile
from ..models import CachePolicy, build_model
from ..models.decoder import DecoderModel
from ..models.experts import MixtureFeedForward

PROMPT_TOKENS = 32


@dataclass(frozen=True)
class MoeStep:
    kind: str  # "decode": one row of each of `rows` sequences; "verify": rows of one sequence
    rows: int
    step_ms: float  # median
    tok_s: float  # rows a second
    experts_per_layer: float  # distinct experts the step's rows chose, mean over layers
    bytes_per_step: int  # weights read: shared, plus each chosen expert once
    bytes_ungrouped: int  # the same if every row read its own experts
    floor_ms: float  # bytes_per_step at the measured read bandwidth

    @property
    def floor_share(self) -> float:
        return self.floor_ms / self.step_ms


@dataclass(frozen=True)
class MoeBenchResult:
    model: str
    threads: int
    read_gb_s: float
    experts: int
    used: int
    steps: list[MoeStep]

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "steps": [asdict(s) | {"floor_share": s.floor_share} for s in self.steps],
        }


def bench_moe(
    path: Path,
    threads: int,
    read_bytes_per_s: float,
    batches: tuple[int, ...] = (1, 2, 4, 8),
    verify_rows: int = 4,
    steps: int = 12,
    seed: int = 0,
) -> MoeBenchResult:
    torch.set_num_threads(threads)
    model = build_model(GGUFFile(path))
    mixtures = [block.feed_forward for block in model.layers]
    if not all(isinstance(m, MixtureFeedForward) for m in mixtures):
        raise ValueError(f"{path.name} is not a mixture of experts")
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=generator).tolist()

    results = []
    with torch.inference_mode():
        for count in batches:
            caches = [model.make_caches(CachePolicy(ctx=512)) for _ in range(count)]
            for own in caches:
                model.hidden_segments([(tokens(PROMPT_TOKENS), own)])

            def decode_step(caches=caches) -> torch.Tensor:
                states = model.hidden_segments([(tokens(1), own) for own in caches])
                return model.logits(states)

            results.append(_measure(model, "decode", count, decode_step, steps, read_bytes_per_s))
        caches = model.make_caches(CachePolicy(ctx=512, streaming=False))
        model.hidden_states(torch.tensor(tokens(PROMPT_TOKENS)), caches)

        def verify_step() -> torch.Tensor:
            rows = torch.tensor(tokens(verify_rows))
            logits = model.logits(model.hidden_states(rows, caches, exact_rows=True))
            for cache in caches:
                cache.trim(verify_rows)
            return logits

        results.append(_measure(model, "verify", verify_rows, verify_step, steps, read_bytes_per_s))
    first = mixtures[0]
    return MoeBenchResult(
        path.name,
        threads,
        read_bytes_per_s / 1e9,
        first.experts.n_experts,
        first.used,
        results,
    )


def _measure(model: DecoderModel, kind: str, rows: int, step, steps: int, bandwidth: float):
    step()  # warm: first-touch of this shape's buffers
    times, chosen, read, ungrouped = [], [], [], []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
        distinct, grouped, separate = _step_reads(model)
        chosen.append(distinct)
        read.append(grouped)
        ungrouped.append(separate)
    step_s = statistics.median(times)
    bytes_per_step = int(statistics.median(read))
    return MoeStep(
        kind=kind,
        rows=rows,
        step_ms=1000 * step_s,
        tok_s=rows / step_s,
        experts_per_layer=statistics.mean(chosen),
        bytes_per_step=bytes_per_step,
        bytes_ungrouped=int(statistics.median(ungrouped)),
        floor_ms=1000 * bytes_per_step / bandwidth,
    )


def _step_reads(model: DecoderModel) -> tuple[float, int, int]:
    """From the last pass's choices: distinct experts per layer (mean), the bytes the pass
    read with rows grouped by expert, and the bytes reading each row's experts apart."""
    shared = model.weight_bytes_per_token()
    distinct, grouped, separate = [], shared, shared
    for block in model.layers:
        ffn = block.feed_forward
        ids = ffn.last_ids
        shared_part = ffn.bytes_per_token()
        chosen = torch.unique(ids).tolist()
        distinct.append(len(chosen))
        grouped += ffn.bytes_for(ids) - shared_part
        per_expert = [ffn.experts.expert_bytes(e) for e in ids.reshape(-1).tolist()]
        separate += ffn.bytes_for(ids[:0]) + sum(per_expert) - shared_part
    return statistics.mean(distinct), grouped, separate

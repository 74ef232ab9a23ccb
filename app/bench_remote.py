"""`miniapp bench --backend openai`: what going over HTTP costs. The same chat messages go to a
server's model and to our torch engine in this process, alternately, greedy, and the
figures are compared pair by pair: TTFT and decode tok/s (the server's taken from its
stream as the chunks arrive).

Point it at a `miniapp serve` of the same model with `--parallel 1 --spec off` to measure the
HTTP path alone: the engine behind the server is then the one measured here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass

from miniapp.engine.api import (
    GREEDY,
    Conversation,
    Finished,
    GenerationRequest,
    GenerationStats,
    RuntimeConfig,
    TextDelta,
    open_runtime,
    resolve_model,
)

from .bench import task_questions
from .host.remote import open_remote

LOCAL_CTX = 4096


@dataclass(frozen=True)
class Answer:
    text: str
    stats: GenerationStats


@dataclass(frozen=True)
class Side:
    """One side's medians over every answer."""

    ttft_ms: float
    decode_tok_s: float
    generated_tokens: float


def run_remote_bench(args: argparse.Namespace) -> int:
    remote = open_remote(args, ("temperature",))
    local = open_runtime(
        RuntimeConfig(
            args.model, "torch", ctx=args.ctx or LOCAL_CTX, threads=args.threads, spec="off"
        )
    )
    request = GenerationRequest(max_tokens=args.tokens, sampling=GREEDY)
    questions = task_questions(args.task or "chat")
    for runtime in (local, remote):  # warm-up: first-call costs are not what is measured
        _answer(runtime, questions[0], request)
    pairs: list[tuple[Answer, Answer]] = []
    for run in range(args.repeat):
        for question in questions:
            if not args.json and sys.stderr.isatty():
                print(f"run {run + 1}/{args.repeat}: {question[:40]!r}", file=sys.stderr)
            pairs.append((_answer(local, question, request), _answer(remote, question, request)))
    report = _report(pairs, remote.info().label, remote.endpoint.base_url, args)
    print(json.dumps(report) if args.json else _table(report))
    return 0


def _answer(runtime, question: str, request: GenerationRequest) -> Answer:
    text, finish = [], None
    for event in Conversation(runtime, request=request).send(question):
        if isinstance(event, TextDelta):
            text.append(event.text)
        elif isinstance(event, Finished):
            finish = event
    assert finish is not None
    return Answer("".join(text), finish.stats)


def _side(answers: list[Answer]) -> Side:
    return Side(
        ttft_ms=statistics.median(a.stats.ttft_s * 1000 for a in answers),
        decode_tok_s=statistics.median(a.stats.decode_tok_s for a in answers),
        generated_tokens=statistics.median(a.stats.generated_tokens for a in answers),
    )


def _report(pairs: list[tuple[Answer, Answer]], model: str, base_url: str, args) -> dict:
    measured = [(a, b) for a, b in pairs if a.stats.generated_tokens > 1 < b.stats.generated_tokens]
    return {
        "server": base_url,
        "remote_model": model,
        "local_model": str(resolve_model(args.model).name),
        "task": args.task or "chat",
        "answers": len(pairs),
        "threads": args.threads,
        "local": asdict(_side([a for a, _ in pairs])),
        "remote": asdict(_side([b for _, b in pairs])),
        # Pair by pair: the same question, one answer after the other.
        "decode_ratio": statistics.median(
            b.stats.decode_tok_s / max(a.stats.decode_tok_s, 1e-9) for a, b in measured
        )
        if measured
        else None,
        "ttft_overhead_ms": statistics.median(
            (b.stats.ttft_s - a.stats.ttft_s) * 1000 for a, b in pairs
        ),
        "identical_answers": sum(a.text == b.text for a, b in pairs),
    }


def _table(report: dict) -> str:
    local, remote = report["local"], report["remote"]
    ratio = report["decode_ratio"]
    lines = [
        f"{report['remote_model']} at {report['server']} vs {report['local_model']} in this "
        f"process (torch, spec off), task {report['task']}, {report['answers']} answers each",
        f"{'':18}{'local':>10}{'server':>10}",
        f"{'TTFT ms':18}{local['ttft_ms']:>10.1f}{remote['ttft_ms']:>10.1f}",
        f"{'decode tok/s':18}{local['decode_tok_s']:>10.1f}{remote['decode_tok_s']:>10.1f}",
        f"{'tokens generated':18}{local['generated_tokens']:>10.0f}"
        f"{remote['generated_tokens']:>10.0f}",
        "medians of pairs: decode server/local "
        + (f"{ratio:.3f}" if ratio is not None else "n/a")
        + f", TTFT overhead {report['ttft_overhead_ms']:+.1f} ms; "
        f"identical answers {report['identical_answers']}/{report['answers']}",
    ]
    return "\n".join(lines)

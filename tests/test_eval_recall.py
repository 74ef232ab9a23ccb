"""`miniapp eval recall`: generated recall cases past a full KV cache, scored for each KV
policy beside the window and a full cache."""

from __future__ import annotations

import faulthandler
import json
import math
import re
import subprocess

import pytest

from miniapp.app.cli import main
from miniapp.engine.api import resolve_model
from miniapp.engine.evaluation import recall
from miniapp.engine.evaluation.recall import make_case, other_depth
from miniapp.engine.tokens.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(resolve_model(None))


def _tokens(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_bos=False, parse_special=False))


def test_filler_never_uses_the_facts_words_or_digits():
    filler = " ".join(recall.SUBJECTS + recall.VERBS + recall.PLACES + recall.TAILS).lower()
    words = set(re.findall(r"[a-z]+", filler))
    for phrase in recall.ATTRIBUTES + recall.COLORS + recall.THINGS:
        assert not set(phrase.split()) & words, phrase
    assert not re.search(r"\d", filler)


@pytest.mark.parametrize(
    ("budget", "length", "depth"),
    [(128, 2.0, 0.0), (128, 2.0, 0.1), (256, 3.0, 0.5), (128, 4.0, 0.9), (512, 2.0, 1.0)],
)
def test_cases_are_reproducible_and_put_the_fact_at_its_depth(tokenizer, budget, length, depth):
    case = make_case(tokenizer, budget, length, depth, seed=3, index=1)
    assert case == make_case(tokenizer, budget, length, depth, seed=3, index=1)
    assert case.document != make_case(tokenizer, budget, length, depth, seed=4).document
    doc = case.document
    assert abs(_tokens(tokenizer, doc) - length * budget) <= 0.05 * length * budget
    for fact, wanted in zip(case.facts, (depth, other_depth(depth)), strict=True):
        # Counted afresh here: the tokens before the sentence, over every other token.
        assert doc.count(fact.sentence) == 1 and doc.count(fact.value) == 1
        before = doc[: doc.index(fact.sentence)].rstrip()
        start = _tokens(tokenizer, before) if before else 0
        own = _tokens(tokenizer, " " + fact.sentence)
        assert abs(start / (_tokens(tokenizer, doc) - own) - wanted) <= 0.05, (start, wanted)
        assert fact.key in fact.question and fact.question.endswith("?")
        assert fact.answer_prefix.lower() == fact.key + " is"
    a, b = case.facts
    assert a.key != b.key and a.value != b.value
    assert abs(case.position - depth) <= 0.05
    tokens = tokenizer.encode(doc, add_bos=False, parse_special=False)
    fact = tokenizer.decode(tokens[case.fact_starts[0] : case.fact_ends[0]])
    assert fact.strip() == a.sentence


def _one_line_error(monkeypatch, capsys, argv: list[str], *fragments: str) -> None:
    # main() points the fault handler at stderr, which capsys replaces by an object with no
    # file descriptor (pytest's own handler stays).
    monkeypatch.setattr(faulthandler, "enable", lambda *args, **kwargs: None)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("miniapp: error:"), err
    for fragment in fragments:
        assert fragment in err[0], err[0]


@pytest.mark.parametrize(
    ("flags", "fragments"),
    [
        (["--budgets", "256,12"], ("--budgets", "12")),
        (["--budgets", "256,abc"], ("--budgets", "abc")),
        (["--depths", "0.1,1.5"], ("--depths", "1.5")),
        (["--depths", "-0.2"], ("--depths",)),
        (["--policies", "window,lru"], ("lru",)),
        (["--text", "no/such/file.txt"], ("file not found",)),
    ],
)
def test_bad_values_are_one_line(monkeypatch, capsys, flags, fragments):
    _one_line_error(monkeypatch, capsys, ["eval", "recall", *flags], *fragments)


def test_bad_budget_from_the_command_line(miniapp_exe):
    done = subprocess.run(
        [miniapp_exe, "eval", "recall", "--budgets", "8", "--sinks", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--budgets" in lines[0] and "Traceback" not in done.stderr


DEPTHS = (0.1, 0.9)


def test_eval_recall_json_end_to_end(miniapp_exe):
    budget, sinks = 64, 4
    window = budget - sinks
    done = subprocess.run(
        [
            miniapp_exe,
            "eval",
            "recall",
            "--budgets",
            str(budget),
            "--depths",
            ",".join(map(str, DEPTHS)),
            "--lengths",
            "2",
            "--cases",
            "1",
            "--policies",
            "window",
            "--no-ppl",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["settings"]["policies"] == ["window"]
    questions = report["questions"]
    conditions = ("full", "window")
    keys = {(q["condition"], q["budget"], q["depth"], q["qtype"]) for q in questions}
    assert len(questions) == len(keys) == len(conditions) * len(DEPTHS) * 3
    assert keys == {
        (c, budget, d, t) for c in conditions for d in DEPTHS for t in recall.QUESTION_TYPES
    }
    assert {(c["condition"], c["depth"], c["qtype"]) for c in report["cells"]} == {
        (c, d, t) for c, _, d, t in keys
    }
    for q in questions:
        assert math.isfinite(q["logprob"]) and q["logprob"] <= 0, q
        assert q["exact"] == (q["value"] in q["answer"]), q
        if q["qtype"] != "inside":
            # The question's turn continued the chat's caches: everything before it was
            # found cached (the rings of the window and the full cache trim exactly).
            assert q["cached_tokens"] >= q["chat_tokens"] > 0, q
    assert report["redone_turns"] == 0
    (summary,) = report["budgets"]
    assert (summary["budget"], summary["sinks"], summary["window"]) == (budget, sinks, window)
    assert set(summary["exact_by_depth"]) == set(conditions)
    assert set(summary["exact_by_depth"]["full"]) == {str(d) for d in DEPTHS}

    # At depth 0.1 the fact is far older than the window's 60 tokens when the question
    # comes: the window cannot have it, the full cache can.
    early = [q for q in questions if q["depth"] == DEPTHS[0]]
    assert all(q["outside"] for q in early)
    assert DEPTHS[0] in summary["outside_depths"]
    window_early = [q for q in early if q["condition"] == "window"]
    full_early = [q for q in early if q["condition"] == "full"]
    assert not any(q["exact"] for q in window_early), window_early
    full_logprob = sum(q["logprob"] for q in full_early) / len(full_early)
    window_logprob = sum(q["logprob"] for q in window_early) / len(window_early)
    assert full_logprob > window_logprob, (full_early, window_early)
    assert summary["outside_exact"]["window"] == 0

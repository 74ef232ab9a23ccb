"""How well a model ranks documents by relevance (engine/chat/relevance.py, what /v1/rerank
serves): a small set written for this project, each query with one document that answers it
and three that do not (two of them on the same subject, so that matching words is not
enough). Scored by how often the answering document comes first (top-1; a tie counts as a
miss) and by the mean reciprocal rank; chance gives top-1 0.25 and MRR about 0.52.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from ..chat.relevance import judgement_prompt, relevance
from ..modelfile.template import ChatTemplate
from ..runtimes.base import Runtime

# (query, the answering document, three that do not answer it)
RERANK_SET: tuple[tuple[str, str, tuple[str, str, str]], ...] = (
    (
        "What is the capital of France?",
        "Paris has been the capital of France for most of its history.",
        (
            "France is known for its cheeses and its wine regions.",
            "The Loire valley in France has many castles.",
            "Bananas grow in warm, wet climates.",
        ),
    ),
    (
        "How many legs does a spider have?",
        "Spiders have eight legs, which sets them apart from insects with six.",
        (
            "Many spiders spin webs to catch flying insects.",
            "Some people are afraid of spiders.",
            "The train to the coast leaves every hour.",
        ),
    ),
    (
        "At what temperature does water boil at sea level?",
        "At sea level, water boils at 100 degrees Celsius.",
        (
            "Water covers most of the surface of the Earth.",
            "Drinking enough water is good for your health.",
            "The museum opens at nine in the morning.",
        ),
    ),
    (
        "Who wrote Romeo and Juliet?",
        "Romeo and Juliet is a tragedy written by William Shakespeare.",
        (
            "Romeo and Juliet has been made into many films.",
            "Verona is a city in northern Italy.",
            "Copper conducts electricity well.",
        ),
    ),
    (
        "How do I reverse a list in Python?",
        "In Python, my_list.reverse() reverses a list in place, and my_list[::-1] makes a "
        "reversed copy.",
        (
            "Python is a programming language named after a comedy group.",
            "Lists in Python can hold items of different types.",
            "The violin has four strings.",
        ),
    ),
    (
        "What gas do plants take in for photosynthesis?",
        "Plants take in carbon dioxide from the air and use light to turn it into sugar.",
        (
            "Plants need water, and most need soil to grow.",
            "Some plants have flowers that attract bees.",
            "The bridge was closed for repairs last week.",
        ),
    ),
    (
        "What is the largest planet in the solar system?",
        "Jupiter is the largest planet in the solar system, more than ten times as wide as "
        "the Earth.",
        (
            "The solar system formed about four and a half billion years ago.",
            "Mars is often called the red planet.",
            "A good bread needs time to rise.",
        ),
    ),
    (
        "How long does it take the Earth to orbit the Sun?",
        "The Earth takes about 365 days to go once around the Sun.",
        (
            "The Sun is a star at the centre of the solar system.",
            "The Earth has one natural satellite, the Moon.",
            "Chess is played on a board of 64 squares.",
        ),
    ),
    (
        "Which language is spoken in Brazil?",
        "The official language of Brazil is Portuguese.",
        (
            "Brazil is the largest country in South America.",
            "Brazil is famous for its football teams.",
            "The recipe needs two eggs and a cup of flour.",
        ),
    ),
    (
        "What does a thermometer measure?",
        "A thermometer measures temperature.",
        (
            "Thermometers used to be filled with mercury.",
            "A doctor may ask you to stay in bed.",
            "The river floods every spring.",
        ),
    ),
    (
        "How can I make a git commit undo its last change?",
        "git revert makes a new commit that undoes the changes of an earlier commit.",
        (
            "Git was first written to manage the Linux kernel's source.",
            "A commit message should say why a change was made.",
            "Owls hunt mostly at night.",
        ),
    ),
    (
        "What is the freezing point of water in Fahrenheit?",
        "Water freezes at 32 degrees Fahrenheit.",
        (
            "The Fahrenheit scale is used mostly in the United States.",
            "Ice floats because it is less dense than liquid water.",
            "The concert was sold out in an hour.",
        ),
    ),
)


@dataclass
class RerankResult:
    model: str
    queries: int
    top1: float  # the share of queries whose answering document scored highest
    mrr: float  # mean reciprocal rank of the answering document
    relevant_score: float  # mean score of the answering documents
    other_score: float  # mean score of the others
    seconds: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def evaluate_rerank(runtime: Runtime, model: str) -> RerankResult:
    template = ChatTemplate.for_model(
        runtime.chat_template, runtime.tokenizer, runtime.architecture
    )
    started = time.perf_counter()
    hits, ranks, relevant, others = 0, [], [], []
    for query, answer, distractors in RERANK_SET:
        documents = [answer, *distractors]
        scores = relevance(
            runtime, [judgement_prompt(runtime, template, query, d) for d in documents]
        )
        rank = 1 + sum(score >= scores[0] for score in scores[1:])  # a tie is no win
        hits += rank == 1
        ranks.append(1 / rank)
        relevant.append(scores[0])
        others.extend(scores[1:])
    return RerankResult(
        model,
        len(RERANK_SET),
        hits / len(RERANK_SET),
        statistics.fmean(ranks),
        statistics.fmean(relevant),
        statistics.fmean(others),
        time.perf_counter() - started,
    )

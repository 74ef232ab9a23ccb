"""How relevant a document is to a query, as the model judges it: asked whether the document
answers the query, the probability of "yes" against "no" as the answer's first token (the
method reranker models such as Qwen3-Reranker are trained for; an instruction-tuned chat
model gives a rougher signal). Each document is judged alone, so its score does not depend
on the others sent with it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..modelfile.template import ChatTemplate, Message
from ..runtimes.base import Runtime

JUDGE_SYSTEM = (
    "You judge search results. Given a query and a document, reply yes if the document "
    "is relevant to the query and answers it, and no otherwise. Reply with one word."
)


def judgement_prompt(
    runtime: Runtime, template: ChatTemplate, query: str, document: str
) -> list[int]:
    """The chat that asks the model about one document, as tokens."""
    messages = [
        Message("system", JUDGE_SYSTEM),
        Message("user", f"Query: {query}\n\nDocument: {document}\n\nRelevant (yes or no)?"),
    ]
    return runtime.tokenizer.encode_chat(template.render(messages))


def relevance(runtime: Runtime, prompts: Sequence[list[int]]) -> list[float]:
    """P(yes) for each judgement prompt (run on the engine's thread)."""
    yes, no = _answer_ids(runtime, "yes"), _answer_ids(runtime, "no")
    return [_yes_probability(runtime, prompt, yes, no) for prompt in prompts]


def _answer_ids(runtime: Runtime, word: str) -> list[int]:
    """The first token of the word as an answer would begin, lower- and capitalised."""
    encode = runtime.tokenizer.encode
    return sorted({encode(form, add_bos=False)[0] for form in (word, word.capitalize())})


def _yes_probability(runtime: Runtime, prompt: list[int], yes: list[int], no: list[int]) -> float:
    _, logits = next(runtime.logit_blocks(prompt, first=len(prompt) - 1))
    row = np.asarray(logits[-1], dtype=np.float64)
    top = max(row[yes].max(), row[no].max())
    yes_mass = sum(math.exp(row[t] - top) for t in yes)
    no_mass = sum(math.exp(row[t] - top) for t in no)
    return yes_mass / (yes_mass + no_mass)

"""Latency budgets for streamed recognition, on whatever CPU runs the tests.

The streaming targets were set where one hypothesis (the encoder, beam search and alignment
over the buffer) costs about `REFERENCE_HYPOTHESIS_S` (2 threads of an AMD EPYC Zen 4). A
word shows as partial text once the hypothesis that first hears it ends (half a period of
waiting for its audio, then that hypothesis), and commits when the next one agrees (one
period more); on a CPU where hypotheses cost more, the period between them grows with their
cost (`StreamingConfig.max_busy`). So each second a hypothesis costs beyond the reference
adds about two seconds to partial text and three to a commit. The budgets add exactly that:
the tests hold the policy's own waits to the targets on any CPU, while docs/BENCHMARKS.md
reports the absolute figures of each CPU.
"""

from __future__ import annotations

REFERENCE_HYPOTHESIS_S = 0.15
PARTIAL_HYPOTHESES = 2
COMMIT_HYPOTHESES = 3


def latency_budget(target_s: float, hypothesis_s: float, hypotheses: int) -> float:
    """`target_s`, plus what `hypotheses` hypotheses costing `hypothesis_s` each (the median
    measured) take beyond the reference CPU's."""
    return target_s + hypotheses * max(0.0, hypothesis_s - REFERENCE_HYPOTHESIS_S)

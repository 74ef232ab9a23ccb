"""Which tokens a full cache keeps (`--kv-policy`); the budget is `--sinks S --window W`.

* `window`: the sinks and the most recent W tokens (StreamingLLM; RotatingKVCache).
* `attention`: the sinks, the most recent tokens and, for the rest of the W, the tokens the
  attention used most (ScoredKVCache, scored.py): chosen from the last prompt rows'
  attention when a prompt overflows the budget (SnapKV), from the current row's when an
  answer does (TOVA). Kept tokens keep their own positions until a sink's distance to
  the newest token could pass the trained context, then are re-rotated as below.
* `attention-compact`: the same choice, the survivors then rotated into contiguous positions
  ending at the newest token at every eviction, as the window policy places its sinks
  (StreamingLLM), so no distance a query sees exceeds the budget. Measured worse than true
  positions within the trained context (docs/BENCHMARKS.md, issue 55): kept to compare.

This module imports no torch: the command line checks a name before anything loads."""

from __future__ import annotations

from ..errors import MiniappError

WINDOW_POLICY = "window"
ATTENTION_POLICY = "attention"
COMPACT_POLICY = "attention-compact"
KV_POLICIES = (WINDOW_POLICY, ATTENTION_POLICY, COMPACT_POLICY)


def check_kv_policy(name: str) -> str:
    """`name` if it is a policy; else one line (MiniappError) naming the choices."""
    if name not in KV_POLICIES:
        raise MiniappError(f"unknown --kv-policy {name!r} (choose from {', '.join(KV_POLICIES)})")
    return name

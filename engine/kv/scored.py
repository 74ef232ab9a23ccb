"""`--kv-policy attention`: a cache of fixed budget that keeps the tokens attention uses.

`ScoredKVCache` holds the first `sinks` tokens, the most recent `recent` (half the window
left after an eviction), and, of the rest, the ones the attention has used most,
`sinks + window` tokens at most (the same budget as the window policy's ring). Tokens are
kept in slots 0..held-1 of a `KVStorage`, in the order they came, each KV head choosing its
own (SnapKV and kvpress choose per head: heads attend to different things). Keys keep the
rotation of their absolute positions, as the recent ring keeps it, so nothing is rotated
again when tokens go; a query sits at its own absolute position, which must stay within the
model's trained context. So from `compact_from` on (the trained context less the budget;
0 with --kv-policy attention-compact) each eviction rotates the survivors into contiguous
positions ending at the newest token instead, as the window policy places its sinks: no
distance a query sees then exceeds the budget, at the cost of rotating `keep - recent` keys
per eviction (quantized keys are decoded and encoded again). Within the trained context
true positions measured better (docs/BENCHMARKS.md, issue 55).

Two moments choose (`observe` hears each pass's queries once it has attended):
* **A prompt's end** (SnapKV). Between `open_prompt` and `close_prompt` (the batching
  scheduler calls them around each sequence's prompt) the cache holds the prompt whole, up
  to `capacity` (the context, --ctx), and keeps its last 32 rows' queries; at the end those
  rows' attention chooses what stays, so a question at the end of a document picks what it
  needs. A prompt longer than the context is cut down the same way each time it fills it.
* **An answer's tokens** (TOVA). Once held tokens reach the budget, the row that filled it
  scores them and `sinks + window - slack` stay, so eviction runs once per `slack` tokens
  (a sixteenth of the window) rather than at every step, and the steps between stay on the
  fused native layer. `max_chunk` ends a pass just before that row, so evictions fall on
  the same tokens, scored by the same row, however the tokens are cut into passes:
  teacher-forced text (perplexity) goes this way too.
Prompt rows skip the fused layer (it keeps its queries to itself), so a prompt's selection
is the same whichever path its passes took. Scores: each row's softmax, summed over rows,
the query heads of a GQA group averaged onto their KV head, then max-pooled over 7 slots so
that a chosen token's neighbours stay with it (a fact is several tokens).

Speculative roll-back stays exact: an eviction keeps what undoes it (the evicted rows, and
where each kept one came from), and a trim that removes the token whose row chose the
eviction undoes it, as a cache that never saw the token would be; tokens evicted by a row
that stays are never brought back.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ContextFullError
from ..ops.layers import Rope
from .cache import _OnStorage
from .storage import KVStorage, Slots, rotate_stored_keys
from .types import F32, KVSetting

OBSERVED_ROWS = 32  # SnapKV's observation window: the prompt rows whose attention scores
RECENT = 32  # newest tokens always kept, at least (what a roll-back trims without a snapshot)
# The share of the budget left after an eviction that goes to the newest tokens, as the
# window policy would keep them; attention chooses the rest. With the newest 32 alone, a
# fact the window still holds was lost whenever the rows that chose did not attend to it
# (a question asked only after the document): see docs/BENCHMARKS.md, issue 55.
RECENT_SHARE = 0.5
POOL = 7  # slots a chosen token's max-pool reaches (SnapKV's kernel size)


SNAPSHOTS = 4  # evictions a roll-back can undo: a verification's rows span at most 3


def eviction_slack(window: int) -> int:
    """Tokens evicted at once: about 1/16 of the window, so scoring costs little per token,
    and at least 8, so that a verification's rows (a draft of up to 16) span few evictions."""
    return max(8, window // 16) if window > 32 else max(1, window // 4)


@dataclass
class _Snapshot:
    """What undoes one eviction: the token whose row chose it (a trim that removes that
    token undoes it), the slots held before, where each kept slot came from, and the
    evicted rows with the slots they came from."""

    chooser: int
    held: int
    kept: torch.Tensor  # [kv_heads, keep]: slot before the eviction of each slot after it
    evicted: torch.Tensor  # [kv_heads, held - keep]: the slots that went
    keys: torch.Tensor  # [1, kv_heads, held - keep, width]: their rows as stored
    values: torch.Tensor
    positions: torch.Tensor  # [kv_heads, held]: every slot's position before the eviction
    compacted: bool  # whether the keys were at contiguous positions before the eviction
    # a compacting eviction: the rows it re-rotated (all but the newest), as stored before
    unrotated: torch.Tensor | None = None


def attention_scores(
    queries: torch.Tensor, keys: torch.Tensor, scale: float, pool: int = POOL
) -> torch.Tensor:
    """Scores [kv_heads, tokens] of `keys` (fp32 [kv_heads, tokens, head_dim]) from the
    attention of `queries` (fp32 [heads, rows, head_dim], the newest `rows` tokens, so row r
    sees keys up to tokens - rows + r): each row's softmax summed over rows, averaged over
    each KV head's group of query heads, then max-pooled over `pool` neighbouring slots."""
    heads, rows, head_dim = queries.shape
    kv_heads, tokens = keys.shape[0], keys.shape[1]
    grouped = queries.reshape(kv_heads, heads // kv_heads * rows, head_dim)
    logits = torch.bmm(grouped, keys.transpose(1, 2)).mul_(scale)
    logits = logits.view(kv_heads, heads // kv_heads, rows, tokens)
    if rows > 1:
        future = torch.arange(tokens) > torch.arange(tokens - rows, tokens).unsqueeze(1)
        logits.masked_fill_(future.to(logits.device), float("-inf"))
    scores = torch.softmax(logits, dim=-1).sum(dim=2).mean(dim=1)
    if pool > 1:
        scores = F.max_pool1d(scores[:, None], pool, stride=1, padding=pool // 2)[:, 0]
    return scores


def recent_kept(kept_window: int) -> int:
    """The newest tokens an eviction always keeps, of the `kept_window` beyond the sinks."""
    if kept_window <= 2 * RECENT:
        return max(1, min(RECENT, kept_window // 2))
    return max(RECENT, int(kept_window * RECENT_SHARE))


def choose_kept(scores: torch.Tensor, sinks: int, recent: int, keep: int) -> torch.Tensor:
    """Slots [kv_heads, keep] to keep, in order, per head: the first `sinks`, the last
    `recent`, and between them the best-scored (ties to the older slot)."""
    kv_heads, held = scores.shape
    middle = keep - sinks - recent
    first = torch.arange(sinks).expand(kv_heads, sinks)
    last = torch.arange(held - recent, held).expand(kv_heads, recent)
    if middle <= 0:
        return torch.cat([first, last], dim=1)
    candidates = scores[:, sinks : held - recent].cpu()
    # topk's order among equal scores is unspecified: a stable sort breaks ties by slot.
    best = torch.sort(candidates, dim=1, descending=True, stable=True).indices[:, :middle]
    chosen = torch.sort(best, dim=1).values + sinks
    return torch.cat([first, chosen, last], dim=1)


def _rows(stored: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows [1, kv_heads, n, width] of `stored` at `slots` [kv_heads, n], per head."""
    index = slots[None, :, :, None].expand(-1, -1, -1, stored.shape[3])
    return stored.gather(2, index)


def _scatter_rows(
    kept_rows: torch.Tensor, snapshot: _Snapshot, device: torch.device, values: bool = False
) -> torch.Tensor:
    """The rows before the snapshot's eviction: the kept ones back in their old slots and
    the evicted ones in theirs."""
    evicted_rows = snapshot.values if values else snapshot.keys
    width = kept_rows.shape[3]
    rows = kept_rows.new_empty((1, kept_rows.shape[1], snapshot.held, width))
    kept = snapshot.kept.to(device)[None, :, :, None].expand(-1, -1, -1, width)
    evicted = snapshot.evicted.to(device)[None, :, :, None].expand(-1, -1, -1, width)
    rows.scatter_(2, kept, kept_rows)
    rows.scatter_(2, evicted, evicted_rows)
    return rows


class ScoredKVCache(_OnStorage):
    """The first `sinks` tokens plus `window` more chosen by attention (see the module).

    Implements the `Cache` protocol of cache.py; not a `StaticCache` (a captured GPU step
    cannot evict), so a GPU runs it step by step."""

    INITIAL_TOKENS = 256

    def __init__(
        self,
        n_kv_heads: int,
        head_dim: int,
        sinks: int,
        window: int,
        max_chunk: int,
        prompt_capacity: int = 0,
        rope: Rope | None = None,
        kv_type: KVSetting = F32,
        device: torch.device | str = "cpu",
        compact_from: int | None = None,
    ):
        if compact_from is not None and rope is None:
            raise ValueError("compact positions need the model's RoPE")
        self.sinks, self.window, self.rope = sinks, window, rope
        # Evictions from this position on rotate the survivors into contiguous positions
        # (None: never); once they have, every later one does.
        self.compact_from = compact_from
        self._compacted = False  # keys at contiguous positions ending at the newest
        self.budget = sinks + window
        self.slack = eviction_slack(window)
        self.recent = recent_kept(window - self.slack)
        self.keep = self.budget - self.slack  # held after an eviction
        # A prompt is held whole, up to `prompt_capacity` tokens, before it is scored.
        self.capacity = max(self.budget + max_chunk, prompt_capacity)
        # q4 keys as rows: an eviction moves single tokens, which tiles of 32 cannot do.
        storage = KVStorage(
            n_kv_heads, head_dim, kv_type, device, self.INITIAL_TOKENS, key_tiles=False
        )
        self._keep_in(storage)
        self.positions = torch.full((n_kv_heads, self.INITIAL_TOKENS), -1, dtype=torch.long)
        self.offset = 0  # the position of the next token
        self.held = 0  # slots in use
        self.evictions = 0
        self._snapshots: deque[_Snapshot] = deque(maxlen=SNAPSHOTS)
        self._fixed_until = -1  # the newest chooser whose eviction can no longer be undone
        self._prompting = False  # between open_prompt and close_prompt
        self._observed: torch.Tensor | None = None  # a prompt's last rows' queries
        self._scale = 1.0

    # -- writing

    def _room(self, n_new: int) -> None:
        needed = self.held + n_new
        if needed > self.capacity:
            raise ContextFullError(
                f"{n_new} tokens at once do not fit a cache of {self.capacity} "
                "(the budget and one prompt chunk, or the context)"
            )
        slots = self.storage.slots
        if needed <= slots:
            return
        while slots < needed:
            slots *= 2
        slots = min(slots, self.capacity)
        self.storage.grow(slots, self.held)
        positions = torch.full((self.positions.shape[0], slots), -1, dtype=torch.long)
        positions[:, : self.held] = self.positions[:, : self.held]
        self.positions = positions

    def _append(self, n_new: int) -> int:
        """Bookkeeping of n_new tokens entering slots held..; returns the first slot."""
        at = self.held
        self.positions[:, at : at + n_new] = torch.arange(self.offset, self.offset + n_new)
        self.held += n_new
        self.offset += n_new
        return at

    def update_and_fetch(
        self, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_new = k.shape[2]
        self._room(n_new)
        at = self._append(n_new)
        self.storage.write(at, self.key_codec.encode(k), self.value_codec.encode(v))
        return self.storage.read(0, self.held)

    def take_one(self, addresses: bool = False) -> Slots | None:
        # The step that fills the budget is scored after its attention, off the fused layer,
        # and so is every prompt row (its query may score the prompt's selection).
        if self._prompting or self.held + 1 >= self.budget or self.held + 1 > self.storage.slots:
            return None
        at = self._append(1)
        return self.storage.take_one(at, 0, self.held, addresses=addresses)

    def take_rows(self, n: int) -> Slots | None:
        if self._prompting or not self.rows_share_storage(n):
            return None
        at = self._append(n)
        return Slots(self.storage.read(at, self.held), self.storage.read(0, self.held))

    def rows_share_storage(self, n_new: int) -> bool:
        """No eviction within the rows, and (outside a prompt, where the fused layer may
        take them) no growth."""
        end = self.held + n_new
        if self._prompting:
            return end < self.capacity - 1
        return end < self.budget and end <= self.storage.slots

    # -- eviction

    def open_prompt(self) -> None:
        """A prompt's rows come next: held whole (up to `capacity`), their queries kept, and
        the selection made by its last rows at `close_prompt` (SnapKV)."""
        self._prompting, self._observed = True, None

    def close_prompt(self) -> None:
        """The prompt is in: if it overflowed the budget, keep what its last rows' attention
        chose (a question at its end chooses what it needs)."""
        if not self._prompting:
            return
        self._prompting = False
        observed, self._observed = self._observed, None
        if self.held >= self.budget and observed is not None:
            self._evict(observed)

    def observe(self, queries: torch.Tensor, scale: float) -> None:
        """After a step's attention: evict down to `keep` tokens if the budget is full
        (within a prompt: if `capacity` is), scored by the step's last rows. queries: fp32
        [heads, rows, head_dim], the step's own (rotated) queries, its last row the newest
        token's."""
        self._scale = scale
        if self._prompting:
            seen = queries if self._observed is None else torch.cat([self._observed, queries], 1)
            self._observed = seen[:, -OBSERVED_ROWS:].clone()
            if self.held >= self.capacity - 1:  # a prompt longer than the context
                self._evict(self._observed)
            return
        if self.held >= self.budget:
            self._evict(queries)

    def _evict(self, queries: torch.Tensor) -> None:
        """Keep `keep` tokens, scored by the newest rows' queries (their last rows)."""
        scale = self._scale
        rows = queries[:, -OBSERVED_ROWS:]
        stored_keys, stored_values = self.storage.read(0, self.held)
        keys = self.key_codec.decode(stored_keys)[0]
        scores = attention_scores(rows.float(), keys.float(), scale)
        kept = choose_kept(scores, self.sinks, self.recent, self.keep)
        held = self.held
        going = torch.ones(kept.shape[0], held, dtype=torch.bool)
        going.scatter_(1, kept, False)
        evicted = torch.arange(held).expand_as(going)[going].view(kept.shape[0], -1)
        device = stored_keys.device
        if len(self._snapshots) == SNAPSHOTS:
            self._fixed_until = self._snapshots[0].chooser
        self._snapshots.append(
            _Snapshot(
                self.offset - 1,
                held,
                kept,
                evicted,
                _rows(stored_keys, evicted.to(device)),
                _rows(stored_values, evicted.to(device)),
                self.positions[:, :held].clone(),
                self._compacted,
            )
        )
        n = self.keep
        self.storage.keys[:, :, :n] = _rows(stored_keys, kept.to(device))
        self.storage.values[:, :, :n] = _rows(stored_values, kept.to(device))
        if self._compacted or (self.compact_from is not None and self.offset >= self.compact_from):
            self._compact(kept, held)
        self.positions[:, :n] = self.positions.gather(1, kept)
        self.positions[:, n:held] = -1
        self.held = n
        self.evictions += 1

    def _compact(self, kept: torch.Tensor, held: int) -> None:
        """Rotate the survivors before the newest run (already in place, called before
        `positions` follows them) into the positions just before it, so the held keys sit
        at contiguous positions ending at the newest token. The snapshot keeps them as they
        were, for a roll-back."""
        moved = self.keep - self.recent  # the newest run is where it belongs
        if self._compacted:  # slot s of `held` was rotated at offset - held + s
            rotated_at = kept[:, :moved] + (self.offset - held)
        else:  # each key still at its own position
            rotated_at = self.positions.gather(1, kept[:, :moved])
        target = torch.arange(moved) + (self.offset - self.keep)
        before = self.storage.keys[:, :, :moved].clone()
        shifts = target - rotated_at
        tables = self.rope.each_shift_tables(shifts)
        self.storage.keys[:, :, :moved] = rotate_stored_keys(before, tables, self.key_codec)
        self._snapshots[-1].unrotated = before
        self._compacted = True

    def held_positions(self) -> torch.Tensor:
        """Positions [kv_heads, held] of the tokens each KV head keeps, in slot order."""
        return self.positions[:, : self.held].clone()

    # -- reading

    def tiled_keys(self, rows: int):
        return None

    def decode_keys(self, keys: torch.Tensor, row: int | None = None) -> torch.Tensor:
        return self.key_codec.decode(keys)

    def keys_by_own_tile(self, keys: torch.Tensor, rows: int):
        raise ValueError("keys in tiles are not taken by this cache")

    def make_mask(self, n_new: int) -> torch.Tensor | None:
        """Every held token, and the new ones causally."""
        if n_new == 1:
            return None
        total = self.held + n_new
        query = torch.arange(self.held, total).unsqueeze(1)
        return torch.arange(total).unsqueeze(0) <= query

    def max_chunk(self) -> int:
        """Up to the row that fills the budget (within a prompt: the capacity), which then
        goes alone: evictions fall on the same tokens, scored by the same rows, however a
        prompt is cut into passes (and the rows before share one storage)."""
        limit = self.capacity if self._prompting else self.budget
        return max(limit - 1 - self.held, 1)

    # -- roll-back and reuse

    def can_trim(self, n: int) -> bool:
        """Whether the newest n positions can go exactly: they are the last slots of every
        head once the evictions their rows chose are undone (if snapshots still can)."""
        n = max(0, min(n, self.offset))
        target = self.offset - n
        if target <= self._fixed_until:
            return False
        positions, held, offset = self.positions, self.held, self.offset
        for snapshot in reversed(self._snapshots):
            if target > snapshot.chooser:
                break
            positions, held, offset = snapshot.positions, snapshot.held, snapshot.chooser + 1
        back = offset - target
        if back > held:
            return False
        return bool((positions[:, held - back : held] == torch.arange(target, offset)).all())

    def trim(self, n: int) -> int:
        """Drop the newest n positions (see the module: a trim past a token whose row chose
        an eviction undoes that eviction first)."""
        n = max(0, min(n, self.offset))
        if n == 0:
            return 0
        target = self.offset - n
        while self._snapshots and target <= self._snapshots[-1].chooser:
            self._undo(self._snapshots.pop())
        drop = min(self.offset - target, self.held)
        self.positions[:, self.held - drop : self.held] = -1
        self.held -= drop
        self.offset = target
        return n

    def _undo(self, snapshot: _Snapshot) -> None:
        """Back to the slots just after the snapshot's chooser came in (the tokens after it
        are dropped: the trim goes past them)."""
        keep, held = snapshot.kept.shape[1], snapshot.held
        device = self.storage.keys.device
        kept_keys = self.storage.keys[:, :, :keep]
        if snapshot.unrotated is not None:
            moved = snapshot.unrotated.shape[2]
            kept_keys = torch.cat([snapshot.unrotated, kept_keys[:, :, moved:]], dim=2)
        keys = _scatter_rows(kept_keys, snapshot, device)
        values = _scatter_rows(self.storage.values[:, :, :keep], snapshot, device, values=True)
        self._room(held - self.held if held > self.held else 0)
        self.storage.keys[:, :, :held] = keys
        self.storage.values[:, :, :held] = values
        self.positions[:, :held] = snapshot.positions
        self.positions[:, held:] = -1
        self._compacted = snapshot.compacted
        self.held, self.offset = held, snapshot.chooser + 1
        self.evictions -= 1

    def exact_prefix(self, n: int) -> int:
        return n

    def can_forget(self, start: int) -> bool:
        return False

    def forget(self, start: int, end: int) -> None:
        raise ContextFullError("cannot drop turns from a cache that chooses what it keeps")

    def clear(self) -> None:
        self.offset = self.held = 0
        self.positions.fill_(-1)
        self._snapshots.clear()
        self._fixed_until = -1
        self._compacted = False
        self._prompting, self._observed = False, None
        self.storage.clear()


def open_prompts(caches) -> None:
    """Before a sequence's prompt: its scored caches hold the prompt whole."""
    for cache in caches:
        if isinstance(cache, ScoredKVCache):
            cache.open_prompt()


def close_prompts(caches) -> None:
    """After a sequence's prompt: its scored caches choose what they keep."""
    for cache in caches:
        if isinstance(cache, ScoredKVCache):
            cache.close_prompt()

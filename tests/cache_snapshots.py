"""Snapshots of a cache's contents and bookkeeping, for tests that compare a cache with its
own past (the engine never needs them: it trims and clears instead)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from miniapp.engine.errors import ContextFullError
from miniapp.engine.kv.cache import KVCache, RotatingKVCache

_ROTATING_FIELDS = ("offset", "sinks_held", "ring_count", "ring_head", "wrapped", "frame")


@dataclass(frozen=True)
class Snapshot:
    tensors: dict[str, torch.Tensor]
    fields: dict[str, Any]


def snapshot(cache: KVCache | RotatingKVCache) -> Snapshot:
    if isinstance(cache, KVCache):
        n = cache.offset
        tensors = {"keys": cache.keys[:, :, :n].clone(), "values": cache.values[:, :, :n].clone()}
        return Snapshot(tensors, {"offset": n})
    fields = {name: copy.copy(getattr(cache, name)) for name in _ROTATING_FIELDS}
    tensors = {
        "keys": cache.keys.clone(),
        "values": cache.values.clone(),
        "ring_pos": cache.ring_pos.clone(),
    }
    return Snapshot(tensors, fields)


def restore(cache: KVCache | RotatingKVCache, saved: Snapshot) -> None:
    """Put the cache back as it was; its storage is new tensors afterwards."""
    if isinstance(cache, KVCache):
        n = saved.fields["offset"]
        if n > cache.max_tokens:
            raise ContextFullError(f"saved state of {n} tokens exceeds cache of {cache.max_tokens}")
        if n > cache.capacity:
            cache._grow(n)
        cache.keys[:, :, :n] = saved.tensors["keys"]
        cache.values[:, :, :n] = saved.tensors["values"]
        cache.offset = n
        return
    for name, value in saved.fields.items():
        setattr(cache, name, value)
    for name in ("keys", "values", "ring_pos"):
        setattr(cache, name, saved.tensors[name].clone())

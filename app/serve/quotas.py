"""Per-key quotas (`--api-key-file FILE`): each key has a name and, optionally, requests a
minute, tokens a minute and answers at once. Past any of them the answer is a 429 with
Retry-After and OpenAI's `x-ratelimit-*` headers (limit, remaining and reset, for requests
and tokens); every answer of a limited key carries those headers too.

The file is TOML, one table per key:

    [keys.alice]
    key = "sk-alice-..."
    requests_per_minute = 60
    tokens_per_minute = 20000
    max_concurrent = 2

The minute limits are token buckets holding a minute's worth, refilled evenly (a key may
spend its minute at once, then goes at the refill rate). A request's tokens are its prompt
plus its `max_tokens` (for each answer it asks for), reserved when it is admitted; when it
ends, what it did not use goes back. Quotas apply to the answering endpoints (chat,
completions, messages, responses).
"""

from __future__ import annotations

import hmac
import math
import threading
import time
import tomllib
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

from miniapp.engine.api import MiniappError

from .errors import ApiError

LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")


@dataclass(frozen=True)
class KeyLimits:
    name: str
    key: str = field(repr=False)
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None


def read_key_file(path: str | Path) -> list[KeyLimits]:
    """The keys and their limits; a file that cannot be used is one line (MiniappError)."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise MiniappError(f"{path}: cannot read the key file ({exc.strerror})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise MiniappError(f"{path}: not a TOML file: {exc}") from None
    tables = data.get("keys")
    if set(data) - {"keys"} or not isinstance(tables, dict) or not tables:
        raise MiniappError(f"{path}: expected one [keys.NAME] table per key, and nothing else")
    keys = [_key_limits(path, name, table) for name, table in tables.items()]
    seen: set[str] = set()
    for limits in keys:
        if limits.key in seen:
            raise MiniappError(f"{path}: keys.{limits.name}: the same key is given twice")
        seen.add(limits.key)
    return keys


def _key_limits(path, name: str, table) -> KeyLimits:
    where = f"{path}: keys.{name}"
    if not isinstance(table, dict):
        raise MiniappError(f"{where}: expected a table")
    unknown = set(table) - {"key", *LIMIT_FIELDS}
    if unknown:
        raise MiniappError(f"{where}: unknown field {sorted(unknown)[0]!r}")
    key = table.get("key")
    if not isinstance(key, str) or not key.strip():
        raise MiniappError(f'{where}: needs key = "..." (a non-empty string)')
    limits = {}
    for field_name in LIMIT_FIELDS:
        value = table.get(field_name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise MiniappError(f"{where}: {field_name} must be a whole number")
        if value is not None and value < 1:
            raise MiniappError(f"{where}: {field_name} must be at least 1")
        limits[field_name] = value
    return KeyLimits(name, key.strip(), **limits)


class _Bucket:
    """A minute's worth of units, refilled evenly."""

    def __init__(self, per_minute: int):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0  # units a second
        self.level = self.capacity
        self.updated = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait_for(self, units: float) -> float:
        """Seconds until `units` are there (0: now)."""
        self._refill()
        return max(0.0, (units - self.level) / self.rate)

    def take(self, units: float) -> None:
        self.level -= units

    def give_back(self, units: float) -> None:
        self._refill()
        self.level = min(self.capacity, self.level + units)

    def headers(self, kind: str) -> dict[str, str]:
        self._refill()
        full_in = (self.capacity - self.level) / self.rate
        return {
            f"x-ratelimit-limit-{kind}": str(int(self.capacity)),
            f"x-ratelimit-remaining-{kind}": str(max(0, math.floor(self.level))),
            f"x-ratelimit-reset-{kind}": f"{full_in:.3f}s",
        }


@dataclass
class KeyUse:
    """What one request did with its key's quota (the middleware's headers read it)."""

    quota: KeyQuota | None = None
    reserved: int = 0
    admitted: bool = False


CURRENT_USE: ContextVar[KeyUse | None] = ContextVar("miniapp_key_use", default=None)


class KeyQuota:
    def __init__(self, limits: KeyLimits):
        self.limits = limits
        self._lock = threading.Lock()
        self._requests = _Bucket(limits.requests_per_minute) if limits.requests_per_minute else None
        self._tokens = _Bucket(limits.tokens_per_minute) if limits.tokens_per_minute else None
        self.running = 0

    def admit(self, tokens: int) -> None:
        """Take one request and `tokens` from the quota, or raise the 429 saying when to
        come back."""
        with self._lock:
            limits = self.limits
            if self._tokens is not None and tokens > self._tokens.capacity:
                raise self._refused(
                    f"this request needs {tokens} tokens (its prompt and max_tokens), more "
                    f"than key '{limits.name}' may use in a minute ({limits.tokens_per_minute})",
                    "tokens",
                    None,
                )
            waits = {"requests": 0.0, "tokens": 0.0}
            if self._requests is not None:
                waits["requests"] = self._requests.wait_for(1)
            if self._tokens is not None:
                waits["tokens"] = self._tokens.wait_for(tokens)
            if limits.max_concurrent is not None and self.running >= limits.max_concurrent:
                # When a running answer ends is not known: a second, or the minute's wait.
                raise self._refused(
                    f"key '{limits.name}' already has {self.running} answers running, its "
                    f"max_concurrent",
                    "requests",
                    max(1.0, *waits.values()),
                )
            kind = max(waits, key=waits.get)
            if waits[kind] > 0:
                per_minute = getattr(limits, f"{kind}_per_minute")
                raise self._refused(
                    f"key '{limits.name}' is past its {kind}_per_minute ({per_minute}); "
                    f"try again in {math.ceil(waits[kind])} s",
                    kind,
                    waits[kind],
                )
            if self._requests is not None:
                self._requests.take(1)
            if self._tokens is not None:
                self._tokens.take(tokens)
            self.running += 1

    def settle(self, reserved: int, used: int) -> None:
        """The request ended: its answer slot frees, and its unused tokens go back."""
        with self._lock:
            self.running = max(0, self.running - 1)
            if self._tokens is not None and used < reserved:
                self._tokens.give_back(reserved - used)

    def headers(self) -> dict[str, str]:
        with self._lock:
            return self._headers_unlocked()

    def _refused(self, message: str, kind: str, retry_s: float | None) -> ApiError:
        headers = self._headers_unlocked()
        if retry_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(retry_s)))
        return ApiError(429, message, kind=kind, code="rate_limit_exceeded", headers=headers)

    def _headers_unlocked(self) -> dict[str, str]:
        headers = {}
        for kind, bucket in (("requests", self._requests), ("tokens", self._tokens)):
            if bucket is not None:
                headers |= bucket.headers(kind)
        return headers


class KeyTable:
    """The keys of a key file, each with its quota."""

    def __init__(self, keys: list[KeyLimits]):
        self.quotas = [KeyQuota(limits) for limits in keys]

    def find(self, presented: str) -> KeyQuota | None:
        """The quota of the key presented, compared in constant time with each."""
        found = None
        for quota in self.quotas:
            if hmac.compare_digest(presented.encode(), quota.limits.key.encode()):
                found = quota
        return found


def current_key_name() -> str | None:
    """The name of the key the current request came with (None: no key file's key)."""
    use = CURRENT_USE.get()
    return use.quota.limits.name if use is not None and use.quota is not None else None


def admit_current(tokens: int) -> KeyUse | None:
    """Admit the current request's answers against its key's quota (a 429 if past it);
    None when its key has none. The caller settles the returned use when they end."""
    use = CURRENT_USE.get()
    if use is None or use.quota is None:
        return None
    use.quota.admit(tokens)
    use.reserved, use.admitted = tokens, True
    return use


def settle(use: KeyUse | None, used: int) -> None:
    if use is not None and use.admitted:
        use.admitted = False
        use.quota.settle(use.reserved, used)

"""The loaded models, for every interface (the GUI, the terminal and the server share one
host): loads in background threads, switching models, keeping the last good model when a
load fails, one generation at a time unless the runtime batches.

**The current model** is the one an interface picked (`request`, `wait_for`: the GUI's
model picker, the terminal's /model, the server's model at start). **Other models** load on
demand when a request names them (`acquire`, the server): while one loads, the caller is
told to come back (`ModelLoading`), never blocked. At most `max_models` stay resident, the
least recently used going first; with `idle_unload_s`, a model unused that long is let go
(the next request loads it again). A model that answers (a lease from `acquire`) is never
let go, and no model is ever loaded twice at once.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path

from miniapp.engine.api import (
    BUNDLED,
    ComputeThread,
    MessageRuntime,
    MiniappError,
    Runtime,
    RuntimeConfig,
    VisionRuntime,
    estimate_memory,
    free_memory,
    installed_models,
    open_runtime,
    open_vision_runtime,
    release_memory,
    resolve_model,
)

LOAD_WAIT_S = 600.0  # an answer waits this long at most for a model that is still loading
RETRY_LOADING_S = 2  # what a caller told "loading" should wait before asking again


class LoadState(StrEnum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    UNLOADED = "unloaded"  # let go after being idle; the next use loads it again


@dataclass(frozen=True)
class ModelStatus:
    state: LoadState
    message: str  # one line for the status bar


class ModelLoadError(MiniappError):
    pass


class ModelLoading(MiniappError):
    """The model is not resident yet: it loads (or cannot now); ask again after
    `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = RETRY_LOADING_S):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class _Resident:
    spec: RuntimeConfig
    runtime: Runtime | MessageRuntime
    memory: int  # the planner's estimate of what it holds (0: unknown)
    leases: int = 0  # requests answering with it now
    last_used: float = field(default_factory=time.monotonic)


class ModelHost:
    """The resident models (see the module). Loads that fail leave the previous model in
    place, and the one-line error is the status. One generation runs at a time
    (`generation_lock`), unless the runtime batches them (`Runtime.parallel`)."""

    def __init__(
        self,
        opener: Callable[[RuntimeConfig], Runtime | MessageRuntime] = open_runtime,
        max_models: int = 1,
        idle_unload_s: float | None = None,
        memory: Callable[[], int | None] = free_memory,
    ):
        """`memory`: what the OS could give the process now (a test may simulate less)."""
        if max_models < 1:
            raise MiniappError(f"--max-models {max_models}: keep at least one model")
        self._opener, self._memory = opener, memory
        self.max_models, self.idle_unload_s = max_models, idle_unload_s
        self.generation_lock = threading.Lock()
        # Answers computed for other threads run on the thread that serves it (the GUI's
        # main thread, where OpenMP runs at full speed); unserved, they run in place.
        self.compute = ComputeThread()
        self._changed = threading.Condition()
        self._resident: OrderedDict[RuntimeConfig, _Resident] = OrderedDict()  # LRU first
        self._loading: dict[RuntimeConfig, str | None] = {}  # spec -> None, or its failure
        self._current: RuntimeConfig | None = None  # the interfaces' model, once loaded
        self._wanted: RuntimeConfig | None = None  # the interfaces' model being loaded
        self._status = ModelStatus(LoadState.FAILED, "no model loaded")
        self._ready_status = self._status  # the current model's, to return to
        self._vision: VisionRuntime | None = None  # loaded when a picture first needs it
        self._vision_key: tuple | None = None
        self._started = 0.0
        self.loads: Counter[str] = Counter()  # loads begun, by model label (figures, tests)
        if idle_unload_s is not None:
            threading.Thread(target=self._unload_idle, name="idle-unload", daemon=True).start()

    # -- the current model (every interface)

    @property
    def status(self) -> ModelStatus:
        status = self._status
        if status.state is LoadState.LOADING:
            elapsed = time.monotonic() - self._started
            return replace(status, message=f"{status.message} ({elapsed:.0f} s)")
        return status

    @property
    def runtime(self) -> Runtime | None:
        resident = self._resident.get(self._current) if self._current else None
        return resident.runtime if resident else None

    @property
    def loaded_spec(self) -> RuntimeConfig | None:
        """What the current runtime was opened with (None before the first load)."""
        return self._current

    def request(self, wanted: RuntimeConfig) -> None:
        """Make this the current model, loading it in the background unless it is resident
        or loading."""
        with self._changed:
            resident = self._resident.get(wanted)
            if resident is not None:  # resident: current at once
                self._make_current(resident)
                return
            if wanted == self._wanted:
                return
            self._wanted, self._started = wanted, time.monotonic()
            self._status = ModelStatus(
                LoadState.LOADING, f"loading {wanted.label} on {wanted.backend}"
            )
            if self._loading.get(wanted, "") is None:
                return  # loading on demand already: it becomes current when loaded
            self._loading[wanted] = None
        threading.Thread(target=self._load, args=(wanted,), daemon=True).start()

    def _make_current(self, resident: _Resident) -> None:
        self._current, self._wanted = resident.spec, None
        resident.last_used = time.monotonic()
        self._resident.move_to_end(resident.spec)
        self._status = ModelStatus(LoadState.READY, describe_runtime(resident.runtime))
        self._ready_status = self._status
        self._changed.notify_all()

    def wait_for(self, wanted: RuntimeConfig, timeout: float = LOAD_WAIT_S) -> Runtime:
        """The runtime for this model, made current, loading it first if needed."""
        self.request(wanted)
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._current != wanted or wanted not in self._resident:
                if self._wanted != wanted:
                    if wanted not in self._resident:
                        raise ModelLoadError(self._status.message)
                    self._make_current(self._resident[wanted])
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ModelLoadError("the model is still loading; try again shortly")
                self._changed.wait(remaining)
            resident = self._resident[wanted]
            resident.last_used = time.monotonic()
            return resident.runtime

    def load_here(self, wanted: RuntimeConfig) -> Runtime:
        """wait_for, loading on the calling thread: the terminal's main thread, where the
        engine answers (as it always loaded there)."""
        with self._changed:
            resident = self._resident.get(wanted)
            if resident is not None:
                self._make_current(resident)
                return resident.runtime
            self._wanted, self._started = wanted, time.monotonic()
            self._status = ModelStatus(
                LoadState.LOADING, f"loading {wanted.label} on {wanted.backend}"
            )
            self._loading[wanted] = None
        self._load(wanted)
        with self._changed:
            resident = self._resident.get(wanted)
            if resident is None:
                self._loading.pop(wanted, None)  # said here; not again to a later acquire
                raise ModelLoadError(self._status.message)
            return resident.runtime

    # -- models on demand (the server)

    def acquire(self, wanted: RuntimeConfig) -> Runtime | MessageRuntime:
        """The runtime for this model, leased until `release`: while leased it is never let
        go. Not resident: its load starts (once, however many ask) and ModelLoading says to
        come back; so does a model that would not fit beside the leased ones. A load that
        failed is a ModelLoadError, once (the next request tries again). Never waits: the
        server's event loop calls it."""
        with self._changed:
            runtime = self._lease(wanted)
        if runtime is not None:
            return runtime
        need = estimate_memory(wanted) or 0  # reads the file's header: outside the lock
        with self._changed:
            runtime = self._lease(wanted)  # it may have loaded meanwhile
            if runtime is not None:
                return runtime
            if wanted in self._loading:
                failure = self._loading[wanted]
                if failure is not None:  # reported once: the next request tries again
                    del self._loading[wanted]
                    raise ModelLoadError(f"{wanted.label} failed to load: {failure}")
                raise ModelLoading(f"{wanted.label} is loading")
            evicted = self._make_room(wanted, need)
            self._loading[wanted] = None
        threading.Thread(target=self._load, args=(wanted, evicted), daemon=True).start()
        raise ModelLoading(f"{wanted.label} is loading")

    def _lease(self, wanted: RuntimeConfig) -> Runtime | MessageRuntime | None:
        """The resident model's runtime, leased; None if it is not resident (lock held)."""
        resident = self._resident.get(wanted)
        if resident is None:
            return None
        resident.leases += 1
        resident.last_used = time.monotonic()
        self._resident.move_to_end(wanted)
        return resident.runtime

    def release(self, runtime: Runtime | MessageRuntime) -> None:
        """The lease from `acquire` ends (a model kept past max_models for it may go now)."""
        with self._changed:
            for resident in self._resident.values():
                if resident.runtime is runtime:
                    resident.leases = max(0, resident.leases - 1)
                    resident.last_used = time.monotonic()
                    break
            evicted = self._evict_over_bound()
        if evicted:  # closing waits for the generation lock: not on the caller's thread
            threading.Thread(target=self._close, args=(evicted,), daemon=True).start()

    def resident_specs(self) -> dict[RuntimeConfig, LoadState]:
        """Every model resident or loading, and which."""
        with self._changed:
            states = {spec: LoadState.READY for spec in self._resident}
            for spec, failure in self._loading.items():
                states.setdefault(spec, LoadState.LOADING if failure is None else LoadState.FAILED)
            return states

    def _make_room(self, wanted: RuntimeConfig, need: int) -> list[_Resident]:
        """Let go of the least recently used idle models until `wanted` fits, by count and
        by the planner's memory estimate (called with the lock held); ModelLoading when the
        models it would have to displace are all answering."""
        free = self._memory()
        evicted: list[_Resident] = []
        idle = [r for r in self._resident.values() if r.leases == 0]

        def short() -> bool:
            count = len(self._resident) + len(self._pending_loads()) - len(evicted)
            if count >= self.max_models:
                return True
            if free is None or not need:
                return False
            return free + sum(r.memory for r in evicted) < need

        while short() and idle:
            evicted.append(idle.pop(0))
        if short():
            if free is not None and need > free + sum(r.memory for r in self._resident.values()):
                reason = (
                    f"{wanted.label} needs about {need >> 20} MiB and would not fit in memory "
                    "even with every other model unloaded"
                )
            else:
                reason = (
                    f"{wanted.label} would not fit beside the models answering now "
                    f"(--max-models {self.max_models})"
                )
            raise ModelLoading(reason)
        for resident in evicted:
            del self._resident[resident.spec]
        return evicted

    def _pending_loads(self) -> list[RuntimeConfig]:
        return [spec for spec, failure in self._loading.items() if failure is None]

    # -- loading and letting go

    def _load(self, wanted: RuntimeConfig, displaced: list[_Resident] | None = None) -> None:
        """Close the models it displaces, load the model and make it resident (and current,
        if an interface wants it); past max_models, the least recently used idle models go.
        Run on a thread of its own, or by load_here on the caller's."""
        self._close(displaced or [])
        try:
            self.loads[wanted.label] += 1
            runtime = self._open(wanted)
            runtime.run_steps_on(self.compute)
        except (MiniappError, OSError, ValueError, RuntimeError) as exc:
            with self._changed:
                self._loading[wanted] = str(exc)  # the next acquire reports it, once
                if self._wanted == wanted:
                    self._wanted = None
                    kept = " (the previous model stays loaded)" if self.runtime else ""
                    self._status = ModelStatus(
                        LoadState.FAILED, f"model failed to load: {exc}{kept}"
                    )
                self._changed.notify_all()
            return
        with self._changed:
            self._loading.pop(wanted, None)
            resident = _Resident(wanted, runtime, estimate_memory(wanted) or 0)
            self._resident[wanted] = resident
            if wanted in (self._wanted, self._current):
                self._make_current(resident)
            self._changed.notify_all()
            evicted = self._evict_over_bound()
        self._close(evicted)

    def _open(self, wanted: RuntimeConfig) -> Runtime | MessageRuntime:
        return self._opener(wanted)

    def _evict_over_bound(self) -> list[_Resident]:
        """Past max_models: the least recently used idle models, never the current one
        (called with the lock held)."""
        evicted = []
        for resident in list(self._resident.values()):
            if len(self._resident) <= self.max_models:
                break
            if resident.leases == 0 and resident.spec != self._current:
                del self._resident[resident.spec]
                evicted.append(resident)
        return evicted

    def _close(self, evicted: list[_Resident]) -> None:
        """Close let-go runtimes once no generation that takes turns is using them."""
        if not evicted:
            return
        with self.generation_lock:
            for resident in evicted:
                resident.runtime.close()
                if resident.spec == self._current:
                    self._status = ModelStatus(
                        LoadState.UNLOADED,
                        f"{resident.spec.label} was unloaded; it loads again when next used",
                    )
            del resident
        evicted.clear()
        release_memory()

    def _unload_idle(self) -> None:
        limit = self.idle_unload_s
        while True:
            time.sleep(max(0.2, min(limit / 4, 5.0)))
            self._close(self._take_idle(limit))

    def _take_idle(self, limit: float) -> list[_Resident]:
        """The models no one has used for `limit` seconds, no longer resident. (In a
        function of its own: the loop's frame would otherwise keep the last one alive while
        the thread sleeps.)"""
        now = time.monotonic()
        with self._changed:
            idle = [
                r for r in self._resident.values() if r.leases == 0 and now - r.last_used >= limit
            ]
            for resident in idle:
                del self._resident[resident.spec]
        return idle

    def vision_runtime(self, wanted: RuntimeConfig, mmproj: Path) -> VisionRuntime:
        """The vision model for this model (call with `generation_lock` held). It is a
        second copy of the model, on llama.cpp with its projector, kept for later pictures."""
        key = (wanted.model, str(mmproj), wanted.ctx, wanted.threads)
        if self._vision_key != key:
            if self._vision is not None:
                self._vision.close()
                self._vision, self._vision_key = None, None
            model = resolve_model(wanted.model)
            self._vision = open_vision_runtime(
                model, mmproj, n_ctx=wanted.ctx, threads=wanted.threads
            )
            self._vision_key = key
        return self._vision


def installed_model_spec(base: RuntimeConfig, name: str) -> RuntimeConfig | None:
    """`base`'s settings for another installed model, named as `miniapp models` and
    /v1/models list it (or by its file's name or stem); None if none is. Adapters stay with
    the model they were loaded for."""
    for listed, path in installed_models():
        if name in (listed, path.name, path.stem):
            model = listed if listed in BUNDLED else str(path)
            return replace(base, model=model, lora=())
    return None


def model_name(spec: RuntimeConfig) -> str:
    """How the interfaces list a model: a bundled model's name, or its GGUF file's."""
    return spec.model if spec.model in BUNDLED else Path(spec.model).name


def describe_runtime(runtime: Runtime) -> str:
    """'SmolLM2-135M-Instruct.Q4_1.gguf on torch, cpu (int4): no GPU visible to torch'."""
    info = runtime.info()
    name, plan = info.label, info.device_plan
    if info.endpoint:
        return f"{name} on {info.backend} at {info.endpoint}"
    if plan is None:
        return f"{name} on {info.backend}"
    return f"{name} on {info.backend}, {info.placement}: {plan.reason}"

"""The one loaded model, for every interface (the GUI now; the terminal and the server can
share it): loads in a background thread, switching models, keeping the last good model when a
load fails, one generation at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path

from miniapp.engine.api import (
    ComputeThread,
    MessageRuntime,
    MiniappError,
    Runtime,
    RuntimeConfig,
    VisionRuntime,
    open_runtime,
    open_vision_runtime,
    resolve_model,
)

LOAD_WAIT_S = 600.0  # an answer waits this long at most for a model that is still loading


class LoadState(StrEnum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class ModelStatus:
    state: LoadState
    message: str  # one line for the status bar


class ModelLoadError(MiniappError):
    pass


class ModelHost:
    """The one loaded model. Loads run in a background thread; a load that fails leaves the
    previous model in place, and its one-line error is the status. One generation runs at a
    time (`generation_lock`), unless the runtime batches them (`Runtime.parallel`); the swap
    to a newly loaded model waits for a locked one."""

    def __init__(self, opener: Callable[[RuntimeConfig], Runtime | MessageRuntime] = open_runtime):
        self._opener = opener
        self.generation_lock = threading.Lock()
        # Answers computed for other threads run on the thread that serves it (the GUI's
        # main thread, where OpenMP runs at full speed); unserved, they run in place.
        self.compute = ComputeThread()
        self._changed = threading.Condition()
        self._runtime: Runtime | None = None
        self._loaded: RuntimeConfig | None = None
        self._wanted: RuntimeConfig | None = None
        self._status = ModelStatus(LoadState.FAILED, "no model loaded")
        self._ready_status = self._status  # the loaded model's, to return to
        self._vision: VisionRuntime | None = None  # loaded when a picture first needs it
        self._vision_key: tuple | None = None
        self._started = 0.0

    @property
    def status(self) -> ModelStatus:
        status = self._status
        if status.state is LoadState.LOADING:
            elapsed = time.monotonic() - self._started
            return replace(status, message=f"{status.message} ({elapsed:.0f} s)")
        return status

    @property
    def runtime(self) -> Runtime | None:
        return self._runtime

    @property
    def loaded_spec(self) -> RuntimeConfig | None:
        """What the loaded runtime was opened with (None before the first load)."""
        return self._loaded

    def request(self, wanted: RuntimeConfig) -> None:
        """Start loading this model, unless it is loaded or loading."""
        with self._changed:
            if wanted == self._loaded:  # back to the loaded model: nothing to wait for
                self._wanted, self._status = None, self._ready_status
                self._changed.notify_all()
                return
            if wanted == self._wanted:
                return
            self._wanted, self._started = wanted, time.monotonic()
            self._status = ModelStatus(
                LoadState.LOADING, f"loading {wanted.label} on {wanted.backend}"
            )
        threading.Thread(target=self._load, args=(wanted,), daemon=True).start()

    def _load(self, wanted: RuntimeConfig) -> None:
        try:
            runtime = self._open(wanted)
            runtime.run_steps_on(self.compute)
        except (MiniappError, OSError, ValueError, RuntimeError) as exc:
            with self._changed:
                if self._wanted == wanted:
                    self._wanted = None
                    kept = " (the previous model stays loaded)" if self._runtime else ""
                    self._status = ModelStatus(
                        LoadState.FAILED, f"model failed to load: {exc}{kept}"
                    )
                self._changed.notify_all()
            return
        with self.generation_lock, self._changed:
            if self._wanted != wanted:
                return  # superseded by a newer request while loading
            self._runtime, self._loaded, self._wanted = runtime, wanted, None
            self._status = ModelStatus(LoadState.READY, describe_runtime(runtime))
            self._ready_status = self._status
            self._changed.notify_all()

    def _open(self, wanted: RuntimeConfig) -> Runtime | MessageRuntime:
        return self._opener(wanted)

    def wait_for(self, wanted: RuntimeConfig, timeout: float = LOAD_WAIT_S) -> Runtime:
        """The runtime for this model, loading it first if needed."""
        self.request(wanted)
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._loaded != wanted:
                if self._wanted != wanted:
                    raise ModelLoadError(self._status.message)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ModelLoadError("the model is still loading; try again shortly")
                self._changed.wait(remaining)
            assert self._runtime is not None
            return self._runtime

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


def describe_runtime(runtime: Runtime) -> str:
    """'SmolLM2-135M-Instruct.Q4_1.gguf on torch, cpu (int4): no GPU visible to torch'."""
    info = runtime.info()
    name, plan = info.label, info.device_plan
    if info.endpoint:
        return f"{name} on {info.backend} at {info.endpoint}"
    if plan is None:
        return f"{name} on {info.backend}"
    return f"{name} on {info.backend}, {info.placement}: {plan.reason}"

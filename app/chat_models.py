"""The terminal chat's models: loaded through the same ModelHost as the GUI's model picker
and the server, so `/model NAME` switches as the picker does (the conversation so far goes
on with the new model; a load that fails leaves the current model answering).
"""

from __future__ import annotations

import sys

from miniapp.engine.api import (
    MiniappError,
    Runtime,
    RuntimeConfig,
    installed_models,
    resolve_model,
)

from .host.model_host import ModelHost, installed_model_spec

USAGE = "usage: /model [NAME]  (NAME as /model lists it)"


class ChatModels:
    def __init__(self, spec: RuntimeConfig, interactive: bool):
        self.host = ModelHost()
        self.spec, self.interactive = spec, interactive

    def open(self) -> Runtime:
        """The current model's runtime, loaded (and reported on a terminal) if need be."""
        if self.interactive and self.host.loaded_spec != self.spec:
            print(f"loading {self.spec.label} on {self.spec.backend}...", file=sys.stderr)
        runtime = self.host.load_here(self.spec)
        info = runtime.info()
        if self.interactive and info.device_plan is not None:
            cache = f"; {info.kv_summary}" if info.kv_summary else ""
            plan = info.device_plan
            print(f"running on {plan.device} ({plan.reason}){cache}", file=sys.stderr, flush=True)
        return runtime

    def listing(self) -> str:
        current = resolve_model(self.spec.model).resolve()
        lines = [
            f"{'*' if path.resolve() == current else ' '} {name}"
            for name, path in installed_models()
        ]
        return "\n".join(["installed models (* = answering):", *lines, USAGE])

    def switch(self, name: str) -> Runtime:
        """Load the installed model `name` (with the current settings) and make it answer;
        MiniappError, one line, when there is none or it fails to load."""
        spec = installed_model_spec(self.spec, name)
        if spec is None:
            raise MiniappError(f"no installed model is named '{name}' (/model lists them)")
        previous, self.spec = self.spec, spec
        try:
            return self.open()
        except MiniappError:
            self.spec = previous
            raise

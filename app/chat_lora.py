"""LoRA adapters in the terminal chat: `--lora PATH [--lora-scale S]` (repeatable) and the
`/lora` command.

On the torch engine the adapters are loaded by name in the runtime (`runtime.lora`) and each
answer picks the active ones (`SamplingParams.lora`): `/lora` switches them between answers
without reloading the model. llama.cpp applies the one adapter it was opened with to every
answer and cannot change it while it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from miniapp.engine.api import (
    AdapterError,
    AdapterInfo,
    AdapterNameError,
    GenerationRequest,
    LoraChoice,
    LoraSpec,
    MessageRuntime,
    MiniappError,
    check_scale,
    parse_lora_flag,
)

from .host.settings import lora_specs

USAGE = "usage: /lora [load PATH [SCALE] | use NAME[:SCALE][,NAME...] | off | unload NAME]"
CANNOT_CHANGE = (
    "the {backend} backend applies the adapter it was opened with (--lora) to every answer "
    "and cannot change adapters while it runs; use --backend torch"
)
ON_A_SERVER = (
    "a server's model: adapters are the server's to apply (it lists them as models: "
    "--remote-model NAME)"
)
KIB, MIB = 1024, 1024 * 1024


def startup_adapters(args: argparse.Namespace) -> tuple[LoraSpec, ...]:
    """The --lora flags, checked before the model loads: a bad flag or a missing file is
    one line (exit 2). Their contents are checked against the model when it opens."""
    specs = lora_specs(args)
    for spec in specs:
        if not spec.path.is_file():
            raise AdapterError(spec.path, "no such adapter file")
    return specs


class ChatAdapters:
    """The adapters the chat's answers run with. On the torch engine: the --lora adapters
    at first, then whatever /lora picks; elsewhere none are picked per answer (llama.cpp
    applies its own to every answer)."""

    def __init__(self, backend: str, specs: Sequence[LoraSpec] = ()):
        self.backend = backend
        self.active: tuple[LoraChoice, ...] = (
            tuple(LoraChoice(spec.name) for spec in specs) if backend == "torch" else ()
        )

    def request(self, request: GenerationRequest) -> GenerationRequest:
        """`request` with the active adapters in its sampling settings."""
        if not self.active:
            return request
        sampling = dataclasses.replace(request.sampling, lora=self.active)
        return dataclasses.replace(request, sampling=sampling)

    def command(self, runtime, argument: str) -> str:
        """`/lora ...`: what to print. A bad file, an unknown name or a backend that cannot
        change adapters is one line ("error: ..."); the chat goes on."""
        action, _, rest = argument.strip().partition(" ")
        action, rest = action.lower(), rest.strip()
        registry = getattr(runtime, "lora", None)
        try:
            if not action or action in ("list", "ls"):
                return self.listing(runtime)
            if action not in ("load", "use", "off", "unload"):
                return USAGE
            if isinstance(runtime, MessageRuntime):
                raise MiniappError(ON_A_SERVER)
            if registry is None:
                raise MiniappError(CANNOT_CHANGE.format(backend=runtime.backend))
            if action == "load":
                return self._load(registry, rest)
            if action == "use":
                return self._use(registry, rest)
            if action == "unload":
                return self._unload(registry, rest)
            self.active = ()
            return "answers now run on the base model"
        except MiniappError as exc:
            return f"error: {exc}"

    def listing(self, runtime) -> str:
        if isinstance(runtime, MessageRuntime):
            return ON_A_SERVER
        registry = getattr(runtime, "lora", None)
        if registry is None:
            applied = runtime.info().adapters
            if applied:
                return f"{', '.join(applied)}: applied to every answer ({runtime.backend})"
            return f"no adapter (the {runtime.backend} backend takes one at start: --lora PATH)"
        loaded = registry.list()
        if not loaded:
            return "no adapters loaded; /lora load PATH [SCALE] loads one"
        active = {choice.name: choice for choice in self.active}
        lines = ["adapters (* = active):"]
        for info in loaded:
            choice = active.get(info.name)
            mark = "*" if choice else " "
            at = f", now at {choice.scale:g}" if choice and choice.scale is not None else ""
            lines.append(f"{mark} {info.name}: {_described(info)}{at}  ({info.path})")
        if not self.active:
            lines.append("answers run on the base model")
        return "\n".join(lines)

    def _load(self, registry, argument: str) -> str:
        """`/lora load PATH [SCALE]` (or NAME=PATH[:SCALE]): loads it and answers with it."""
        if not argument:
            return USAGE
        text, scale = argument, None
        head, space, tail = argument.rpartition(" ")
        if space and head.strip():
            try:
                scale = float(tail)
                text = head.strip()
            except ValueError:
                pass
        spec = parse_lora_flag(text)
        if scale is not None:
            spec = dataclasses.replace(spec, scale=check_scale(scale))
        try:
            info = registry.load(spec.name, spec.path, spec.scale)
        except AdapterNameError as exc:
            raise MiniappError(f"{exc} (/lora use {spec.name}, or load it as NAME=PATH)") from None
        self.active = (LoraChoice(info.name),)
        took = f"{info.load_seconds * 1000:.0f} ms"
        return f"loaded {info.name}: {_described(info)}, in {took}; {self._now()}"

    def _use(self, registry, argument: str) -> str:
        """`/lora use NAME[:SCALE][,NAME...]`: these adapters, in this order, from now on."""
        choices = []
        for part in filter(None, (p.strip() for p in argument.split(","))):
            name, colon, tail = part.rpartition(":")
            scale = None
            if colon and name:
                try:
                    scale = check_scale(float(tail))
                except ValueError:
                    name = part
            else:
                name = part
            if name not in registry:
                known = ", ".join(info.name for info in registry.list()) or "none"
                raise MiniappError(f"no adapter named {name!r} is loaded (loaded: {known})")
            choices.append(LoraChoice(name, scale))
        if not choices:
            return USAGE
        self.active = tuple(choices)
        return self._now()

    def _unload(self, registry, name: str) -> str:
        if not name:
            return USAGE
        info = registry.unload(name)
        self.active = tuple(choice for choice in self.active if choice.name != info.name)
        return f"unloaded {info.name}; {self._now()}"

    def _now(self) -> str:
        if not self.active:
            return "answers now run on the base model"
        names = [
            choice.name if choice.scale is None else f"{choice.name} at {choice.scale:g}"
            for choice in self.active
        ]
        return f"answers now run with {', '.join(names)}"


def _described(info: AdapterInfo) -> str:
    size = f"{info.nbytes / MIB:.1f} MiB" if info.nbytes >= MIB else f"{info.nbytes / KIB:.1f} KiB"
    resident = "" if info.resident else ", let go (read again on use)"
    return f"rank {info.rank}, scale {info.scale:g}, {size}{resident}"

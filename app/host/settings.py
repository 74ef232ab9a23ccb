"""The one settings model: it makes the `chat` and `gui` command-line flags, the GUI's
defaults, and the TOML file in the user config folder (`miniapp config show|set|path`).

Each value comes from, highest first: a command-line flag, an environment variable
(`MINIAPP_` + the name in capitals, e.g. MINIAPP_TEMPERATURE=0.2), the config file, the
default here. `Settings.sources` says where each value came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import platformdirs
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from miniapp.engine.api import (
    BACKENDS,
    DEFAULT_CTX,
    DEFAULT_KV_TYPE,
    DEFAULT_MODEL,
    DEFAULT_PARALLEL,
    DEFAULT_SINKS,
    DEVICE_CHOICES,
    KV_TYPE_NAMES,
    SPEC_MODES,
    WINDOW_POLICY,
    GenerationRequest,
    LoraSpec,
    MiniappError,
    RuntimeConfig,
    SamplingParams,
    SpecMode,
    check_kv_policy,
    check_scale,
    kv_type,
    parse_lora_flag,
)

CONFIG_ENV = "MINIAPP_CONFIG"  # a config file elsewhere (tests, several profiles)
ENV_PREFIX = "MINIAPP_"
COMMANDS = ("chat", "gui", "serve")
# The choices and defaults are the engine's own: one source for each.
Backend = Literal[BACKENDS]
Device = Literal[DEVICE_CHOICES]
Spec = Literal[SPEC_MODES]
_SAMPLING, _REQUEST = SamplingParams(), GenerationRequest()
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 7860  # the GUI's (loopback only unless told)
_KV_NAMES = [f"{n} (default)" if n == DEFAULT_KV_TYPE else n for n in KV_TYPE_NAMES]
KV_TYPE_HELP = (
    f"KV cache storage: {', '.join(_KV_NAMES)}, or KEYS/VALUES types such as q8/q4 (keys "
    "need the bits more)"
)


def kv_type_name(text: str) -> str:
    """A --kv-type value, checked by the engine: a bad one is the engine's one-line error
    (MiniappError, exit code 2), not argparse's usage block."""
    return kv_type(text).name


def _field(default, help: str, commands: tuple[str, ...] = COMMANDS, **limits):  # noqa: A002
    return Field(default, description=help, json_schema_extra={"commands": commands}, **limits)


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str = _field(DEFAULT_MODEL, "GGUF path or bundled model name")
    backend: Backend = _field(
        BACKENDS[0], "our engine, llama.cpp, or openai: a server's model (--base-url)"
    )
    base_url: str | None = _field(
        None, "--backend openai: the server's address, e.g. http://host:8000/v1", ("chat", "gui")
    )
    remote_model: str | None = _field(
        None, "--backend openai: the server's model (default: its first)", ("chat", "gui")
    )
    device: Device = _field("auto", "torch engine: auto (a GPU if torch sees one), cuda, rocm, cpu")
    cpu_moe: bool = _field(
        False,
        "torch engine on a GPU: keep a mixture of experts' experts on the CPU, attention and "
        "shared weights on the GPU (also chosen when the experts do not fit)",
    )
    threads: int | None = _field(None, "CPU threads (default: all)", gt=0)
    ctx: int = _field(DEFAULT_CTX, "context size in tokens", gt=0)
    window: int | None = _field(
        None,
        "torch engine: recent tokens kept once the context is full (default: ctx - sinks)",
        gt=0,
    )
    sinks: int | None = _field(
        None, f"torch engine: first tokens kept as attention sinks (default: {DEFAULT_SINKS})", ge=0
    )
    kv_policy: str = _field(
        WINDOW_POLICY,
        "torch engine: which tokens a full cache keeps: window (the sinks and the most recent "
        "--window), attention (the sinks, the most recent and the ones attention used most) "
        "or attention-compact (the same, re-rotated into contiguous positions; for comparison)",
    )
    spec: Spec = _field(
        SpecMode.AUTO.value, "speculative decoding (torch engine; output unchanged)"
    )
    kv_type: str = _field(
        DEFAULT_KV_TYPE, KV_TYPE_HELP + " (llama.cpp keeps its f16 unless this is set)"
    )
    parallel: int = _field(
        DEFAULT_PARALLEL,
        "torch engine: answers generated at once, batched (more wait in a queue)",
        ("gui", "serve"),
        gt=0,
    )
    # The server's requests say their own limit (unset: what the context has left).
    max_tokens: int = _field(
        _REQUEST.max_tokens, "most tokens in one answer", ("chat", "gui"), gt=0
    )
    temperature: float = _field(_SAMPLING.temperature, "0 = greedy", ge=0)
    top_k: int = _field(
        _SAMPLING.top_k, "sample from the k most likely tokens (0 = all)", ("chat", "serve"), ge=0
    )
    top_p: float = _field(_SAMPLING.top_p, "nucleus sampling", gt=0, le=1)
    min_p: float = _field(
        _SAMPLING.min_p, "drop tokens below this share of the best", ("chat", "serve"), ge=0
    )
    repeat_penalty: float = _field(
        _SAMPLING.repeat_penalty, "llama.cpp's repetition penalty", ("chat", "serve"), gt=0
    )
    seed: int | None = _field(None, "sampling seed", ("chat", "serve"))
    system: str | None = _field(None, "system prompt", ("chat", "gui"))
    asr_model: str | None = _field(
        None, "a faster-whisper model folder (default: the bundled tiny.en)"
    )
    host: str = _field(DEFAULT_HOST, "GUI: address to bind (default: loopback)", ("gui",))
    port: int = _field(DEFAULT_PORT, "GUI: port", ("gui",), gt=0, lt=65536)

    @field_validator("kv_type", mode="before")
    @classmethod
    def _known_kv_type(cls, value: Any) -> str:
        try:
            return kv_type(value).name
        except MiniappError as exc:  # the engine's one line, naming the choices
            raise PydanticCustomError("kv_type", "{message}", {"message": str(exc)}) from None

    @field_validator("kv_policy", mode="before")
    @classmethod
    def _known_kv_policy(cls, value: Any) -> str:
        try:
            return check_kv_policy(value)
        except MiniappError as exc:
            raise PydanticCustomError("kv_policy", "{message}", {"message": str(exc)}) from None

    @classmethod
    def fields_for(cls, command: str) -> list[str]:
        return [
            name
            for name, info in cls.model_fields.items()
            if command in info.json_schema_extra["commands"]
        ]


# ------------------------------------------------------------------ the file


def config_path() -> Path:
    override = os.environ.get(CONFIG_ENV)
    return Path(override) if override else platformdirs.user_config_path("miniapp") / "config.toml"


def read_file(path: Path | None = None) -> dict[str, Any]:
    path = path or config_path()
    if not path.exists():
        return {}
    try:
        values = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise MiniappError(f"{path}: not a readable TOML settings file ({exc})") from None
    unknown = sorted(set(values) - set(Settings.model_fields))
    if unknown:
        raise MiniappError(f"{path}: unknown setting '{unknown[0]}'")
    return values


def write_file(values: dict[str, Any], path: Path | None = None) -> Path:
    """Only the values set in the file are written (defaults stay defaults)."""
    from .files import write_atomically

    path = path or config_path()
    lines = ["# miniapp settings: `miniapp config set NAME VALUE` edits this file"]
    lines += [f"{name} = {_toml_value(value)}" for name, value in sorted(values.items())]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, "\n".join(lines) + "\n")
    except OSError as exc:  # the old file, if any, is left as it was
        raise MiniappError(f"{path}: cannot write the settings ({exc.strerror or exc})") from None
    return path


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    text = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{text}"'


# ------------------------------------------------------------------ resolving


def resolve(
    flags: dict[str, Any] | None = None,
    file: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> tuple[Settings, dict[str, str]]:
    """The settings and, per name, where its value came from."""
    environ = os.environ if environ is None else environ
    given = {k: v for k, v in (flags or {}).items() if k in Settings.model_fields}
    layers = [
        ("file", read_file() if file is None else file),
        ("environment", _from_env(environ)),
        ("flag", given),
    ]
    values: dict[str, Any] = {}
    sources = dict.fromkeys(Settings.model_fields, "default")
    for source, layer in layers:
        for name, value in layer.items():
            values[name], sources[name] = value, source
    try:
        return Settings(**values), sources
    except ValidationError as exc:
        error = exc.errors()[0]
        name = error["loc"][0] if error["loc"] else "?"
        where = sources.get(name, "?")
        if where == "file" and file is None:
            where = f"file {config_path()}"
        raise MiniappError(f"setting {name} (from the {where}): {error['msg']}") from None


def _from_env(environ) -> dict[str, Any]:
    found = {}
    for name in Settings.model_fields:
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is not None:
            found[name] = None if raw == "" else raw
    return found


def _check_name(name: str) -> None:
    if name not in Settings.model_fields:
        choices = ", ".join(Settings.model_fields)
        raise MiniappError(f"unknown setting '{name}' (settings: {choices})")


def parse_value(name: str, text: str) -> Any:
    """A value typed on the command line (`config set`), checked against the model."""
    _check_name(name)
    try:
        return getattr(Settings(**{name: text}), name)
    except ValidationError as exc:
        raise MiniappError(f"setting {name}: {exc.errors()[0]['msg']}") from None


# ------------------------------------------------------------------ command-line flags

# Flags whose values the engine checks as they are parsed (one line, exit code 2).
_FLAG_TYPES = {"kv_type": (kv_type_name, "TYPE"), "kv_policy": (check_kv_policy, "POLICY")}


def add_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """One flag per setting of this command. Defaults are left out of the namespace, so that
    an absent flag lets the environment, the file or the default decide."""
    for name in Settings.fields_for(command):
        info = Settings.model_fields[name]
        options: dict[str, Any] = {"help": info.description, "default": argparse.SUPPRESS}
        choices = _choices(info.annotation)
        if info.annotation is bool:  # a switch: present is true
            options["action"] = "store_true"
        elif name in _FLAG_TYPES:
            check, metavar = _FLAG_TYPES[name]
            options.update(type=check, metavar=metavar)
        elif choices:
            options["choices"] = choices
        else:
            options["type"] = _base_type(info.annotation)
        parser.add_argument("--" + name.replace("_", "-"), **options)


def _choices(annotation) -> tuple[str, ...] | None:
    return get_args(annotation) if get_origin(annotation) is Literal else None


def _base_type(annotation):
    inner = [a for a in get_args(annotation) if a is not type(None)] or [annotation]
    return inner[0] if inner[0] in (int, float) else str


def apply(args: argparse.Namespace, command: str) -> Settings:
    """Fill the namespace with the resolved settings of this command (flags already parsed)."""
    own = Settings.fields_for(command)  # another command's flag of the same name is its own
    flags = {name: value for name, value in vars(args).items() if name in own}
    settings, sources = resolve(flags)
    for name in Settings.fields_for(command):
        setattr(args, name, getattr(settings, name))
    args.setting_sources = sources
    return settings


def runtime_kv_type(args: argparse.Namespace) -> str | None:
    """The KV cache type to open the runtime with: None while the setting is its default,
    so that each backend keeps its own (the torch engine's is the default here; llama.cpp's
    is f16); a type set by flag, environment or file applies to either backend."""
    sources = getattr(args, "setting_sources", None) or {}
    return None if sources.get("kv_type", "default") == "default" else args.kv_type


def local_runtime_config(args: argparse.Namespace, model: str | None = None) -> RuntimeConfig:
    """The RuntimeConfig the settings flags name for a local backend (`model`: instead of
    --model, e.g. the path it resolved to). Generations at once and the queue where the
    command has them; llama.cpp answers one at a time."""
    parallel = getattr(args, "parallel", 1) if args.backend == "torch" else 1
    return RuntimeConfig(
        model=args.model if model is None else model,
        backend=args.backend,
        device=args.device,
        spec=args.spec,
        ctx=args.ctx,
        window=args.window,
        sinks=args.sinks,
        kv_policy=args.kv_policy,
        threads=args.threads,
        parallel=parallel,
        kv_type=runtime_kv_type(args),
        max_queue=getattr(args, "queue", None),
        lora=lora_specs(args),
        lora_budget_mb=getattr(args, "lora_budget_mb", None),
        cpu_moe=getattr(args, "cpu_moe", False),
    )


def lora_specs(args: argparse.Namespace) -> tuple[LoraSpec, ...]:
    """The --lora flags (NAME=PATH[:SCALE], or a PATH named after its file), each with the
    --lora-scale in its position where the chat gives one. A bad one is one line."""
    flags = getattr(args, "lora", None) or []
    scales = getattr(args, "lora_scale", None) or []
    if len(scales) > len(flags):
        raise MiniappError(f"{len(scales)} --lora-scale for {len(flags)} --lora")
    specs = [parse_lora_flag(flag) for flag in flags]
    for index, scale in enumerate(scales):
        specs[index] = dataclasses.replace(specs[index], scale=check_scale(scale))
    names = [spec.name for spec in specs]
    for name in names:
        if names.count(name) > 1:
            raise MiniappError(f"two --lora adapters are named {name!r}: give NAME=PATH")
    return tuple(specs)


# ------------------------------------------------------------------ `miniapp config`


def run_config(args: argparse.Namespace) -> int:
    if args.config_command == "path":
        print(config_path())
        return 0
    if args.config_command == "set":
        values = read_file()
        if args.value is None:  # `config set NAME` alone: back to the default
            _check_name(args.name)
            values.pop(args.name, None)
        else:
            values[args.name] = parse_value(args.name, args.value)
        print(write_file(values))
        return 0
    settings, sources = resolve()
    width = max(map(len, Settings.model_fields))
    for name in Settings.model_fields:
        print(f"{name.ljust(width)}  {getattr(settings, name)!r}  ({sources[name]})")
    return 0

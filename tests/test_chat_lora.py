"""LoRA adapters in the terminal chat (issue 51): `miniapp chat --lora PATH [--lora-scale S]`
answers as the engine does with those adapters, and `/lora` lists, loads and switches them
between answers. On a tiny random model and adapters written with gguf's writer; the chat
runs in-process through `main` (stdin a terminal or a pipe), the engine is the real one."""

from __future__ import annotations

import dataclasses
import faulthandler
import io
import subprocess
import sys

import pytest
from gguf.constants import GGMLQuantizationType as Q
from tiny_gguf import LLAMA, write_tiny_adapter, write_tiny_model

from miniapp.app.cli import main
from miniapp.engine.api import (
    GREEDY,
    Conversation,
    GenerationRequest,
    LoraChoice,
    LoraSpec,
    RuntimeConfig,
    TextDelta,
    open_runtime,
)

MESSAGE = "Hello there"
MAX_TOKENS = 12
PROMPT = ">>> "


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A float model (llama.cpp and the torch engine agree closely on it) and two adapters."""
    folder = tmp_path_factory.mktemp("chat_lora")
    spec = dataclasses.replace(LLAMA, weight_type=Q.F32, embed_type=Q.F32)
    base = write_tiny_model(folder / "tiny.gguf", spec)
    a = write_tiny_adapter(folder / "a.gguf", base, rank=4, alpha=8.0, seed=1)
    b = write_tiny_adapter(folder / "b.gguf", base, rank=8, alpha=4.0, seed=2)
    return base, a, b


@pytest.fixture(scope="module")
def engine(tiny):
    """The torch engine with both adapters loaded: the answers the chat must give."""
    base, a, b = tiny
    config = RuntimeConfig(
        model=str(base), backend="torch", ctx=256, lora=(LoraSpec("a", a), LoraSpec("b", b))
    )
    return open_runtime(config)


def engine_answer(runtime, *choices: LoraChoice) -> str:
    sampling = dataclasses.replace(GREEDY, lora=tuple(choices))
    conversation = Conversation(runtime, None, GenerationRequest(MAX_TOKENS, sampling))
    return "".join(e.text for e in conversation.send(MESSAGE) if isinstance(e, TextDelta))


class _Stdin(io.StringIO):
    def __init__(self, text: str, terminal: bool):
        super().__init__(text)
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


def run_chat(monkeypatch, capsys, base, *flags, stdin: str = MESSAGE, terminal: bool = False):
    """`miniapp chat` on the tiny model, greedy: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "stdin", _Stdin(stdin, terminal))
    # main() points the fault handler at stderr, which capsys replaces by an object with no
    # file descriptor; pytest's own fault handler stays in place.
    monkeypatch.setattr(faulthandler, "enable", lambda *args, **kwargs: None)
    argv = ["chat", "--model", str(base), "--ctx", "256", "--threads", "2", "--temperature", "0"]
    code = main([*argv, "--max-tokens", str(MAX_TOKENS), *flags])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def replies(out: str) -> list[str]:
    """What the interactive chat printed after each line typed (the prompt splits them)."""
    return [chunk.removesuffix("\n") for chunk in out.split(PROMPT)[1:]]


def test_chat_with_lora_answers_as_the_engine_does_with_the_adapter(
    tiny, engine, monkeypatch, capsys
):
    base, a, b = tiny
    code, out, err = run_chat(monkeypatch, capsys, base, "--lora", str(a))
    assert code == 0, err
    adapted = engine_answer(engine, LoraChoice("a"))
    assert out == adapted + "\n"
    plain = run_chat(monkeypatch, capsys, base)[1]
    assert plain == engine_answer(engine) + "\n" and plain != out
    # Both adapters, the second at half its scale, in the order given.
    flags = ["--lora", str(a), "--lora", str(b), "--lora-scale", "1", "--lora-scale", "0.5"]
    code, both, err = run_chat(monkeypatch, capsys, base, *flags)
    assert code == 0, err
    assert both == engine_answer(engine, LoraChoice("a"), LoraChoice("b", 0.5)) + "\n"
    assert both not in (out, plain)
    # Scale 0 is the base model exactly.
    assert run_chat(monkeypatch, capsys, base, "--lora", str(a), "--lora-scale", "0")[1] == plain


def test_llama_cpp_applies_its_adapter_to_every_answer(tiny, engine, monkeypatch, capsys):
    base, a, _ = tiny
    code, out, err = run_chat(monkeypatch, capsys, base, "--backend", "llamacpp", "--lora", str(a))
    assert code == 0, err
    # llama.cpp is the oracle: on a float model its greedy answer is the torch engine's.
    assert out == engine_answer(engine, LoraChoice("a")) + "\n"
    typed = "/lora\n/lora use a\n/lora off\n/lora load x.gguf\n" + MESSAGE + "\n"
    flags = ("--backend", "llamacpp", "--lora", str(a))
    code, out, err = run_chat(monkeypatch, capsys, base, *flags, stdin=typed, terminal=True)
    assert code == 0, err
    listed, use, off, load, answer, _ = replies(out)
    assert listed == "a: applied to every answer (llamacpp)"
    for refused in (use, off, load):
        assert refused.startswith("error: the llamacpp backend applies the adapter it was opened")
        assert "\n" not in refused
    assert answer == engine_answer(engine, LoraChoice("a"))  # the chat went on, adapted


def test_lora_commands_list_load_switch_and_turn_off(tiny, engine, monkeypatch, capsys):
    base, a, b = tiny
    adapted, plain = engine_answer(engine, LoraChoice("a")), engine_answer(engine)
    mixed = engine_answer(engine, LoraChoice("a"), LoraChoice("b", 0.5))
    b_half = engine_answer(engine, LoraChoice("b", 0.5))
    typed = [
        "/lora",
        MESSAGE,
        "/reset",
        "/lora off",
        MESSAGE,
        "/reset",
        f"/lora load {b} 0.5",
        MESSAGE,
        "/lora",
        "/reset",
        "/lora use a, b:0.5",
        MESSAGE,
        "/lora use nope",
        f"/lora load {b.parent / 'missing.gguf'}",
        f"/lora load {base}",
        f"/lora load {a}",
        "/lora use a",
        "/reset",
        MESSAGE,
        "/lora unload b",
        "/lora frobnicate",
        "/help",
    ]
    stdin = "\n".join(typed) + "\n"
    code, out, err = run_chat(
        monkeypatch, capsys, base, "--lora", str(a), stdin=stdin, terminal=True
    )
    assert code == 0, err
    shown = dict(enumerate(replies(out)))
    listed = shown[0].splitlines()
    assert listed[0] == "adapters (* = active):"
    assert listed[1].startswith("* a: rank 4, scale 1, ") and str(a) in listed[1]
    assert shown[1] == adapted  # --lora: every answer runs with it
    assert shown[3] == "answers now run on the base model" and shown[4] == plain
    assert shown[6].startswith("loaded b: rank 8, scale 0.5, ")
    assert shown[6].endswith("; answers now run with b")
    assert shown[7] == b_half  # loaded, and picked at its own scale
    assert [line[:4] for line in shown[8].splitlines()[1:]] == ["  a:", "* b:"]
    assert shown[10] == "answers now run with a, b at 0.5" and shown[11] == mixed
    assert shown[12] == "error: no adapter named 'nope' is loaded (loaded: a, b)"
    assert shown[13] == f"error: {b.parent / 'missing.gguf'}: no such adapter file"
    assert shown[14].startswith(f"error: {base}: not a LoRA adapter")
    assert shown[15].startswith("error: an adapter named 'a' is already loaded")
    assert shown[16] == "answers now run with a" and shown[18] == adapted
    assert shown[19] == "unloaded b; answers now run with a"
    assert shown[20].startswith("usage: /lora")
    assert "/lora load PATH [SCALE]" in shown[21] and "/lora off" in shown[21]
    assert all("\n" not in shown[i] for i in (12, 13, 14, 15))  # one line each
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--lora", "{missing}"], "missing.gguf: no such adapter file"),
        (["--lora", "{base}"], "not a LoRA adapter"),
        (["--lora", "{a}", "--lora-scale", "1", "--lora-scale", "2"], "2 --lora-scale for 1"),
        (["--lora", "{a}", "--lora-scale", "1000"], "out of range"),
        (["--lora", "{a}", "--lora", "{a}"], "two --lora adapters are named 'a'"),
    ],
)
def test_a_bad_adapter_at_start_is_one_line_and_exit_2(tiny, monkeypatch, capsys, flags, says):
    base, a, _ = tiny
    names = {"missing": base.parent / "missing.gguf", "base": base, "a": a}
    given = [flag.format(**names) for flag in flags]
    for terminal in (False, True):
        code, out, err = run_chat(monkeypatch, capsys, base, *given, terminal=terminal)
        assert code == 2 and says in err, err
        lines = [line for line in err.splitlines() if not line.startswith("loading ")]
        assert lines == [f"miniapp: error: {lines[0].split('error: ', 1)[1]}"], err
        assert "Traceback" not in err and PROMPT not in out


def test_the_installed_command_refuses_a_missing_adapter(miniapp_exe, tiny):
    base, _, _ = tiny
    missing = base.parent / "nowhere.gguf"
    done = subprocess.run(
        [miniapp_exe, "chat", "--model", str(base), "--lora", str(missing)],
        input=MESSAGE,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr == f"miniapp: error: {missing}: no such adapter file\n"

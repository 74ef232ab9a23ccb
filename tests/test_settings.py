"""The settings model: flags over environment over file over defaults, the TOML file, the
flags it makes, and `miniapp config show|set|path`."""

from __future__ import annotations

import argparse
import os
import re
import subprocess

import pytest

from miniapp.app.host.settings import (
    Settings,
    add_flags,
    apply,
    parse_value,
    read_file,
    resolve,
    runtime_kv_type,
    write_file,
)
from miniapp.engine.errors import MiniappError
from miniapp.engine.kv.types import DEFAULT_KV_TYPE, KV_TYPE_NAMES


def test_each_layer_overrides_the_one_below():
    file = {"temperature": 0.5, "max_tokens": 100, "ctx": 1024}
    environ = {"MINIAPP_MAX_TOKENS": "200", "MINIAPP_CTX": "2048"}
    settings, sources = resolve({"ctx": 512}, file, environ)
    assert (settings.temperature, settings.max_tokens, settings.ctx) == (0.5, 200, 512)
    assert (sources["temperature"], sources["max_tokens"], sources["ctx"]) == (
        "file",
        "environment",
        "flag",
    )
    assert sources["top_p"] == "default" and settings.top_p == 0.95


def test_bad_values_name_the_setting_and_where_it_came_from():
    with pytest.raises(MiniappError, match="setting ctx \\(from the environment\\)"):
        resolve({}, {}, {"MINIAPP_CTX": "lots"})
    with pytest.raises(MiniappError, match="setting backend"):
        parse_value("backend", "tensorflow")
    with pytest.raises(MiniappError, match="unknown setting 'colour'"):
        parse_value("colour", "red")


def test_the_file_round_trips_as_toml(tmp_path):
    path = tmp_path / "config.toml"
    write_file({"system": 'Say "hi"\nthen stop', "temperature": 0.2, "port": 8080}, path)
    assert read_file(path) == {"system": 'Say "hi"\nthen stop', "temperature": 0.2, "port": 8080}
    path.write_text("nonsense = 1\n")
    with pytest.raises(MiniappError, match="unknown setting 'nonsense'"):
        read_file(path)


def test_flags_are_made_from_the_model():
    parser = argparse.ArgumentParser()
    add_flags(parser, "chat")
    given = vars(parser.parse_args(["--max-tokens", "9", "--backend", "llamacpp"]))
    assert given == {"max_tokens": 9, "backend": "llamacpp"}  # absent flags stay absent
    with pytest.raises(SystemExit):
        parser.parse_args(["--device", "tpu"])
    gui = argparse.ArgumentParser()
    add_flags(gui, "gui")
    assert vars(gui.parse_args(["--port", "8000"])) == {"port": 8000}
    assert set(Settings.fields_for("gui")) - set(Settings.fields_for("chat")) == {
        "host",
        "port",
        "parallel",
    }


def test_kv_type_comes_from_the_environment_and_is_checked_by_the_engine():
    settings, sources = resolve({}, {}, {})
    assert (settings.kv_type, sources["kv_type"]) == (DEFAULT_KV_TYPE, "default")
    settings, sources = resolve({}, {"kv_type": "f16"}, {"MINIAPP_KV_TYPE": "Q4"})
    assert (settings.kv_type, sources["kv_type"]) == ("q4", "environment")  # as the engine names it
    choices = "choose from " + ", ".join(KV_TYPE_NAMES)
    with pytest.raises(MiniappError, match=r"setting kv_type \(from the environment\)") as bad:
        resolve({}, {}, {"MINIAPP_KV_TYPE": "q9"})
    assert choices in str(bad.value) and "\n" not in str(bad.value)
    with pytest.raises(MiniappError, match=r"setting kv_type \(from the file\)"):
        resolve({}, {"kv_type": "int3"}, {})
    assert parse_value("kv_type", "BF16") == "bf16"
    with pytest.raises(MiniappError, match="choose from"):
        parse_value("kv_type", "q9")


def test_the_kv_type_flag_and_what_each_backend_gets(monkeypatch):
    """Left at its default, the runtime gets None: each backend keeps its own (llama.cpp's
    f16); set anywhere, either backend gets it."""
    parser = argparse.ArgumentParser()
    add_flags(parser, "chat")
    assert vars(parser.parse_args(["--kv-type", "F16"])) == {"kv_type": "f16"}
    with pytest.raises(MiniappError, match="--kv-type 'q9': choose from"):  # one line, exit 2
        parser.parse_args(["--kv-type", "q9"])
    for command in ("chat", "gui"):
        assert "kv_type" in Settings.fields_for(command)
    args = parser.parse_args(["--backend", "llamacpp"])
    apply(args, "chat")
    assert args.kv_type == DEFAULT_KV_TYPE and runtime_kv_type(args) is None
    monkeypatch.setenv("MINIAPP_KV_TYPE", "q4")
    args = parser.parse_args(["--backend", "llamacpp"])
    apply(args, "chat")
    assert runtime_kv_type(args) == "q4"
    args = parser.parse_args(["--kv-type", "f32"])
    apply(args, "chat")
    assert runtime_kv_type(args) == "f32"


def _miniapp(exe, config, *args, env_extra=None, stdin=None):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MINIAPP_") or k in ("MINIAPP_MODELS_DIR", "MINIAPP_CACHE_DIR")
    }
    env.update(MINIAPP_CONFIG=str(config), **(env_extra or {}))
    return subprocess.run(
        [exe, *args], input=stdin, capture_output=True, text=True, env=env, timeout=180
    )


def _generated(done) -> int:
    return int(re.search(r"generated (\d+) tok", done.stderr).group(1))


def test_chat_follows_flag_then_environment_then_file(miniapp_exe, tmp_path):
    config = tmp_path / "config.toml"
    assert _miniapp(miniapp_exe, config, "config", "set", "max_tokens", "3").returncode == 0
    assert _miniapp(miniapp_exe, config, "config", "set", "temperature", "0").returncode == 0
    base = ("chat", "--stats", "--threads", "2")
    question = "Write a long story about a dragon."
    from_file = _miniapp(miniapp_exe, config, *base, stdin=question)
    from_env = _miniapp(
        miniapp_exe, config, *base, stdin=question, env_extra={"MINIAPP_MAX_TOKENS": "5"}
    )
    from_flag = _miniapp(
        miniapp_exe,
        config,
        *base,
        "--max-tokens",
        "7",
        stdin=question,
        env_extra={"MINIAPP_MAX_TOKENS": "5"},
    )
    assert [_generated(d) for d in (from_file, from_env, from_flag)] == [3, 5, 7]
    shown = _miniapp(
        miniapp_exe, config, "config", "show", env_extra={"MINIAPP_TOP_P": "0.5"}
    ).stdout
    assert re.search(r"max_tokens\s+3\s+\(file\)", shown)
    assert re.search(r"top_p\s+0.5\s+\(environment\)", shown)
    assert _miniapp(miniapp_exe, config, "config", "path").stdout.strip() == str(config)
    bad = _miniapp(miniapp_exe, config, "config", "set", "ctx", "-1")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1

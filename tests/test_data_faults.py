"""Saved chats and settings when the disk misbehaves: a full disk, a read-only or impossible
data folder, a corrupt file, a file from a newer miniapp, a settings file with wrong types.
Each gets one line; the chat goes on (kept in memory); nothing saved is lost or written over.

The faults are the kernel's own: a full disk is a file-size limit (RLIMIT_FSIZE, so writes
fail with EFBIG as they would with ENOSPC), a read-only folder is one this user may not write
(when the tests run as root, which may write anywhere, a forked child drops to `nobody`)."""

from __future__ import annotations

import json
import os
import pickle
import resource
import subprocess
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import pytest

from miniapp.app.gui.history import HISTORY_VERSION, ChatStore, HistoryError, SavedChat
from miniapp.app.gui.history import SavedMessage as Message

NOBODY = 65534


def _chat(text: str = "hello") -> SavedChat:
    chat = SavedChat.new("model.gguf")
    chat.messages += [Message("user", text), Message("assistant", "hi there")]
    chat.retitle()
    return chat


@contextmanager
def _file_size_limit(nbytes: int):
    """Writes past `nbytes` fail with EFBIG (Python ignores SIGXFSZ), as on a full disk."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def _without_write_permission(action: Callable[[], object]) -> object:
    """`action()` as a user who may not write the read-only folders: this one, or `nobody`
    in a forked child when this one is root. Its result comes back pickled."""
    if os.geteuid() != 0:
        return action()
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(reader)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with os.fdopen(writer, "wb") as out:
                pickle.dump(action(), out)
            code = 0
        finally:
            os._exit(code)
    os.close(writer)
    with os.fdopen(reader, "rb") as results:
        data = results.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the unprivileged child failed"
    return pickle.loads(data)


def test_a_full_disk_keeps_the_chat_in_memory_and_the_saved_file_intact(tmp_path):
    store = ChatStore(tmp_path)
    chat = _chat()
    store.save(chat)
    before = (tmp_path / f"{chat.id}.json").read_bytes()
    chat.messages.append(Message("user", "a long question " * 2000))
    with _file_size_limit(len(before) + 100), pytest.raises(HistoryError) as failed:
        store.save(chat)
    assert "could not save this chat" in str(failed.value) and "\n" not in str(failed.value)
    assert "File too large" in str(failed.value)
    assert (tmp_path / f"{chat.id}.json").read_bytes() == before  # the saved one, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{chat.id}.json"]  # no half copies
    assert store.load(chat.id).messages[-1].content.startswith("a long question")
    assert [c.id for c in store.list()] == [chat.id] and "not saved yet" in store.notice()
    store.save(chat)  # room again: the next save writes everything
    assert json.loads((tmp_path / f"{chat.id}.json").read_text())["messages"][-1]["role"] == "user"
    assert store.notice() == ""


def test_a_read_only_folder_lists_what_is_there_and_keeps_new_chats_in_memory():
    folder = Path(tempfile.mkdtemp(prefix="miniapp-readonly-"))
    os.chmod(folder, 0o755)
    saved = _chat("saved earlier")
    ChatStore(folder).save(saved)
    os.chmod(folder / f"{saved.id}.json", 0o644)
    os.chmod(folder, 0o555)

    def use_it():
        store = ChatStore(folder)
        listed = [c.id for c in store.list()]
        chat = _chat("new one")
        try:
            store.save(chat)
            error = ""
        except HistoryError as exc:
            error = str(exc)
        return listed, error, store.load(chat.id).messages[0].content, store.notice()

    listed, error, kept, notice = _without_write_permission(use_it)
    assert listed == [saved.id]
    assert "could not save this chat" in error and "Permission denied" in error
    assert kept == "new one" and "not saved yet" in notice
    assert ChatStore(folder).load(saved.id) == saved


def test_a_data_folder_that_cannot_be_made_is_one_line_and_chats_stay_in_memory(tmp_path):
    blocker = tmp_path / "data"
    blocker.write_text("a file where the folder should be")
    store = ChatStore(blocker / "conversations")
    assert store.problem.startswith(f"cannot use {blocker / 'conversations'}")
    chat = _chat()
    with pytest.raises(HistoryError):
        store.save(chat)
    assert store.load(chat.id) is chat and store.list() == [chat]
    assert store.notice() == store.problem


def test_corrupt_and_newer_files_are_named_and_never_written_over(tmp_path):
    store = ChatStore(tmp_path)
    good = _chat()
    store.save(good)
    corrupt = tmp_path / ("a" * 32 + ".json")
    corrupt.write_text('{"id": "truncated')
    newer = tmp_path / ("b" * 32 + ".json")
    newer_data = {
        **json.loads(good.to_json()),
        "id": "b" * 32,
        "version": HISTORY_VERSION + 1,
        "branches": [],
    }
    newer.write_text(json.dumps(newer_data))
    before = {path: path.read_bytes() for path in (corrupt, newer)}

    assert [c.id for c in store.list()] == [good.id]
    assert set(store.unreadable) == {corrupt.name, newer.name}
    assert "newer miniapp (history version 2)" in store.unreadable[newer.name]
    assert "and 1 more could not be read" in store.notice()
    for path in (corrupt, newer):
        with pytest.raises(HistoryError, match="left as it is") as refused:
            store.load(path.stem)
        assert "\n" not in str(refused.value)
    store.save(_chat("another"))  # the app goes on saving new chats beside them
    assert {path: path.read_bytes() for path in (corrupt, newer)} == before


def _config_cli(miniapp_exe: str, config: Path, *args: str, limit: int | None = None):
    def limited():
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    env = {**os.environ, "MINIAPP_CONFIG": str(config)}
    return subprocess.run(
        [miniapp_exe, *args],
        input="hi\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        preexec_fn=limited,
    )


def test_a_settings_file_with_wrong_types_is_one_line_and_nothing_is_lost(miniapp_exe, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text('ctx = "lots"\ntemperature = 0.7\n')
    done = _config_cli(miniapp_exe, config, "chat")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"setting ctx (from the file {config})" in done.stderr
    # Setting another value keeps the bad one for the user to fix: nothing is dropped.
    assert _config_cli(miniapp_exe, config, "config", "set", "top_p", "0.5").returncode == 0
    text = config.read_text()
    assert 'ctx = "lots"' in text and "temperature = 0.7" in text and "top_p = 0.5" in text


def test_a_settings_file_that_cannot_be_read_or_written_is_left_as_it_was(miniapp_exe, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text("temperature = [unclosed\n")
    before = config.read_bytes()
    done = _config_cli(miniapp_exe, config, "config", "set", "top_p", "0.5")
    assert done.returncode == 2 and "not a readable TOML settings file" in done.stderr
    assert config.read_bytes() == before
    config.write_text("temperature = 0.7\n")
    before = config.read_bytes()
    done = _config_cli(miniapp_exe, config, "config", "set", "system", "x" * 5000, limit=1000)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "cannot write the settings (File too large)" in done.stderr
    assert config.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml"]

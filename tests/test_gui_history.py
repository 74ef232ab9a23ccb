"""Saved conversations: listing, restoring, exporting, and atomic writes under a kill."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from miniapp.app.gui.history import ChatStore, SavedChat, SavedMessage


def _conversation(turns: int = 2) -> SavedChat:
    chat = SavedChat.new("model.gguf")
    for i in range(turns):
        chat.messages.append(SavedMessage("user", f"question {i}", notes=[f"note {i}"]))
        chat.messages.append(SavedMessage("assistant", f"answer {i}", stats="10 tok/s"))
    chat.retitle()
    return chat


def test_saved_chats_are_listed_newest_first_and_restored(tmp_path):
    store = ChatStore(tmp_path)
    older, newer = _conversation(1), _conversation(3)
    store.save(older)
    time.sleep(0.01)
    store.save(newer)
    assert [c.id for c in store.list()] == [newer.id, older.id]
    restored = store.load(newer.id)
    assert restored == newer and restored.title == "question 0"
    store.delete(older.id)
    assert [c.id for c in store.list()] == [newer.id]


def test_export_to_markdown_and_json(tmp_path):
    chat = _conversation(1)
    markdown = chat.to_markdown()
    assert markdown.startswith("# question 0") and "**assistant:**" in markdown
    assert "> note 0" in markdown
    assert json.loads(chat.to_json())["messages"][1]["content"] == "answer 0"


def test_an_unreadable_file_is_skipped_not_fatal(tmp_path):
    store = ChatStore(tmp_path)
    store.save(_conversation())
    (tmp_path / ("0" * 32 + ".json")).write_text("{ not json")
    assert len(store.list()) == 1


WRITER = """
import sys
from miniapp.app.gui.history import SavedChat, ChatStore, SavedMessage
store = ChatStore(__import__("pathlib").Path(sys.argv[1]))
chat = SavedChat.new()
chat.id = sys.argv[2]
big = "x" * 200_000
print("ready", flush=True)
turn = 0
while True:
    turn += 1
    chat.messages.append(SavedMessage("user", f"{turn} {big}"))
    store.save(chat)
"""


def test_a_kill_mid_write_never_leaves_a_torn_conversation(tmp_path):
    chat_id = "a" * 32
    for _ in range(5):
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), chat_id],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert writer.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        saved = ChatStore(tmp_path).load(chat_id)  # parses: old or new, never torn
        assert all(m.content.endswith("x" * 1000) for m in saved.messages)

"""Saved conversations: one JSON file each in the user data folder, written atomically.

A conversation is saved after every message and every answer. Each write goes to a temporary
file in the same folder, is flushed to disk, then renamed over the old file: a crash or a
kill at any moment leaves either the previous version or the new one, never a torn file.

When the folder cannot be written (read-only, full, gone), a save fails in one line
(`HistoryError`) and the conversation is kept in memory, where the chat goes on, until a
later save succeeds. A file that cannot be read (corrupt, or written by a newer miniapp) is
listed as unreadable and never written over: its conversation id is never reused.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import platformdirs

from miniapp.engine.api import MiniappError

from ..host.files import write_atomically

DATA_DIR_ENV = "MINIAPP_DATA_DIR"
HISTORY_VERSION = 1  # written into each file; a larger one is a newer miniapp's format
TITLE_CHARS = 48
_ID_PATTERN = re.compile(r"^[0-9a-f]{32}$")


class HistoryError(MiniappError):
    """A saved conversation that could not be written or read, in one line."""


@dataclass
class SavedMessage:
    role: str  # "user" | "assistant"
    content: str  # what the model saw (OCR labels and transcripts included)
    shown: str | None = None  # what the user typed, when it differs from `content`
    notes: list[str] = field(default_factory=list)  # which image path, transcript facts
    words: list[dict] | None = None  # spoken messages: [{"word", "start", "end"}]
    stats: str | None = None  # answers: speed figures
    images: list[str] | None = None  # pictures for a vision model (saved copies' paths)

    @property
    def display(self) -> str:
        return self.shown if self.shown is not None else self.content


@dataclass
class SavedChat:
    id: str
    title: str
    created: float
    updated: float
    model: str = ""
    messages: list[SavedMessage] = field(default_factory=list)
    version: int = HISTORY_VERSION

    @classmethod
    def new(cls, model: str = "") -> SavedChat:
        now = time.time()
        return cls(uuid.uuid4().hex, "New chat", now, now, model)

    def retitle(self) -> None:
        """Named after the first user message, as chat apps do."""
        first = next((m for m in self.messages if m.role == "user"), None)
        if first is not None:
            text = " ".join(first.display.split())
            self.title = text[:TITLE_CHARS] + ("…" if len(text) > TITLE_CHARS else "")

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, indent=1)

    @classmethod
    def from_dict(cls, data: dict) -> SavedChat:
        """ValueError (or KeyError, TypeError) for data that is not a saved chat of ours."""
        version = data.get("version", HISTORY_VERSION)
        if not isinstance(version, int) or version > HISTORY_VERSION:
            raise ValueError(f"written by a newer miniapp (history version {version})")
        messages = [SavedMessage(**m) for m in data.get("messages", [])]
        fields = {k: data[k] for k in ("id", "title", "created", "updated")}
        if not all(isinstance(m.content, str) for m in messages):
            raise ValueError("a message without text")
        return cls(**fields, model=data.get("model", ""), messages=messages)

    def to_markdown(self) -> str:
        lines = [f"# {self.title}", ""]
        stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.created))
        lines += [f"*{stamp}, model {self.model or 'unknown'}*", ""]
        for message in self.messages:
            lines += [f"**{message.role}:**", "", message.display, ""]
            lines += [f"> {note}" for note in message.notes]
            if message.notes:
                lines.append("")
        return "\n".join(lines)


def data_dir() -> Path:
    override = os.environ.get(DATA_DIR_ENV)
    return Path(override) if override else platformdirs.user_data_path("miniapp")


class ChatStore:
    def __init__(self, folder: Path | None = None):
        self.folder = folder or data_dir() / "conversations"
        self._unsaved: dict[str, SavedChat] = {}  # saves that failed, newest version each
        self.unreadable: dict[str, str] = {}  # file name -> why, from the last listing
        self.problem = ""  # why the folder cannot be used, if it cannot
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self.problem = f"cannot use {self.folder} ({_reason(exc)}): chats are kept in memory"

    def _path(self, conversation_id: str) -> Path:
        if not _ID_PATTERN.match(conversation_id):
            raise ValueError(f"not a conversation id: {conversation_id!r}")
        return self.folder / f"{conversation_id}.json"

    def save(self, conversation: SavedChat) -> None:
        """HistoryError if the write failed; the conversation is then kept in memory (and
        written by the next save that works)."""
        conversation.updated = time.time()
        try:
            write_atomically(self._path(conversation.id), conversation.to_json())
        except OSError as exc:
            self._unsaved[conversation.id] = conversation
            raise HistoryError(
                f"could not save this chat in {self.folder} ({_reason(exc)}); it is kept in "
                "memory while the app runs"
            ) from None
        self._unsaved.pop(conversation.id, None)

    def load(self, conversation_id: str) -> SavedChat:
        """HistoryError if the file is missing or is not a saved chat this version reads."""
        if conversation_id in self._unsaved:
            return self._unsaved[conversation_id]
        path = self._path(conversation_id)
        try:
            return SavedChat.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except OSError as exc:
            raise HistoryError(f"cannot read {path} ({_reason(exc)})") from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise HistoryError(
                f"{path} is not a readable saved chat ({exc}); it is left as it is"
            ) from None

    def delete(self, conversation_id: str) -> None:
        self._unsaved.pop(conversation_id, None)
        try:
            self._path(conversation_id).unlink(missing_ok=True)
        except OSError as exc:
            raise HistoryError(f"could not delete that chat ({_reason(exc)})") from None

    def list(self) -> list[SavedChat]:
        """Newest first, unsaved ones included. A file that cannot be read is skipped and
        named in `unreadable`, not fatal."""
        found = dict(self._unsaved)
        self.unreadable = {}
        try:
            paths = sorted(self.folder.glob("*.json"))
        except OSError:
            paths = []
        for path in paths:
            if path.stem in found:
                continue
            try:
                found[path.stem] = self.load(path.stem)
            except (HistoryError, ValueError) as exc:
                self.unreadable[path.name] = str(exc)
        return sorted(found.values(), key=lambda c: c.updated, reverse=True)

    def notice(self) -> str:
        """One line on what is wrong with the saved chats, or ""."""
        if self.problem:
            return self.problem
        if self._unsaved:
            return f"{len(self._unsaved)} chat(s) not saved yet: {self.folder} cannot be written"
        if self.unreadable:
            name = next(iter(self.unreadable))
            more = f" and {len(self.unreadable) - 1} more" if len(self.unreadable) > 1 else ""
            return f"{name}{more} could not be read and {'are' if more else 'is'} left as is"
        return ""


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__

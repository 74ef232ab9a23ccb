"""Saved conversations: one JSON file each in the user data folder, written atomically.

A conversation is saved after every message and every answer. Each write goes to a temporary
file in the same folder, is flushed to disk, then renamed over the old file: a crash or a
kill at any moment leaves either the previous version or the new one, never a torn file.
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

DATA_DIR_ENV = "MINIAPP_DATA_DIR"
TITLE_CHARS = 48
_ID_PATTERN = re.compile(r"^[0-9a-f]{32}$")


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
        messages = [SavedMessage(**m) for m in data.get("messages", [])]
        fields = {k: data[k] for k in ("id", "title", "created", "updated")}
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
        self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, conversation_id: str) -> Path:
        if not _ID_PATTERN.match(conversation_id):
            raise ValueError(f"not a conversation id: {conversation_id!r}")
        return self.folder / f"{conversation_id}.json"

    def save(self, conversation: SavedChat) -> None:
        conversation.updated = time.time()
        write_atomically(self._path(conversation.id), conversation.to_json())

    def load(self, conversation_id: str) -> SavedChat:
        data = json.loads(self._path(conversation_id).read_text(encoding="utf-8"))
        return SavedChat.from_dict(data)

    def delete(self, conversation_id: str) -> None:
        self._path(conversation_id).unlink(missing_ok=True)

    def list(self) -> list[SavedChat]:
        """Newest first. A file that cannot be read is skipped, not fatal."""
        found = []
        for path in self.folder.glob("*.json"):
            try:
                found.append(SavedChat.from_dict(json.loads(path.read_text("utf-8"))))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return sorted(found, key=lambda c: c.updated, reverse=True)


def write_atomically(path: Path, text: str) -> None:
    write_atomically_bytes(path, text.encode("utf-8"))


def write_atomically_bytes(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with temporary.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # the rename itself survives a power cut
    finally:
        os.close(folder)

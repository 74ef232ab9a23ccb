"""Data files shipped with miniapp (sample texts and prompts for benchmarks, evaluation and
calibration)."""

from importlib.resources import files


def sample_texts() -> list[str]:
    """Our own English prose samples, in a stable order."""
    folder = files(__name__) / "text"
    return [
        p.read_text(encoding="utf-8")
        for p in sorted(folder.iterdir(), key=lambda p: p.name)
        if p.name.endswith(".txt")
    ]


def chat_prompts() -> list[str]:
    """Our own open-ended chat questions, one per line, in a stable order."""
    text = (files(__name__) / "prompts" / "chat.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]

"""Data files shipped with miniapp (sample texts for benchmarks and evaluation)."""

from importlib.resources import files


def sample_texts() -> list[str]:
    """Our own English prose samples, in a stable order."""
    folder = files(__name__) / "text"
    return [
        p.read_text(encoding="utf-8")
        for p in sorted(folder.iterdir(), key=lambda p: p.name)
        if p.name.endswith(".txt")
    ]

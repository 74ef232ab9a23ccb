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
    return _lines(files(__name__) / "prompts" / "chat.txt")


def training_prompts(seed: int = 0) -> list[str]:
    """Varied chat requests for training a drafting head: every ask of `prompts/asks.txt`
    about every topic of `prompts/topics.txt`, shuffled reproducibly. None of them is a
    question of `chat.txt`, whose first ones benchmarks and calibration measure on."""
    import random

    folder = files(__name__) / "prompts"
    asks, topics = _lines(folder / "asks.txt"), _lines(folder / "topics.txt")
    prompts = [ask.format(topic) for ask in asks for topic in topics]
    random.Random(seed).shuffle(prompts)
    return prompts


def _lines(path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]

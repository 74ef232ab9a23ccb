"""What the app does with a model file before its first token, as one function: the GGUF
fuzzer's target (tests/fuzz_gguf.py) and the bad-file tests' (tests/test_bad_gguf.py)."""

from __future__ import annotations

from pathlib import Path

from miniapp.engine.modelfile.gguf_file import GGUFFile
from miniapp.engine.modelfile.template import ChatTemplate, Message
from miniapp.engine.models import build_model
from miniapp.engine.tokens.tokenizer import Tokenizer

SEED_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def load_to_first_token(path: Path) -> list[int]:
    """Everything the app does with a model file before it computes a token: the prompt's
    token ids. Raises MiniappError (and nothing else) for a bad file."""
    gguf = GGUFFile(path)
    model = build_model(gguf)
    tokenizer = Tokenizer(path)
    source = gguf.metadata.get("tokenizer.chat_template")
    template = ChatTemplate.for_model(source, tokenizer, gguf.architecture)
    prompt = tokenizer.encode_chat(template.render([Message("user", "Hello there")]))
    if any(not 0 <= token < model.config.vocab_size for token in prompt):
        raise AssertionError(f"token ids outside the {model.config.vocab_size}-token model")
    return prompt

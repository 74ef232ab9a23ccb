"""What a model file must pass before any of it is used, by either backend.

`GGUFFile` already refuses a file whose structure is broken (truncated, bad counts, tensors
outside the file or overlapping). These checks cover what the structure leaves open: known
keys holding the wrong type of value, a tokenizer whose arrays disagree with each other or
with the embedding, byte tokens llama.cpp's tokenizer would abort on, and a chat template
that does not parse. They run before llama.cpp reads
the vocabulary, so a hostile file is refused here in one line rather than inside C++.
"""

from __future__ import annotations

import re

import numpy as np

from ..errors import MiniappError, ModelFileError
from .gguf_file import ArrayInfo, GGUFFile
from .template import ChatTemplate

# GGUF's type ids (gguf's GGUFValueType) of the arrays llama.cpp reads as raw memory.
_INT32, _FLOAT32, _STRING = 5, 6, 8

_BYTE_TOKEN = 6  # llama.cpp's LLAMA_TOKEN_TYPE_BYTE
_BYTE_SPELLING = re.compile(rb"<0x[0-9A-Fa-f]{2}>")

# `<architecture>.<suffix>` keys both backends read, by the kind of value they must hold
# (GGUF's several integer types all count as whole numbers).
_WHOLE_SUFFIXES = (
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "rope.dimension_count",
    "vocab_size",
    "attention.sliding_window",
)
_REAL_SUFFIXES = (
    "attention.layer_norm_rms_epsilon",
    "attention.layer_norm_epsilon",
    "rope.freq_base",
    "rope.freq_base_swa",
    "rope.scaling.factor",
    "final_logit_softcapping",
)
_TEXT_KEYS = (
    "general.architecture",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.chat_template",
)
_TOKEN_ID_KEYS = tuple(
    f"tokenizer.ggml.{name}_token_id"
    for name in ("bos", "eos", "unknown", "padding", "seperator", "eot", "eom")
)
_FLAG_KEYS = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token")
# Per-layer forms some architectures use; the engine refuses them later, by name.
_LIST_ALLOWED = ("feed_forward_length", "attention.head_count", "attention.head_count_kv")


def check_model_file(gguf: GGUFFile) -> None:
    """Raises ModelFileError naming the first problem found."""
    _check_value_types(gguf)
    _check_tokenizer(gguf)
    _check_chat_template(gguf)


def describe_value(value) -> str:
    """A metadata value as an error line shows it: its type and the start of its text."""
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return f"{type(value).__name__} {repr(value)[:40]}"


def _check_value_types(gguf: GGUFFile) -> None:
    def bad(key: str, value, wanted: str) -> ModelFileError:
        return ModelFileError(gguf.path, f"metadata {key} is {describe_value(value)}, not {wanted}")

    for key in _TEXT_KEYS:
        value = gguf.metadata.get(key)
        if key in gguf.arrays or (value is not None and not isinstance(value, str)):
            raise bad(key, value if value is not None else [], "text")
    arch = gguf.architecture
    for suffix in _WHOLE_SUFFIXES:
        value = gguf.metadata.get(f"{arch}.{suffix}")
        if isinstance(value, list) and suffix in _LIST_ALLOWED:
            value = value[0] if value and all(type(v) is int for v in value) else value
        if value is not None and type(value) is not int:
            raise bad(f"{arch}.{suffix}", value, "a whole number")
    for suffix in _REAL_SUFFIXES:
        value = gguf.metadata.get(f"{arch}.{suffix}")
        if value is not None and type(value) not in (int, float):
            raise bad(f"{arch}.{suffix}", value, "a number")
    for key in _FLAG_KEYS:
        value = gguf.metadata.get(key)
        if value is not None and type(value) is not bool:
            raise bad(key, value, "true or false")


def _check_tokenizer(gguf: GGUFFile) -> None:
    """The arrays llama.cpp reads as raw memory have the types and lengths it assumes, and
    the vocabulary matches the embedding table."""
    tokens = gguf.arrays.get("tokenizer.ggml.tokens")
    if tokens is None:
        if "tokenizer.ggml.tokens" in gguf.metadata:
            raise ModelFileError(gguf.path, "metadata tokenizer.ggml.tokens is not a list")
        return  # llama.cpp reports a file without a vocabulary itself, in one line
    _need_array(gguf, "tokenizer.ggml.tokens", tokens, _STRING, None)
    _need_array(
        gguf,
        "tokenizer.ggml.scores",
        gguf.arrays.get("tokenizer.ggml.scores"),
        _FLOAT32,
        tokens.length,
    )
    _need_array(
        gguf,
        "tokenizer.ggml.token_type",
        gguf.arrays.get("tokenizer.ggml.token_type"),
        _INT32,
        tokens.length,
    )
    _need_array(
        gguf, "tokenizer.ggml.merges", gguf.arrays.get("tokenizer.ggml.merges"), _STRING, None
    )
    for key in _TOKEN_ID_KEYS:
        value = gguf.metadata.get(key)
        if value is None and key not in gguf.arrays:
            continue
        # An id past the vocabulary is allowed: llama.cpp warns and uses its default.
        if type(value) is not int:
            raise ModelFileError(
                gguf.path, f"metadata {key} is {describe_value(value)}, not a token id"
            )
    _check_byte_tokens(gguf)
    embedding = gguf.tensors.get("token_embd.weight")
    if embedding is not None and embedding.shape[0] != tokens.length:
        raise ModelFileError(
            gguf.path,
            f"the vocabulary has {tokens.length} tokens but the embedding table "
            f"token_embd.weight has {embedding.shape[0]} rows",
        )


def _check_byte_tokens(gguf: GGUFFile) -> None:
    """SentencePiece-style vocabularies (llama.cpp's "llama" and "t5" tokenizers) spell a
    character they have no token for as byte tokens `<0xXX>` (or one-byte tokens): every
    byte needs one, or llama.cpp aborts on the first text that reaches it. And a token
    typed as a byte must spell one, or turning it into text aborts."""
    if gguf.metadata.get("tokenizer.ggml.model") not in ("llama", "t5"):
        return
    texts = list(gguf.array_strings("tokenizer.ggml.tokens"))
    if "tokenizer.ggml.token_type" in gguf.arrays:
        types = gguf.array_numbers("tokenizer.ggml.token_type")
        for token in np.flatnonzero(types == _BYTE_TOKEN):
            if not _BYTE_SPELLING.fullmatch(texts[token]):
                raise ModelFileError(
                    gguf.path, f"token {token} is typed as a byte but reads {texts[token][:20]!r}"
                )
    short = {text for text in texts if len(text) <= 6}
    for byte in range(256):
        if f"<0x{byte:02X}>".encode() not in short and bytes([byte]) not in short:
            raise ModelFileError(
                gguf.path,
                f"the vocabulary has no token for byte 0x{byte:02X}, which its tokenizer needs",
            )


def _need_array(
    gguf: GGUFFile, key: str, found: ArrayInfo | None, element: int, length: int | None
) -> None:
    if found is None:
        if key in gguf.metadata:
            raise ModelFileError(gguf.path, f"metadata {key} is not a list")
        return
    if found.element != element:
        kind = {_INT32: "32-bit integers", _FLOAT32: "32-bit floats", _STRING: "strings"}
        raise ModelFileError(gguf.path, f"metadata {key} is not a list of {kind[element]}")
    if length is not None and found.length != length:
        raise ModelFileError(
            gguf.path, f"metadata {key} has {found.length} entries for {length} tokens"
        )


def _check_chat_template(gguf: GGUFFile) -> None:
    source = gguf.metadata.get("tokenizer.chat_template")
    if not source:
        return
    try:
        ChatTemplate(source, architecture=gguf.architecture)
    except MiniappError as exc:
        raise ModelFileError(gguf.path, str(exc)) from None

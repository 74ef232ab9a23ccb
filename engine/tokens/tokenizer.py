"""Tokenization through llama.cpp's own tokenizer, loaded vocab-only from the GGUF.

We never re-implement a tokenizer: llama.cpp reads the vocabulary, merges and pre-tokenizer
rules from the file, so our token ids match the oracle's exactly.
"""

from __future__ import annotations

import codecs
import ctypes
from pathlib import Path

from ..errors import ModelFileError
from ..llamacpp.library import Llama, llama_cpp
from ..llamacpp.vocab_probe import check_vocabulary_apart


class Tokenizer:
    def __init__(self, model_path: Path | str, llama: Llama | None = None):
        self.path = Path(model_path)
        if llama is None:
            check_vocabulary_apart(self.path)
            try:
                llama = Llama(str(self.path), vocab_only=True, verbose=False)
            except ValueError as exc:  # llama-cpp-python reports load failures as ValueError
                reason = f"llama.cpp could not read its vocabulary ({exc})"
                raise ModelFileError(self.path, reason) from exc
        self._llama = llama
        self._vocab = vocab = llama_cpp.llama_model_get_vocab(llama.model)
        self._piece_cache: dict[tuple[int, bool], bytes] = {}
        self.n_vocab = llama.n_vocab()
        self.bos_id = llama.token_bos()
        self.eos_id = llama.token_eos()
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
        self.eog_ids = frozenset(
            t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)
        )
        self.bos_text = self.token_text(self.bos_id) if self.bos_id >= 0 else ""
        self.eos_text = self.token_text(self.eos_id) if self.eos_id >= 0 else ""

    @property
    def vocab_handle(self):
        """llama.cpp's vocabulary object (for libraries that read it, like llguidance)."""
        return self._vocab

    def encode(
        self, text: str, add_bos: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        """Token ids for `text`. BOS follows the model's own setting unless told otherwise."""
        if add_bos is None:
            add_bos = self.add_bos
        if not text:
            return [self.bos_id] if add_bos else []
        return self._llama.tokenize(text.encode("utf-8"), add_bos=add_bos, special=parse_special)

    def encode_chat(self, rendered: str) -> list[int]:
        """Tokens of a rendered chat template. Templates often write the BOS token
        themselves; never add a second one."""
        add_bos = self.add_bos and not (self.bos_text and rendered.startswith(self.bos_text))
        return self.encode(rendered, add_bos=add_bos, parse_special=True)

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        """The bytes a token contributes to text; control tokens give b"" unless `special`."""
        key = (token, special)
        piece = self._piece_cache.get(key)
        if piece is None:
            piece = self._piece(token, special)
            self._piece_cache[key] = piece
        return piece

    def pieces(self) -> list[bytes]:
        """Every token's bytes in id order, control tokens as b"" (not kept in the cache)."""
        return [self._piece(token, False) for token in range(self.n_vocab)]

    def _piece(self, token: int, special: bool) -> bytes:
        size = 64
        while True:
            buffer = (ctypes.c_char * size)()
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buffer, size, 0, special)
            if n >= 0:
                return bytes(buffer[:n])
            size = -n  # a negative result is the size the piece needs

    def token_text(self, token: int) -> str:
        """A token's text including special tokens, e.g. '<|im_end|>'."""
        return self.token_bytes(token, special=True).decode("utf-8", "replace")

    def decode(self, tokens: list[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", "replace")


class IncrementalDecoder:
    """Turns a stream of token ids into text, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._utf8.decode(self._tokenizer.token_bytes(token))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)

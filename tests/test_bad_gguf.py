"""Every class of bad model file gets one line naming the file and the cause, quickly, and
never a crash: truncated, wrong magic or version, absurd counts and sizes, misplaced tensor
data, known keys of the wrong type, NaN or infinite numbers, a vocabulary that does not fit
the embedding or the tokenizer, tensors that disagree with the metadata, a template that does
not parse. Checked on the path to the first token (tests/first_token.py, which the fuzzer
also drives) and through the CLI with both backends."""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from first_token import load_to_first_token
from gguf import GGUFReader, GGUFValueType
from test_bad_input import _assert_one_line_error, _run
from tiny_gguf import QWEN3MOE, TOKEN_TYPES, VOCAB, write_tiny_model

from miniapp.engine.errors import ModelFileError

V = GGUFValueType


def _edit(path: Path, at: int, data: bytes) -> Path:
    raw = bytearray(path.read_bytes())
    raw[at : at + len(data)] = data
    path.write_bytes(bytes(raw))
    return path


def _tensor_fields(path: Path, index: int) -> dict[str, int]:
    """Byte offsets of one tensor entry's dims, type and data offset, and where its data
    starts relative to the data section."""
    tensor = GGUFReader(path).tensors[index]
    at = tensor.field.offset + 8 + len(tensor.name.encode()) + 4
    dims = at
    after_dims = at + 8 * len(tensor.shape)
    return {
        "dims": dims,
        "type": after_dims,
        "offset": after_dims + 4,
        "relative": int(tensor.field.parts[-1][0]),
    }


def _model(tmp: Path, metadata: dict | None = None) -> Path:
    return write_tiny_model(tmp / "bad.gguf", metadata=metadata)


def _experts(tmp: Path, metadata: dict) -> Path:
    return write_tiny_model(tmp / "bad.gguf", QWEN3MOE, metadata=metadata)


def _cut(fraction: float) -> Callable[[Path], Path]:
    def build(tmp: Path) -> Path:
        path = _model(tmp)
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * fraction)])
        return path

    return build


def _terabyte_tensor(tmp: Path) -> Path:
    path = _model(tmp)
    fields = _tensor_fields(path, 0)  # token_embd.weight: 64 columns
    return _edit(path, fields["dims"] + 8, struct.pack("<Q", 1 << 34))  # 2^34 rows


def _overlapping(tmp: Path) -> Path:
    path = _model(tmp)
    first = _tensor_fields(path, 0)
    return _edit(path, _tensor_fields(path, 1)["offset"], struct.pack("<Q", first["relative"]))


def _outside(tmp: Path) -> Path:
    path = _model(tmp)
    last = len(GGUFReader(path).tensors) - 1
    return _edit(path, _tensor_fields(path, last)["offset"], struct.pack("<Q", 1 << 40))


def _misaligned(tmp: Path) -> Path:
    path = _model(tmp)
    fields = _tensor_fields(path, 1)
    return _edit(path, fields["offset"], struct.pack("<Q", fields["relative"] + 1))


def _nan_scale(tmp: Path) -> Path:
    """The first Q4_1 block of blk.0.attn_q.weight gets a NaN scale."""
    path = _model(tmp)
    tensor = next(t for t in GGUFReader(path).tensors if t.name == "blk.0.attn_q.weight")
    return _edit(path, tensor.data_offset, np.array([np.nan], np.float16).tobytes())


def _infinite_norm(tmp: Path) -> Path:
    path = _model(tmp)
    tensor = next(t for t in GGUFReader(path).tensors if t.name == "blk.0.ffn_norm.weight")
    return _edit(path, tensor.data_offset + 12, np.array([np.inf], np.float32).tobytes())


def _tokens(tokens: list[str], types: list[int]) -> dict:
    return {
        "tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING),
        "tokenizer.ggml.scores": ([0.0] * len(tokens), V.ARRAY, V.FLOAT32),
        "tokenizer.ggml.token_type": (types, V.ARRAY, V.INT32),
    }


def _without_byte_0x73() -> dict:
    tokens, types = list(VOCAB), list(TOKEN_TYPES)
    where = tokens.index("<0x73>")
    tokens[where], types[where] = "not-a-byte", 1
    return _tokens(tokens, types)


def _misspelt_byte_token() -> dict:
    tokens = list(VOCAB)
    tokens[tokens.index("<0x73>")] = "<0xS3>"
    return _tokens(tokens, list(TOKEN_TYPES))


extra = [f"extra{i}" for i in range(41)]
BAD_FILES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "cut in the header": (_cut(0.001), "corrupt or truncated GGUF"),
    "cut in the metadata": (_cut(0.1), "corrupt or truncated GGUF (it ends at byte"),
    "cut in the tensor data": (_cut(0.9), "truncated GGUF (tensor"),
    "bad magic": (lambda tmp: _edit(_model(tmp), 0, b"GGML"), "not a GGUF file (bad magic"),
    "bad version": (
        lambda tmp: _edit(_model(tmp), 4, struct.pack("<I", 7)),
        ": GGUF version 7 is not supported (2 and 3 are)",
    ),
    "absurd key count": (
        lambda tmp: _edit(_model(tmp), 16, struct.pack("<Q", 1 << 60)),
        "1152921504606846976 keys and 20 tensors, more than",
    ),
    "absurd tensor count": (
        lambda tmp: _edit(_model(tmp), 8, struct.pack("<Q", 1 << 60)),
        "1152921504606846976 tensors, more than it holds",
    ),
    "a tensor of a terabyte": (_terabyte_tensor, "claims 1.1 TB from byte"),
    "overlapping tensors": (_overlapping, "overlap"),
    "a tensor outside the file": (_outside, "past the end of the file"),
    "a misaligned tensor": (_misaligned, "is not aligned to 32 bytes"),
    "a count of the wrong type": (
        lambda tmp: _model(tmp, {"llama.block_count": ("two", V.STRING)}),
        "metadata llama.block_count is str 'two', not a whole number",
    ),
    "a NaN epsilon": (
        lambda tmp: _model(tmp, {"llama.attention.layer_norm_rms_epsilon": (math.nan, V.FLOAT32)}),
        "layer_norm_rms_epsilon is float nan, not a finite number",
    ),
    "no attention heads": (
        lambda tmp: _model(tmp, {"llama.attention.head_count": (0, V.UINT32)}),
        "llama.attention.head_count is 0, not a positive count",
    ),
    "a width the tensors do not have": (
        lambda tmp: _model(tmp, {"llama.embedding_length": (128, V.UINT32)}),
        "has shape [64, 64], but the metadata gives [64, 128]",
    ),
    "an expert count the tensors do not have": (
        lambda tmp: _experts(tmp, {"qwen3moe.expert_count": (6, V.UINT32)}),
        "tensor blk.0.ffn_gate_inp.weight has shape [8, 64], but the metadata gives [6, 64]",
    ),
    "more experts used than there are": (
        lambda tmp: _experts(tmp, {"qwen3moe.expert_used_count": (9, V.UINT32)}),
        "expert_used_count is 9, outside 1..8",
    ),
    "a mixture of experts without an expert count": (
        lambda tmp: _experts(tmp, {"qwen3moe.expert_count": None}),
        "qwen3moe.expert_count is missing or 0",
    ),
    "a NaN scale": (_nan_scale, "tensor blk.0.attn_q.weight holds NaN or infinite values"),
    "an infinite norm weight": (_infinite_norm, "blk.0.ffn_norm.weight holds NaN or infinite"),
    "more tokens than embeddings": (
        lambda tmp: _model(tmp, _tokens(VOCAB + extra, TOKEN_TYPES + [1] * len(extra))),
        "the vocabulary has 300 tokens but the embedding table token_embd.weight has 259 rows",
    ),
    "scores that do not match the tokens": (
        lambda tmp: _model(tmp, {"tokenizer.ggml.scores": ([0.0] * 10, V.ARRAY, V.FLOAT32)}),
        "tokenizer.ggml.scores has 10 entries for 259 tokens",
    ),
    "token types of the wrong type": (
        lambda tmp: _model(tmp, {"tokenizer.ggml.token_type": (["x"] * 259, V.ARRAY, V.STRING)}),
        "tokenizer.ggml.token_type is not a list of 32-bit integers",
    ),
    "a byte without a token": (
        lambda tmp: _model(tmp, _without_byte_0x73()),
        "no token for byte 0x73",
    ),
    "a byte token that spells no byte": (
        lambda tmp: _model(tmp, _misspelt_byte_token()),
        "token 118 is typed as a byte but reads b'<0xS3>'",
    ),
    "a template that does not parse": (
        lambda tmp: _model(tmp, {"tokenizer.chat_template": ("{% for m in %}hi", V.STRING)}),
        "chat template does not parse",
    ),
}


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """One good model first: the native kernels load once, and are not timed below."""
    load_to_first_token(write_tiny_model(tmp_path_factory.mktemp("good") / "good.gguf"))


@pytest.mark.parametrize("case", BAD_FILES)
def test_a_bad_file_is_refused_in_one_line_before_the_first_token(warm, tmp_path, case):
    build, reason = BAD_FILES[case]
    path = build(tmp_path)
    started = time.monotonic()
    with pytest.raises(ModelFileError) as refused:
        load_to_first_token(path)
    message = str(refused.value)
    assert time.monotonic() - started < 10, "refused, but slowly"
    assert "\n" not in message
    assert message.startswith(str(path)) and reason in message, message


TORCH_CLI_CASES = [
    "cut in the tensor data",
    "a tensor of a terabyte",
    "a count of the wrong type",
    "a NaN scale",
    "an expert count the tensors do not have",
    "more tokens than embeddings",
    "a template that does not parse",
]
LLAMACPP_CLI_CASES = [
    "overlapping tensors",
    "a count of the wrong type",
    "a byte token that spells no byte",
    "a template that does not parse",
]


@pytest.mark.parametrize(
    "backend, case",
    [("torch", case) for case in TORCH_CLI_CASES] + [("llamacpp", c) for c in LLAMACPP_CLI_CASES],
)
def test_the_cli_says_one_line_and_exits_2(miniapp_exe, tmp_path, backend, case):
    build, reason = BAD_FILES[case]
    path = build(tmp_path)
    done = _run(miniapp_exe, "chat", "--backend", backend, "--model", str(path))
    _assert_one_line_error(done, path.name, reason)


def test_a_vocabulary_that_would_crash_llamacpp_is_refused_by_a_child(tmp_path):
    """Past our own checks (here: the byte check, by calling the probe alone), llama.cpp's
    abort on a missing byte token kills only the child that reads the vocabulary first."""
    from miniapp.engine.llamacpp.vocab_probe import check_vocabulary_apart

    path = _model(tmp_path, _without_byte_0x73())
    with pytest.raises(ModelFileError, match="llama.cpp crashed reading its vocabulary .SIGABRT"):
        check_vocabulary_apart(path)
    check_vocabulary_apart(write_tiny_model(tmp_path / "good.gguf"))  # a good one passes


@pytest.mark.parametrize(
    "backend, case", [("torch", "no attention heads"), ("llamacpp", "more tokens than embeddings")]
)
def test_the_server_refuses_a_bad_file_before_it_listens(miniapp_exe, tmp_path, backend, case):
    build, reason = BAD_FILES[case]
    path = build(tmp_path)
    done = _run(miniapp_exe, "serve", "--port", "0", "--backend", backend, "--model", str(path))
    _assert_one_line_error(done, path.name, reason)


def test_a_file_cut_anywhere_is_refused_in_one_line(warm, tmp_path):
    """Every 2% of a tiny model, and the last bytes: each cut is a one-line refusal."""
    whole = write_tiny_model(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    ends = sorted({len(whole) * i // 50 for i in range(50)} | {len(whole) - 1})
    for end in ends:
        cut.write_bytes(whole[:end])
        with pytest.raises(ModelFileError) as refused:
            load_to_first_token(cut)
        assert "\n" not in str(refused.value) and str(cut) in str(refused.value), end

"""Reading one metadata value without parsing the whole GGUF (`read_scalar`), as the
server's model list does: the same values GGUFFile reads, None for a missing key, and a
one-line error for a truncated file."""

from __future__ import annotations

import pytest
from tiny_gguf import GEMMA3, LLAMA, write_tiny_model

from miniapp.engine.errors import ModelFileError
from miniapp.engine.gguf_file import GGUFFile, read_scalar


@pytest.mark.parametrize("spec", [LLAMA, GEMMA3], ids=["llama", "gemma3"])
def test_one_value_is_the_value_the_full_reader_gives(tmp_path, spec):
    path = write_tiny_model(tmp_path / "tiny.gguf", spec)
    metadata = GGUFFile(path).metadata
    architecture = read_scalar(path, "general.architecture")
    assert architecture == metadata["general.architecture"] == spec.architecture
    for key in (f"{architecture}.context_length", f"{architecture}.block_count",
                f"{architecture}.attention.layer_norm_rms_epsilon"):  # fmt: skip
        assert read_scalar(path, key) == pytest.approx(metadata[key])
    assert read_scalar(path, "no.such.key") is None


def test_a_truncated_file_is_one_line(tmp_path):
    path = write_tiny_model(tmp_path / "tiny.gguf", LLAMA)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:200])
    with pytest.raises(ModelFileError, match="cut.gguf.*corrupt or truncated"):
        read_scalar(cut, "no.such.key")
    absurd = bytearray(data)
    absurd[24:32] = (1 << 62).to_bytes(8, "little")  # the first key's length
    cut.write_bytes(bytes(absurd))
    with pytest.raises(ModelFileError, match="a string of 4611686018427387904 bytes"):
        read_scalar(cut, "no.such.key")

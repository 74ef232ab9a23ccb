"""Our GGUF reader (`GGUFFile`, and `read_scalar` for one value, as the server's model list
uses it) against `gguf`'s own GGUFReader as the oracle: the same metadata, tensor shapes,
types and data offsets, large arrays left out, and a one-line error for a bad file."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from tiny_gguf import GEMMA3, LLAMA, PHI3, QWEN2, QWEN3, write_tiny_model

from miniapp.engine.errors import ModelFileError
from miniapp.engine.modelfile.gguf_file import LARGE_ARRAY_ITEMS, GGUFFile, read_scalar

SPECS = {"llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3, "phi3": PHI3, "gemma3": GEMMA3}


def oracle_metadata(reader: GGUFReader) -> dict:
    """GGUFReader's fields as plain values, without its own GGUF.* entries and without
    arrays longer than LARGE_ARRAY_ITEMS, which our reader skips."""

    def value(field):
        parts = [field.parts[i] for i in field.data]
        if field.types[-1] == GGUFValueType.STRING:
            values = [bytes(p).decode("utf-8", "replace") for p in parts]
        else:
            values = [p.tolist()[0] for p in parts]
        return values if field.types[0] == GGUFValueType.ARRAY else values[0]

    return {
        name: value(field)
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.") and len(field.data) <= LARGE_ARRAY_ITEMS
    }


def assert_reads_as_the_oracle(path) -> GGUFFile:
    ours, oracle = GGUFFile(path), GGUFReader(path)
    assert ours.metadata == oracle_metadata(oracle)
    assert len(ours.tensors) == len(oracle.tensors)
    for tensor in oracle.tensors:
        info = ours.tensors[tensor.name]
        assert info.shape == tuple(int(d) for d in reversed(tensor.shape.tolist()))
        assert info.ggml_type == tensor.tensor_type and info.offset == tensor.data_offset
        assert info.nbytes == tensor.n_bytes
        assert ours.raw(info).numpy().tobytes() == tensor.data.tobytes()
    return ours


@pytest.mark.parametrize("name", SPECS)
def test_every_architecture_reads_as_ggufs_own_reader(tmp_path, name):
    assert_reads_as_the_oracle(write_tiny_model(tmp_path / "tiny.gguf", SPECS[name]))


def test_large_arrays_are_skipped_and_a_custom_alignment_is_kept(tmp_path):
    path = tmp_path / "odd.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    vocabulary = [f"tok{i}é" for i in range(LARGE_ARRAY_ITEMS + 1)]
    writer.add_array("tokenizer.ggml.tokens", vocabulary)  # one past the limit: skipped
    writer.add_array("tokenizer.ggml.scores", [0.5] * (LARGE_ARRAY_ITEMS + 1))
    writer.add_array("small.strings", ["a", "ü", ""])
    writer.add_array("small.numbers", [1, 2, 3])
    writer.add_bool("flag", True)
    writer.add_float64("precise", 1 / 3)
    writer.add_string("text", "line\nnext")
    writer.add_tensor("odd.weight", np.arange(7, dtype=np.float32))
    writer.add_tensor("matrix.weight", np.ones((3, 5), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = assert_reads_as_the_oracle(path)
    assert "tokenizer.ggml.tokens" not in ours.metadata
    assert ours.metadata["small.strings"] == ["a", "ü", ""]
    assert ours.metadata["precise"] == 1 / 3 and ours.metadata["flag"] is True
    assert ours.tensors["matrix.weight"].shape == (3, 5)
    assert all(info.offset % 64 == 0 for info in ours.tensors.values())


@pytest.mark.parametrize("spec", [LLAMA, GEMMA3], ids=["llama", "gemma3"])
def test_one_value_is_the_value_the_full_reader_gives(tmp_path, spec):
    path = write_tiny_model(tmp_path / "tiny.gguf", spec)
    metadata = GGUFFile(path).metadata
    architecture = read_scalar(path, "general.architecture")
    assert architecture == metadata["general.architecture"] == spec.architecture
    for key in (
        f"{architecture}.context_length",
        f"{architecture}.block_count",
        f"{architecture}.attention.layer_norm_rms_epsilon",
    ):
        assert read_scalar(path, key) == pytest.approx(metadata[key])
    assert read_scalar(path, "no.such.key") is None


def test_a_truncated_or_corrupt_file_is_one_line(tmp_path):
    path = write_tiny_model(tmp_path / "tiny.gguf", LLAMA)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:200])
    with pytest.raises(ModelFileError, match="cut.gguf.*corrupt or truncated"):
        read_scalar(cut, "no.such.key")
    with pytest.raises(ModelFileError, match="cut.gguf.*corrupt or truncated"):
        GGUFFile(cut)
    absurd = bytearray(data)
    absurd[24:32] = (1 << 62).to_bytes(8, "little")  # the first key's length
    cut.write_bytes(bytes(absurd))
    with pytest.raises(ModelFileError, match="a string of 4611686018427387904 bytes"):
        read_scalar(cut, "no.such.key")
    with pytest.raises(ModelFileError, match="a string of 4611686018427387904 bytes"):
        GGUFFile(cut)
    tail = tmp_path / "tail.gguf"
    tail.write_bytes(data[: len(data) - 100])  # every header intact, the last tensor cut
    with pytest.raises(ModelFileError, match="tail.gguf: truncated GGUF .tensor .* past the end"):
        GGUFFile(tail)

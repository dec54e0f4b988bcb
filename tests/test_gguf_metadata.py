"""kvreuse.weights.gguf_metadata reads what gguf's GGUFReader reads, field for field and tensor for tensor, and names
the file and the problem for anything that is not a whole GGUF file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from kvreuse.weights.errors import ModelLoadError
from kvreuse.weights.gguf_metadata import read_gguf
from kvreuse.weights.loader import embedded_model_path
from kvreuse.weights.named_models import resolve_named_model

VOCAB = ["<unk>", "<s>", "</s>", "héllo", "日本語", "zzzz", " ", "  ", "▁the", "a b"]


def write_gguf(path: Path, endianess: GGUFEndian = GGUFEndian.LITTLE, alignment: int | None = None) -> Path:
    """A small GGUF with every kind of metadata value and F32, F16, BF16, Q8_0 and Q4_0 tensors."""
    rng = np.random.default_rng(0)
    writer = GGUFWriter(path, "llama", endianess=endianess)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_string("general.name", "tiny test")
    writer.add_uint32("llama.block_count", 2)
    writer.add_uint64("test.u64", 2**63 + 5)
    writer.add_int64("test.i64", -(2**40))
    writer.add_int8("test.i8", -7)
    writer.add_uint16("test.u16", 65535)
    writer.add_float32("test.f32", 1e-6)
    writer.add_float64("test.f64", 0.1)
    writer.add_bool("test.bool", True)
    writer.add_bool("test.false", False)
    writer.add_array("tokenizer.ggml.tokens", VOCAB)
    writer.add_array("tokenizer.ggml.scores", [float(-i) / 3 for i in range(len(VOCAB))])
    writer.add_array("tokenizer.ggml.token_type", [1, 3, 3, 1, 1, 1, 1, 4, 1, 1])
    writer.add_array("test.bools", [True, False, True])
    writer.add_key_value("test.u64s", [1, 2**40], GGUFValueType.ARRAY, GGUFValueType.UINT64)
    writer.add_key_value("test.i16s", [-3, 4, 5], GGUFValueType.ARRAY, GGUFValueType.INT16)
    writer.add_key_value("test.f64s", [0.5, -2.25], GGUFValueType.ARRAY, GGUFValueType.FLOAT64)
    weights = rng.standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor("f32.weight", weights)
    writer.add_tensor("norm.weight", rng.standard_normal(64).astype(np.float32))
    writer.add_tensor("f16.weight", weights.astype(np.float16))
    writer.add_tensor("i32.weight", np.arange(12, dtype=np.int32).reshape(3, 4))
    for qtype in (GGMLQuantizationType.BF16, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0):
        writer.add_tensor(f"{qtype.name.lower()}.weight", quantize(weights, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_same_as_gguf_reader(path: Path, compare_data: bool = True) -> None:
    ours, theirs = read_gguf(path), GGUFReader(path)
    keys = [key for key in theirs.fields if not key.startswith("GGUF.")]  # GGUFReader's header pseudo-fields
    assert list(ours.fields) == keys
    for key in keys:
        field, value = theirs.fields[key], ours.fields[key]
        assert ours.fields.types[key] == tuple(field.types), key
        if isinstance(value, np.ndarray):
            assert value.dtype == field.parts[field.data[0]].dtype, key
            value = value.tolist()
        assert value == field.contents(), key
        assert type(value) is type(field.contents()), key
    assert list(ours.tensors) == [tensor.name for tensor in theirs.tensors]
    assert ours.version == theirs.fields["GGUF.version"].contents()
    assert ours.alignment == theirs.alignment and ours.data_offset == theirs.data_offset
    for tensor in theirs.tensors:
        info = ours.tensors[tensor.name]
        assert info.shape == tuple(reversed(tensor.shape.tolist())), tensor.name
        assert info.ggml_type == tensor.tensor_type and info.n_elements == tensor.n_elements, tensor.name
        assert (info.offset, info.n_bytes) == (tensor.data_offset, tensor.n_bytes), tensor.name
        data = ours.tensor_data(tensor.name)
        assert (data.dtype, data.shape) == (tensor.data.dtype, tensor.data.shape), tensor.name
        if compare_data:
            assert data.tobytes() == tensor.data.tobytes(), tensor.name


@pytest.mark.parametrize("endianess", [GGUFEndian.LITTLE, GGUFEndian.BIG], ids=["little-endian", "big-endian"])
def test_a_written_file_reads_as_gguf_reader_reads_it(tmp_path, endianess):
    path = write_gguf(tmp_path / "tiny.gguf", endianess)
    assert_same_as_gguf_reader(path)
    fields = read_gguf(path).fields
    assert fields["tokenizer.ggml.tokens"] == VOCAB
    assert fields["test.u64"] == 2**63 + 5 and fields["test.bool"] is True and fields["test.false"] is False
    assert fields["test.f32"] == float(np.float32(1e-6))


def test_values_and_tensors_are_usable_as_they_come(tmp_path):
    gguf = read_gguf(write_gguf(tmp_path / "tiny.gguf"))
    assert gguf.fields["tokenizer.ggml.token_type"].tolist() == [1, 3, 3, 1, 1, 1, 1, 4, 1, 1]
    weights = gguf.tensor_data("f32.weight")
    assert weights.shape == (8, 64) == gguf.tensors["f32.weight"].shape
    for qtype, tolerance in ((GGMLQuantizationType.BF16, 1e-2), (GGMLQuantizationType.Q8_0, 3e-2),
                             (GGMLQuantizationType.Q4_0, 0.3)):
        name = f"{qtype.name.lower()}.weight"
        assert gguf.tensors[name].shape == (8, 64) and gguf.tensors[name].ggml_type == qtype
        values = dequantize(gguf.tensor_data(name), qtype)
        assert values.shape == (8, 64)
        assert np.abs(values - weights).max() < tolerance * np.abs(weights).max()


def test_a_custom_alignment_moves_the_data(tmp_path):
    path = write_gguf(tmp_path / "aligned.gguf", alignment=256)
    gguf = read_gguf(path)
    assert gguf.alignment == 256 and gguf.data_offset % 256 == 0
    assert_same_as_gguf_reader(path)


def test_the_embedded_model_reads_as_gguf_reader_reads_it():
    assert_same_as_gguf_reader(embedded_model_path())


@pytest.mark.slow  # GGUFReader takes ~10 s on its 262k-token vocabulary
def test_gemma3_reads_as_gguf_reader_reads_it():
    path = resolve_named_model("gemma3-270m")
    assert_same_as_gguf_reader(path, compare_data=False)
    gguf = read_gguf(path)
    assert gguf.fields["general.architecture"] == "gemma3"
    assert len(gguf.fields["tokenizer.ggml.tokens"]) == 262_144
    assert gguf.tensors["token_embd.weight"].shape == (262_144, 640)


def test_a_bad_string_fails_only_when_its_key_is_read(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf")
    data = path.read_bytes()
    path.write_bytes(data.replace(b"zzzz", b"z\xffzz", 1))
    gguf = read_gguf(path)  # the vocabulary is not decoded until it is read
    assert gguf.fields["general.name"] == "tiny test"
    with pytest.raises(ModelLoadError, match=r"tiny\.gguf.*'tokenizer\.ggml\.tokens'.*not UTF-8"):
        gguf.fields["tokenizer.ggml.tokens"]


@pytest.mark.parametrize("keep", [0, 10, 30, 200, -100])
def test_a_truncated_file_is_refused_naming_it(tmp_path, keep):
    path = write_gguf(tmp_path / "tiny.gguf")
    data = path.read_bytes()
    path.write_bytes(data[:keep])  # inside the header, or (negative) inside the last tensor's data
    with pytest.raises(ModelLoadError, match=r"tiny\.gguf: (not a GGUF file|truncated)") as caught:
        read_gguf(path)
    if keep >= 24:
        assert "truncated" in str(caught.value)


def test_bad_magic_and_unknown_version_are_refused(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf")
    data = path.read_bytes()
    (tmp_path / "magic.gguf").write_bytes(b"GGML" + data[4:])
    with pytest.raises(ModelLoadError, match=r"magic\.gguf: not a GGUF file \(it starts with b'GGML'"):
        read_gguf(tmp_path / "magic.gguf")
    (tmp_path / "v1.gguf").write_bytes(data[:4] + (1).to_bytes(4, "little") + data[8:])
    with pytest.raises(ModelLoadError, match=r"v1\.gguf: GGUF version 1 is not supported"):
        read_gguf(tmp_path / "v1.gguf")
    with pytest.raises(ModelLoadError, match="missing.gguf"):
        read_gguf(tmp_path / "missing.gguf")


def test_nested_arrays_keep_their_nesting(tmp_path):
    writer = GGUFWriter(tmp_path / "nested.gguf", "llama")
    writer.add_key_value("test.nested", [[1, 2], [3]], GGUFValueType.ARRAY, GGUFValueType.ARRAY)
    writer.add_key_value("test.nested_strings", [["a", "b"], ["c"]], GGUFValueType.ARRAY, GGUFValueType.ARRAY)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    fields, theirs = read_gguf(tmp_path / "nested.gguf").fields, GGUFReader(tmp_path / "nested.gguf").fields
    assert [item.tolist() for item in fields["test.nested"]] == [[1, 2], [3]]
    assert fields["test.nested_strings"] == [["a", "b"], ["c"]]
    for key in ("test.nested", "test.nested_strings"):  # GGUFReader flattens them
        assert fields.types[key] == tuple(theirs[key].types)
        assert [v for item in fields[key] for v in list(item)] == theirs[key].contents()

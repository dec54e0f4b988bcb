"""A GGUF file's metadata and tensor table, read straight from a memory map.

gguf's GGUFReader makes numpy views for every element of every metadata array, which takes seconds for a large
vocabulary. Here an array of numbers is one view, and an array of strings (a vocabulary, a merge table) is only
walked to find where it ends, decoded when its key is first read. Tensor data comes out exactly as GGUFReader's
`ReaderTensor.data`, ready for `gguf.quants.dequantize`.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

from kvreuse.weights.errors import ModelLoadError

SUPPORTED_VERSIONS = (2, 3)

_SCALAR_CODES = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d", GGUFValueType.BOOL: "?",
}
# The tensor types GGUFReader reads as numbers; every other type is read as its bytes (uint8), rows last.
_TENSOR_DTYPES = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
_MAX_DIMS = 8  # ggml has 4; more is a corrupt file, not a bigger tensor


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in the tensor table. `shape` is rows first (numpy order: the GGUF dims reversed), in
    elements; `offset` is absolute in the file; `n_bytes` is what the data takes there."""
    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return prod(self.shape)


class _LazyStrings:
    """An array of strings located in the file (each string's first byte, and where the last one ends), decoded on
    demand."""

    def __init__(self, buffer: memoryview, starts: list[int], end: int):
        self._buffer, self._starts, self._end = buffer, starts, end

    def decode(self) -> list[str]:
        buffer, starts = self._buffer, self._starts
        if not starts:
            return []
        ends = [start - 8 for start in starts[1:]] + [self._end]  # each string's length prefix ends the one before
        return [str(buffer[start:end], "utf-8") for start, end in zip(starts, ends, strict=True)]


class GGUFFields(Mapping):
    """The metadata: key -> a Python scalar (int, float, bool, str), a read-only numpy array (an array of numbers),
    or a list (of str for an array of strings, decoded when the key is first read; of arrays for nested arrays).
    `types[key]` is the value's GGUF type, then for an array its element type (types, for nested arrays).
    """

    def __init__(self, path: Path, values: dict[str, object], types: dict[str, tuple[GGUFValueType, ...]]):
        self._path, self._values, self.types = path, values, types

    def __getitem__(self, key: str) -> object:
        value = self._values[key]
        if isinstance(value, _LazyStrings):
            try:
                value = self._values[key] = value.decode()
            except UnicodeDecodeError as exc:
                raise ModelLoadError(f"{self._path}: metadata key {key!r} holds a string that is not UTF-8 "
                                     f"({exc})") from None
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


@dataclass(frozen=True, eq=False)
class GGUFFile:
    """A GGUF file's header: its metadata `fields`, its `tensors` by name (in file order), and where the tensor data
    starts. The file stays memory-mapped while this object or any array from it lives."""
    path: Path
    version: int
    fields: GGUFFields
    tensors: dict[str, TensorInfo]
    alignment: int
    data_offset: int
    byte_order: str  # "<" or ">": how the file stores numbers
    _map: np.memmap = field(repr=False)

    def tensor_data(self, name: str) -> np.ndarray:
        """The tensor's data as GGUFReader's `ReaderTensor.data` holds it (a read-only view, no copy): F32, F16,
        F64 and the integer types as numbers of `shape`; every other type (the quantized ones, BF16) as uint8 of
        shape [..., bytes per row], which `gguf.quants.dequantize(data, ggml_type)` takes."""
        info = self.tensors[name]
        raw = self._map[info.offset:info.offset + info.n_bytes]
        dtype = _TENSOR_DTYPES.get(info.ggml_type)
        if dtype is None:
            return raw.reshape(quant_shape_to_byte_shape(info.shape, info.ggml_type))
        return raw.view(np.dtype(dtype).newbyteorder(self.byte_order)).reshape(info.shape)


def read_gguf(path: Path) -> GGUFFile:
    """The header of the GGUF file at `path` (v2 or v3, either byte order); no tensor data is read. ModelLoadError
    naming the file and the problem for anything that is not a complete GGUF file."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from None
    if size < 24:
        raise ModelLoadError(f"{path}: not a GGUF file ({size} bytes, shorter than a GGUF header)")
    data = np.memmap(path, mode="r")
    buffer = memoryview(data)
    if bytes(buffer[:4]) != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (it starts with {bytes(buffer[:4])!r}, not b'GGUF')")
    version = struct.unpack_from("<I", buffer, 4)[0]
    order = ">" if version & 0xFFFF == 0 else "<"  # a file written on a big-endian machine
    if order == ">":
        version = struct.unpack_from(">I", buffer, 4)[0]
    if version not in SUPPORTED_VERSIONS:
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (only versions "
                             f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
    reader = _HeaderReader(path, buffer, order, size)
    try:
        return reader.read(version, data)
    except struct.error:
        raise ModelLoadError(f"{path}: truncated or corrupt GGUF file: its header runs past the end of the file at "
                             f"byte {reader.pos:,} (the file has {size:,} bytes)") from None
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"{path}: corrupt GGUF file: a name near byte {reader.pos:,} is not UTF-8 "
                             f"({exc})") from None


class _HeaderReader:
    """Reads the header front to back: a position in the file and typed values at it."""

    def __init__(self, path: Path, buffer: memoryview, order: str, size: int):
        self.path, self.buffer, self.order, self.size = path, buffer, order, size
        self.pos = 8
        self._structs = {code: struct.Struct(order + code) for code in (*_SCALAR_CODES.values(), "IQ")}

    def read(self, version: int, data: np.memmap) -> GGUFFile:
        tensor_count, kv_count = self._take("Q"), self._take("Q")
        values: dict[str, object] = {}
        types: dict[str, tuple[GGUFValueType, ...]] = {}
        for _ in range(kv_count):
            key = self._string()
            if key in values:
                raise ModelLoadError(f"{self.path}: corrupt GGUF file: metadata key {key!r} appears twice")
            values[key], types[key] = self._value(self._value_type(key))
        entries = [self._tensor_entry() for _ in range(tensor_count)]
        alignment = self._alignment(values, types)
        data_offset = -(-self.pos // alignment) * alignment
        tensors: dict[str, TensorInfo] = {}
        for name, shape, ggml_type, relative in entries:
            if name in tensors:
                raise ModelLoadError(f"{self.path}: corrupt GGUF file: tensor {name!r} appears twice")
            tensors[name] = self._tensor_info(name, shape, ggml_type, data_offset + relative)
        return GGUFFile(self.path, version, GGUFFields(self.path, values, types), tensors, alignment, data_offset,
                        self.order, data)

    def _take(self, code: str):
        unpacker = self._structs[code]
        value = unpacker.unpack_from(self.buffer, self.pos)
        self.pos += unpacker.size
        return value[0] if len(value) == 1 else value

    def _string(self) -> str:
        length = self._take("Q")
        start = self.pos
        self._skip(length)
        return str(self.buffer[start:self.pos], "utf-8")

    def _skip(self, n_bytes: int) -> None:
        if n_bytes > self.size - self.pos:
            raise struct.error("past the end")
        self.pos += n_bytes

    def _value_type(self, key: str) -> GGUFValueType:
        raw = self._take("I")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise ModelLoadError(f"{self.path}: corrupt GGUF file: metadata key {key!r} has unknown value type "
                                 f"{raw}") from None

    def _value(self, kind: GGUFValueType) -> tuple[object, tuple[GGUFValueType, ...]]:
        if kind == GGUFValueType.STRING:
            return self._string(), (kind,)
        if kind != GGUFValueType.ARRAY:
            return self._take(_SCALAR_CODES[kind]), (kind,)
        item_kind = self._value_type("an array's items")
        count = self._take("Q")
        if item_kind == GGUFValueType.STRING:
            return self._strings(count), (kind, item_kind)
        if item_kind == GGUFValueType.ARRAY:
            items = [self._value(item_kind) for _ in range(count)]
            values = [value.decode() if isinstance(value, _LazyStrings) else value for value, _ in items]
            return values, (kind, *(items[0][1] if items else (item_kind,)))
        dtype = np.dtype(self.order + _SCALAR_CODES[item_kind])
        start = self.pos
        self._skip(count * dtype.itemsize)
        return np.frombuffer(self.buffer, dtype, count, start), (kind, item_kind)

    def _strings(self, count: int) -> _LazyStrings:
        if count > (self.size - self.pos) // 8:  # each string takes at least its 8-byte length
            raise struct.error("past the end")
        unpack, buffer, pos = self._structs["Q"].unpack_from, self.buffer, self.pos
        starts = [0] * count
        for i in range(count):
            length = unpack(buffer, pos)[0]
            pos += 8
            starts[i] = pos
            pos += length
        if pos > self.size:
            raise struct.error("past the end")
        self.pos = pos
        return _LazyStrings(buffer, starts, pos)

    def _tensor_entry(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        n_dims = self._take("I")
        if n_dims > _MAX_DIMS:
            raise ModelLoadError(f"{self.path}: corrupt GGUF file: tensor {name!r} has {n_dims} dimensions")
        dims = [self._take("Q") for _ in range(n_dims)]
        ggml_type, offset = self._take("IQ")
        return name, tuple(reversed(dims)), ggml_type, offset

    def _alignment(self, values: dict, types: dict) -> int:
        if "general.alignment" not in values:
            return GGUF_DEFAULT_ALIGNMENT
        alignment = values["general.alignment"]
        if types["general.alignment"] != (GGUFValueType.UINT32,) or alignment <= 0 or alignment & (alignment - 1):
            raise ModelLoadError(f"{self.path}: general.alignment must be a power of two stored as uint32, got "
                                 f"{alignment!r} ({types['general.alignment'][0].name})")
        return alignment

    def _tensor_info(self, name: str, shape: tuple[int, ...], raw_type: int, offset: int) -> TensorInfo:
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ModelLoadError(f"{self.path}: tensor {name!r} has ggml type {raw_type}, which gguf "
                                 f"{_gguf_version()} does not know") from None
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        if shape and shape[-1] % block_size:
            raise ModelLoadError(f"{self.path}: tensor {name!r} has rows of {shape[-1]} values, not a whole number of "
                                 f"{ggml_type.name} blocks of {block_size}")
        n_bytes = prod(shape) // block_size * type_size
        if offset + n_bytes > self.size:
            raise ModelLoadError(f"{self.path}: truncated GGUF file: tensor {name!r} ends at byte "
                                 f"{offset + n_bytes:,}, past the end of the file ({self.size:,} bytes)")
        return TensorInfo(name, shape, ggml_type, offset, n_bytes)


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")

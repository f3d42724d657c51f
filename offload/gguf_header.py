"""Read a GGUF file's header — metadata and tensor infos — without touching tensor data.

Why not ``gguf.GGUFReader``: it turns every array element into numpy views, and a real
model's tokenizer holds ~250k strings (vocab + merges): 13 s on this machine for a
DeepSeek-V3 header, where ``offload plan`` must answer in about a second. This reader walks
the same format (GGUF v2/v3, little-endian) with ``struct`` over an mmap, decodes scalars and
short arrays, and keeps long arrays as ``LazyArray`` (offset + count) to decode on demand.
It is tested against ``GGUFReader`` on the same files. Types and sizes come from ``gguf``
(``GGUFValueType``, ``GGMLQuantizationType``, ``GGML_QUANT_SIZES``).

Every problem (missing file, bad magic, truncated header or data, unknown quant type, a row
that is not a whole number of quant blocks) raises ``OffloadError`` with one line naming the
file and the problem.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, Keys

from offload.errors import OffloadError

_SCALAR = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
EAGER_ARRAY_LIMIT = 4096   # arrays longer than this stay lazy (tokenizer vocab, merges, scores)


@dataclass(frozen=True)
class LazyArray:
    """A long metadata array, decoded only when asked (``values()``)."""

    path: str
    offset: int            # of the first element
    item_type: GGUFValueType
    count: int

    def __len__(self) -> int:
        return self.count

    def values(self) -> list[Any]:
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _Cursor(buf, self.offset, self.path).array_items(self.item_type, self.count)


@dataclass(frozen=True)
class TensorHeader:
    name: str
    ne: tuple[int, ...]                 # GGUF order: innermost (row length) first
    ggml_type: GGMLQuantizationType
    data_offset: int                    # absolute offset of the data in the file
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order, outermost first."""
        return tuple(reversed(self.ne))


@dataclass(frozen=True)
class GGUFHeader:
    path: str
    version: int
    metadata: dict[str, Any]           # scalars, strings, short lists, LazyArray
    tensors: tuple[TensorHeader, ...]
    data_start: int
    file_size: int


class _Cursor:
    def __init__(self, buf, offset: int, path: str):
        self.buf, self.pos, self.path = buf, offset, path

    def unpack(self, fmt: str):
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise OffloadError(f"{self.path}: truncated GGUF header (ends inside byte {self.pos})") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise OffloadError(f"{self.path}: truncated GGUF header (a string runs past the end of the file)")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise OffloadError(f"{self.path}: corrupt GGUF header (a string is not UTF-8)") from None

    def value_type(self) -> GGUFValueType:
        raw = self.unpack("<I")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise OffloadError(f"{self.path}: corrupt GGUF header (unknown value type {raw})") from None

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype in _SCALAR:
            return self.unpack(_SCALAR[vtype])
        if vtype is GGUFValueType.STRING:
            return self.string()
        item_type, count = self.value_type(), self.unpack("<Q")
        if item_type is GGUFValueType.ARRAY:
            raise OffloadError(f"{self.path}: nested metadata arrays are not supported")
        if count <= EAGER_ARRAY_LIMIT:
            return self.array_items(item_type, count)
        lazy = LazyArray(self.path, self.pos, item_type, count)
        self.skip_items(item_type, count)
        return lazy

    def array_items(self, item_type: GGUFValueType, count: int) -> list[Any]:
        if item_type in _SCALAR:
            fmt = _SCALAR[item_type]
            size = struct.calcsize(fmt)
            if self.pos + size * count > len(self.buf):
                raise OffloadError(f"{self.path}: truncated GGUF header (an array runs past the end of the file)")
            items = list(struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos))
            self.pos += size * count
            return items
        return [self.string() for _ in range(count)]

    def skip_items(self, item_type: GGUFValueType, count: int) -> None:
        if item_type in _SCALAR:
            self.pos += struct.calcsize(_SCALAR[item_type]) * count
            if self.pos > len(self.buf):
                raise OffloadError(f"{self.path}: truncated GGUF header (an array runs past the end of the file)")
            return
        unpack_len, buf, pos, end = struct.Struct("<Q").unpack_from, self.buf, self.pos, len(self.buf)
        try:
            for _ in range(count):          # strings: walk the lengths, decode nothing
                pos += 8 + unpack_len(buf, pos)[0]
        except struct.error:
            pos = end + 1
        if pos > end:
            raise OffloadError(f"{self.path}: truncated GGUF header (an array runs past the end of the file)")
        self.pos = pos


def _tensor_bytes(path: str, name: str, ne: tuple[int, ...], raw_type: int) -> tuple[GGMLQuantizationType, int]:
    try:
        qtype = GGMLQuantizationType(raw_type)
        block, size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise OffloadError(f"{path}: tensor {name} has unknown quant type id {raw_type}") from None
    if ne and ne[0] % block:
        raise OffloadError(f"{path}: tensor {name}: row of {ne[0]} values is not a whole number "
                           f"of {qtype.name} blocks ({block})")
    n = 1
    for d in ne:
        n *= d
    return qtype, n // block * size


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse one GGUF file's header. Tensor data is never read (only its extent is checked)."""
    path = os.fspath(path)
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise OffloadError(f"{path}: cannot open ({exc.strerror})") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise OffloadError(f"{path}: not a GGUF file (only {size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, path, size)


def _parse(buf, path: str, size: int) -> GGUFHeader:
    cur = _Cursor(buf, 0, path)
    if cur.unpack("<I") != GGUF_MAGIC:
        raise OffloadError(f"{path}: not a GGUF file (bad magic)")
    version = cur.unpack("<I")
    if version not in (2, 3):
        hint = " (big-endian files are not supported)" if version & 0xFFFF == 0 else ""
        raise OffloadError(f"{path}: unsupported GGUF version {version}{hint}")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        if key in metadata:
            raise OffloadError(f"{path}: corrupt GGUF header (metadata key {key} twice)")
        metadata[key] = cur.value(cur.value_type())
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("<I")
        if n_dims > 8:
            raise OffloadError(f"{path}: corrupt GGUF header (tensor {name} has {n_dims} dimensions)")
        ne = tuple(cur.unpack("<Q") for _ in range(n_dims))
        raw_type, offset = cur.unpack("<I"), cur.unpack("<Q")
        infos.append((name, ne, raw_type, offset))
    alignment = metadata.get(Keys.General.ALIGNMENT, GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise OffloadError(f"{path}: corrupt GGUF header (alignment {alignment!r})")
    data_start = -(-cur.pos // alignment) * alignment
    tensors, seen = [], set()
    for name, ne, raw_type, offset in infos:
        if name in seen:
            raise OffloadError(f"{path}: corrupt GGUF header (tensor {name} twice)")
        seen.add(name)
        qtype, n_bytes = _tensor_bytes(path, name, ne, raw_type)
        end = data_start + offset + n_bytes
        if end > size:
            raise OffloadError(f"{path}: truncated: tensor {name} ends at byte {end} "
                               f"but the file has {size} bytes")
        tensors.append(TensorHeader(name, ne, qtype, data_start + offset, n_bytes))
    return GGUFHeader(path, version, metadata, tuple(tensors), data_start, size)

"""Read a GGUF file's header — metadata and tensor infos — without touching tensor data.

Why not ``gguf.GGUFReader``: it turns every array element into numpy views, and a real
model's tokenizer holds ~250k strings (vocab + merges): 13 s on this machine for a
DeepSeek-V3 header, where ``offload plan`` must answer in about a second. This reader walks
the same format (GGUF v2/v3, little-endian) with ``struct`` over an mmap, decodes scalars and
short arrays, and keeps long arrays as ``LazyArray`` (offset + count) to decode on demand.
It is tested against ``GGUFReader`` on the same files. Types and sizes come from ``gguf``
(``GGUFValueType``, ``GGMLQuantizationType``, ``GGML_QUANT_SIZES``).

Every problem raises ``OffloadError`` with one line naming the file and the problem, and
the reader refuses what cannot be *before* it does work proportional to a claimed count, so
any input is answered in well under a second (``bench/fuzz.py`` runs 10,000+ mutants):

- missing file, bad magic, unsupported version, truncated header;
- a count (metadata keys, tensors, array items) whose minimal encoded size exceeds what is
  left of the file; a string array longer than ``MAX_STRING_ARRAY``, a string longer than
  ``MAX_STRING`` (reading them cannot be cheap, and no real model comes near);
- an empty, duplicate or unprintable metadata key or tensor name (found as it is read, not
  after), a tensor name of ``MAX_NAME`` bytes or more;
- a tensor with no dimensions or more than ``MAX_DIMS``, a dimension < 1, a type id outside
  ``GGMLQuantizationType``, a row that is not a whole number of quant blocks;
- a data offset that is not aligned, data outside the file, two tensors' data overlapping.
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
MAX_DIMS = 4               # ggml.h GGML_MAX_DIMS (gguf.c refuses more)
MAX_NAME = 64              # ggml.h GGML_MAX_NAME: a tensor name is shorter (gguf.c refuses longer)
MAX_STRING = 1 << 24        # bytes of one metadata string (chat templates are ~10-100 KB)
MAX_KEY = 1 << 16           # bytes of a metadata key
MAX_STRING_ARRAY = 1 << 21  # strings in one metadata array; the largest vocabularies are ~262k
# Smallest encodings (bytes): a string is its u64 length + bytes; a metadata pair is a
# non-empty key, a u32 type and at least a one-byte value; a tensor info is a non-empty name,
# u32 n_dims, one u64 dimension, u32 type and u64 offset.
MIN_KV_BYTES = 8 + 1 + 4 + 1
MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8


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

    def fits(self, count: int, min_bytes: int, what: str) -> None:
        """Refuse ``count`` items of at least ``min_bytes`` each that the rest of the file cannot hold."""
        left = len(self.buf) - self.pos
        if count * min_bytes > left:
            raise OffloadError(f"{self.path}: truncated or corrupt GGUF header ({count:,} {what} need at least "
                               f"{count * min_bytes:,} bytes; {left:,} are left in the file)")

    def string(self, limit: int = MAX_STRING, what: str = "a metadata string") -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise OffloadError(f"{self.path}: truncated GGUF header (a string runs past the end of the file)")
        if n > limit:      # refused before it is copied: a corrupt length can claim gigabytes
            raise OffloadError(f"{self.path}: corrupt GGUF header ({what} of {n:,} bytes; "
                               f"offload reads at most {limit:,})")
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
        self.fits(count, struct.calcsize(_SCALAR[item_type]) if item_type in _SCALAR else 8, "array items")
        if item_type is GGUFValueType.STRING and count > MAX_STRING_ARRAY:
            raise OffloadError(f"{self.path}: corrupt GGUF header (a metadata array of {count:,} strings; "
                               f"offload reads at most {MAX_STRING_ARRAY:,})")
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


def _quant_type(path: str, name: str, raw_type: int) -> GGMLQuantizationType:
    try:
        qtype = GGMLQuantizationType(raw_type)
        GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise OffloadError(f"{path}: tensor {name} has unknown quant type id {raw_type}") from None
    return qtype


def _tensor_bytes(path: str, name: str, ne: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    if ne[0] % block:
        raise OffloadError(f"{path}: tensor {name}: row of {ne[0]} values is not a whole number "
                           f"of {qtype.name} blocks ({block})")
    n = 1
    for d in ne:
        n *= d
    return n // block * size


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
    cur.fits(n_kv, MIN_KV_BYTES, "metadata keys")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string(MAX_KEY, "a metadata key")
        if not key.isprintable() or not key:
            raise OffloadError(f"{path}: corrupt GGUF header (metadata key {key[:80]!r})")
        if key in metadata:
            raise OffloadError(f"{path}: corrupt GGUF header (metadata key {key} twice)")
        metadata[key] = cur.value(cur.value_type())
    cur.fits(n_tensors, MIN_TENSOR_INFO_BYTES, "tensor infos")
    infos: dict[str, tuple] = {}
    for _ in range(n_tensors):
        name = cur.string(MAX_NAME - 1, f"the name of tensor {len(infos)}")
        if not name.isprintable() or not name:
            raise OffloadError(f"{path}: corrupt GGUF header (tensor {len(infos)} is named {name[:80]!r})")
        if name in infos:
            raise OffloadError(f"{path}: corrupt GGUF header (tensor {name} twice)")
        n_dims = cur.unpack("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise OffloadError(f"{path}: corrupt GGUF header (tensor {name} has {n_dims} dimensions; "
                               f"1 to {MAX_DIMS} are possible)")
        ne = tuple(cur.unpack("<Q") for _ in range(n_dims))
        if min(ne) < 1:
            raise OffloadError(f"{path}: corrupt GGUF header (tensor {name} has shape {list(ne)})")
        raw_type, offset = cur.unpack("<I"), cur.unpack("<Q")
        infos[name] = (ne, _quant_type(path, name, raw_type), offset)
    alignment = metadata.get(Keys.General.ALIGNMENT, GGUF_DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 \
            or alignment & (alignment - 1):
        raise OffloadError(f"{path}: corrupt GGUF header (alignment {alignment!r})")
    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, (ne, qtype, offset) in infos.items():
        if offset % alignment:
            raise OffloadError(f"{path}: corrupt GGUF header (tensor {name}'s data offset {offset} "
                               f"is not a multiple of the alignment {alignment})")
        n_bytes = _tensor_bytes(path, name, ne, qtype)
        end = data_start + offset + n_bytes
        if end > size:
            raise OffloadError(f"{path}: truncated: tensor {name} ends at byte {end} "
                               f"but the file has {size} bytes")
        tensors.append(TensorHeader(name, ne, qtype, data_start + offset, n_bytes))
    _check_overlap(path, tensors)
    return GGUFHeader(path, version, metadata, tuple(tensors), data_start, size)


def _check_overlap(path: str, tensors: list[TensorHeader]) -> None:
    """No two tensors' data share a byte (gguf.c requires them packed in order; we only
    need them disjoint)."""
    by_start = sorted(tensors, key=lambda t: t.data_offset)
    for a, b in zip(by_start, by_start[1:]):
        if a.data_offset + a.n_bytes > b.data_offset:
            raise OffloadError(f"{path}: corrupt GGUF header (the data of tensors {a.name} and {b.name} "
                               f"overlap at byte {b.data_offset})")

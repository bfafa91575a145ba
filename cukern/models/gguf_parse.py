"""The byte-level GGUF parser behind :func:`cukern.models.gguf_loader.load_gguf`: :class:`_Reader`
walks a file's header (memory-mapped, no copy) as strictly as llama.cpp, and :func:`read_key` reads
one metadata value with its type and range checked. Every error is a :class:`GGUFError`.
"""

from __future__ import annotations

import array
import math
import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT


class GGUFError(ValueError):
    """A GGUF file cukern cannot run: corrupt, truncated, unsupported, or missing something."""


VT = gguf.GGUFValueType
# scalar value types: struct format (little-endian) and the NumPy dtype of an array of them
_SCALAR = {VT.UINT8: ("<B", np.uint8), VT.INT8: ("<b", np.int8), VT.UINT16: ("<H", np.uint16),
           VT.INT16: ("<h", np.int16), VT.UINT32: ("<I", np.uint32), VT.INT32: ("<i", np.int32),
           VT.UINT64: ("<Q", np.uint64), VT.INT64: ("<q", np.int64), VT.FLOAT32: ("<f", np.float32),
           VT.FLOAT64: ("<d", np.float64), VT.BOOL: ("<?", np.bool_)}
_INT_TYPES = {VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.UINT64, VT.INT64}
_FLOAT_TYPES = {VT.FLOAT32, VT.FLOAT64}
_MAX_DIMS = 4               # GGML_MAX_DIMS
# The parse costs Python steps per key, per tensor and per string of a string array, so their number is
# bounded for the load to take about a second per 100 MB at most, plus a fraction of a second for a
# small file (a step costs about 0.25 us, a string can be 9 bytes): models have tens of keys, a few
# thousand tensors, and vocabulary and merges of a few hundred thousand strings in files of hundreds of MB.
_MAX_KEYS = 1 << 14
_MAX_TENSORS = 1 << 14
_MIN_STRINGS = 1 << 20      # strings in arrays, whatever the file's size ...
_BYTES_PER_STRING = 64      # ... or one per this many bytes of file in a larger file
_TYPED_DATA = {QT.F32: np.float32, QT.F16: np.float16, QT.F64: np.float64, QT.I8: np.int8, QT.I16: np.int16,
               QT.I32: np.int32, QT.I64: np.int64}


class _Field:
    """One metadata key/value as the file stores it. ``types``: ``[scalar type]``, ``[STRING]`` or
    ``[ARRAY, item type]`` (the layout of ``gguf.ReaderField.types``); :meth:`contents` decodes it.
    String arrays keep only the offset of each string until read, so that a vocabulary costs 8 bytes
    an entry whatever its strings hold."""

    __slots__ = ("name", "offset", "types", "_value", "_buf", "_starts")

    def __init__(self, name, offset, types, value=None, buf=None, starts=None):
        self.name, self.offset, self.types, self._value = name, offset, types, value
        self._buf, self._starts = buf, starts

    def __len__(self) -> int:
        """Item count of an array value, 1 for a scalar or string."""
        if self._starts is not None:
            return len(self._starts) - 1
        return len(self._value) if self.types[0] == VT.ARRAY else 1

    def contents(self):
        """The value: a Python scalar or str, or a list for an array (strings: invalid UTF-8 bytes
        become U+FFFD, so that one bad byte in a vocabulary entry costs that entry, not the file)."""
        if self._starts is not None:
            s, buf = self._starts, self._buf
            return [bytes(buf[a + 8:b]).decode("utf-8", "replace") for a, b in zip(s[:-1].tolist(), s[1:].tolist())]
        if isinstance(self._value, np.ndarray):
            return self._value.tolist()
        return self._value


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    tensor_type: QT
    shape: np.ndarray           # GGUF order: shape[0] is the contiguous dimension
    n_bytes: int
    data_offset: int            # absolute byte offset in the file
    data: np.ndarray


class _Cursor:
    """Reads the header front to back; every read checks that the bytes are in the file first, so a
    corrupt length or count is an error naming where it is, never a long loop or a huge allocation."""

    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos = buf, size, 0
        self.strings_left = max(_MIN_STRINGS, size // _BYTES_PER_STRING)   # budget of array strings

    def need(self, n: int, what: str) -> int:
        if n > self.size - self.pos:
            raise GGUFError(f"truncated: {what} at byte {self.pos} needs {n} bytes, the file has "
                            f"{self.size - self.pos} left of {self.size}")
        at, self.pos = self.pos, self.pos + n
        return at

    def scalar(self, vtype, what: str):
        fmt, _ = _SCALAR[vtype]
        at = self.need(struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self.buf, at)[0]

    def string(self, what: str) -> str:
        n = self.scalar(VT.UINT64, f"length of {what}")
        at = self.need(n, what)
        try:
            return bytes(self.buf[at:at + n]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{what} at byte {at} is not UTF-8 ({e.reason} at its byte {e.start})") from None

    def value_type(self, what: str):
        raw = self.scalar(VT.UINT32, f"type of {what}")
        try:
            return VT(raw)
        except ValueError:
            raise GGUFError(f"{what} has unknown value type {raw} (at byte {self.pos - 4})") from None

    def array(self, name: str, offset: int) -> _Field:
        itype = self.value_type(f"item type of array {name!r}")
        count = self.scalar(VT.UINT64, f"item count of array {name!r}")
        if itype == VT.ARRAY:
            raise GGUFError(f"metadata key {name!r} is an array of arrays (GGUF readers support one level)")
        least = 8 if itype == VT.STRING else np.dtype(_SCALAR[itype][1]).itemsize
        if count > (self.size - self.pos) // least:
            raise GGUFError(f"truncated or corrupt: array {name!r} at byte {self.pos} claims {count} items of "
                            f"{itype.name} (at least {count * least} bytes), the file has {self.size - self.pos} "
                            f"left of {self.size}")
        if itype != VT.STRING:
            dtype = np.dtype(_SCALAR[itype][1]).newbyteorder("<")
            at = self.need(count * dtype.itemsize, f"array {name!r}")
            values = np.frombuffer(self.buf, dtype, count, at)
            return _Field(name, offset, [VT.ARRAY, itype], values)
        if count > self.strings_left:
            limit = max(_MIN_STRINGS, self.size // _BYTES_PER_STRING)
            raise GGUFError(f"array {name!r} at byte {self.pos} claims {count} strings, past the "
                            f"{limit} that string arrays may hold together in a file of {self.size} bytes "
                            f"(one per {_BYTES_PER_STRING} bytes, at least {_MIN_STRINGS})")
        self.strings_left -= count
        starts = array.array("q")
        p, size, unpack = self.pos, self.size, _U64.unpack_from
        try:
            for _ in range(count):
                starts.append(p)
                p += 8 + unpack(self.buf, p)[0]
                if p > size:
                    break
        except struct.error:
            p = size + 1
        if p > size:
            raise GGUFError(f"truncated: string {len(starts) - 1} of array {name!r} at byte {starts[-1]} runs past "
                            f"the end of the file ({size} bytes)")
        starts.append(p)
        self.pos = p
        return _Field(name, offset, [VT.ARRAY, VT.STRING], buf=self.buf, starts=np.frombuffer(starts, np.int64))


_U64 = struct.Struct("<Q")


class _Reader:
    """A GGUF file (version 2 or 3, little-endian) parsed and checked as strictly as llama.cpp's
    ``gguf_init_from_file``: every count and length bounded by the bytes left before anything is
    read or allocated, no duplicate keys or tensor names, at most 4 dimensions of positive sizes, a
    known type whose block divides each row, and every tensor's data exactly where the one before it
    ends (rounded up to ``general.alignment``), the last one ending the file. So offsets are aligned,
    inside the data section and disjoint, and a changed type or shape word shows up as a tensor out
    of place instead of reinterpreted bytes.

    ``fields``: key -> :class:`_Field`; ``tensors``: :class:`_TensorInfo` in file order, ``data``
    a view of the memory map (F32/F16 typed, block types uint8 ``[..., bytes per row]``). The parse
    walks the header once, a string array costing one Python step per string; the number of keys,
    tensors and array strings is bounded (``_MAX_KEYS``, ``_MAX_TENSORS``, ``_BYTES_PER_STRING``) so
    that no file takes more than about a second per 100 MB. Numeric arrays are views of the map."""

    def __init__(self, path):
        self.path = os.fspath(path)
        size = os.path.getsize(self.path)
        if size == 0:
            raise GGUFError("truncated: the file is empty")
        with open(self.path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(buf, np.uint8)
        cur = _Cursor(buf, size)
        magic = bytes(buf[cur.need(4, "magic"):4])
        if magic != b"GGUF":
            raise GGUFError(f"not a GGUF file (starts with {magic!r}, not b'GGUF')")
        version = cur.scalar(VT.UINT32, "version")
        if version & 0xFFFF == 0 and version:
            raise GGUFError(f"big-endian GGUF (version word {version:#x}) is not supported")
        if version not in (2, 3):
            raise GGUFError(f"GGUF version {version} is not supported (2 and 3 are)")
        n_tensors = cur.scalar(VT.UINT64, "tensor count")
        n_kv = cur.scalar(VT.UINT64, "metadata key count")
        # the smallest key/value is 13 bytes (empty key, type, one byte), the smallest tensor info 24
        if n_kv * 13 + n_tensors * 24 > size - cur.pos:
            raise GGUFError(f"truncated or corrupt header: {n_kv} metadata keys and {n_tensors} tensors cannot "
                            f"fit in the {size - cur.pos} bytes after byte {cur.pos}")
        if n_kv > _MAX_KEYS or n_tensors > _MAX_TENSORS:
            raise GGUFError(f"the header claims {n_kv} metadata keys and {n_tensors} tensors; this loader reads "
                            f"at most {_MAX_KEYS} keys and {_MAX_TENSORS} tensors")
        self.fields: dict[str, _Field] = {}
        for i in range(n_kv):
            offset = cur.pos
            key = cur.string(f"metadata key {i}")
            if key in self.fields:
                raise GGUFError(f"duplicate metadata key {key!r} at byte {offset}")
            vtype = cur.value_type(f"metadata key {key!r}")
            if vtype == VT.ARRAY:
                self.fields[key] = cur.array(key, offset)
            elif vtype == VT.STRING:
                self.fields[key] = _Field(key, offset, [vtype], cur.string(f"value of {key!r}"))
            else:
                self.fields[key] = _Field(key, offset, [vtype], cur.scalar(vtype, f"value of {key!r}"))
        self.tensor_info_offset = cur.pos
        infos = []
        for i in range(n_tensors):
            name = cur.string(f"name of tensor {i}")
            n_dims = cur.scalar(VT.UINT32, f"dimension count of tensor {name!r}")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise GGUFError(f"tensor {name!r} has {n_dims} dimensions (1 to {_MAX_DIMS} are valid)")
            dims = [cur.scalar(VT.UINT64, f"dimensions of tensor {name!r}") for _ in range(n_dims)]
            raw = cur.scalar(VT.UINT32, f"type of tensor {name!r}")
            offset = cur.scalar(VT.UINT64, f"data offset of tensor {name!r}")
            infos.append((name, dims, raw, offset))
        align = self.fields.get("general.alignment")
        self.alignment = gguf.GGUF_DEFAULT_ALIGNMENT
        if align is not None:
            self.alignment = align.contents()
            if align.types != [VT.UINT32] or self.alignment == 0 or self.alignment & (self.alignment - 1):
                raise GGUFError(f"general.alignment must be a UINT32 power of two, got "
                                f"{align.types[0].name} {self.alignment!r}")
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        self.tensors = self._tensors(infos, size)

    def _tensors(self, infos, size: int) -> list[_TensorInfo]:
        tensors, names, expected = [], set(), 0
        for name, dims, raw, offset in infos:
            if name in names:
                raise GGUFError(f"duplicate tensor name {name!r}")
            names.add(name)
            try:
                qtype = QT(raw)
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise GGUFError(f"tensor {name!r} has unknown GGML type {raw}") from None
            if any(d <= 0 for d in dims):
                raise GGUFError(f"tensor {name!r} has shape {dims}: every dimension must be positive")
            if dims[0] % block:
                raise GGUFError(f"tensor {name!r}: a row of {dims[0]} elements is not a whole number of "
                                f"{qtype.name} blocks of {block}")
            n_bytes = math.prod(dims) // block * type_size
            if offset != expected:
                raise GGUFError(f"tensor {name!r} has data offset {offset}, expected {expected} (where the tensor "
                                f"before it ends, aligned to {self.alignment}): the offset or an earlier "
                                f"tensor's type or shape is corrupt")
            start = self.data_offset + offset
            if n_bytes > size - start:
                raise GGUFError(f"tensor {name!r} ({qtype.name} {dims}, {n_bytes} bytes) ends at byte "
                                f"{start + n_bytes}, past the end of the file ({size} bytes): the file is truncated")
            expected = -(-(offset + n_bytes) // self.alignment) * self.alignment
            shape = tuple(reversed(dims))
            if qtype in _TYPED_DATA:
                data = np.frombuffer(self.data, _TYPED_DATA[qtype], math.prod(dims), start).reshape(shape)
            else:
                data = self.data[start:start + n_bytes].reshape(gguf.quants.quant_shape_to_byte_shape(shape, qtype))
            tensors.append(_TensorInfo(name, qtype, np.array(dims, np.uint64), n_bytes, start, data))
        if tensors:
            end = tensors[-1].data_offset + tensors[-1].n_bytes
            if size > self.data_offset + expected:
                raise GGUFError(f"{size - end} bytes after the last tensor's data (which ends at byte {end}): "
                                f"a tensor's type or shape is corrupt")
        return tensors


_REQUIRED = object()
_INT32_MAX = 2**31 - 1
_KINDS = {"int": _INT_TYPES, "float": _INT_TYPES | _FLOAT_TYPES, "str": {VT.STRING}, "bool": {VT.BOOL}}


def read_key(reader, key: str, kind: str, path: str, default=_REQUIRED, *, lo=None, hi=None, above=None,
             note: str = ""):
    """The value of metadata key ``key``, checked: ``kind`` is ``"int"`` (an integer type: a float is
    not truncated), ``"float"`` (an integer or float type; finite), ``"str"`` or ``"bool"``, or
    ``"array of <kind>"``; numbers lie in ``[lo, hi]`` and above ``above`` where given. ``default``
    when the key is absent (without one, a missing key is an error). Works on this module's reader
    and on ``gguf.GGUFReader``; every error is a :class:`GGUFError` naming the file, key and value."""
    f = reader.fields.get(key)
    if f is None:
        if default is _REQUIRED:
            raise GGUFError(f"{path}: missing metadata key {key!r}")
        return default
    is_array = kind.startswith("array of ")
    item = kind.removeprefix("array of ")
    stored = f.types[-1] if f.types else None
    if (f.types[0] == VT.ARRAY) != is_array or (stored not in _KINDS[item] and not (is_array and len(f.types) == 1)):
        what = f"array of {stored.name}" if f.types[0] == VT.ARRAY else stored.name
        raise GGUFError(f"{path}: metadata key {key!r} must be {'an ' if kind[0] in 'ai' else 'a '}{kind}, "
                        f"the file stores {what}")
    value = f.contents()
    if item in ("int", "float"):
        values = np.asarray(value, np.float64 if item == "float" else object)
        bad = [v for v in np.atleast_1d(values).tolist()
               if (item == "float" and not math.isfinite(v)) or (lo is not None and v < lo)
               or (hi is not None and v > hi) or (above is not None and not v > above)]
        if bad:
            rule = " and ".join(r for r in ("finite" if item == "float" else "",
                                            f"in [{lo}, {hi}]" if lo is not None and hi is not None else
                                            f">= {lo}" if lo is not None else f"<= {hi}" if hi is not None else "",
                                            f"> {above}" if above is not None else "") if r)
            shown = value if not is_array else f"{len(value)} items including {bad[0]!r}"
            raise GGUFError(f"{path}: metadata key {key!r} must be {rule}, got {shown!r}{note}")
    return float(value) if kind == "float" else value

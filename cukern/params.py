"""Kernel parameter structs: one source of truth, the C header.

Every cukern kernel takes device pointers first and one parameter struct by
value last (the CUDA counterpart of a Vulkan push-constant block). Each
family declares its structs in ``cuda_src/<family>/params.cuh``; this module
parses those declarations into NumPy structured dtypes (``align=True``
mirrors the C layout rules), so Python never restates a layout by hand.

Three checks keep the two sides honest:

* :func:`layout_probe_source` generates ``static_assert``\\ s of every
  ``sizeof``/``alignof``/``offsetof`` against the NumPy layout, compiled by
  NVRTC on the CPU (``tests/test_params.py``);
* ``python -m cukern check`` compares each kernel's last ``.param`` size and
  alignment in the PTX with its struct's dtype;
* on the GPU, an echo kernel receives a packed struct by value and writes its
  layout and every field back (``tests/test_params.py::test_echo``).

The header grammar is deliberately small: ``struct Name {`` then one field per
line, ``type name;`` or ``type name[N];`` with an optional ``//`` comment, then
``};``. Field types are the fixed-width integers, ``float`` and ``double``.
Anything else is rejected with the file and line.
"""

from __future__ import annotations

import math
import re
import struct as _struct
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from cukern.runtime import source_root

__all__ = ["Field", "ParamStruct", "parse_header", "load_header", "all_headers", "layout_probe_source",
           "check_int", "check_real"]


def check_int(name: str, value, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as a Python ``int``: any integer type, NumPy's included, but not ``bool``; inside
    ``[lo, hi]`` where given. Otherwise TypeError (wrong type) or ValueError (out of range) naming
    ``name``. Callers compute with the returned ``int``, so no NumPy fixed-width sum overflows."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rule = (f"in [{lo}, {hi}]" if lo is not None and hi is not None
                else f">= {lo}" if lo is not None else f"<= {hi}")
        raise ValueError(f"{name} must be {rule}, got {value}")
    return value


def check_real(name: str, value) -> float:
    """``value`` as a finite Python ``float``: any int or float type, NumPy's included, but not
    ``bool``. Otherwise TypeError (wrong type) or ValueError (NaN, infinite, or an int too large
    for a double) naming ``name``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    try:
        value = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be finite, got {value}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value

C_TYPES: dict[str, np.dtype] = {
    "int8_t": np.dtype(np.int8),
    "uint8_t": np.dtype(np.uint8),
    "int16_t": np.dtype(np.int16),
    "uint16_t": np.dtype(np.uint16),
    "int32_t": np.dtype(np.int32),
    "uint32_t": np.dtype(np.uint32),
    "int64_t": np.dtype(np.int64),
    "uint64_t": np.dtype(np.uint64),
    "float": np.dtype(np.float32),
    "double": np.dtype(np.float64),
}

# (min, max) of each integer type; (None, largest finite) for floating types
_BOUNDS = {name: ((int(np.iinfo(dt).min), int(np.iinfo(dt).max)) if dt.kind in "iu"
                  else (None, float(np.finfo(dt).max))) for name, dt in C_TYPES.items()}
_STRUCT_CODES = {"int8_t": "b", "uint8_t": "B", "int16_t": "h", "uint16_t": "H", "int32_t": "i",
                 "uint32_t": "I", "int64_t": "q", "uint64_t": "Q", "float": "f", "double": "d"}


def _struct_packer(dtype: np.dtype, fields) -> _struct.Struct:
    """A struct.Struct that writes the fields at the dtype's offsets, padding explicit."""
    fmt, pos = "<", 0
    for f in fields:
        offset = dtype.fields[f.name][1]
        fmt += "x" * (offset - pos) + _STRUCT_CODES[f.ctype] * f.count
        pos = offset + dtype.fields[f.name][0].itemsize
    fmt += "x" * (dtype.itemsize - pos)
    packer = _struct.Struct(fmt)
    assert packer.size == dtype.itemsize
    return packer


_STRUCT_OPEN = re.compile(r"^struct\s+([A-Za-z_]\w*)\s*\{\s*$")
_FIELD = re.compile(r"^([A-Za-z_]\w*)\s+([A-Za-z_]\w*)\s*(?:\[\s*(\d+)\s*\])?\s*;\s*(?://\s*(.*))?$")
_STRUCT_CLOSE = re.compile(r"^\}\s*;\s*$")


@dataclass(frozen=True)
class Field:
    name: str
    ctype: str  # C type name, a key of C_TYPES
    count: int  # 1 for a scalar, N for ``type name[N]``
    doc: str  # the trailing // comment: meaning, units, range

    @property
    def dtype(self) -> np.dtype:
        base = C_TYPES[self.ctype]
        return base if self.count == 1 else np.dtype((base, (self.count,)))


class ParamStruct:
    """A parameter struct parsed from a header: its dtype, and a validating packer."""

    def __init__(self, name: str, fields: tuple[Field, ...], header: str):
        self.name = name
        self.fields = fields
        self.header = header  # path relative to cuda_src/
        self.dtype = np.dtype([(f.name, f.dtype) for f in fields], align=True)
        self._by_name = {f.name: f for f in fields}
        self._names = self._by_name.keys()
        self._packer = _struct_packer(self.dtype, fields)

    def __repr__(self) -> str:
        return f"ParamStruct({self.name}, {self.dtype.itemsize} bytes, from {self.header})"

    def pack(self, **values) -> np.void:
        """Build the by-value kernel argument. Every field must be given, with a
        value of the right kind that fits the C type; otherwise TypeError or
        ValueError naming the struct and field. Cheap enough for a hot path
        (a few microseconds): checks in Python, then one ``struct.pack``."""
        if values.keys() != self._names:
            missing = [f.name for f in self.fields if f.name not in values]
            extra = [k for k in values if k not in self._by_name]
            parts = []
            if missing:
                parts.append(f"missing field(s) {', '.join(missing)}")
            if extra:
                parts.append(f"unknown field(s) {', '.join(extra)}")
            raise TypeError(f"{self.name}: {'; '.join(parts)}")
        flat = []
        for f in self.fields:
            v = values[f.name]
            if f.count == 1:
                flat.append(self._scalar(f, f.name, v))
            else:
                flat.extend(self._array(f, v))
        return np.frombuffer(self._packer.pack(*flat), dtype=self.dtype)[0]

    def _array(self, f: Field, value) -> list:
        seq = np.asarray(value) if not isinstance(value, (str, bytes)) else None
        if seq is None or seq.shape != (f.count,):
            raise ValueError(f"{self.name}.{f.name} ({f.ctype}[{f.count}]): expected {f.count} values, "
                             f"got {value!r}")
        return [self._scalar(f, f"{f.name}[{i}]", v) for i, v in enumerate(seq.tolist())]

    def _scalar(self, f: Field, label: str, value):
        lo, hi = _BOUNDS[f.ctype]
        if lo is not None:  # integer field
            if type(value) is not int:
                if isinstance(value, (bool, np.bool_)):
                    value = int(value)
                elif isinstance(value, (int, np.integer)):
                    value = int(value)
                else:
                    raise TypeError(f"{self.name}.{label} ({f.ctype}): expected an integer, "
                                    f"got {type(value).__name__} {value!r}")
            if not lo <= value <= hi:
                raise ValueError(f"{self.name}.{label} ({f.ctype}): {value} is outside [{lo}, {hi}]")
            return value
        if type(value) is not float:
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise TypeError(f"{self.name}.{label} ({f.ctype}): expected a real number, "
                                f"got {type(value).__name__} {value!r}")
            try:
                value = float(value)
            except OverflowError:   # an int past the largest double
                raise ValueError(f"{self.name}.{label} ({f.ctype}): {value} overflows {f.ctype}") from None
        if value != value:
            raise ValueError(f"{self.name}.{label} ({f.ctype}): NaN is not a valid parameter")
        if abs(value) > hi and abs(value) != math.inf:
            raise ValueError(f"{self.name}.{label} ({f.ctype}): {value} overflows {f.ctype}")
        return value

    def unpack(self, raw: bytes | np.ndarray) -> dict:
        """Decode bytes laid out as this struct into a dict of field values."""
        arr = np.frombuffer(bytes(raw), dtype=self.dtype, count=1)[0]
        return {f.name: arr[f.name] for f in self.fields}


def parse_header(text: str, header: str = "<string>") -> dict[str, ParamStruct]:
    """Parse every ``struct`` in a params header. ``header`` names it in errors."""
    structs: dict[str, ParamStruct] = {}
    current: str | None = None
    fields: list[Field] = []
    opened_at = 0
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if current is None:
            m = _STRUCT_OPEN.match(line)
            if m:
                current, fields, opened_at = m.group(1), [], lineno
                if current in structs:
                    raise ValueError(f"{header}:{lineno}: struct {current} is declared twice")
            elif line.startswith("struct"):
                raise ValueError(f"{header}:{lineno}: write 'struct Name {{' on one line: {raw!r}")
            continue
        if not line or line.startswith("//"):
            continue
        if _STRUCT_CLOSE.match(line):
            if not fields:
                raise ValueError(f"{header}:{opened_at}: struct {current} has no fields")
            structs[current] = ParamStruct(current, tuple(fields), header)
            current = None
            continue
        m = _FIELD.match(line)
        if not m:
            raise ValueError(f"{header}:{lineno}: cannot parse field of struct {current}: {raw!r}")
        ctype, name, count, doc = m.group(1), m.group(2), m.group(3), (m.group(4) or "").strip()
        if ctype not in C_TYPES:
            raise ValueError(f"{header}:{lineno}: {current}.{name} has unsupported type {ctype!r} "
                             f"(use one of {', '.join(C_TYPES)})")
        if count is not None and int(count) < 1:
            raise ValueError(f"{header}:{lineno}: {current}.{name} has an empty array")
        if any(f.name == name for f in fields):
            raise ValueError(f"{header}:{lineno}: {current}.{name} is declared twice")
        fields.append(Field(name, ctype, int(count) if count else 1, doc))
    if current is not None:
        raise ValueError(f"{header}:{opened_at}: struct {current} is never closed")
    return structs


@lru_cache(maxsize=None)
def load_header(rel_path: str) -> dict[str, ParamStruct]:
    """Parse ``cuda_src/<rel_path>`` (e.g. ``elementwise/params.cuh``)."""
    path = source_root() / rel_path
    if not path.is_file():
        raise FileNotFoundError(f"params header {rel_path} not found under {source_root()}")
    return parse_header(path.read_text(), rel_path)


def all_headers() -> list[str]:
    """Every family's params header, relative to cuda_src/."""
    root = source_root()
    return sorted(str(p.relative_to(root)) for p in root.glob("*/params.cuh"))


def layout_probe_source(rel_path: str, structs: dict[str, ParamStruct] | None = None) -> str:
    """A compilation unit that includes ``rel_path``, static_asserts each struct's
    C layout against its NumPy dtype and defines one echo kernel per struct
    (``echo_<Name>``). ``structs`` defaults to the header's own parse; tests pass
    altered ones to prove that a drift fails to compile."""
    lines = ['#include "common/echo.cuh"', f'#include "{rel_path}"', ""]
    for s in (structs if structs is not None else load_header(rel_path)).values():
        lines.append(f"CUKERN_ASSERT_SIZE({s.name}, {s.dtype.itemsize}, {s.dtype.alignment})")
        for f in s.fields:
            lines.append(f"CUKERN_ASSERT_FIELD({s.name}, {f.name}, {s.dtype.fields[f.name][1]}, "
                         f"{f.dtype.itemsize})")
        lines.append(f"CUKERN_ECHO_BEGIN({s.name})")
        lines.extend(f"    CUKERN_ECHO_FIELD({f.name})" for f in s.fields)
        lines.append("CUKERN_ECHO_END")
        lines.append("")
    return "\n".join(lines)

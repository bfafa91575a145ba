"""Parameter structs: parsing, packing, and the proof that C and Python agree."""

from __future__ import annotations

import numpy as np
import pytest

from cukern import params, runtime

HEADER = """\
#pragma once
// a comment line
struct Demo {
    uint32_t n;          // count
    float eps;           // epsilon
    int64_t offset;      // bytes
    int32_t sections[3]; // per-section sizes
    uint8_t flag;        // 0 or 1
};
"""


def test_parse_layout_matches_c_rules():
    s = params.parse_header(HEADER, "demo.cuh")["Demo"]
    assert [f.name for f in s.fields] == ["n", "eps", "offset", "sections", "flag"]
    assert s.fields[0].doc == "count"
    # C: n@0 eps@4 offset@8 sections@16 flag@28, size 32 (8-byte aligned)
    assert [s.dtype.fields[n][1] for n in ("n", "eps", "offset", "sections", "flag")] == [0, 4, 8, 16, 28]
    assert s.dtype.itemsize == 32 and s.dtype.alignment == 8


@pytest.mark.parametrize("text,match", [
    ("struct A {\n    bool x;\n};\n", "unsupported type 'bool'"),
    ("struct A {\n    int32_t x\n};\n", "cannot parse field"),
    ("struct A {\n    int32_t x;\n", "never closed"),
    ("struct A {\n};\n", "has no fields"),
    ("struct A {\n    int32_t x;\n    float x;\n};\n", "declared twice"),
    ("struct A { int32_t x; };\n", "on one line"),
])
def test_parse_errors_name_file_and_line(text, match):
    with pytest.raises(ValueError, match=match) as info:
        params.parse_header(text, "demo.cuh")
    assert "demo.cuh:" in str(info.value)


def test_pack_round_trip():
    s = params.parse_header(HEADER)["Demo"]
    v = s.pack(n=7, eps=1e-6, offset=-(2**40), sections=[1, 2, 3], flag=True)
    assert v.dtype == s.dtype
    back = s.unpack(v.tobytes())
    assert back["n"] == 7 and back["offset"] == -(2**40) and list(back["sections"]) == [1, 2, 3]
    assert np.float32(back["eps"]) == np.float32(1e-6) and back["flag"] == 1


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(n=1, eps=0.0, offset=0, sections=[1, 2, 3]), TypeError, "missing field"),
    (dict(n=1, eps=0.0, offset=0, sections=[1, 2, 3], flag=0, bogus=1), TypeError, "unknown field"),
    (dict(n=-1, eps=0.0, offset=0, sections=[1, 2, 3], flag=0), ValueError, r"Demo.n \(uint32_t\).*outside"),
    (dict(n=2**32, eps=0.0, offset=0, sections=[1, 2, 3], flag=0), ValueError, "outside"),
    (dict(n=1.5, eps=0.0, offset=0, sections=[1, 2, 3], flag=0), TypeError, "expected an integer"),
    (dict(n=1, eps="x", offset=0, sections=[1, 2, 3], flag=0), TypeError, "expected a real number"),
    (dict(n=1, eps=float("nan"), offset=0, sections=[1, 2, 3], flag=0), ValueError, "NaN"),
    (dict(n=1, eps=1e39, offset=0, sections=[1, 2, 3], flag=0), ValueError, "overflows float"),
    (dict(n=1, eps=0.0, offset=0, sections=[1, 2], flag=0), ValueError, "expected 3 values"),
    (dict(n=1, eps=0.0, offset=0, sections=[1, 2, 2**31], flag=0), ValueError, r"sections\[2\]"),
])
def test_pack_rejects(kwargs, exc, match):
    s = params.parse_header(HEADER)["Demo"]
    with pytest.raises(exc, match=match):
        s.pack(**kwargs)


def test_every_header_parses():
    headers = params.all_headers()
    assert headers, "no params headers found"
    for h in headers:
        assert params.load_header(h), h


@pytest.mark.parametrize("header", params.all_headers())
def test_layout_probe_compiles_on_cpu(header):
    """static_asserts of sizeof/alignof/offsetof against the NumPy dtypes, via NVRTC."""
    runtime.compile_ptx(f"probe:{header}", params.layout_probe_source(header), (), 90)


def test_layout_probe_catches_drift():
    """A Python-side layout that differs from the C one must fail to compile."""
    header = params.all_headers()[0]
    structs = dict(params.load_header(header))
    name, s = next(iter(structs.items()))
    f0 = s.fields[0]
    wider = {"uint32_t": "uint64_t", "int32_t": "int64_t", "float": "double"}.get(f0.ctype, "uint64_t")
    drifted = params.ParamStruct(name, (params.Field(f0.name, wider, f0.count, ""),) + s.fields[1:], header)
    structs[name] = drifted
    with pytest.raises(runtime.CompileError, match="differs from the Python dtype"):
        runtime.compile_ptx("probe:drift", params.layout_probe_source(header, structs), (), 90)


def _random_fields(s: params.ParamStruct, rng) -> dict:
    values = {}
    for f in s.fields:
        dt = params.C_TYPES[f.ctype]
        if dt.kind in "iu":
            info = np.iinfo(dt)
            draw = rng.integers(info.min, info.max, size=f.count, endpoint=True, dtype=dt).tolist()
        else:
            draw = (rng.standard_normal(f.count) * 1e3).tolist()
        values[f.name] = draw[0] if f.count == 1 else draw
    return values


@pytest.mark.gpu
@pytest.mark.parametrize("header", params.all_headers())
def test_echo(header, rng):
    """Each struct, packed in Python and passed by value, comes back field by field with the
    layout (sizeof, alignof, offsets) that NumPy computed."""
    import cupy
    arch = runtime.device_arch()
    structs = params.load_header(header)
    mod = runtime.load_module(f"probe:{header}", params.layout_probe_source(header),
                              tuple(f"echo_{n}" for n in structs), arch)
    for name, s in structs.items():
        for _ in range(3):
            packed = s.pack(**_random_fields(s, rng))
            out = cupy.zeros(s.dtype.itemsize, dtype=cupy.uint8)
            layout = cupy.full(2 + len(s.fields), -1, dtype=cupy.int64)
            mod.get_function(f"echo_{name}")((1,), (1,), (out, layout, packed))
            got_layout = layout.get().tolist()
            want_layout = [s.dtype.itemsize, s.dtype.alignment] + [s.dtype.fields[f.name][1] for f in s.fields]
            assert got_layout == want_layout, name
            assert out.get().tobytes() == packed.tobytes(), name

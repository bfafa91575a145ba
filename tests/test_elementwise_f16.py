"""f16 and bf16 activations on the elementwise kernels templated on the activation type: row norms, group
norms, binary ops / gated activations, RoPE (cukern/elementwise; the f32 paths are tests/test_elementwise*.py).

Inputs are drawn in f32 and rounded to the dtype (bf16 as uint16 bits, round to nearest even); the float64
references take the rounded values, so what is left is the kernel's f32 arithmetic and the one rounding of
its output: f16 1e-3 abs + 2e-3 rel, bf16 1e-2 abs + 1.6e-2 rel (cukern.testing.TOLERANCES; half an ulp
is 4.9e-4 and 3.9e-3 relative). Shapes cover the register paths (whole 16-byte units of 8 elements,
16-byte aligned), the scalar fallbacks (odd lengths, a row length not a multiple of 8, a 2-byte offset),
length 1 and the widest register row (65536 elements); every output is NaN-poisoned first.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern.elementwise import ElementwiseDispatch  # noqa: E402
from cukern.reference import elementwise as ref  # noqa: E402
from cukern.reference.attention import as_float64, to_storage  # noqa: E402
from cukern.testing import assert_close, poison  # noqa: E402

gpu = pytest.mark.gpu
KINDS = ["float16", "bfloat16"]
_STORAGE = {"float16": np.float16, "bfloat16": np.uint16}
_CTYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16"}


@pytest.fixture(scope="module")
def d():
    return ElementwiseDispatch()


def _act(rng, kind, *shape, scale=1.0, offset=False):
    """(device array of kind, its float64 values): standard normal * scale rounded to kind; ``offset``: the
    array starts 2 bytes past a 16-byte boundary (the scalar paths)."""
    host = to_storage((rng.standard_normal(shape) * scale).astype(np.float32), kind)
    if not offset:
        return cupy.asarray(host), as_float64(host, kind)
    buf = cupy.empty(host.size + 1, host.dtype)
    dev = buf[1:].reshape(shape)
    dev[...] = cupy.asarray(host)
    return dev, as_float64(host, kind)


def _out(kind, *shape):
    return poison(cupy.empty(shape, _STORAGE[kind]))


def _check(out, want, kind, name):
    assert_close(as_float64(out, kind), want, dtype=kind, name=f"{name} {kind}")


def _w(rng, n):
    w = rng.standard_normal(n).astype(np.float32)
    return cupy.asarray(w), w


# --------------------------------------------------------------------------------------- CPU tests

@pytest.mark.parametrize("kind", KINDS)
def test_half_calls_launch_their_types_kernels(d, host_if_no_gpu, kind):
    """The dtype picks the instance (its unit holds it, else the launcher raises) and the 16-byte unit of 8
    elements sets the vector path and the block: 4096 columns are 512 units (rms_norm_reg<512, 1, T> for a
    few rows; f32 takes 1024 float4s)."""
    if host_if_no_gpu is None:
        pytest.skip("records launches on the host (no GPU)")
    t, s = _CTYPE[kind], _STORAGE[kind]
    w = cupy.ones(4096, cupy.float32)
    x, out = cupy.ones((2, 4096), s), cupy.empty((2, 4096), s)
    d.rms_norm(x, w, out)
    d.rms_norm(cupy.ones((2, 4092), s), w[:4092], cupy.empty((2, 4092), s))  # 4092 % 8 != 0: the loop
    d.residual_rms_norm(x, cupy.ones((2, 4096), s), w, out)
    d.add(x, x, out)
    d.swiglu(x, None, cupy.empty((2, 2048), s))
    d.head_rms_norm(cupy.ones((3, 4, 128), s), cupy.ones(128, cupy.float32), cupy.empty((3, 4, 128), s))
    d.rope(cupy.ones((3, 4, 128), s), cupy.zeros(1, cupy.int32), cupy.empty((3, 4, 128), s))
    d.rope(cupy.ones((3, 4, 96), s), cupy.zeros(1, cupy.int32), cupy.empty((3, 4, 96), s))
    assert set(host_if_no_gpu) == {f"rms_norm_reg<512, 1, {t}>", f"rms_norm_loop<256, {t}>",
                                   f"residual_rms_norm_reg<512, 1, {t}>", f"binary_rows<0, true, {t}>",
                                   f"binary_rows<3, true, {t}>", f"group_norm_reg<false, 1, {t}>",
                                   f"rope_vec<false, 16, {t}>", f"rope<false, 2, 4, {t}>"}


def test_half_units_hold_only_their_type():
    from cukern.elementwise import FAMILIES
    for unit, t in (("elementwise_f16", "__half"), ("elementwise_bf16", "__nv_bfloat16")):
        names = [k.name for k in FAMILIES[unit].kernels]
        assert names and all(n.endswith(f", {t}>") for n in names), unit
    templated = {k.name.split("<")[0] for k in FAMILIES["elementwise_f16"].kernels}  # their f32 instances stay
    f32 = [k.name for u in ("elementwise", "elementwise_rope") for k in FAMILIES[u].kernels]
    assert not any(n.split("<")[0] in templated and n.endswith(("__half>", "bfloat16>")) for n in f32)


def test_half_bad_arguments_raise_before_launch(d, host_if_no_gpu):
    h = cupy.ones((4, 8), cupy.float16)
    b = cupy.ones((4, 8), cupy.uint16)
    w = cupy.ones(8, cupy.float32)
    x3 = cupy.ones((2, 4, 8), cupy.float16)
    pos = cupy.zeros(1, cupy.int32)
    cases = [
        (lambda: d.rms_norm(h, w, cupy.empty((4, 8), cupy.float32)), TypeError, "out must have dtype float16"),
        (lambda: d.rms_norm(b, w, h), TypeError, "out must have dtype uint16"),
        (lambda: d.rms_norm(h, w.astype(cupy.float16), h), TypeError, "w must have dtype float32"),
        (lambda: d.rms_norm(h.astype(cupy.float64), w, h), TypeError, "float32, float16 or bfloat16"),
        (lambda: d.rms_norm(h.astype(cupy.int16), w, h), TypeError, "float32, float16 or bfloat16"),
        (lambda: d.residual_rms_norm(h, b, w, h), TypeError, "residual must have dtype float16"),
        (lambda: d.residual_rms_norm_q8_1(h, h, w, cupy.empty((4, 9), cupy.uint8)), TypeError, "float32"),
        (lambda: d.add(h, b, h), TypeError, "b must have dtype float16"),
        (lambda: d.bias_add(h, w, h), TypeError, "bias must have dtype float16"),
        (lambda: d.swiglu(h, h, cupy.empty((4, 8), cupy.float32)), TypeError, "out must have dtype float16"),
        (lambda: d.gated_rms_norm(h, b, w, h, group_size=8), TypeError, "z must have dtype float16"),
        (lambda: d.rope(x3, pos, cupy.empty((2, 4, 8), cupy.uint16)), TypeError, "out must have dtype float16"),
        (lambda: d.rms_norm_rope(x3, cupy.ones(8, cupy.float16), pos, x3), TypeError, "w must have dtype float32"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    if host_if_no_gpu is not None:
        assert not host_if_no_gpu, f"a rejected call launched: {dict(host_if_no_gpu)}"


# ------------------------------------------------------------------------------------------- norms

# (rows, cols): length 1, odd, not a multiple of 8 (loop), whole 16-byte units of every block size, the
# widest register row of 16-bit elements (8 * 1024 * 8) and one unit wider (loop), many rows
HALF_NORM_SHAPES = [(1, 1), (3, 7), (2, 12), (1, 640), (5, 1030), (2, 4096), (257, 256), (3, 5120), (1, 65536),
                    (1, 65544), (140, 4096)]


@gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,cols", HALF_NORM_SHAPES)
def test_half_row_norms(d, rng, kind, rows, cols):
    x, xv = _act(rng, kind, rows, cols, scale=3)
    r, rv = _act(rng, kind, rows, cols)
    (w, wh), (w2, w2h) = _w(rng, cols), _w(rng, cols)
    out = _out(kind, rows, cols)
    d.rms_norm(x, w, out, eps=1e-5, weight_offset=1.0)
    _check(out, ref.rms_norm(xv, wh, eps=1e-5, weight_offset=1.0), kind, "rms_norm")
    out, rd = _out(kind, rows, cols), r.copy()
    d.residual_rms_norm(x, rd, w, out)
    want_y, want_r = ref.residual_rms_norm(xv, rv, wh)
    _check(out, want_y, kind, "residual_rms_norm")
    _check(rd, want_r, kind, "residual_rms_norm residual")
    out, rd = _out(kind, rows, cols), r.copy()
    d.post_norm_residual_rms_norm(x, rd, w2, w, out)
    want_y, want_r = ref.post_norm_residual_rms_norm(xv, rv, w2h, wh)
    _check(out, want_y, kind, "post_norm_residual_rms_norm")
    _check(rd, want_r, kind, "post_norm_residual_rms_norm residual")
    hd = r.copy()
    d.rms_norm_accumulate(x, w, hd)
    _check(hd, ref.rms_norm_accumulate(xv, wh, rv), kind, "rms_norm_accumulate")


@gpu
@pytest.mark.parametrize("kind", KINDS)
def test_half_rms_norm_in_place_and_misaligned(d, rng, kind):
    x, xv = _act(rng, kind, 3, 1024, offset=True)  # 2 bytes off: the loop
    w, wh = _w(rng, 1024)
    d.rms_norm(x, w, x)
    _check(x, ref.rms_norm(xv, wh), kind, "misaligned in place")
    x, xv = _act(rng, kind, 9, 4096)
    d.rms_norm(x, cupy.tile(w, 4), x)
    _check(x, ref.rms_norm(xv, np.tile(wh, 4)), kind, "in place")


@gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape,gs", [((1, 1, 64), 64), ((3, 8, 128), 128), ((5, 2, 96), 96), ((2, 3, 7), 7),
                                      ((1, 40, 256), 256), ((3, 3, 1024), 1024), ((2, 2, 2048), 2048),
                                      ((4, 6, 64), 32), ((3, 2, 50), 25)])
def test_half_group_norms(d, rng, kind, shape, gs):
    x, xv = _act(rng, kind, *shape, scale=2)
    z, zv = _act(rng, kind, *shape, scale=2)
    w, wh = _w(rng, gs)
    if shape[-1] == gs:
        out = _out(kind, *shape)
        d.head_rms_norm(x, w, out, weight_offset=1.0)
        _check(out, ref.group_norm(xv, group_size=gs, w=wh, weight_offset=1.0), kind, "head_rms_norm")
    out = _out(kind, *shape)
    d.group_norm(x, out, group_size=gs, l2=True)
    _check(out, ref.group_norm(xv, group_size=gs, l2=True), kind, "group_norm l2")
    out = _out(kind, *shape)
    d.gated_rms_norm(x, z, w, out, group_size=gs)
    _check(out, ref.group_norm(xv, group_size=gs, w=wh, z=zv), kind, "gated_rms_norm")


# ------------------------------------------------------------------------------------- activations

@gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 3, 8, 1001, 4096, (1 << 20) + 8, (1 << 20) + 3])
def test_half_flat_ops(d, rng, kind, n):
    a, av = _act(rng, kind, n, scale=3)
    b, bv = _act(rng, kind, n, scale=3)
    for name, call, want in [("add", lambda o: d.add(a, b, o), av + bv),
                             ("add_scaled", lambda o: d.add_scaled(a, b, o, alpha=-0.3), ref.add_scaled(av, bv, alpha=-0.3)),
                             ("scale", lambda o: d.scale(a, o, alpha=0.7), ref.scale(av, alpha=0.7)),
                             ("sigmoid_mul", lambda o: d.sigmoid_mul(a, b, o), ref.sigmoid_mul(av, bv))]:
        out = _out(kind, n)
        call(out)
        _check(out, want, kind, f"{name} n={n}")
    a2, a2v = _act(rng, kind, n, scale=3, offset=True)  # the scalar path
    d.scale_accumulate(a2, b, 1.25)
    _check(a2, ref.add_scaled(a2v, bv, alpha=1.25), kind, "scale_accumulate misaligned")


@gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,cols,offset", [(1, 1, 0), (3, 7, 5), (4, 4096, 0), (2, 128, 256), (5, 136, 4)])
def test_half_bias_add(d, rng, kind, rows, cols, offset):
    x, xv = _act(rng, kind, rows, cols)
    bias, bv = _act(rng, kind, offset + cols + 3)
    out = _out(kind, rows, cols)
    d.bias_add(x, bias, out, offset=offset)
    _check(out, ref.bias_add(xv, bv, offset=offset), kind, "bias_add")


@gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", ["swiglu", "swiglu_oai", "geglu"])
@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 7), (1, 14336), (5, 1030), (64, 512)])
def test_half_glu(d, rng, kind, op, rows, cols):
    g, gv = _act(rng, kind, rows, cols, scale=4)
    u, uv = _act(rng, kind, rows, cols, scale=4)
    want = {"swiglu": lambda: ref.swiglu(gv, uv), "swiglu_oai": lambda: ref.swiglu_oai(gv, uv),
            "geglu": lambda: ref.geglu(gv, uv)}[op]()
    out = _out(kind, rows, cols)
    getattr(d, op)(g, u, out)
    _check(out, want, kind, f"{op} separate")
    out = _out(kind, rows, cols)
    getattr(d, op)(cupy.concatenate([g, u], axis=1), None, out)
    _check(out, want, kind, f"{op} fused")


# -------------------------------------------------------------------------------------------- RoPE

@gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", [(1, 1, 2, 2), (1, 8, 128, 128), (5, 3, 64, 32), (17, 4, 96, 64), (3, 2, 256, 128),
                                  (2, 5, 80, 80), (1, 1, 32, 8), (9001, 2, 64, 64)])
@pytest.mark.parametrize("neox", [True, False])
def test_half_rope(d, rng, kind, case, neox):
    n_tok, n_heads, hd, rd = case
    x, xv = _act(rng, kind, n_tok, n_heads, hd)
    positions = np.array([int(rng.integers(0, 100000))], np.int32)
    out = _out(kind, n_tok, n_heads, hd)
    d.rope(x, cupy.asarray(positions), out, rope_dim=rd, neox=neox, freq_base=1e6)
    _check(out, ref.rope(xv, positions, rope_dim=rd, neox=neox, freq_base=1e6), kind, "rope")
    w, wh = _w(rng, hd)
    per_tok = rng.integers(0, 40000, n_tok).astype(np.int32)
    d.rms_norm_rope(x, w, cupy.asarray(per_tok), x, weight_offset=1.0, rope_dim=rd, neox=neox,  # in place
                    pos_mode="per_token")
    want = ref.rms_norm_rope(xv, wh, per_tok, weight_offset=1.0, rope_dim=rd, neox=neox, pos_mode="per_token")
    _check(x, want, kind, "rms_norm_rope in place")

"""Shared helpers of the dmmv tests (test_dmmv*.py): weights, inputs, checks and tolerances.

Weights are random *valid* GGUF blocks (cukern.reference.dmmv.random_weight), so the kernel and
the reference see exactly the same blocks: the comparison is kernel(W_blocks, x) against
dequantize(W_blocks) @ x in float64. Tolerance: the issue's relative error 2e-3, plus an absolute
floor of 1e-4 * rms(reference) for outputs that cancel to near zero (f32 accumulation over k
terms is ~1e-6 relative; one wrong nibble is ~1e-2).
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern import dmmv as D  # noqa: E402
from cukern.dmmv import DmmvDispatch, QWeight  # noqa: E402
from cukern.reference import dmmv as ref  # noqa: E402
from cukern.testing import assert_close, nmse, poison  # noqa: E402


TYPES = list(ref.TYPES)  # every GGML type id the family supports
NAMES = {q: ref.TYPES[q][0] for q in TYPES}
RTOL = 2e-3
# The int8 path against the exact x: the NMSE of x's 8-bit rounding alone, from the float64
# reference at these tests' shapes (300-4000 random draws per type and k): median ~3e-5,
# heavy-tailed at few blocks per row (max 8.7e-4, MXFP4 k = 32; Q4_K/Q5_K k = 256 up to 4.4e-4),
# so the former 2e-4 failed about 0.1-0.5% of checks. One wrong unit of 32 among a row's <= 41 is
# >= 2e-2; the element-wise check against x^ comes first in any case.
Q8_NMSE = 1e-3
# act(g) * u of two int8-path dots: g's error passes through act's log-derivative (1 + |g| on SiLU's
# negative tail), so the product's NMSE is a few times a dot's; over 33 outputs it measured up to
# 5.2e-4 (H100). Element-wise against x^, the kernel's own math, the bound stays RTOL.
Q8_NMSE_GLU = 2e-3


def _ks(q):
    """Valid k for a type: one block, a tail (k % 256 != 0) where the block allows, several steps."""
    be = ref.TYPES[q][1]
    if be == 1:
        return [4, 132, 1028]
    if be == 32:
        return [32, 224, 1312]
    return [256, 1280]


def _check(out, want, name="out"):
    want = np.asarray(want, dtype=np.float64)
    rms = float(np.sqrt(np.mean(want * want))) if want.size else 0.0
    assert_close(out, want, atol=1e-4 * rms + 1e-30, rtol=RTOL, name=name)


def _xhat(q, x, int8_path=True):
    """The x the kernel multiplies: the int8 path (dmmv, moe_dmmv without GLU, for D.Q8_TYPES) rounds
    x to 8 bits per 32 elements (ref.quantize_q8 emulates it exactly)."""
    return ref.quantize_q8(x) if int8_path and q in D.Q8_TYPES else x


def _check_q(out, q, f, x, name="out", bound=Q8_NMSE):
    """out against f(x^) element-wise; on the int8 path also its error against f(x), by NMSE."""
    _check(out, f(_xhat(q, x)), name)
    if q in D.Q8_TYPES and out.size >= 32:  # a norm over a handful of outputs is noise
        err = nmse(out, f(x))
        assert err < bound, f"{name}: NMSE {err:.3g} against the exact x"


def _check_matvec(d, q, m, k, rng):
    """dmmv of a random m x k weight of type q on one random column, against the float64 matvec."""
    w, dense = _weight(q, m, k, rng)
    x = _x(rng, k)
    y = poison(cupy.empty(m, cupy.float32))
    d.dmmv(w, cupy.asarray(x), y)
    _check_q(y, q, lambda v: ref.matvec(dense, v), x, name=f"{NAMES[q]} {m}x{k}")


def _weight(q, m, k, rng, *, pad_front=0, n_experts=0):
    """(QWeight on the device, float64 dequantized [m, k] or [n_e, m, k])."""
    rows = m * max(n_experts, 1)
    raw = ref.random_weight(q, rows, k, rng)
    dense = ref.dequantize(raw, q, rows, k)
    buf = np.concatenate([rng.integers(0, 256, pad_front, dtype=np.uint8), raw.ravel(),
                          rng.integers(0, 256, 7, dtype=np.uint8)])  # trailing bytes: never read as weights
    w = QWeight(cupy.asarray(buf), q, m, k, offset=pad_front, n_experts=n_experts)
    if n_experts:
        dense = dense.reshape(n_experts, m, k)
    return w, dense


def _x(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _ids(rng, T, top_k, n_e):
    return np.stack([rng.permutation(n_e)[:top_k] for _ in range(T)]).astype(np.int32)


def _count_pdl_launches(monkeypatch) -> list:
    """The kernel names of every pdl launch from here on: first calls (dispatch._launch_pdl) and the
    pdl replays of repeated ones (Dispatch._replay)."""
    from cukern import dispatch
    names = []
    launch, replay = dispatch._launch_pdl, dispatch.Dispatch._replay
    monkeypatch.setattr(dispatch, "_launch_pdl", lambda *a: (names.append(a[0]), launch(*a)))
    monkeypatch.setattr(dispatch.Dispatch, "_replay", staticmethod(
        lambda r, i, stream: (r.launches[i][6] and names.append(r.launches[i][0]), replay(r, i, stream))))
    return names


def _matvec_chain(ws, alphas, x0):
    """chain(dd, ys) for _assert_pdl_chain_matches_plain: the matvecs of ws ((weight, dense float64) pairs) one
    after the other, each on the previous one's output times its alpha, then the first again accumulated into
    the last output (y read and written after the wait)."""
    def chain(dd, ys):
        x = x0
        for (w, _), a, y in zip(ws, alphas, ys):
            dd.dmmv(w, x, y, alpha=a)
            x = y
        dd.dmmv(ws[0][0], ys[-2], ys[-1], accumulate=True)
    return chain


def _assert_pdl_chain_matches_plain(chain, steps: int, shape):
    """chain(dispatch, ys) with DmmvDispatch(pdl=True), eager and replayed from a CUDA graph, writes
    the bits that DmmvDispatch() writes into ``steps`` f32 outputs of ``shape``."""
    from cukern.streams import capture_graph
    want = [poison(cupy.empty(shape, cupy.float32)) for _ in range(steps)]
    chain(DmmvDispatch(), want)
    dp = DmmvDispatch(pdl=True)
    for graph in (False, True):  # eager first: it also compiles and plans outside the capture
        got = [poison(cupy.empty(shape, cupy.float32)) for _ in range(steps)]
        if graph:
            capture_graph(lambda stream: chain(dp, got)).replay(cupy.cuda.get_current_stream())
        else:
            chain(dp, got)
        for i, (a, b) in enumerate(zip(got, want)):
            assert bool(cupy.isfinite(b).all()), f"step {i}: the plain chain overflowed"
            assert bool((a == b).all()), f"step {i} differs with pdl (graph={graph})"

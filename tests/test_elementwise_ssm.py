"""Elementwise SSM / DeltaNet kernels (cukern/elementwise/ssm.py) against their float64 references.

Outputs are poisoned with NaN first; tolerances (the DeltaNet recurrences' among them): elementwise_helpers.py.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern.elementwise import ElementwiseDispatch  # noqa: E402
from cukern.elementwise.ssm import _conv_in_place_spans  # noqa: E402
from cukern.reference import elementwise as ref  # noqa: E402
from cukern.testing import assert_close, poison  # noqa: E402
from elementwise_helpers import _deltanet_inputs, _dev, _empty, _randn, gpu  # noqa: E402


@pytest.fixture(scope="module")
def d():
    return ElementwiseDispatch()


# ---------------------------------------------------------------------------------- SSM / DeltaNet

@gpu
@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("C", [1, 37, 2048])
def test_conv1d_silu_decode_and_prefill(d, rng, K, C):
    w = _randn(rng, C, K, scale=0.7)
    state0 = _randn(rng, K - 1, C)
    state = _dev(state0)
    want_state = state0
    wd = _dev(w)
    for step, n_tok in enumerate([1, 1, 2, 1, 40, 17]):  # decode steps, short and long prefill chunks
        x = _randn(rng, n_tok, C, scale=2)
        y = _empty(n_tok, C)
        d.conv1d_silu(_dev(x), state, wd, y)
        want_y, want_state = ref.conv1d_silu(x, want_state, w)
        assert_close(y, want_y, name=f"y step {step}")
        assert_close(state, want_state, name=f"state step {step}")


@gpu
@pytest.mark.parametrize("n_qk,n_v,dk,dv", [(2, 4, 128, 128), (1, 1, 64, 40), (3, 3, 128, 70), (2, 2, 48, 33)])
def test_deltanet_baseline_and_tiled_agree_with_reference(d, rng, n_qk, n_v, dk, dv):
    tol = dict(atol=2e-5, rtol=1e-4)
    state0 = _randn(rng, n_v, dk, dv, scale=0.3)
    variants = [False, True] if dk in (64, 128) else [False]
    states = {t: _dev(state0) for t in variants}
    want_state = state0
    for step, n_tok in enumerate([1, 1, 1, 6, 1, 23]):  # decode steps and batched chunks, state carried
        q, k, v, g, beta = _deltanet_inputs(rng, n_tok, n_qk, n_v, dk, dv)
        want_o, want_state = ref.deltanet(q, k, v, g, beta, want_state)
        outs = {}
        for tiled in variants:
            o = _empty(n_tok, n_v, dv)
            d.deltanet(*map(_dev, (q, k, v, g, beta)), states[tiled], o, tiled=tiled)
            assert_close(o, want_o, name=f"o step {step} tiled={tiled}", **tol)
            assert_close(states[tiled], want_state, name=f"state step {step} tiled={tiled}", **tol)
            outs[tiled] = o.get()
        if len(outs) == 2:
            assert_close(outs[True], outs[False], name="tiled vs baseline", **tol)


@gpu
@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("C", [1, 37, 200, 2048])
@pytest.mark.parametrize("taps", ["f32", "f16"])
@pytest.mark.parametrize("in_place", [False, True])
def test_conv1d_silu_ring_state(d, rng, K, C, taps, in_place):
    """The ring state (state_offset rotating by n_tokens), f16 taps (the reference reads the same rounded
    taps, so f32 tolerances hold) and y aliasing x, over decode steps and prefill chunks. In place, 17, 40,
    600 and 1037 tokens run 2, 3, 32 (19 tokens, the last 11) and 32 (33, the last 14) spans per block; 1 and
    2 tokens are fewer than K - 1 (the new state keeps old entries)."""
    w = _randn(rng, C, K, scale=0.7)
    if taps == "f16":
        w = w.astype(np.float16)
    ring0 = _randn(rng, K - 1, C)
    offset = int(rng.integers(K - 1))
    ring, want_ring, wd = _dev(ring0), ring0, _dev(w)
    for step, n_tok in enumerate([1, 1, 2, 1, 40, 17, 3, 1037, 2, 600]):
        x = _randn(rng, n_tok, C, scale=2)
        xd = _dev(x)
        y = xd if in_place else _empty(n_tok, C)
        assert d.conv1d_silu(xd, ring, wd, y, state_offset=offset) is y
        want_y, want_ring = ref.conv1d_silu(x, want_ring, w, state_offset=offset)
        assert_close(y, want_y, name=f"y step {step}")
        assert_close(ring, want_ring, name=f"ring step {step}")
        offset = (offset + n_tok) % (K - 1)


@gpu
@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("taps", ["f32", "f16"])
@pytest.mark.parametrize("n_tok", [1, 2, 16, 17, 70, 513, 1037])
def test_conv1d_silu_shifting_in_place_and_allocating(d, rng, K, taps, n_tok):
    """The shifting state with y aliasing x (1 to 32 spans per block, 129 channels: a last block of one
    channel), and out=None allocating, against the reference."""
    C = 129
    w, state0, x = _randn(rng, C, K), _randn(rng, K - 1, C), _randn(rng, n_tok, C)
    if taps == "f16":
        w = w.astype(np.float16)
    want_y, want_state = ref.conv1d_silu(x, state0, w)
    for in_place in (True, False):
        state, xd = _dev(state0), _dev(x)
        y = d.conv1d_silu(xd, state, _dev(w), xd if in_place else None)
        assert (y is xd) == in_place
        assert_close(y, want_y, name=f"y in_place={in_place}")
        assert_close(state, want_state, name=f"state in_place={in_place}")


def test_conv1d_silu_in_place_spans_cover_the_tokens_evenly():
    """conv1d_silu_in_place's spans: at most 32 (a 1024-thread block), none empty, all but the last of one
    length; one per 16 tokens up to 512 tokens, then longer ones."""
    for n in [*range(1, 2100), 8192, 100_003, 2**31 - 1]:
        spans, span = _conv_in_place_spans(n)
        assert 1 <= spans <= 32 and (spans - 1) * span < n <= spans * span, (n, spans, span)
        assert spans == min(32, -(-n // 16)) or n > 512, (n, spans, span)
        assert span <= 16 if n <= 512 else spans >= 31, (n, spans, span)


def test_conv1d_silu_bad_arguments_raise_before_launch(d, host_if_no_gpu):
    x = cupy.ones((4, 8), cupy.float32)
    w = cupy.ones((8, 4), cupy.float32)
    st = cupy.ones((3, 8), cupy.float32)
    y = poison(cupy.empty((4, 8), cupy.float32))
    buf = cupy.ones((5, 8), cupy.float32)  # y one row past x: overlapping, not in place
    cases = [
        (lambda: d.conv1d_silu(x, st, w, y, state_offset=3), ValueError, "state_offset must be"),
        (lambda: d.conv1d_silu(x, st, w, y, state_offset=-1), ValueError, "state_offset must be"),
        (lambda: d.conv1d_silu(x, st, w, y, state_offset=1.0), ValueError, "state_offset must be"),
        (lambda: d.conv1d_silu(x, st, w.astype(cupy.float64), y), TypeError, "w must have dtype"),
        (lambda: d.conv1d_silu(x, st, w, st), ValueError, "y must have shape"),
        (lambda: d.conv1d_silu(x, x[:3], w, y), ValueError, "must not overlap"),
        (lambda: d.conv1d_silu(buf[:4], st, w, buf[1:]), ValueError, "y and x must not overlap"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    cupy.cuda.get_current_stream().synchronize()
    assert np.isnan(y.get()).all(), "a rejected call wrote its output"


@gpu
@pytest.mark.parametrize("n_qk,n_v,dk,dv", [(2, 4, 128, 128), (1, 1, 64, 40), (3, 3, 128, 70), (2, 2, 48, 33),
                                            (1, 2, 64, 64)])
def test_deltanet_qk_l2norm_in_kernel(d, rng, n_qk, n_v, dk, dv):
    """q and k straight from the projections (not unit length; one k head near the eps scale), normalised in
    the kernel, baseline and tiled, state carried over decode steps and chunks (8-token staging: 9 and 23)."""
    tol = dict(atol=2e-5, rtol=1e-4)
    eps = 1e-6
    state0 = _randn(rng, n_v, dk, dv, scale=0.3)
    variants = [False, True] if dk in (64, 128) else [False]
    states = {t: _dev(state0) for t in variants}
    want_state = state0
    for step, n_tok in enumerate([1, 1, 9, 1, 23]):
        q, k, v, g, beta = _deltanet_inputs(rng, n_tok, n_qk, n_v, dk, dv)
        q = q * rng.uniform(0.5, 8, (n_tok, n_qk, 1)).astype(np.float32)
        k = k * rng.uniform(0.5, 8, (n_tok, n_qk, 1)).astype(np.float32)
        k[0, 0] *= np.float32(1e-4)  # sum(k^2) ~ 1e-8 .. 6e-7: eps matters
        want_o, want_state = ref.deltanet(q, k, v, g, beta, want_state, qk_l2norm=True, norm_eps=eps)
        for tiled in variants:
            o = _empty(n_tok, n_v, dv)
            d.deltanet(*map(_dev, (q, k, v, g, beta)), states[tiled], o, tiled=tiled, qk_l2norm=True, norm_eps=eps)
            assert_close(o, want_o, name=f"o step {step} tiled={tiled}", **tol)
            assert_close(states[tiled], want_state, name=f"state step {step} tiled={tiled}", **tol)


def test_deltanet_bad_norm_eps_raises_before_launch(d, host_if_no_gpu):
    x3 = cupy.ones((2, 4, 64), cupy.float32)
    g = cupy.ones((2, 4), cupy.float32)
    o = poison(cupy.empty((2, 4, 64), cupy.float32))
    with pytest.raises(ValueError, match="eps must be >= 0"):
        d.deltanet(x3, x3, x3, g, g, cupy.ones((4, 64, 64), cupy.float32), o, qk_l2norm=True, norm_eps=-1.0)
    cupy.cuda.get_current_stream().synchronize()
    assert np.isnan(o.get()).all()


@gpu
@pytest.mark.parametrize("n_tok,n_k,group", [(1, 1, 1), (5, 2, 4), (33, 3, 2), (1, 1, 32)])
def test_deltanet_gates_per_key_head_layout(d, rng, n_tok, n_k, group):
    n_v = n_k * group
    ba = _randn(rng, n_tok, 2 * n_v, scale=6)  # alphas past softplus's threshold of 20 too, with the bias
    ba[0, -1] = 30.0
    a = -np.exp(_randn(rng, n_v))
    dt = _randn(rng, n_v)
    g, beta = _empty(n_tok, n_v), _empty(n_tok, n_v)
    d.deltanet_gates(_dev(ba), _dev(a), _dev(dt), g, beta, group=group)
    want_g, want_beta = ref.deltanet_gates(ba, a, dt, group=group)
    assert_close(g, want_g, name="g")
    assert_close(beta, want_beta, name="beta")

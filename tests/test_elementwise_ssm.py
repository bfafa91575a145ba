"""Elementwise SSM / DeltaNet kernels (cukern/elementwise/ssm.py) against their float64 references.

Outputs are poisoned with NaN first; tolerances (the DeltaNet recurrences' among them): elementwise_helpers.py.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern.elementwise import ElementwiseDispatch  # noqa: E402
from cukern.reference import elementwise as ref  # noqa: E402
from cukern.testing import assert_close  # noqa: E402
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

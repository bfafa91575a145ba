"""Elementwise MoE kernels (cukern/elementwise/moe.py: softmax top-k, weighted sums, router) against
their float64 references.

Outputs are poisoned with NaN first; tolerances: elementwise_helpers.py.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern.elementwise import ElementwiseDispatch  # noqa: E402
from cukern.reference import elementwise as ref  # noqa: E402
from cukern.routing import RouteSlot  # noqa: E402
from cukern.testing import assert_close, poison  # noqa: E402
from elementwise_helpers import _dev, _empty, _randn, gpu  # noqa: E402


@pytest.fixture(scope="module")
def d():
    return ElementwiseDispatch()


# --------------------------------------------------------------------------------------------- MoE

def _check_softmax_topk(d, logits, k, renorm):
    """softmax_topk of host logits [n_tok, n_exp] against the float64 reference: ids exactly, weights close."""
    n_tok = logits.shape[0]
    ids, w = _empty(n_tok, k, dtype=cupy.int32), _empty(n_tok, k)
    d.softmax_topk(_dev(logits), ids, w, k=k, renorm=renorm, scale=1.5)
    want_ids, want_w = ref.softmax_topk(logits, k, renorm=renorm, scale=1.5)
    np.testing.assert_array_equal(ids.get(), want_ids)
    assert_close(w, want_w)


@gpu
@pytest.mark.parametrize("n_tok,n_exp,k", [(1, 8, 2), (1, 128, 8), (5, 32, 4), (33, 64, 6), (7, 257, 32), (3, 1, 1),
                                           (2, 2048, 16)])
@pytest.mark.parametrize("renorm", [True, False])
def test_softmax_topk(d, rng, n_tok, n_exp, k, renorm):
    logits = _randn(rng, n_tok, n_exp, scale=3)
    _check_softmax_topk(d, logits, k, renorm)


@gpu
def test_softmax_topk_ties_pick_lower_id(d):
    logits = np.array([[1, 3, 3, 0, 3, 2], [5, 5, 5, 5, 5, 5]], np.float32)
    ids, w = _empty(2, 4, dtype=cupy.int32), _empty(2, 4)
    d.softmax_topk(_dev(logits), ids, w, k=4)
    np.testing.assert_array_equal(ids.get(), [[1, 2, 4, 5], [0, 1, 2, 3]])
    assert_close(w, ref.softmax_topk(logits, 4)[1])


@gpu
@pytest.mark.parametrize("n_exp,k", [(128, 8), (128, 1), (64, 4), (100, 6), (124, 5), (4, 2), (8, 8), (96, 3)])
@pytest.mark.parametrize("renorm", [True, False])
def test_softmax_topk_many_tokens(d, rng, n_exp, k, renorm):
    """Token batches for the lane-group kernel (or, for 100 experts, the warp kernel), with tied logits
    (rounded), rows of one repeated value (more candidates than the list holds) and -inf logits."""
    n_tok = 32768 + 133
    logits = _randn(rng, n_tok, n_exp, scale=3)
    logits[::7] = np.round(logits[::7])  # many ties
    logits[5] = 1.0
    logits[9, : n_exp // 2] = -np.inf
    logits[11, 1:] = -np.inf
    _check_softmax_topk(d, logits, k, renorm)


def _topk_rows(rng, n_tok, n_exp):
    """Logit rows for the lane-group kernel's paths: distinct values (threshold + rank), ties inside the
    top k and across its boundary (slot clash -> argmax rounds), +0/-0 ties, one repeated value (more
    candidates than slots), -inf halves, and a large-magnitude row."""
    logits = _randn(rng, n_tok, n_exp, scale=3)
    logits[1::6] = np.round(logits[1::6])  # many ties
    logits[2::6] = np.round(logits[2::6] * 4) / 4
    logits[3::6, : n_exp // 2] = -np.inf
    logits[4::6] = 1.0
    logits[5::6] = -np.abs(logits[5::6])
    logits[5::6, ::3] = 0.0
    logits[5::6, 1::5] = -0.0
    logits[0] *= 1e4
    return logits


@gpu
@pytest.mark.parametrize("n_exp,k", [(4, 1), (4, 4), (8, 8), (12, 3), (32, 4), (36, 5), (64, 16), (100, 6),
                                     (128, 8), (128, 16), (132, 2), (200, 11), (252, 9), (256, 16)])
@pytest.mark.parametrize("renorm", [True, False])
def test_softmax_topk_lanes(d, rng, n_exp, k, renorm):
    """Every (V, M) instance of softmax_topk_lanes, a ragged token count (masked groups) and every path."""
    n_tok = 8192 + 6 * 37 + 5  # from _TOPK_LANES_MIN_TOKENS
    logits = _topk_rows(rng, n_tok, n_exp)
    _check_softmax_topk(d, logits, k, renorm)


@gpu
@pytest.mark.parametrize("n_tok,n_used,n_cols", [(1, 1, 1), (1, 8, 4096), (3, 4, 2880), (5, 6, 1030), (17, 2, 7)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_moe_weighted_sum(d, rng, n_tok, n_used, n_cols, accumulate):
    e, w = _randn(rng, n_tok, n_used, n_cols), _randn(rng, n_tok, n_used)
    base = _randn(rng, n_tok, n_cols)
    out = _dev(base) if accumulate else _empty(n_tok, n_cols)
    d.moe_weighted_sum(_dev(e), _dev(w), out, accumulate=accumulate)
    assert_close(out, ref.moe_weighted_sum(e, w, base if accumulate else None))


@gpu
@pytest.mark.parametrize("n_tok,n_cols", [(1, 1), (1, 2048), (4, 1030), (9, 4096)])
def test_shared_expert_accumulate(d, rng, n_tok, n_cols):
    h, s, g = _randn(rng, n_tok, n_cols), _randn(rng, n_tok, n_cols), _randn(rng, n_tok, scale=3)
    hd = _dev(h)
    d.shared_expert_accumulate(hd, _dev(s), _dev(g))
    assert_close(hd, ref.shared_expert_accumulate(h, s, g))


@gpu
@pytest.mark.parametrize("n_tok,n_exp,n_embd", [(1, 1, 4), (1, 128, 2048), (3, 60, 1028), (16, 64, 512), (37, 33, 260)])
def test_router_matvec(d, rng, n_tok, n_exp, n_embd):
    x, W, wn = _randn(rng, n_tok, n_embd, scale=2), _randn(rng, n_exp, n_embd, scale=0.05), _randn(rng, n_embd)
    logits = _empty(n_tok, n_exp)
    d.router_matvec(_dev(x), _dev(W), logits, scale=0.5)
    assert_close(logits, ref.router_matvec(x, W, scale=0.5), atol=1e-5, rtol=1e-4)  # n_embd-term dot products
    logits = _empty(n_tok, n_exp)
    d.router_rms_norm_matvec(_dev(x), _dev(wn), _dev(W), logits, eps=1e-6, weight_offset=1.0, scale=2.0)
    want = ref.router_rms_norm_matvec(x, wn, W, eps=1e-6, weight_offset=1.0, scale=2.0)
    assert_close(logits, want, atol=1e-5, rtol=1e-4, name="fused norm")


@gpu
@pytest.mark.parametrize("n_tok,n_exp,n_embd", [(4096, 128, 2048), (4100, 64, 260), (4127, 200, 1028), (4096, 64, 4),
                                                (4111, 129, 20)])
def test_router_gemm(d, rng, n_tok, n_exp, n_embd):
    """Token batches from _ROUTER_GEMM_MIN_TOKENS: the register-tiled GEMM, ragged in tokens (last block),
    experts (past one 128-expert tile) and n_embd (past one stage).

    Accuracy: normwise relative error <= 1e-5; per element, an absolute part scaled to the outputs' rms. Each
    output is one sequential f32 FMA chain over n_embd columns: at n_embd 2048 with outputs of rms ~6 (the
    fused case) single elements near zero miss 1e-5 absolute by up to 6e-5 (seen on an H100, and in a CPU
    emulation of the kernel's arithmetic: max |err| / rms(ref) ~ 1e-5, normwise ~ 9e-7)."""
    x, W, wn = _randn(rng, n_tok, n_embd, scale=2), _randn(rng, n_exp, n_embd, scale=0.05), _randn(rng, n_embd)

    def check(out, want, name):
        rms = float(np.sqrt(np.mean(want ** 2)))
        assert_close(out, want, atol=3e-5 * max(rms, 1.0), rtol=1e-4, name=name)
        assert np.linalg.norm(out.get() - want) <= 1e-5 * np.linalg.norm(want), name
    logits = _empty(n_tok, n_exp)
    d.router_matvec(_dev(x), _dev(W), logits, scale=0.5)
    check(logits, ref.router_matvec(x, W, scale=0.5), "router_matvec")
    logits = _empty(n_tok, n_exp)
    d.router_rms_norm_matvec(_dev(x), _dev(wn), _dev(W), logits, eps=1e-6, weight_offset=1.0, scale=2.0)
    check(logits, ref.router_rms_norm_matvec(x, wn, W, eps=1e-6, weight_offset=1.0, scale=2.0), "fused norm")


# ------------------------------------------------------------------------- the packed route slot

@gpu
@pytest.mark.parametrize("n_tok,n_exp,k", [(1, 8, 2), (5, 32, 4), (33, 257, 8), (3, 2048, 16), (9000, 128, 8),
                                           (8193, 64, 3)])
def test_softmax_topk_writes_route_slot(d, rng, n_tok, n_exp, k):
    """softmax_topk into a RouteSlot (ids then the weights' bits per token) on each kernel (the warp, register
    and, from 8192 tokens, lane-group ones): the same ids and weights as separate outputs, and moe_weighted_sum
    reading the slot's weights."""
    logits = _randn(rng, n_tok, n_exp, scale=3)
    want_ids, want_w = ref.softmax_topk(logits, k, scale=1.5)
    slot = RouteSlot(poison(cupy.empty((n_tok, 2 * k), cupy.float32)), k)
    assert d.softmax_topk(_dev(logits), k=k, scale=1.5, slot=slot) is slot
    got = slot.buf.get()
    np.testing.assert_array_equal(got[:, :k].view(np.int32), want_ids)
    assert_close(got[:, k:], want_w, name="slot weights")
    n_cols = 67
    e_out = _randn(rng, min(n_tok, 40), k, n_cols)
    out = _empty(e_out.shape[0], n_cols)
    head = RouteSlot(slot.buf[:e_out.shape[0]], k)
    d.moe_weighted_sum(_dev(e_out), head, out)
    assert_close(out, ref.moe_weighted_sum(e_out, want_w[:e_out.shape[0]]), name="weighted sum from the slot")


def test_route_slot_rejects(d, host_if_no_gpu):
    logits = cupy.ones((4, 8), cupy.float32)
    slot = RouteSlot(poison(cupy.empty((4, 6), cupy.float32)), 3)
    ids = poison(cupy.empty((4, 3), cupy.int32))
    cases = [
        (lambda: d.softmax_topk(logits, k=2, slot=slot), ValueError, "slot must be"),
        (lambda: d.softmax_topk(logits, ids, k=3, slot=slot), TypeError, "without ids and weights"),
        (lambda: d.softmax_topk(logits, k=3, slot=slot.buf), TypeError, "slot must be a RouteSlot"),
        (lambda: d.softmax_topk(logits, ids, cupy.empty((4, 6), cupy.float32)[:, ::2], k=3), ValueError,
         "weights: the entries of a row must be contiguous"),
        (lambda: d.moe_weighted_sum(cupy.ones((4, 2, 8), cupy.float32), slot), ValueError, "weights must have shape"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    cupy.cuda.get_current_stream().synchronize()
    assert np.isnan(slot.buf.get()).all(), "a rejected call wrote its output"

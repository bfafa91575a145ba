"""torch tensors in and out of every family (cukern.interop) against the float64 references, on the GPU.

Inputs are made by torch on the device, outputs poisoned (NaN) before the call or left None for the
dispatch to allocate. Covered: a method of each family (norm, activation, RoPE; dmmv matvec; matmul
GEMM; attention varlen and decode; tokens embed and sample), bfloat16 in and out, torch's current
stream and a non-blocking one with no synchronisation beyond torch's own, and a torch CUDA graph
replayed on new input values. Tolerances as in the family tests: f32 1e-5 + 1e-5 relative
(cukern.testing), the matvec / GEMM ones of test_dmmv / test_matmul, bf16 1e-2 + 1.6e-2.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the tensor path's GPU tests need it)")
cupy = pytest.importorskip("cupy")

from cukern.attention import AttentionDispatch, PagedKVCache  # noqa: E402
from cukern.dmmv import DmmvDispatch, QWeight  # noqa: E402
from cukern.elementwise import ElementwiseDispatch  # noqa: E402
from cukern.matmul import MatmulDispatch  # noqa: E402
from cukern.qtypes import GGMLType  # noqa: E402
from cukern.reference import attention as ref_attn  # noqa: E402
from cukern.reference import dmmv as ref_dmmv  # noqa: E402
from cukern.reference import elementwise as ref  # noqa: E402
from cukern.reference import matmul as ref_mm  # noqa: E402
from cukern.reference import tokens as ref_tokens  # noqa: E402
from cukern.testing import assert_close  # noqa: E402
from cukern.tokens import SamplePlan, TokensDispatch  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device (a CPU build?)")]

BF16_TOL = dict(atol=1e-2, rtol=1.6e-2)


def _t(a: np.ndarray, dtype=None) -> torch.Tensor:
    """A host array as a CUDA tensor made by torch on its current stream (bfloat16: rounded by torch)."""
    t = torch.from_numpy(np.ascontiguousarray(a)).cuda()
    return t if dtype is None else t.to(dtype)


def _np(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as float64 on the host (synchronises: torch's .cpu())."""
    if t.dtype == torch.bfloat16:
        return ref_attn.bf16_to_float(t.view(torch.int16).cpu().numpy().view(np.uint16))
    return t.cpu().numpy().astype(np.float64)


def _poisoned(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def _rms(a) -> float:
    return float(np.sqrt(np.mean(np.square(a))))


def _randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.fixture(scope="module")
def ew():
    return ElementwiseDispatch()


# ------------------------------------------------------------------------------------- elementwise

@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 7), (5, 1030), (140, 4096)])
def test_norm_and_activation(ew, rng, rows, cols):
    x, w = _randn(rng, rows, cols, scale=3), _randn(rng, cols)
    xt, wt = _t(x), _t(w)
    out = _poisoned(rows, cols)
    assert ew.rms_norm(xt, wt, out, eps=1e-5) is out
    assert_close(_np(out), ref.rms_norm(x, w, eps=1e-5), name="rms_norm out=")
    y = ew.rms_norm(xt, wt, eps=1e-5)                      # allocated: a torch tensor on x's device
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32 and y.device == xt.device
    assert_close(_np(y), ref.rms_norm(x, w, eps=1e-5), name="rms_norm out=None")
    gate_up = _randn(rng, rows, 2 * cols)
    g = ew.swiglu(_t(gate_up), None)                      # fused [gate | up]: out [rows, cols]
    assert tuple(g.shape) == (rows, cols)
    assert_close(_np(g), ref.swiglu(gate_up[:, :cols], gate_up[:, cols:]), name="swiglu")
    strided = _t(_randn(rng, rows + 1, cols + 1))[:, :cols]  # a view torch made: refused, not misread
    with pytest.raises(ValueError, match="C-contiguous"):
        ew.rms_norm(strided, wt)


@pytest.mark.parametrize("n_tok,n_heads,hd,rd", [(1, 8, 128, 128), (7, 3, 64, 32), (33, 2, 256, 128)])
def test_rope(ew, rng, n_tok, n_heads, hd, rd):
    x = _randn(rng, n_tok, n_heads, hd)
    per_tok = rng.integers(0, 40000, n_tok).astype(np.int32)
    out = ew.rope(_t(x), _t(per_tok), rope_dim=rd, pos_mode="per_token", freq_base=1e6)
    assert_close(_np(out), ref.rope(x, per_tok, rope_dim=rd, pos_mode="per_token", freq_base=1e6), name="rope")


# ------------------------------------------------------------------------------------- dmmv / matmul

def _qweight(rng, q, m, k):
    raw = ref_dmmv.random_weight(q, m, k, rng)
    return QWeight(_t(raw.ravel()), q, m, k), ref_dmmv.dequantize(raw, q, m, k)


@pytest.mark.parametrize("m,k,n", [(67, 1024, 1), (5, 4096, 3)])
def test_dmmv(rng, m, k, n):
    d = DmmvDispatch(int8=False)                           # the f32 path: W x exactly as the reference
    w, dense = _qweight(rng, GGMLType.Q8_0, m, k)
    assert isinstance(w.buf, cupy.ndarray)                 # QWeight took the torch bytes as a view
    x = _randn(rng, n, k) if n > 1 else _randn(rng, k)
    y = d.dmmv(w, _t(x))
    assert isinstance(y, torch.Tensor) and tuple(y.shape) == ((n, m) if n > 1 else (m,))
    want = ref_dmmv.matvec(dense, x)
    assert_close(_np(y), want, atol=1e-4 * _rms(want), rtol=2e-3, name="dmmv")   # as test_dmmv._check


@pytest.mark.parametrize("m,n,k", [(70, 40, 512), (128, 129, 1024)])
def test_gemm(rng, m, n, k):
    mm = MatmulDispatch()
    w, dense = _qweight(rng, GGMLType.Q4_K, m, k)
    b = _randn(rng, n, k).astype(np.float16)
    out = mm.gemm(w, _t(b))
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == (n, m) and out.dtype == torch.float32
    want, tight = ref_mm.gemm(dense, b), ref_mm.gemm_f16_inputs(dense, b)   # as test_matmul._check
    assert_close(_np(out), want, atol=2e-3 * _rms(want), rtol=2e-3, name="gemm")
    assert_close(_np(out), tight, atol=1e-4 * _rms(tight), rtol=1e-4, name="gemm (f16 inputs)")


# ------------------------------------------------------------------------------------- attention

@pytest.mark.parametrize("causal", [False, True])
def test_varlen_bfloat16_in_and_out(rng, causal):
    h, hk, d = 4, 2, 128
    q_lens, k_lens = [1, 130, 7], [1, 130, 9]
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    q, k, v = (_t(_randn(rng, n, hh, d), torch.bfloat16) for n, hh in ((cu_q[-1], h), (cu_k[-1], hk), (cu_k[-1], hk)))
    out, lse = AttentionDispatch().flash_attn_varlen(q, k, v, _t(cu_q), _t(cu_k), max_seqlen_q=max(q_lens),
                                                     causal=causal)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse is None
    want, _ = ref_attn.varlen(_np(q), _np(k), _np(v), cu_q, cu_k, causal=causal)
    assert_close(_np(out), want, **BF16_TOL, name="varlen bf16")


def test_decode_on_a_cukern_cache(rng):
    attn = AttentionDispatch()
    h, hk, d, ps, lengths = 8, 2, 128, 16, [1, 17, 300]
    cache = PagedKVCache(1, sum(-(-n // ps) for n in lengths) + 2, ps, hk, d, max_seqs=4, dtype="float16")
    slots = []
    for n in lengths:
        s = cache.add(n)
        attn.write_kv_run(cache, 0, _t(_randn(rng, n, hk, d)), _t(_randn(rng, n, hk, d)), s, 0)
        slots.append(s)
    x = _randn(rng, len(slots), h, d, scale=2.0)
    plan = attn.plan_decode(cache, slots, h)
    out = attn.flash_attn_decode(plan, 0, _t(x))
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == (len(slots), h, d)
    kp, vp = (ref_attn.as_float64(p[0], cache.kind) for p in (cache.k_pools, cache.v_pools))
    want, _ = ref_attn.paged_attention(x, kp, vp, cache.page_table.get(), cache.lengths.get(), slots,
                                       [1] * len(slots), ps)
    assert_close(_np(out), want, atol=1e-4, rtol=1e-4, name="decode")


# ------------------------------------------------------------------------------------- tokens

def test_embed_bfloat16_table_and_sample(rng):
    td = TokensDispatch()
    rows, cols = 37, 256
    table = _t(_randn(rng, rows, cols), torch.bfloat16)
    ids = np.array([0, 36, 5, 5, -1, 12], np.int32)
    out = td.embed(table, int(GGMLType.BF16), cols, _t(ids), scale=1.5)
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == (ids.size, cols)
    assert_close(_np(out), ref_tokens.embed(_np(table), ids, scale=1.5), atol=0, rtol=1e-6, name="embed")
    logits = _randn(rng, 3, 1000)
    plan = SamplePlan(3, 1000, sampling=False)
    next_ids = td.sample(plan, _t(logits))
    assert isinstance(next_ids, torch.Tensor) and next_ids.dtype == torch.int32   # a torch view of plan.next_ids
    np.testing.assert_array_equal(next_ids.cpu().numpy(), ref_tokens.greedy(logits))


# ------------------------------------------------------------------------------------- streams and graphs

def test_streams_order_like_torch_ops(ew, rng):
    """On a non-blocking torch stream, with nothing but torch's own ordering: the kernel runs on the
    current stream (after the long GEMM that makes x there), or on the stream given by ``stream=``."""
    s = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device="cuda")
    w = _randn(rng, 512)
    wt = _t(w)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x = (a @ a)[:64, :512] * 1e-3                     # milliseconds of work queued on s
        y = ew.rms_norm(x, wt)                             # stream=None: torch's current stream, s
    torch.cuda.current_stream().wait_stream(s)
    assert_close(_np(y), ref.rms_norm(_np(x), w), name="on the current torch stream")
    s2 = torch.cuda.Stream()
    s2.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s2):
        x2 = (a @ a)[:64, :512] * 1e-3
        z = _poisoned(64, 512)
    ew.rms_norm(x2, wt, z, stream=s2)                     # launched on s2 from outside its context
    torch.cuda.current_stream().wait_stream(s2)
    assert_close(_np(z), ref.rms_norm(_np(x2), w), name="on stream=s2")


def test_torch_cuda_graph_replays_on_new_values(ew, rng):
    rows, cols = 5, 1030
    x, w = _t(_randn(rng, rows, cols)), _t(_randn(rng, cols))
    gate_up = _t(_randn(rng, rows, 2 * cols))
    out = _poisoned(rows, cols)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):                             # warm-up: compile, and the replay cache's first call
        ew.rms_norm(x, w, out)
        ew.swiglu(gate_up, None)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ew.rms_norm(x, w, out)
        act = ew.swiglu(gate_up, None)                     # allocated from the graph's pool
    for _ in range(2):
        xh, gh = _randn(rng, rows, cols, scale=2), _randn(rng, rows, 2 * cols)
        x.copy_(torch.from_numpy(xh))
        gate_up.copy_(torch.from_numpy(gh))
        out.fill_(float("nan"))
        act.fill_(float("nan"))
        g.replay()
        assert_close(_np(out), ref.rms_norm(xh, _np(w)), name="graph rms_norm")
        assert_close(_np(act), ref.swiglu(gh[:, :cols], gh[:, cols:]), name="graph swiglu")

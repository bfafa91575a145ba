"""cukern.torch: the torch custom operators (torch.ops.cukern.*) against the float64 references on the
GPU, under torch.compile (fullgraph: each operator one opaque call) and in a torch CUDA graph; their fake
implementations on meta tensors on the CPU. Tolerances: f32 cukern.testing's, bf16 1e-2 + 1.6e-2
relative (as tests/test_torch.py). Skipped without torch (CI installs none)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (cukern.torch registers torch operators)")

from cukern import torch as cukern_torch  # noqa: E402 (importing it registers torch.ops.cukern.*)
from cukern.reference import attention as ref_attn  # noqa: E402
from cukern.reference import elementwise as ref  # noqa: E402
from cukern.testing import assert_close  # noqa: E402

BF16_TOL = dict(atol=1e-2, rtol=1.6e-2)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device (a CPU build?)")


def _np(t) -> np.ndarray:
    return t.detach().to(torch.float64).cpu().numpy()


def test_fake_implementations_give_shapes_and_dtypes():
    """On meta tensors (no GPU): what torch.compile traces with; every operator of the module registered."""
    assert all(hasattr(torch.ops.cukern, name) for name in cukern_torch.__all__)
    meta = dict(device="meta")
    x, w = torch.empty(3, 64, dtype=torch.bfloat16, **meta), torch.empty(64, **meta)
    y = torch.ops.cukern.rms_norm(x, w, 1e-6)
    assert (y.shape, y.dtype, y.device.type) == ((3, 64), torch.bfloat16, "meta")
    g = torch.empty(2, 48, dtype=torch.float16, **meta)
    assert torch.ops.cukern.swiglu(g, g).shape == (2, 48) and torch.ops.cukern.geglu(g, g).dtype == torch.float16
    q, k = torch.empty(7, 4, 64, dtype=torch.float16, **meta), torch.empty(7, 2, 64, dtype=torch.float16, **meta)
    cu = torch.empty(3, dtype=torch.int32, **meta)
    assert torch.ops.cukern.flash_attn_varlen(q, k, k, cu, cu, 5, 5, None, True).shape == (7, 4, 64)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_operators_match_the_references(rng, dtype):
    dt = getattr(torch, dtype)
    tol = BF16_TOL if dtype == "bfloat16" else {}
    x = torch.from_numpy(rng.standard_normal((5, 1030)).astype(np.float32) * 3).cuda().to(dt)
    w = torch.from_numpy(rng.standard_normal(1030).astype(np.float32)).cuda()
    y = torch.ops.cukern.rms_norm(x, w, 1e-5, 1.0)
    assert y.dtype == dt and y.shape == x.shape and y.data_ptr() != x.data_ptr()
    assert_close(_np(y), ref.rms_norm(_np(x), _np(w), eps=1e-5, weight_offset=1.0), **tol, name="rms_norm")
    g, u = (torch.from_numpy(rng.standard_normal((3, 70)).astype(np.float32)).cuda().to(dt) for _ in range(2))
    assert_close(_np(torch.ops.cukern.swiglu(g, u)), ref.swiglu(_np(g), _np(u)), **tol, name="swiglu")
    assert_close(_np(torch.ops.cukern.geglu(g, u)), ref.geglu(_np(g), _np(u)), **tol, name="geglu")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_operator_compiled_and_in_a_graph(rng, causal):
    """flash_attn_varlen through torch.compile(fullgraph=True) and replayed from a torch CUDA graph on new
    values, against the float64 reference."""
    h, hk, d, lens = 4, 2, 64, [1, 77, 9]
    cu_np = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cu = torch.from_numpy(cu_np).cuda()
    n = int(cu_np[-1])

    def fresh():
        return [torch.from_numpy(rng.standard_normal(s).astype(np.float32)).cuda().to(torch.bfloat16)
                for s in ((n, h, d), (n, hk, d), (n, hk, d))]

    def attend(q, k, v):
        return torch.ops.cukern.flash_attn_varlen(q, k, v, cu, cu, max(lens), max(lens), None, causal) * 1.0

    compiled = torch.compile(attend, fullgraph=True)
    q, k, v = fresh()
    out = compiled(q, k, v)
    want, _ = ref_attn.varlen(_np(q), _np(k), _np(v), cu_np, cu_np, causal=causal)
    assert_close(_np(out), want, **BF16_TOL, name="compiled")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attend(q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend(q, k, v)
    for _ in range(2):
        for t, new in zip((q, k, v), fresh()):
            t.copy_(new)
        graph.replay()
        want, _ = ref_attn.varlen(_np(q), _np(k), _np(v), cu_np, cu_np, causal=causal)
        assert_close(_np(out), want, **BF16_TOL, name="graph replay")

"""cukern.interop on the CPU: tensors of other frameworks in and out of the dispatch methods.

A stand-in torch (tests/torch_fakes.py: tensors over host memory) and the host dispatch layer
(tests/host_dispatch.py: launches recorded, not made) run the real conversion, stream choice, output
allocation, replay cache and error paths without a GPU (on a GPU too: nothing is launched). What the
kernels compute from torch tensors is tests/test_torch.py's (GPU).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import host_dispatch  # noqa: E402 (tests/ is on sys.path under pytest)
import torch_fakes  # noqa: E402

from cukern import interop  # noqa: E402
from cukern import streams as streams_module  # noqa: E402
from cukern.attention import AttentionDispatch  # noqa: E402
from cukern.dispatch import Dispatch  # noqa: E402
from cukern.dmmv import DmmvDispatch  # noqa: E402
from cukern.elementwise import ElementwiseDispatch  # noqa: E402
from cukern.matmul import MatmulDispatch  # noqa: E402
from cukern.tokens import TokensDispatch  # noqa: E402

# public methods that take host values or cukern objects only (plans, sizes, settings)
HOST_ONLY = {"plan_decode", "plan_decode_contiguous", "plan_batched", "plan_moe_route", "plan_path", "packable",
             "check_errors", "struct_of"}


class _Stream(host_dispatch._Stream):
    def __init__(self, handle: int = 0, device: int = -1):
        self.ptr, self.device_id = handle, device


@pytest.fixture
def fake(monkeypatch):
    """The host dispatch layer, the stand-in torch as sys.modules["torch"], and a record of the launch stream
    of every launch: returns (torch, launches, streams)."""
    launches = host_dispatch.patch(monkeypatch)
    torch = torch_fakes.make(current_handle=77)
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(interop, "_KINDS", {k: v for k, v in interop._KINDS.items() if v == interop._NATIVE})
    monkeypatch.setattr(interop, "_to_numpy", {})
    monkeypatch.setattr(interop, "_to_torch", {})
    monkeypatch.setattr(interop, "_current_device", lambda: 0)
    monkeypatch.setattr(interop, "_raw_stream", None)
    for module in (interop, streams_module):
        monkeypatch.setattr(module, "external_stream", lambda handle, device=-1: _Stream(handle, device))
    streams = []
    relaunch = Dispatch.relaunch
    monkeypatch.setattr(Dispatch, "relaunch", staticmethod(
        lambda launch, stream=None: (streams.append(getattr(stream, "ptr", stream)), relaunch(launch, stream))))
    replay = Dispatch._replay  # a repeated call's launches (cukern.repeat)
    monkeypatch.setattr(Dispatch, "_replay", staticmethod(
        lambda r, i, stream: (streams.append(getattr(stream, "ptr", stream)), replay(r, i, stream))))
    return torch, launches, streams


def test_every_public_dispatch_method_takes_tensors():
    for cls in (ElementwiseDispatch, DmmvDispatch, MatmulDispatch, TokensDispatch, AttentionDispatch):
        for name in dir(cls):
            fn = getattr(cls, name)
            if name.startswith("_") or not callable(fn) or hasattr(Dispatch, name) or name in HOST_ONLY:
                continue
            assert hasattr(fn, "__cukern_tensors__"), f"{cls.__name__}.{name} is not wrapped by interop.tensors"
    from cukern import attention
    for fn in (attention.flash_attn_varlen_func, attention.flash_attn_with_kvcache,
               attention.BatchDecodeWithPagedKVCacheWrapper.run, attention.BatchPrefillWithPagedKVCacheWrapper.run):
        assert hasattr(fn, "__cukern_tensors__"), f"{fn.__qualname__} is not wrapped by interop"


def test_tensors_in_are_the_kernels_pointers_and_come_back(fake):
    torch, launches, streams = fake
    rng = np.random.default_rng(0)
    x, w = torch_fakes.tensor(rng.standard_normal((3, 64))), torch_fakes.tensor(rng.standard_normal(64))
    out = torch_fakes.tensor(np.zeros((3, 64)))
    seen = []
    d = ElementwiseDispatch()
    real = type(d)._row_norm
    d._row_norm = lambda name, r, c, arrays, *a, **k: (seen.append(arrays), real(d, name, r, c, arrays, *a, **k))[1]
    assert d.rms_norm(x, w, out, eps=1e-5) is out
    assert [a.data.ptr for a in seen[0]] == [out.data_ptr(), x.data_ptr(), w.data_ptr()]
    assert seen[0][1].dtype == np.float32 and seen[0][1].shape == (3, 64)
    assert streams == [77]                              # torch's current stream, none given
    d.rms_norm(x, w, out, eps=1e-5, stream=torch_fakes.Stream(91))
    assert streams[-1] == 91                            # an explicit torch stream wins
    assert sum(launches.values()) == 2


def test_repeated_tensor_call_hits_the_replay_cache(fake, monkeypatch):
    """New tensor objects over the same memory (what an eager loop passes) replay the first call's launches,
    keyed by the tensors themselves: no CuPy view is made."""
    torch, launches, _ = fake
    views = []
    real_view = interop._torch_view
    monkeypatch.setattr(interop, "_torch_view", lambda name, t: (views.append(name), real_view(name, t))[1])
    x, w, out = (torch_fakes.tensor(np.ones(s)) for s in ((2, 32), (32,), (2, 32)))
    d = ElementwiseDispatch()
    bodies = []
    real = type(d)._row_norm
    d._row_norm = lambda *a, **k: (bodies.append(1), real(d, *a, **k))[1]
    assert d.rms_norm(x, w, out) is out
    x2, out2 = x[0:2], out[0:2]                         # other objects, same pointer, shape, strides, dtype
    assert d.rms_norm(x2, w, out2) is out2
    assert len(bodies) == 1 and sum(launches.values()) == 2 and views == ["x", "w", "out"]
    d.rms_norm(x[0:1], w, out[0:1])                     # another shape: the body runs
    assert len(bodies) == 2


def test_out_none_allocates_in_the_inputs_framework_on_the_launch_stream(fake):
    torch, launches, _ = fake
    x, w = torch_fakes.tensor(np.ones((3, 40))), torch_fakes.tensor(np.ones(40))
    d = ElementwiseDispatch()
    y = d.rms_norm(x, w)
    assert isinstance(y, torch_fakes.Tensor) and y is torch.made[-1]
    assert y.shape == (3, 40) and y.dtype is torch.float32 and torch.made_on[-1] == 77
    y = d.rms_norm(x, w, stream=torch_fakes.Stream(5))
    assert torch.made_on[-1] == 5                       # allocated on the stream that writes it
    ids, weights = d.softmax_topk(x, k=3)
    assert (ids.shape, ids.dtype, weights.shape, weights.dtype) == ((3, 3), torch.int32, (3, 3), torch.float32)
    q8 = d.quantize_q8_1(torch_fakes.tensor(np.ones((2, 64))))
    assert (q8.shape, q8.dtype) == ((2, 72), torch.uint8)
    gate_up = torch_fakes.tensor(np.ones((2, 48)))
    assert d.swiglu(gate_up, None).shape == (2, 24)     # the fused [gate | up] layout halves the width
    # CuPy inputs keep CuPy outputs
    xc, wc = host_dispatch.host_array((3, 40), fill=1.0), host_dispatch.host_array(40, fill=1.0)
    yc = d.rms_norm(xc, wc)
    assert type(yc) is cupy.ndarray and yc.shape == (3, 40) and yc.dtype == np.float32


def test_bfloat16_tensors_arrive_as_bits_and_allocate_bfloat16(fake):
    torch, launches, _ = fake
    h, hk, dd, n = 4, 2, 64, 5
    q = torch_fakes.tensor(np.zeros((n, h, dd)), "bfloat16")
    k = torch_fakes.tensor(np.zeros((n, hk, dd)), "bfloat16")
    v = torch_fakes.tensor(np.zeros((n, hk, dd)), "bfloat16")
    cu = torch_fakes.tensor([0, 2, 5], "int32")
    out, lse = AttentionDispatch().flash_attn_varlen(q, k, v, cu, cu, max_seqlen_q=3)
    assert out is torch.made[-1] and out.dtype is torch.bfloat16 and out.shape == (n, h, dd) and lse is None
    assert sum(launches.values()) == 1
    view = interop.as_cupy(q, "q")
    assert view.dtype == np.uint16 and view.data.ptr == q.data_ptr() and view.data.mem._owner is q


def test_cupy_calls_take_the_direct_path(monkeypatch, fake):
    """All-CuPy arguments with their outputs given never reach the conversion."""
    for name in ("_outer_slow", "_torch_view", "_foreign_view"):
        monkeypatch.setattr(interop, name, lambda *a, **k: pytest.fail("converted a CuPy call"))
    x, w, y = (host_dispatch.host_array(s, fill=1.0) for s in ((2, 16), 16, (2, 16)))
    assert ElementwiseDispatch().rms_norm(x, w, y, eps=1e-5, stream=None) is y


def test_bad_tensors_raise_before_any_launch(fake):
    torch, launches, _ = fake
    d = ElementwiseDispatch()
    x, w = torch_fakes.tensor(np.ones((2, 8))), torch_fakes.tensor(np.ones(8))
    with pytest.raises(TypeError, match=r"x is a torch tensor on cpu.*x\.cuda\(\)"):
        d.rms_norm(torch_fakes.tensor(np.ones((2, 8)), dev=("cpu", None)), w)
    with pytest.raises(TypeError, match="w: cukern takes no torch.complex64 tensors"):
        d.rms_norm(x, torch_fakes.tensor(np.ones(8), "complex64"))
    with pytest.raises(ValueError, match="w is on cuda:1, another tensor of the call on cuda:0"):
        d.rms_norm(x, torch_fakes.tensor(np.ones(8), dev=("cuda", 1)))
    with pytest.raises(ValueError, match="the dispatch runs on device 0"):
        d.rms_norm(*(torch_fakes.tensor(np.ones(s), dev=("cuda", 2)) for s in ((2, 8), 8)))
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16.*got int32"):  # the method's
        d.rms_norm(torch_fakes.tensor(np.ones((2, 8)), "int32"), w)                            # check, on the view
    with pytest.raises(ValueError, match="C-contiguous"):                 # strides arrive as they are
        d.rms_norm(torch_fakes.Tensor(x._buf, (2, 4), torch.float32, offset=x._offset, strides=(8, 2)),
                   torch_fakes.tensor(np.ones(4)))
    with pytest.raises(TypeError, match="must be a cupy.ndarray on the GPU, got ndarray.*DLPack"):
        d.rms_norm(np.ones((2, 8), np.float32), w)                        # NumPy: host memory

    class HostDL:
        def __dlpack__(self, stream=None):
            raise AssertionError("not to be exported")

        def __dlpack_device__(self):
            return (1, 0)                                                  # kDLCPU

    with pytest.raises(TypeError, match="HostDL in host memory"):
        d.rms_norm(HostDL(), w)
    assert sum(launches.values()) == 0  # (an output allocated for a call that raised is dropped with it)


def test_dlpack_and_cuda_array_interface_objects(fake, monkeypatch):
    """Objects of other frameworks go through cupy.from_dlpack / cupy.asarray with the launch stream current,
    and come back as the objects passed."""
    torch, launches, streams = fake

    class DL:
        def __init__(self, shape):
            self.array = host_dispatch.host_array(shape, fill=1.0)
            self.shape, self.dtype = self.array.shape, self.array.dtype    # as array-API objects have

        def __dlpack__(self, stream=None):
            raise AssertionError("cupy.from_dlpack is replaced here")

        def __dlpack_device__(self):
            return (2, 0)                                                  # kDLCUDA

    class CAI:
        def __init__(self, shape):
            self.array = host_dispatch.host_array(shape, fill=1.0)

        @property
        def __cuda_array_interface__(self):
            return {"shape": self.array.shape, "typestr": "<f4", "data": (self.array.data.ptr, False), "version": 3}

    current = []
    monkeypatch.setattr(interop.cupy, "from_dlpack", lambda a: (current.append("dlpack"), a.array)[1])
    monkeypatch.setattr(interop.cupy, "asarray", lambda a: (current.append("cai"), a.array)[1])
    x, w, out = DL((2, 16)), CAI((16,)), DL((2, 16))
    assert ElementwiseDispatch().rms_norm(x, w, out) is out
    assert sorted(current) == ["cai", "dlpack", "dlpack"] and sum(launches.values()) == 1
    y = ElementwiseDispatch().rms_norm(x, w)                             # no torch among them: a CuPy output
    assert type(y) is cupy.ndarray and y.shape == (2, 16)


def test_flash_attention_style_functions_take_tensors(fake):
    """The module-level FlashAttention-style entry points (interop.tensor_function) take torch tensors, run
    on torch's current stream and return their output as a tensor made in the inputs' framework."""
    from cukern.attention import flash_attn_varlen_func
    torch, launches, streams = fake
    h, hk, dd, n = 4, 2, 64, 5
    q = torch_fakes.tensor(np.zeros((n, h, dd)), "bfloat16")
    k, v = (torch_fakes.tensor(np.zeros((n, hk, dd)), "bfloat16") for _ in range(2))
    cu = torch_fakes.tensor([0, 2, 5], "int32")
    out = flash_attn_varlen_func(q, k, v, cu, cu, 3, 3, causal=True)
    assert out is torch.made[-1] and out.dtype is torch.bfloat16 and out.shape == (n, h, dd)
    assert sum(launches.values()) == 1 and streams == [77]
    given = torch_fakes.tensor(np.zeros((n, h, dd)), "bfloat16")
    assert flash_attn_varlen_func(q, k, v, cu, cu, 3, 3, out=given) is given
    with pytest.raises(TypeError, match="q is a torch tensor on cpu"):
        flash_attn_varlen_func(torch_fakes.tensor(np.zeros((n, h, dd)), "bfloat16", dev=("cpu", None)), k, v, cu, cu,
                               3, 3)

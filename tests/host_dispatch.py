"""Run cukern's real dispatch layer on a machine without a GPU: every array a ``cupy.ndarray`` over host
memory, every kernel launch recorded instead of made.

Everything on the host side runs for real: argument validation, struct packing, grid choice, kernel
lookup in the family, PagedKVCache's allocator, the attention and sampling plans, and the model's
orchestration. It catches an API mismatch between the model code and a family (a renamed argument,
a shape, dtype or alignment the family rejects) without a GPU. Numbers are not computed: outputs keep
their NaN fill.
"""

from __future__ import annotations

import collections
import ctypes

import cupy
import numpy as np
from cupy.cuda import memory
from model_fakes import FakeStream as _Stream  # tests/ is on sys.path under pytest

_keep: list = []   # host buffers behind the arrays of the current test


def host_view(a: cupy.ndarray) -> np.ndarray:
    """A NumPy view of a host-backed cupy array's memory (its shape and strides)."""
    if a.size == 0:
        return np.empty(a.shape, a.dtype)
    span = sum((n - 1) * abs(s) for n, s in zip(a.shape, a.strides)) + a.itemsize
    buf = (ctypes.c_uint8 * span).from_address(a.data.ptr)
    return np.ndarray(a.shape, a.dtype, buffer=buf, strides=a.strides)


class HostArray(cupy.ndarray):
    """A cupy.ndarray over host memory whose element-wise methods run in NumPy (a test's
    ``x.astype(...)``, ``.copy()``, ``.get()``, ``.fill()``), so that bad-input tests written for the
    GPU run unchanged. Views (slices, reshapes) keep the class."""

    def astype(self, dtype, *args, **kwargs):
        with np.errstate(invalid="ignore"):   # NaN poison cast to an integer type
            return _asarray(host_view(self), dtype, HostArray)

    def copy(self, *args, **kwargs):
        return _asarray(host_view(self), cls=HostArray)

    def get(self, *args, **kwargs):
        return host_view(self).copy()

    def fill(self, value):
        host_view(self)[...] = value

    def set(self, arr, *args, **kwargs):
        host_view(self)[...] = arr


def host_array(shape, dtype=np.float32, fill=None, cls=cupy.ndarray) -> cupy.ndarray:
    """A cupy.ndarray (``cls``: or a :class:`HostArray`) whose data pointer is 256-byte-aligned host
    memory (NaN-filled floats by default)."""
    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in shape) if isinstance(shape, (tuple, list)) else (int(shape),)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(n + 512, np.uint8)
    _keep.append(raw)
    mem = memory.UnownedMemory(raw.ctypes.data + (-raw.ctypes.data) % 256, max(n, 1), raw, device_id=0)
    a = cls(shape, dtype, memptr=memory.MemoryPointer(mem, 0))
    host_view(a)[...] = (np.nan if dtype.kind == "f" else 0) if fill is None else fill
    return a


def _asarray(x, dtype=None, cls=cupy.ndarray) -> cupy.ndarray:
    x = np.asarray(x, dtype=dtype)
    a = host_array(x.shape, x.dtype, cls=cls)
    host_view(a)[...] = x
    return a


class _Device:
    """cupy.cuda.Device on a machine without one: an H100 (sm_90) as device 0, a context manager
    that does nothing."""

    compute_capability = "90"

    def __init__(self, device=None):
        self.id = 0 if device is None else int(device)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Graph:
    def __init__(self, fn, stream):
        fn(stream)           # capture: the step's dispatches run (and validate) once
        self.replays = 0

    def replay(self, stream=None):
        self.replays += 1


def patch(monkeypatch, array_methods: bool = False) -> collections.Counter:
    """Install the host arrays and the launch recorder for one test; returns the launch counter
    (kernel name -> launches). ``array_methods``: ``cupy.zeros`` and the like make :class:`HostArray`\\ s,
    whose ``astype``/``copy``/``get``/``fill`` work on the host (not exactly ``cupy.ndarray``, so
    dispatch caches keyed on that type stay off)."""
    from cukern import attention, dispatch, dmmv, matmul
    from cukern.models import gguf_loader
    from cukern.models import transformer as T

    launches: collections.Counter = collections.Counter()
    current = _Stream()
    cls = HostArray if array_methods else cupy.ndarray
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=np.float32: host_array(shape, dtype, cls=cls))
    monkeypatch.setattr(cupy, "zeros", lambda shape, dtype=np.float32: host_array(shape, dtype, 0, cls))
    monkeypatch.setattr(cupy, "full", lambda shape, v, dtype=np.float32: host_array(shape, dtype, v, cls))
    monkeypatch.setattr(cupy, "ones", lambda shape, dtype=np.float32: host_array(shape, dtype, 1, cls))
    monkeypatch.setattr(cupy, "empty_like", lambda a, dtype=None: host_array(a.shape, dtype or a.dtype, cls=cls))
    monkeypatch.setattr(cupy, "zeros_like", lambda a, dtype=None: host_array(a.shape, dtype or a.dtype, 0, cls))
    monkeypatch.setattr(cupy, "asarray", lambda x, dtype=None: _asarray(x, dtype, cls))
    monkeypatch.setattr(cupy.cuda, "Stream", _Stream)
    monkeypatch.setattr(cupy.cuda, "Device", _Device)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: current)
    monkeypatch.setattr(dispatch.Dispatch, "_function", lambda self, kernel, shared_mem=0: kernel)
    monkeypatch.setattr(dispatch.Dispatch, "_call", staticmethod(
        lambda kernel, fn, grid, block, args, shared_mem, pdl=False: launches.update([kernel])))
    monkeypatch.setattr(dispatch.Dispatch, "_replay", staticmethod(
        lambda replay, i, stream: launches.update([replay.launches[i][0]])))
    monkeypatch.setattr(dispatch.Dispatch, "device_id", property(lambda self: 0))
    monkeypatch.setattr(dispatch, "_pdl_supported", lambda device_id: True)  # an sm_90 device
    h100 = {"MultiProcessorCount": 132, "MaxSharedMemoryPerBlockOptin": 232448}
    monkeypatch.setattr(dispatch.Dispatch, "sm_count", lambda self: h100["MultiProcessorCount"])
    monkeypatch.setattr(dispatch.Dispatch, "resident_blocks",  # an H100's 2048 threads, 228 KB (1 KB a block)
                        lambda self, kernel, threads, shared_mem=0: min(2048 // threads, 233472 // (shared_mem + 1024)))
    monkeypatch.setattr(dispatch.Dispatch, "max_shared_optin", lambda self: h100["MaxSharedMemoryPerBlockOptin"])
    monkeypatch.setattr(matmul.MatmulDispatch, "_zero_for_split", lambda self, *a, **k: None, raising=False)
    monkeypatch.setattr(matmul.MatmulDispatch, "_copy_rows", staticmethod(
        lambda dst, src, stream=None: host_view(dst).__setitem__(Ellipsis, host_view(src))))

    def split_copy(w, quants, scales, stream=None):
        raw = host_view(w.buf)[w.offset:]
        blocks = np.lib.stride_tricks.as_strided(raw, shape=(w.m, w.k // 32, 34), strides=(w.row_stride, 34, 1))
        host_view(quants).view(np.uint8).reshape(w.m, w.k // 32, 32)[...] = blocks[:, :, 2:]
        host_view(scales).view(np.uint8).reshape(w.m, w.k // 32, 2)[...] = blocks[:, :, :2]

    monkeypatch.setattr(dmmv.DmmvDispatch, "_split_copy", staticmethod(split_copy))

    def upload_slot(cache, slot, stream=None):
        host_view(cache.page_table)[slot] = cache.alloc.page_table[slot]
        host_view(cache.lengths)[slot] = cache.alloc.lengths[slot]

    def upload_model(model, *, progress=None, stream=None):
        model.device, model.raw = {}, {}
        for name in gguf_loader.required_tensors(model.config):
            t = model.tensors[name]
            dst = _asarray(np.ascontiguousarray(t.data).view(np.uint8).reshape(-1))
            typed = {gguf_loader.QT.F32: np.float32, gguf_loader.QT.F16: np.float16}.get(t.qtype)
            model.device[name] = dst.view(typed).reshape(t.shape) if typed else dst.reshape(t.shape[0], -1)
            model.raw[name] = dst.reshape(t.shape[0] if len(t.shape) > 1 else 1, -1)
        return model.device

    monkeypatch.setattr(attention.PagedKVCache, "_upload", upload_slot)
    monkeypatch.setattr(gguf_loader.GGUFModel, "upload", upload_model)
    monkeypatch.setattr(T, "_to_device", lambda dst, values, stream: host_view(dst).__setitem__(Ellipsis, values))
    monkeypatch.setattr(T, "_to_host", lambda a, stream: host_view(a).copy())
    monkeypatch.setattr(T, "capture_graph", lambda fn, stream=None: _Graph(fn, stream))
    monkeypatch.setattr(T, "resolve_stream", lambda s=None: s if s is not None else current)
    return launches

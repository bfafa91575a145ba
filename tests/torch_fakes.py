"""A stand-in for the part of torch that cukern.interop touches, over host memory, for the CPU tests of the
tensor path (tests/test_interop.py): ``torch.Tensor`` (data_ptr, shape, stride, dtype, device), the dtypes,
``torch.empty``, the current stream and ``torch.cuda.stream``. Installed as ``sys.modules["torch"]`` for
one test; launches are recorded by tests/host_dispatch.py, so no kernel runs.
"""

from __future__ import annotations

import contextlib
import types

import numpy as np


class dtype:  # noqa: N801 (torch's name)
    def __init__(self, name: str, host: str):
        self.name, self.host, self.itemsize = name, np.dtype(host), np.dtype(host).itemsize

    def __repr__(self):
        return f"torch.{self.name}"


DTYPES = {n: dtype(n, h) for n, h in (("float32", "f4"), ("float16", "f2"), ("bfloat16", "u2"), ("int32", "i4"),
                                      ("int64", "i8"), ("uint8", "u1"), ("uint16", "u2"), ("complex64", "c8"))}


class device:  # noqa: N801
    def __init__(self, type: str, index: int | None = None):  # noqa: A002 (torch's name)
        self.type, self.index = type, index

    def __repr__(self):
        return f"{self.type}:{self.index}" if self.index is not None else self.type


class Tensor:
    """A strided tensor over a NumPy buffer (kept alive by the tensor), on ``device``."""

    def __init__(self, buf: np.ndarray, shape, dtype, dev=("cuda", 0), offset: int = 0, strides=None):
        self._buf, self.dtype, self._offset = buf, dtype, offset
        self.shape = tuple(shape)
        self._strides = tuple(strides) if strides is not None else tuple(
            int(np.prod(self.shape[i + 1:])) for i in range(len(self.shape)))
        self.device = device(*dev)
        self.requires_grad = False
        self._ptr = buf.ctypes.data + offset * dtype.itemsize

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def data_ptr(self) -> int:
        return self._ptr

    def stride(self):
        return self._strides

    def get_device(self) -> int:
        return self.device.index if self.is_cuda else -1

    def numpy(self) -> np.ndarray:
        """The elements as NumPy (bfloat16 as its uint16 bits)."""
        flat = self._buf.view(self.dtype.host)
        return np.lib.stride_tricks.as_strided(flat[self._offset:], self.shape,
                                               tuple(s * self.dtype.itemsize for s in self._strides))

    def __getitem__(self, rows: slice):
        """Rows ``start:stop`` of the first axis (a view)."""
        start, stop, _ = rows.indices(self.shape[0])
        return Tensor(self._buf, (stop - start, *self.shape[1:]), self.dtype, (self.device.type, self.device.index),
                      self._offset + start * self._strides[0], self._strides)


def tensor(values, dtype_name: str = "float32", dev=("cuda", 0)) -> Tensor:
    a = np.ascontiguousarray(np.asarray(values, DTYPES[dtype_name].host))
    buf = np.zeros(a.nbytes + 256, np.uint8)
    off = (-buf.ctypes.data) % 256
    buf[off:off + a.nbytes] = a.view(np.uint8).reshape(-1)
    return Tensor(buf, a.shape, DTYPES[dtype_name], dev, off // max(1, a.itemsize))


class Stream:
    def __init__(self, handle: int, dev: int = 0):
        self.cuda_stream, self.device = handle, device("cuda", dev)


def make(current_handle: int = 77):
    """A module object standing in for torch: tensors made by ``empty`` are recorded in ``.made`` with the
    stream current when they were made (``.made_on``)."""
    torch = types.ModuleType("torch")
    torch.Tensor, torch.device, torch.dtype = Tensor, device, dtype
    for n, d in DTYPES.items():
        setattr(torch, n, d)
    torch.made, torch.made_on, torch.current = [], [], [Stream(current_handle)]

    def empty(shape, dtype=None, device=None):
        t = tensor(np.full(tuple(shape), np.nan if dtype.host.kind == "f" else 7, dtype.host), dtype.name,
                   (device.type, device.index))
        torch.made.append(t)
        torch.made_on.append(torch.current[-1].cuda_stream)
        return t

    @contextlib.contextmanager
    def stream(s):
        torch.current.append(s)
        try:
            yield s
        finally:
            torch.current.pop()

    torch.empty = empty
    torch.cuda = types.SimpleNamespace(current_stream=lambda dev=None: torch.current[-1], stream=stream,
                                       ExternalStream=lambda handle, device=None: Stream(handle))
    torch._C = types.SimpleNamespace()
    torch.utils = types.SimpleNamespace(dlpack=types.SimpleNamespace(from_dlpack=lambda capsule: ("from_dlpack",
                                                                                                 capsule)))
    return torch

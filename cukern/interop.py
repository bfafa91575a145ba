"""Tensors of other frameworks in and out of the dispatch methods, zero-copy.

Every public dispatch method is wrapped by :func:`tensors`, in two layers around the method body:

* the outer layer picks the launch stream and allocates the outputs a call left None. With a torch
  tensor among the arguments and ``stream=None`` the kernels run on torch's current stream of the
  tensors' device, as a torch operator would; an explicit ``stream=`` (CuPy, torch, a raw handle)
  wins. Outputs are made in the inputs' framework (``torch.empty`` / ``cupy.empty``) on the launch
  stream, so that the allocator orders their reuse after the kernels that write them, with the
  dtype a method declares (``@tensors(out=like("x"))``: x's own, so bfloat16 stays bfloat16);
* the inner layer hands the body CuPy views of the same memory: a torch tensor's from its
  ``data_ptr()``, shape, strides and dtype (``torch.bfloat16`` as its uint16 bits, cukern's
  bfloat16; the view keeps the tensor alive); anything with ``__dlpack__`` through
  ``cupy.from_dlpack`` with the launch stream current (the producer orders its pending work before
  that stream: the DLPack handshake); anything with ``__cuda_array_interface__`` through
  ``cupy.asarray`` (which waits for the producer's stream when the interface names one). The
  result comes back as the caller's objects: a converted argument as the object passed, and, when a
  torch tensor came in, any other CuPy array as a torch view of it.

A ``repeatable`` method's replay cache sits between the two (:func:`wrap_inside`): it keys a torch
tensor by its own pointer, shape, strides, dtype and device, so that an eager loop's repeated call
makes no view at all and returns the caller's tensor.

As with torch's own operators, work on another stream is ordered by the caller
(``s.wait_stream(...)``); nothing here synchronises the host. torch is never imported here: a tensor
is recognised through ``sys.modules["torch"]``, loaded by whoever made it.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types

import cupy
import numpy as np
from cupy.cuda import memory

from cukern.streams import external_stream, resolve_stream

__all__ = ["TORCH_TYPES", "as_cupy", "like", "tensor_function", "tensors", "wrap_inside"]

_ndarray = cupy.ndarray
_KDL_CUDA, _KDL_CUDA_MANAGED = 2, 13  # DLPack device types of device memory
_current_device = cupy.cuda.runtime.getDevice
_raw_stream = None  # torch's current stream handle of a device (_torch_stream)

# torch dtype name -> the dtype of the CuPy view the kernels see (bfloat16 as its bits)
_TORCH_DTYPES = {"float32": "f4", "float16": "f2", "bfloat16": "u2", "float64": "f8", "int8": "i1", "uint8": "u1",
                 "int16": "i2", "uint16": "u2", "int32": "i4", "uint32": "u4", "int64": "i8", "uint64": "u8",
                 "bool": "?"}
_to_numpy: dict = {}   # torch.dtype -> np.dtype, filled on the first tensor
_to_torch: dict = {}   # np.dtype -> torch.dtype

_NATIVE, _TORCH, _DLPACK, _CAI = "native", "torch", "dlpack", "cai"
_KINDS: dict = {_ndarray: _NATIVE, int: _NATIVE, float: _NATIVE, bool: _NATIVE, str: _NATIVE,
                type(None): _NATIVE, tuple: _NATIVE, list: _NATIVE, np.ndarray: _NATIVE}
_PLAIN: set = {t for t, k in _KINDS.items() if k is _NATIVE}  # the types known to need no conversion
TORCH_TYPES: set = set()  # the torch tensor types seen so far (cukern.repeat keys them)


def _kind(t: type) -> str:
    """What an argument of type ``t`` is to the wrappers (cached per type)."""
    kind = _KINDS.get(t)
    if kind is None:
        torch = sys.modules.get("torch")
        if issubclass(t, _ndarray):
            kind = _NATIVE
        elif torch is not None and issubclass(t, torch.Tensor):
            kind = _TORCH
            TORCH_TYPES.add(t)
        elif hasattr(t, "__dlpack__"):
            kind = _DLPACK
        elif hasattr(t, "__cuda_array_interface__"):
            kind = _CAI
        else:
            kind = _NATIVE  # a number, a plan, a weight: the method's own checks judge it
        _KINDS[t] = kind
        if kind is _NATIVE:
            _PLAIN.add(t)
    return kind


# ----------------------------------------------------------------------------- conversions

def _dtype_maps(torch) -> None:
    if not _to_numpy:
        _to_numpy.update({getattr(torch, n): np.dtype(c) for n, c in _TORCH_DTYPES.items() if hasattr(torch, n)})
        _to_torch.update({np.dtype(c): getattr(torch, n) for n, c in _TORCH_DTYPES.items()
                          if n != "bfloat16" and hasattr(torch, n)})


def _numpy_dtype(name: str, t):
    dt = _to_numpy.get(t.dtype)
    if dt is None:
        _dtype_maps(sys.modules["torch"])
        dt = _to_numpy.get(t.dtype)
        if dt is None:
            raise TypeError(f"{name}: cukern takes no {t.dtype} tensors (its dtypes: "
                            f"{', '.join(_TORCH_DTYPES)}; bfloat16 arrives as its uint16 bits)")
    return dt


def _torch_view(name: str, t) -> cupy.ndarray:
    """A CuPy view of a CUDA tensor's memory that keeps the tensor alive; TypeError for a tensor on
    another device or of a dtype cukern has no kernels for."""
    if not t.is_cuda:
        raise TypeError(f"{name} is a torch tensor on {t.device}: cukern runs on CUDA tensors ({name}.cuda())")
    dt = _numpy_dtype(name, t)
    shape, strides = tuple(t.shape), tuple(s * dt.itemsize for s in t.stride())
    span = 0 if 0 in shape else dt.itemsize + sum((n - 1) * s for n, s in zip(shape, strides))
    mem = memory.UnownedMemory(t.data_ptr(), span, t, t.get_device())
    return _ndarray(shape, dt, memory.MemoryPointer(mem, 0), strides)


def _foreign_view(name: str, a, kind: str, stream) -> cupy.ndarray:
    """A CuPy array over a DLPack or CUDA-array-interface object's memory, ordered before ``stream``."""
    if kind == _DLPACK:
        device = getattr(a, "__dlpack_device__", None)
        if device is not None and device()[0] not in (_KDL_CUDA, _KDL_CUDA_MANAGED):
            raise TypeError(f"{name} is a {type(a).__name__} in host memory: cukern takes device arrays "
                            f"(cupy.asarray({name}), or the framework's own copy to the GPU)")
        with stream:
            return cupy.from_dlpack(a)
    with stream:
        return cupy.asarray(a)


def as_cupy(a, name: str = "array") -> cupy.ndarray:
    """``a`` as a CuPy array over the same device memory (zero-copy; a CuPy array is returned as is): a
    torch tensor (bfloat16 as uint16 bits; the view keeps the tensor alive), a DLPack or a
    CUDA-array-interface object. For the arrays a cukern object keeps (``QWeight.buf`` ...)."""
    kind = _kind(type(a))
    if kind == _NATIVE:
        return a
    if kind == _TORCH:
        return _torch_view(name, a)
    return _foreign_view(name, a, kind, cupy.cuda.get_current_stream())


def _back(result, originals: dict, torch_out: bool, stream):
    """The result in the caller's objects: a converted argument as the object passed; with ``torch_out`` any
    other CuPy array (a plan's buffer) as a torch view of it, exported with the launch stream current (the
    DLPack handshake then orders torch's current stream after it, a no-op when they are one)."""
    if type(result) is tuple:
        return tuple(_back(r, originals, torch_out, stream) for r in result)
    if isinstance(result, _ndarray):
        original = originals.get(id(result))
        if original is not None:
            return original
        if torch_out:
            with stream:
                return sys.modules["torch"].utils.dlpack.from_dlpack(result)
    return result


def _converting(method, names):
    """The inner layer: ``method`` called with every foreign array as a CuPy view (module docstring)."""

    @functools.wraps(method)
    def call(self, *args, stream, **kwargs):
        originals, torch_out = {}, False
        for i, a in enumerate(args):
            kind = _KINDS.get(type(a)) or _kind(type(a))
            if kind is not _NATIVE:
                name = names[i] if i < len(names) else f"argument {i}"
                view = _torch_view(name, a) if kind is _TORCH else _foreign_view(name, a, kind, stream)
                args = (*args[:i], view, *args[i + 1:])
                originals[id(view)], torch_out = a, torch_out or kind is _TORCH
        for k, a in kwargs.items():
            kind = _KINDS.get(type(a)) or _kind(type(a))
            if kind is not _NATIVE:
                view = _torch_view(k, a) if kind is _TORCH else _foreign_view(k, a, kind, stream)
                kwargs[k] = view
                originals[id(view)], torch_out = a, torch_out or kind is _TORCH
        result = method(self, *args, stream=stream, **kwargs)
        return _back(result, originals, torch_out, stream) if originals else result

    return call


# ----------------------------------------------------------------------------- outputs and streams

class like:  # noqa: N801 (reads as a declaration: out=like("x"))
    """How a method allocates an output argument left None: with the shape and dtype of argument
    ``name`` (the framework's own dtype: a bfloat16 tensor gives a bfloat16 output), or ``shape`` (a
    function of the argument getter: ``shape=lambda a: (a("x").shape[0], a("k"))``) and ``dtype`` (a
    NumPy dtype) given."""

    __slots__ = ("name", "shape", "dtype")

    def __init__(self, name: str, *, shape=None, dtype=None):
        self.name, self.shape, self.dtype = name, shape, None if dtype is None else np.dtype(dtype)


def _torch_stream(torch, device: int):
    """torch's current stream on ``device``, as the CuPy stream the kernels launch on."""
    global _raw_stream
    if _raw_stream is None:  # an int handle without a Stream object made, where torch has it
        _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda dev: torch.cuda.current_stream(dev).cuda_stream)
    return external_stream(_raw_stream(device), device)


def _allocate(spec: like, get, device, stream):
    """An output as ``spec`` says, from the call's arguments (``get(name)``): a torch tensor on ``device``
    when a tensor came in (None: a CuPy array), allocated on the launch stream. None where the arguments
    it is computed from are not arrays: the method's own checks then say what is wrong with them."""
    base = get(spec.name)
    if _KINDS.get(type(base)) is _CAI:  # shape and dtype from the interface (DLPack objects: array-API ones)
        cai = base.__cuda_array_interface__
        base = types.SimpleNamespace(shape=tuple(cai["shape"]), dtype=np.dtype(cai["typestr"]))
    try:
        shape = tuple(int(n) for n in (base.shape if spec.shape is None else spec.shape(get)))
        dtype = spec.dtype if spec.dtype is not None else base.dtype
    except (AttributeError, IndexError, TypeError, ValueError):
        return None
    if device is None:
        with stream:
            return cupy.empty(shape, dtype)
    torch = sys.modules["torch"]
    if not isinstance(dtype, torch.dtype):
        _dtype_maps(torch)
        dtype = _to_torch[np.dtype(dtype)]
    where = torch.device("cuda", device)
    if torch.cuda.current_stream(where).cuda_stream == stream.ptr:
        return torch.empty(shape, dtype=dtype, device=where)
    with torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr, device=where)):
        return torch.empty(shape, dtype=dtype, device=where)


def _device_error(names, args, kwargs):
    """Raise for a call whose torch tensors are not all on one CUDA device, naming them."""
    device = None
    for name, a in (*zip(names, args), *kwargs.items()):
        if type(a) in TORCH_TYPES:
            if not a.is_cuda:
                raise TypeError(f"{name} is a torch tensor on {a.device}: cukern runs on CUDA tensors ({name}.cuda())")
            if device is not None and a.get_device() != device:
                raise ValueError(f"{name} is on cuda:{a.get_device()}, another tensor of the call on cuda:{device}")
            device = a.get_device()


def _outer_slow(target, specs, out_at, names, positions, dispatch, args, kwargs):
    """The outer layer with a foreign array or an output to allocate: the launch stream, the outputs, then
    ``target`` (the replay cache or the inner layer)."""
    stream = kwargs.pop("stream", None)
    device = None  # the torch tensors' device; None: no torch tensor came in
    for group in (args, kwargs.values()):
        for a in group:
            if type(a) in TORCH_TYPES and (dev := a.get_device()) != device:
                if device is not None or dev < 0:
                    _device_error(names, args, kwargs)
                device = dev
    if device is None:
        launch = resolve_stream(stream)
    else:
        want = dispatch._device if dispatch._device is not None else _current_device()
        if device != want:
            raise ValueError(f"the tensors are on cuda:{device}, the dispatch runs on device {want} "
                             f"(make it with device={device}, or call it under cupy.cuda.Device({device}))")
        launch = resolve_stream(stream) if stream is not None else _torch_stream(sys.modules["torch"], device)
    if specs and any((args[i] if -1 < i < len(args) else kwargs.get(n)) is None for i, n in out_at):
        args = list(args)

        def get(name):
            i = positions.get(name)
            return args[i] if i is not None and i < len(args) else kwargs.get(name)

        for name, spec in specs:
            if get(name) is None:
                out = _allocate(spec, get, device, launch)
                i = positions.get(name)
                if i is not None and i < len(args):
                    args[i] = out
                else:
                    kwargs[name] = out
    return target(dispatch, *args, stream=launch, **kwargs)


def tensors(method=None, /, **outputs):
    """Make a dispatch method take the device arrays of any framework (module docstring) and, for each
    keyword ``name=like(...)``, allocate argument ``name`` when it is None: ``@tensors`` or
    ``@tensors(out=like("x"))``. A call whose arrays are all CuPy arrays and whose outputs are all
    given goes straight to the method after one type test per argument."""
    if method is None:
        return lambda m: tensors(m, **outputs)
    return _build(method, None, outputs)


_ON_CURRENT_DEVICE = types.SimpleNamespace(_device=None)  # the "dispatch" of a module-level entry point


def tensor_function(fn=None, /, **outputs):
    """:func:`tensors` for a module-level function (the FlashAttention-style entry points): the same two
    layers, the tensors checked against the current device; ``fn`` takes ``stream=``."""
    if fn is None:
        return lambda f: tensor_function(f, **outputs)

    def method(_self, *args, **kwargs):
        return fn(*args, **kwargs)

    sig = inspect.signature(fn)
    method.__qualname__ = fn.__qualname__
    method.__signature__ = sig.replace(
        parameters=[inspect.Parameter("_self", inspect.Parameter.POSITIONAL_ONLY), *sig.parameters.values()])
    call = _build(method, None, outputs)

    @functools.wraps(fn)
    def entry(*args, **kwargs):
        return call(_ON_CURRENT_DEVICE, *args, **kwargs)

    entry.__cukern_tensors__ = call.__cukern_tensors__
    return entry


def wrap_inside(fn, decorator):
    """``decorator`` (``repeatable``) placed between the two layers of ``fn``'s :func:`tensors` wrapper
    (around ``fn`` itself when it has none), so that it sees the launch stream and the outputs the outer
    layer chose, and calls the inner layer only when it runs the method."""
    built = getattr(fn, "__cukern_tensors__", None)
    if built is None:
        return decorator(fn)
    method, _, outputs = built
    return _build(method, decorator, outputs)


def _build(method, middle, outputs: dict):
    params = list(inspect.signature(method).parameters.values())[1:]  # without self
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    positions = {n: i for i, n in enumerate(names)}
    for name, spec in outputs.items():
        if not isinstance(spec, like) or name not in {p.name for p in params}:
            raise TypeError(f"{method.__qualname__}: tensors({name}=...) needs a like() for one of its arguments")
    specs = tuple(outputs.items())
    out_at = tuple((positions.get(n, -1), n) for n in outputs)
    inner = _converting(method, names)
    target = inner if middle is None else middle(inner)
    direct = method if middle is None else target  # all-CuPy calls: the body, or the cache
    plain = _PLAIN

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        for a in args:
            if type(a) not in plain and _kind(type(a)) is not _NATIVE:
                return _outer_slow(target, specs, out_at, names, positions, self, args, kwargs)
        for a in kwargs.values():
            if type(a) not in plain and _kind(type(a)) is not _NATIVE:
                return _outer_slow(target, specs, out_at, names, positions, self, args, kwargs)
        for i, name in out_at:
            if (args[i] if -1 < i < len(args) else kwargs.get(name)) is None:
                return _outer_slow(target, specs, out_at, names, positions, self, args, kwargs)
        return direct(self, *args, **kwargs)

    call.__cukern_tensors__ = (method, middle, outputs)
    return call

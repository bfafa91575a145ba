"""The base of every family's Dispatch class, and the argument checks they share.

The three tiers of a cukern operation:

1. the ``__global__`` kernel in ``cuda_src/<family>/``;
2. a launcher, :meth:`Dispatch._launch`: it checks that the kernel exists, that
   the packed struct is the one the kernel takes, that every other argument is
   a device pointer, and that the grid is legal, then launches on the given
   stream inside an NVTX range (when profiling is on) and between two CUDA
   events (when a launch timer is set: :func:`set_launch_timer`); ``pdl=True``
   launches with programmatic dependent launch (``cuLaunchKernelEx``) on sm_90+;
3. the public method (``ElementwiseDispatch.rms_norm`` ...): it validates the
   caller's arrays (``check_array``), packs the struct and picks the grid.

Validation raises TypeError/ValueError before any launch; a launcher never
synchronises, allocates or reads device memory, so dispatches can be captured
into CUDA graphs.
"""

from __future__ import annotations

import ctypes
import functools
import os

import cupy
import numpy as np

from cukern import runtime
from cukern.params import ParamStruct, check_int, check_real, load_header  # noqa: F401 (shared checks)
from cukern.repeat import recording as _recording
from cukern.repeat import repeatable  # noqa: F401 (the dispatches' decorator)
from cukern.runtime import FamilySpec
from cukern.streams import resolve_stream

__all__ = ["Dispatch", "Unit", "check_array", "check_int", "check_real", "enable_nvtx", "nvtx_enabled",
           "repeatable", "set_launch_timer", "tensor_map_2d"]

_MAX_GRID = (2**31 - 1, 65535, 65535)

# ----------------------------------------------------------------------------- NVTX

_nvtx_on = os.environ.get("CUKERN_NVTX", "0") not in ("", "0", "false", "False")
_nvtx_domain = None


def enable_nvtx(on: bool = True) -> None:
    """Wrap every dispatch in an NVTX range named after its kernel (also: CUKERN_NVTX=1)."""
    global _nvtx_on
    _nvtx_on = bool(on)


def nvtx_enabled() -> bool:
    return _nvtx_on


# An object with begin(kernel) -> token and end(token), called around every launch on the
# launch stream (cukern.profiler.KernelTimer); None, the default, costs nothing per launch.
_launch_timer = None


def set_launch_timer(timer) -> None:
    """Bracket every dispatch with ``timer.begin(kernel)`` / ``timer.end(token)`` (None: off).
    Both run on the host with the launch stream current; see :class:`cukern.profiler.KernelTimer`."""
    global _launch_timer
    _launch_timer = timer


def _domain():
    global _nvtx_domain
    if _nvtx_domain is None:
        import nvtx
        _nvtx_domain = nvtx.get_domain("cukern")
    return _nvtx_domain


# ----------------------------------------------------------------------------- argument checks

def _dtypes(dtype) -> tuple[np.dtype, ...]:
    return tuple(np.dtype(d) for d in (dtype if isinstance(dtype, (tuple, list)) else (dtype,)))


def check_array(name: str, a, *, dtype=None, shape=None, ndim=None, contiguous: bool = True,
                align: int = 0, device: int | None = None) -> cupy.ndarray:
    """Validate a device array argument; raise TypeError/ValueError naming it.

    ``dtype``: one dtype or a tuple of accepted ones. ``shape``: a tuple whose
    entries are ints, or None for "any". ``align``: required byte alignment of
    the data pointer (e.g. 16 for float4 loads). Runs on every dispatch, so the
    common path is kept to a few attribute reads."""
    if type(a) is not cupy.ndarray and not isinstance(a, cupy.ndarray):
        raise TypeError(f"{name} must be a cupy.ndarray on the GPU, got {type(a).__name__} (the dispatch methods take "
                        f"torch tensors and other DLPack / __cuda_array_interface__ device arrays too; "
                        f"cukern.interop.as_cupy makes a zero-copy CuPy view of one)")
    if dtype is not None and a.dtype != dtype and (not isinstance(dtype, tuple) or a.dtype not in dtype):
        accepted = _dtypes(dtype)
        if a.dtype not in accepted:
            raise TypeError(f"{name} must have dtype {' or '.join(str(d) for d in accepted)}, got {a.dtype}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {a.shape}")
    if shape is not None:
        got = a.shape
        if len(shape) != len(got) or any(s is not None and s != n for s, n in zip(shape, got)):
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise ValueError(f"{name} must have shape {want}, got {got}")
    if contiguous and not a._c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if align and a.data.ptr % align:
        raise ValueError(f"{name} must be {align}-byte aligned (data pointer {a.data.ptr:#x})")
    if device is not None and a.device.id != device:
        raise ValueError(f"{name} is on device {a.device.id}, the dispatch runs on device {device}")
    return a


@functools.lru_cache(maxsize=None)
def device_attribute(device_id: int, name: str) -> int:
    """A CUDA device attribute by CuPy's name (``"MultiProcessorCount"``), queried once per device."""
    return int(cupy.cuda.Device(device_id).attributes[name])


# ----------------------------------------------------------------------------- programmatic dependent launch
# CuPy launches through cuLaunchKernel, which takes no launch attributes: a kernel that may overlap
# the previous one in the stream (common/pdl.cuh) goes through the driver's cuLaunchKernelEx.

_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, padding, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=1)
def _cu_launch_kernel_ex():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuLaunchKernelEx
    fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                   ctypes.c_void_p]
    fn.restype = ctypes.c_int
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return fn, lib.cuGetErrorName


@functools.lru_cache(maxsize=None)
def _pdl_supported(device_id: int) -> bool:
    """Programmatic dependent launch needs sm_90 or newer (queried once per device)."""
    return runtime.device_arch(device_id) >= 90


def _raw_launch(kernel: str, fn, grid, block, args, shared_mem: int, pdl: bool) -> None:
    if pdl:
        _launch_pdl(kernel, fn, grid, block, args, shared_mem)
    else:
        fn(grid, block, args, shared_mem=shared_mem)


@functools.lru_cache(maxsize=1)
def _pdl_attribute():
    """The one launch attribute of a pdl launch (a constant, built once)."""
    attr = _LaunchAttribute(id=_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1
    return ctypes.pointer(attr)


def _launch_pdl(kernel: str, fn, grid, block, args, shared_mem: int) -> None:
    """``fn(grid, block, args)`` with programmatic stream serialisation allowed, on the current stream: the
    kernel may start before the previous kernel in the stream ends (it waits for it with pdl_wait())."""
    _PreparedLaunch(kernel, fn, grid, block, args, shared_mem, True)(cupy.cuda.get_current_stream().ptr)


class _PreparedLaunch:
    """A launch's driver arguments built once: one 8-byte slot per device pointer (a cupy array), the
    bytes of every other argument (a packed struct, a tensor map, a detached pointer), the launch
    config (with the pdl attribute where ``pdl``); calling it issues the launch on a stream through
    one cuLaunchKernelEx call. A remembered call (cukern.repeat) keeps one per launch and issues it
    again for the stream's pointer: none of CuPy's per-call argument marshalling."""

    __slots__ = ("kernel", "fn_ptr", "slots", "params", "keep", "config")

    def __init__(self, kernel: str, fn, grid, block, args, shared_mem: int, pdl: bool):
        n = len(args)
        self.kernel, self.fn_ptr = kernel, getattr(fn, "kernel", fn).ptr  # RawKernel -> Function
        self.slots = (ctypes.c_uint64 * n)()
        self.params = (ctypes.c_void_p * n)()
        self.keep = []
        base = ctypes.addressof(self.slots)
        for i, a in enumerate(args):
            if isinstance(a, cupy.ndarray):
                self.slots[i] = a.data.ptr
                self.params[i] = base + 8 * i
            else:
                self.keep.append(ctypes.create_string_buffer(a.tobytes(), a.nbytes))
                self.params[i] = ctypes.addressof(self.keep[-1])
        self.config = (_LaunchConfig(grid, block, shared_mem, 0, _pdl_attribute(), 1) if pdl else
                       _LaunchConfig(grid, block, shared_mem, 0, None, 0))

    def __call__(self, stream_ptr: int) -> None:
        launch, error_name = _cu_launch_kernel_ex()
        self.config.stream = stream_ptr
        err = launch(ctypes.byref(self.config), self.fn_ptr, self.params, None)
        if err:
            name = ctypes.c_char_p()
            error_name(err, ctypes.byref(name))
            raise runtime.CukernError(f"{self.kernel}: cuLaunchKernelEx failed with {name.value.decode()} ({err})")


# ----------------------------------------------------------------------------- tensor maps
# The copy engine's 2-D tiled loads (common/mbarrier.cuh tma_load_2d) read a CUtensorMap that the
# driver encodes on the host (cuTensorMapEncodeTiled); it travels by value as a kernel argument.

TENSOR_MAP_DTYPE = np.dtype([("opaque", "<u8", (16,))])  # CUtensorMap: 128 opaque bytes
_TMA_DATA_TYPES = {np.dtype(np.float16): 6, np.dtype(np.float32): 7}  # CU_TENSOR_MAP_DATA_TYPE_*
_TMA_SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}  # bytes -> CU_TENSOR_MAP_SWIZZLE_*
_TMA_L2_PROMOTION_256B = 3


@functools.lru_cache(maxsize=1)
def _cu_tensor_map_encode_tiled():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
                   ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def bounded_put(cache: dict, key, value, limit: int):
    """``cache[key] = value`` in a dict kept to ``limit`` entries, the oldest leaving first; returns value."""
    if len(cache) >= limit:
        cache.pop(next(iter(cache)))
    cache[key] = value
    return value


_TMA_CACHE: dict = {}
_TMA_CACHE_SIZE = 256  # encoded maps kept (a dict lookup instead of a driver call per launch)


def tensor_map_2d(a: cupy.ndarray, box: tuple[int, int], swizzle: int = 128) -> np.void:
    """A tensor map of the 2-D row-strided view ``a`` ([rows, cols], unit stride along a row) for
    boxes of ``box = (cols, rows)`` elements, out-of-range elements zero-filled: 128 bytes to pass
    as a ``const __grid_constant__ cukern::TensorMap`` argument. Maps are cached by address, shape,
    strides and box (the last 256), so a repeated call costs a dict lookup. The driver's rules hold: base
    16-byte aligned, row stride a multiple of 16 bytes, box sides 1..256, ``box[0]`` times the
    element size a multiple of 16 (and at most ``swizzle`` bytes when swizzled)."""
    key = (a.data.ptr, a.shape, a.strides, a.dtype.char, box, swizzle)
    hit = _TMA_CACHE.get(key)
    if hit is not None:
        return hit
    dt = _TMA_DATA_TYPES.get(a.dtype)
    if dt is None or a.ndim != 2 or a.strides[1] != a.itemsize:
        raise ValueError(f"tensor_map_2d takes a 2-D f16/f32 view with unit row stride, got {a.dtype} {a.shape} "
                         f"strides {a.strides}")
    rows, cols = a.shape
    pitch = a.strides[0] if rows > 1 else -(-cols * a.itemsize // 16) * 16  # one row: any legal stride
    if a.data.ptr % 16 or pitch % 16:
        raise ValueError(f"tensor_map_2d: base {a.data.ptr:#x} and row stride {pitch} bytes must be 16-byte aligned")
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(pitch)
    boxes = (ctypes.c_uint32 * 2)(*box)
    ones = (ctypes.c_uint32 * 2)(1, 1)
    buf = ctypes.create_string_buffer(128 + 64)
    addr = -(-ctypes.addressof(buf) // 64) * 64  # CUtensorMap is 64-byte aligned
    err = _cu_tensor_map_encode_tiled()(addr, dt, 2, a.data.ptr, dims, strides, boxes, ones, 0,
                                        _TMA_SWIZZLE[swizzle], _TMA_L2_PROMOTION_256B, 0)
    if err:
        raise runtime.CukernError(f"cuTensorMapEncodeTiled failed ({err}) for a {a.dtype} {a.shape} view, "
                                  f"row stride {pitch} bytes, box {box}, swizzle {swizzle}")
    return bounded_put(_TMA_CACHE, key, np.frombuffer(ctypes.string_at(addr, 128), TENSOR_MAP_DTYPE)[0],
                       _TMA_CACHE_SIZE)


def _grid3(name: str, dims, limits) -> tuple[int, int, int]:
    if type(dims) is int:
        if not 1 <= dims <= limits[0]:
            raise ValueError(f"{name} ({dims},) is outside the CUDA limits {limits}")
        return (dims, 1, 1)
    dims = (dims,) if isinstance(dims, (int, np.integer)) else tuple(dims)
    if not 1 <= len(dims) <= 3:
        raise ValueError(f"{name} must have 1 to 3 dimensions, got {dims}")
    dims = dims + (1,) * (3 - len(dims))
    for d, limit in zip(dims, limits):
        if not isinstance(d, (int, np.integer)) or not 1 <= d <= limit:
            raise ValueError(f"{name} {dims} is outside the CUDA limits {limits}")
    return tuple(int(d) for d in dims)


# ----------------------------------------------------------------------------- Dispatch

class Dispatch:
    """Base of the family dispatch classes. Subclasses set ``family``.

    The family's module is compiled on first use for this dispatch's device
    (lazily: constructing a Dispatch needs no GPU)."""

    family: FamilySpec

    def __init__(self, device: int | None = None):
        self._device = device
        self._module = None
        self._functions: dict[str, object] = {}
        self._structs: dict[str, ParamStruct] = load_header(self.family.params_header)
        for k in self.family.kernels:
            if k.params not in self._structs:
                raise runtime.CukernError(f"family {self.family.name}: kernel {k.name} takes {k.params}, "
                                          f"which {self.family.params_header} does not declare")

    @property
    def device_id(self) -> int:
        return cupy.cuda.Device(self._device).id if self._device is not None else cupy.cuda.Device().id

    def sm_count(self) -> int:
        """Multiprocessors of this dispatch's device."""
        return device_attribute(self.device_id, "MultiProcessorCount")

    def resident_blocks(self, kernel: str, threads: int, shared_mem: int = 0) -> int:
        """Blocks of ``kernel`` (``threads`` each, ``shared_mem`` dynamic shared bytes) one SM holds at once
        (the driver's occupancy calculator; compiles the module if need be)."""
        fn = self._function(kernel, shared_mem)
        with cupy.cuda.Device(self.device_id):
            return int(cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
                getattr(fn, "kernel", fn).ptr, int(threads), int(shared_mem)))

    def max_shared_optin(self) -> int:
        """The most dynamic shared memory one block may opt in to on this device (bytes)."""
        return device_attribute(self.device_id, "MaxSharedMemoryPerBlockOptin")

    def struct(self, name: str) -> ParamStruct:
        return self._structs[name]

    def load(self):
        """Compile (or fetch from cache) this family's module for the device; returns it."""
        if self._module is None:
            with cupy.cuda.Device(self.device_id):
                arch = runtime.device_arch()
                names = tuple(k.name for k in self.family.kernels)
                self._module = runtime.load_module(self.family.name, self.family.unit_source(), names, arch,
                                                   self.family.defines)
        return self._module

    def _function(self, kernel: str, shared_mem: int = 0):
        fn = self._functions.get(kernel)
        if fn is None:
            fn = self.load().get_function(kernel)
            self._functions[kernel] = fn
        if shared_mem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < shared_mem:
            fn.max_dynamic_shared_size_bytes = shared_mem
        return fn

    def _launch(self, kernel: str, grid, block, pointers: tuple, params: np.void, *, stream=None,
                shared_mem: int = 0, pdl: bool = False) -> tuple:
        """Launch ``kernel(*pointers, params)``; see the module docstring for what is checked.
        ``pdl``: the kernel follows common/pdl.cuh's contract and may start before the previous
        kernel in the stream ends (honoured from sm_90; older devices launch it plainly).
        Returns the checked launch, which :meth:`relaunch` issues again without the checks."""
        spec = self.family.kernel(kernel)
        struct = self._structs[spec.params]
        if not isinstance(params, np.void) or params.dtype != struct.dtype:
            raise TypeError(f"{kernel} takes a packed {struct.name} (use struct('{struct.name}').pack(...)), "
                            f"got {type(params).__name__}")
        for i, p in enumerate(pointers):
            if type(p) is not cupy.ndarray and not isinstance(p, cupy.ndarray) and not (
                    isinstance(p, np.void) and p.dtype == TENSOR_MAP_DTYPE):
                raise TypeError(f"{kernel}: argument {i} must be a cupy.ndarray (a device pointer) or a "
                                f"tensor map, got {type(p).__name__}")
        grid = _grid3(f"{kernel}: grid", grid, _MAX_GRID)
        block = _grid3(f"{kernel}: block", block, (1024, 1024, 64))
        if block[0] * block[1] * block[2] > 1024:
            raise ValueError(f"{kernel}: block {block} has more than 1024 threads")
        fn = self._function(kernel, shared_mem)
        launch = (kernel, fn, grid, block, (*pointers, params), shared_mem, pdl and _pdl_supported(self.device_id))
        self.relaunch(launch, stream)
        recording = getattr(_recording, "launches", None)
        if recording is not None:
            recording.append(self.detach(launch))
        return launch

    @staticmethod
    def detach(launch: tuple) -> tuple:
        """The launch with its array arguments as bare device pointers (np.uint64, the same
        argument bytes), so that keeping it keeps no caller's array alive."""
        kernel, fn, grid, block, args, shared_mem, pdl = launch
        args = tuple(np.uint64(a.data.ptr) if isinstance(a, cupy.ndarray) else a for a in args)
        return kernel, fn, grid, block, args, shared_mem, pdl

    @staticmethod
    def relaunch(launch: tuple, stream=None) -> None:
        """Issue a launch that :meth:`_launch` checked (same kernel, arguments and sizes) on
        ``stream``: what a dispatch method's cache of its own calls replays (detached: the caller
        must pass the same arrays again, which the cache's key makes sure of)."""
        if stream is None or stream is cupy.cuda.get_current_stream():
            Dispatch._call(*launch)
        else:
            with resolve_stream(stream):
                Dispatch._call(*launch)

    def _repeat_state(self):
        """The settings a repeatable method's launches depend on besides its arguments."""
        return getattr(self, "pdl", False)

    @staticmethod
    def _replay(replay, i: int, stream) -> None:
        """Issue launch i of a remembered call (repeatable) on ``stream`` from its prepared driver
        arguments (made on first use)."""
        prepared = replay.prepared[i]
        if prepared is None:
            kernel, fn, grid, block, args, shared_mem, pdl = replay.launches[i]
            prepared = replay.prepared[i] = _PreparedLaunch(kernel, fn, grid, block, args, shared_mem, pdl)
        prepared(stream.ptr)

    @staticmethod
    def _call(kernel, fn, grid, block, args, shared_mem, pdl=False):
        if _nvtx_on or _launch_timer is not None:
            Dispatch._call_profiled(kernel, fn, grid, block, args, shared_mem, pdl)
        else:
            _raw_launch(kernel, fn, grid, block, args, shared_mem, pdl)

    @staticmethod
    def _call_profiled(kernel, fn, grid, block, args, shared_mem, pdl=False):
        timer, dom = _launch_timer, (_domain() if _nvtx_on else None)
        if dom is not None:
            dom.push_range(dom.get_event_attributes(message=kernel))
        token = timer.begin(kernel) if timer is not None else None
        try:
            _raw_launch(kernel, fn, grid, block, args, shared_mem, pdl)
        finally:
            if timer is not None:
                timer.end(token)
            if dom is not None:
                dom.pop_range()


class Unit(Dispatch):
    """One more compilation unit of a family (a FamilySpec with its own RawModule), launched through the
    same checks as the family's dispatch. ``sm90a``: on an sm_90 device the unit is built for sm_90a
    (wgmma), which CuPy's RawModule cannot be asked for (runtime.load_module_sm90a); elsewhere its
    sm_90a kernels compile to stubs that the dispatch never launches."""

    def __init__(self, family: FamilySpec, device: int | None = None, sm90a: bool = False):
        self.family = family
        self.sm90a = sm90a
        self._sm90: bool | None = None
        super().__init__(device)

    def is_sm90(self) -> bool:
        """Whether this unit's device is an sm_90 (Hopper) one."""
        if self._sm90 is None:
            with cupy.cuda.Device(self.device_id):
                self._sm90 = runtime.device_arch() == 90
        return self._sm90

    def load(self):
        if self._module is None and self.sm90a and self.is_sm90():
            with cupy.cuda.Device(self.device_id):
                self._module = runtime.load_module_sm90a(self.family.name, self.family.unit_source(),
                                                         tuple(k.name for k in self.family.kernels),
                                                         self.family.defines)
        return super().load()

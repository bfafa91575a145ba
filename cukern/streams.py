"""Streams, event timing and CUDA graphs.

Every dispatch method takes ``stream=``: a ``cupy.cuda.Stream`` (or
``ExternalStream``), a torch stream, a raw ``cudaStream_t`` handle, or None for
CuPy's current stream (torch's current one when a torch tensor is among the
arguments: cukern.interop). Nothing here synchronises unless its name says so.

* :class:`EventTimer` brackets device work with two CUDA events;
* :func:`benchmark` times a callable with ``cupyx.profiler.benchmark`` and
  returns the median device time;
* :func:`capture_graph` records a sequence of dispatches into a CUDA graph
  whose :meth:`Graph.replay` relaunches them for well under a microsecond per
  kernel (a CuPy launch from Python costs several).
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass

import cupy
import numpy as np

__all__ = ["resolve_stream", "external_stream", "EventTimer", "Timing", "benchmark", "Graph", "capture_graph"]


_EXTERNAL: dict = {}  # (handle, device) -> the CuPy stream wrapping it
_EXTERNAL_LIMIT = 256


def resolve_stream(stream=None):
    """The CuPy stream a dispatch launches on: ``None`` -> CuPy's current stream; a CuPy stream ->
    itself; a torch ``cuda.Stream`` (anything with a ``cuda_stream`` handle, on its ``device``) or a
    raw ``cudaStream_t`` handle as an int (0 the legacy default stream, 2 the per-thread one) -> a
    CuPy stream over it (``Stream.from_external``, made once per handle; it does not own the stream, so the
    caller keeps it alive while work is queued); anything else -> TypeError."""
    if stream is None:
        return cupy.cuda.get_current_stream()
    if isinstance(stream, (cupy.cuda.Stream, cupy.cuda.ExternalStream)):
        return stream
    handle, device = getattr(stream, "cuda_stream", None), -1
    if handle is not None:
        device = getattr(getattr(stream, "device", None), "index", None)
        device = -1 if device is None else device
    elif isinstance(stream, (int, np.integer)) and not isinstance(stream, (bool, np.bool_)):
        handle = stream
    if handle is None or isinstance(handle, bool) or not isinstance(handle, (int, np.integer)) or handle < 0:
        raise TypeError(f"stream must be a cupy.cuda.Stream, a torch.cuda.Stream, a cudaStream_t handle (int) or "
                        f"None, got {type(stream).__name__}")
    return external_stream(int(handle), int(device))


class _Handle:
    """A raw ``cudaStream_t`` as an object of the CUDA stream protocol (``__cuda_stream__``), which
    ``cupy.cuda.Stream.from_external`` takes."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def external_stream(handle: int, device: int = -1):
    """A CuPy stream over the ``cudaStream_t`` ``handle`` of ``device`` (-1: the current one; not owned:
    ``cupy.cuda.Stream.from_external``), made once per pair (the last 256 kept)."""
    key = (handle, device)
    ext = _EXTERNAL.get(key)
    if ext is None:
        if len(_EXTERNAL) >= _EXTERNAL_LIMIT:
            _EXTERNAL.pop(next(iter(_EXTERNAL)))
        ext = _EXTERNAL[key] = _wrap_handle(handle, device)
    return ext


def _wrap_handle(handle: int, device: int):
    with cupy.cuda.Device(device) if device >= 0 else contextlib.nullcontext():
        return cupy.cuda.Stream.from_external(_Handle(handle))


class EventTimer:
    """Time device work on a stream with CUDA events::

        with EventTimer(stream) as t:
            dispatch.rms_norm(...)
        print(t.ms)   # synchronises on the end event the first time it is read
    """

    def __init__(self, stream=None):
        self.stream = resolve_stream(stream)
        self._start = cupy.cuda.Event()
        self._end = cupy.cuda.Event()
        self._ms: float | None = None

    def __enter__(self) -> "EventTimer":
        self._ms = None
        self._start.record(self.stream)
        return self

    def __exit__(self, *exc) -> None:
        self._end.record(self.stream)

    @property
    def ms(self) -> float:
        if self._ms is None:
            self._end.synchronize()
            self._ms = cupy.cuda.get_elapsed_time(self._start, self._end)
        return self._ms


@dataclass(frozen=True)
class Timing:
    name: str
    median_ms: float  # device time, CUDA events
    min_ms: float
    n_repeat: int

    @property
    def median_us(self) -> float:
        return self.median_ms * 1e3


def benchmark(fn, *, name: str = "", n_warmup: int = 10, n_repeat: int = 100) -> Timing:
    """Median device time of ``fn()`` on the current stream (``cupyx.profiler.benchmark``).

    ``fn`` should rotate its inputs when they would otherwise sit in L2."""
    from cupyx.profiler import benchmark as _bench
    result = _bench(fn, n_warmup=n_warmup, n_repeat=n_repeat, name=name or getattr(fn, "__name__", "fn"))
    gpu_ms = np.asarray(result.gpu_times)[0] * 1e3  # seconds -> ms, first (only) device
    return Timing(result.name, float(np.median(gpu_ms)), float(gpu_ms.min()), n_repeat)


class Graph:
    """A captured CUDA graph; :meth:`replay` launches it on a stream."""

    def __init__(self, graph, stream):
        self._graph = graph
        self.stream = stream

    def replay(self, stream=None) -> None:
        self._graph.launch(resolve_stream(stream) if stream is not None else self.stream)


def capture_graph(fn, stream=None) -> Graph:
    """Record ``fn(stream)`` into a CUDA graph.

    Capture needs a stream other than the legacy default one: with ``stream``
    None a new non-blocking stream is made and becomes the graph's default.
    Everything ``fn`` launches must go to the stream it is given, and ``fn``
    must not synchronise, allocate fresh device memory or read device values on
    the host; CUDA rejects such calls during capture, and CuPy raises."""
    stream = resolve_stream(stream) if stream is not None else cupy.cuda.Stream(non_blocking=True)
    if stream.ptr == 0:
        raise ValueError("capture_graph needs a non-default stream (cupy.cuda.Stream(non_blocking=True))")
    with stream:
        stream.begin_capture()
        try:
            fn(stream)
        finally:
            graph = stream.end_capture()
    return Graph(graph, stream)

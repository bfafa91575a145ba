"""Where the time of a decode step goes, without nsys: CUDA events around every dispatch.

:class:`KernelTimer` installs itself as the launch timer of
:mod:`cukern.dispatch` (``set_launch_timer``): every ``Dispatch._launch`` inside
its ``with`` block is bracketed by two CUDA events on the launch stream, and
:meth:`KernelTimer.table` sums the event times by kernel name, as a share of
the step time measured by :meth:`KernelTimer.step`. Launches made while a
stream is being captured into a graph are not timed (events inside a capture
become graph nodes, not timestamps).

Why a runway: a CuPy launch costs the host several microseconds, more than
most decode kernels run, so in an eager loop the GPU idles between launches
and an event pair around a launch would time the host's launch latency, not
the kernel (measured on the H100: 15-17 us per event pair around kernels of
2-4 us). Before each step the timer therefore enqueues a cuBLAS GEMM long
enough to cover the host's time to queue the whole step (calibrated from the
previous steps): the step's launches wait behind it and then run back to back,
so each event pair times its kernel alone, and the step's event time is the
device time of the queued step. The host's own time per step (what an eager
loop costs in wall time) is reported beside it. This holds while a step's
launches fit the stream's launch queue (about a thousand entries, three per
timed launch): a decode step does; a step of several thousand launches (a
long prefill through batched matvecs) drains the queue and is partly starved
again. ``KernelTimer(runway=False)`` times the starved eager loop as it is.

:func:`nvtx_range` opens an NVTX range in the ``cukern`` domain (the one the
dispatches use) when NVTX is on, and costs nothing when it is off; nsys shows
these ranges around the per-kernel ranges (``profiling/README.md``).
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from dataclasses import dataclass

from cukern import dispatch as _dispatch

__all__ = ["KernelTimer", "KernelStat", "summarize", "format_table", "nvtx_range"]


@dataclass(frozen=True)
class KernelStat:
    kernel: str
    calls: int
    total_us: float  # summed device time of every call
    mean_us: float
    pct_step: float | None  # total_us over the summed step time (None when no step was timed)


def _base_name(kernel: str) -> str:
    return re.sub(r"<.*>$", "", kernel)


def summarize(records, step_us: float | None = None, *, strip_templates: bool = False) -> list[KernelStat]:
    """Sum ``(kernel, us)`` records by kernel name, slowest first.

    records: iterable of (kernel name, device microseconds) pairs, one per launch.
    step_us: the summed time of the steps the records come from (for the % column).
    strip_templates: group the variants of a kernel (``dmmv<12, 1>`` and ``dmmv<14, 1>``) together."""
    totals: dict[str, list] = {}
    for kernel, us in records:
        key = _base_name(kernel) if strip_templates else kernel
        t = totals.setdefault(key, [0, 0.0])
        t[0] += 1
        t[1] += us
    stats = [KernelStat(k, n, tot, tot / n, tot / step_us if step_us else None) for k, (n, tot) in totals.items()]
    return sorted(stats, key=lambda s: -s.total_us)


def format_table(stats: list[KernelStat], step_us: float | None = None, n_steps: int = 0,
                 host_us: float | None = None) -> str:
    """The per-kernel table as text: one row per kernel, then the kernel total and, when the
    steps were timed, the rest of the steps' device time (event overhead, launch gaps) and
    the host's time to launch them (``host_us``, summed over the steps)."""
    width = max([len(s.kernel) for s in stats] + [24])
    lines = [f"{'kernel':<{width}} {'calls':>6} {'total us':>10} {'mean us':>9} {'% step':>7}",
             "-" * (width + 36)]
    for s in stats:
        pct = f"{s.pct_step:.1%}" if s.pct_step is not None else ""
        lines.append(f"{s.kernel:<{width}} {s.calls:>6} {s.total_us:>10.1f} {s.mean_us:>9.2f} {pct:>7}")
    kernel_us = sum(s.total_us for s in stats)
    calls = sum(s.calls for s in stats)
    lines.append("-" * (width + 36))
    pct = f"{kernel_us / step_us:.1%}" if step_us else ""
    lines.append(f"{'all kernels':<{width}} {calls:>6} {kernel_us:>10.1f} {'':>9} {pct:>7}")
    if step_us:
        gap = step_us - kernel_us
        lines.append(f"{'between kernels':<{width}} {'':>6} {gap:>10.1f} {'':>9} {gap / step_us:>7.1%}")
        per = f", {step_us / n_steps:.1f} us per step" if n_steps else ""
        lines.append(f"{'steps (device)':<{width}} {n_steps:>6} {step_us:>10.1f}   (event-timed{per})")
    if host_us:
        per = f", {host_us / n_steps:.1f} us per step" if n_steps else ""
        lines.append(f"{'steps (host launches)':<{width}} {n_steps:>6} {host_us:>10.1f}   (wall clock{per})")
    return "\n".join(lines)


class KernelTimer:
    """Time every dispatch launched inside ``with KernelTimer() as kt:`` with CUDA events::

        with KernelTimer() as kt:
            for _ in range(n):
                with kt.step():
                    model.decode_step(...)
        print(kt.report())

    ``runway``: queue each step behind a cuBLAS GEMM so that its kernels run back to back and
    are timed alone (module docstring); False times the eager loop as it runs. Reading the
    results (:meth:`records`, :meth:`table`, :meth:`report`) synchronises on the recorded
    events; while recording, only the runway's one-time calibration (at the first step of the
    process) synchronises."""

    def __init__(self, *, runway: bool = True):
        self._free: list = []  # events ready for reuse
        self._pending: list = []  # (kernel, start, end) not yet read
        self._pending_steps: list = []  # (start, end)
        self._records: list[tuple[str, float]] = []  # (kernel, us)
        self._step_us: list[float] = []
        self._host_us: list[float] = []  # host wall time of each step (launching it)
        self._open_step = None  # (start event, stream, host t0) between begin_step and end_step
        self._runway = _runway() if runway else None
        self._previous = None

    # -- the launch-timer protocol (cukern.dispatch.set_launch_timer)
    def begin(self, kernel: str):
        import cupy
        stream = cupy.cuda.get_current_stream()
        if stream.is_capturing():
            return None
        start = self._event()
        start.record(stream)
        return kernel, start, stream

    def end(self, token) -> None:
        if token is None:
            return
        kernel, start, stream = token
        end = self._event()
        end.record(stream)
        self._pending.append((kernel, start, end))

    # -- use
    def __enter__(self) -> "KernelTimer":
        self._previous = _dispatch._launch_timer
        _dispatch.set_launch_timer(self)
        return self

    def __exit__(self, *exc) -> None:
        _dispatch.set_launch_timer(self._previous)

    @contextlib.contextmanager
    def step(self, stream=None):
        """Time the enclosed work on ``stream`` (None: the current stream) as one step."""
        self.begin_step(stream)
        try:
            yield
        finally:
            self.end_step()

    def begin_step(self, stream=None) -> None:
        """Start a step on ``stream`` (for code whose steps are delimited by callbacks, not blocks)."""
        from cukern.streams import resolve_stream
        if self._open_step is not None:
            raise RuntimeError("begin_step: the previous step was not ended")
        stream = resolve_stream(stream)
        if self._runway is not None and not stream.is_capturing():
            self._runway.enqueue(stream)
        start = self._event()
        start.record(stream)
        self._open_step = (start, stream, time.perf_counter())

    def end_step(self) -> None:
        """End the step :meth:`begin_step` started."""
        if self._open_step is None:
            raise RuntimeError("end_step: no step was begun")
        (start, stream, t0), self._open_step = self._open_step, None
        end = self._event()
        end.record(stream)
        host_s = time.perf_counter() - t0
        self._host_us.append(host_s * 1e6)
        if self._runway is not None:
            self._runway.observe(host_s)
        self._pending_steps.append((start, end))

    def reset(self) -> None:
        """Forget what was recorded (e.g. after warm-up steps); a step begun stays open."""
        self._collect()
        self._records.clear()
        self._step_us.clear()
        self._host_us.clear()

    def records(self) -> list[tuple[str, float]]:
        """Every timed launch so far as (kernel, device us), in launch order."""
        self._collect()
        return list(self._records)

    @property
    def step_us(self) -> list[float]:
        """Device time of each step (event-timed; with the runway: the queued step alone)."""
        self._collect()
        return list(self._step_us)

    @property
    def host_step_us(self) -> list[float]:
        """Host wall time of each step: what launching it eagerly costs."""
        return list(self._host_us)

    def table(self, *, strip_templates: bool = False) -> list[KernelStat]:
        self._collect()
        return summarize(self._records, sum(self._step_us) or None, strip_templates=strip_templates)

    def report(self, *, strip_templates: bool = False) -> str:
        stats = self.table(strip_templates=strip_templates)
        return format_table(stats, sum(self._step_us) or None, len(self._step_us), sum(self._host_us) or None)

    # -- internals
    def _event(self):
        import cupy
        return self._free.pop() if self._free else cupy.cuda.Event()

    def _collect(self) -> None:
        import cupy
        for kernel, start, end in self._pending:
            end.synchronize()
            self._records.append((kernel, cupy.cuda.get_elapsed_time(start, end) * 1e3))
            self._free += (start, end)
        for start, end in self._pending_steps:
            end.synchronize()
            self._step_us.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
            self._free += (start, end)
        self._pending.clear()
        self._pending_steps.clear()


def _runway() -> "_Runway":
    """One runway per process: its buffers and its calibration outlive a KernelTimer."""
    global _RUNWAY
    if _RUNWAY is None:
        _RUNWAY = _Runway()
    return _RUNWAY


_RUNWAY = None


class _Runway:
    """cuBLAS GEMMs enqueued before a step, long enough (1.5x the host time of the longest
    recent step, at most 2000 products) for the host to queue the whole step behind them; see
    the module docstring."""

    N = 4096  # f16 [N, N] operands: 32 MiB each, about 0.2 ms per product on an H100

    def __init__(self):
        self.host_s = 0.005  # first guess of a step's host time, before one is observed
        self._ops = None
        self._gemm_s = 0.0

    def observe(self, host_s: float) -> None:
        self.host_s = max(host_s, 0.5 * self.host_s)  # follows the steps, forgets old peaks slowly

    def enqueue(self, stream) -> None:
        import cupy
        with stream:
            if self._ops is None:
                rng = cupy.random.default_rng(0)
                self._ops = [rng.standard_normal((self.N, self.N), dtype=cupy.float32).astype(cupy.float16)
                             for _ in range(3)]
                a, b, c = self._ops
                for _ in range(2):
                    cupy.matmul(a, b, out=c)  # cuBLAS handle and kernel selection
                start, end = cupy.cuda.Event(), cupy.cuda.Event()
                start.record(stream)
                for _ in range(5):
                    cupy.matmul(a, b, out=c)
                end.record(stream)
                end.synchronize()
                self._gemm_s = cupy.cuda.get_elapsed_time(start, end) * 1e-3 / 5
            a, b, c = self._ops
            for _ in range(min(2000, max(1, math.ceil(1.5 * self.host_s / self._gemm_s)))):
                cupy.matmul(a, b, out=c)


@contextlib.contextmanager
def nvtx_range(name: str):
    """An NVTX range in the ``cukern`` domain while NVTX is on (``CUKERN_NVTX=1``); else nothing."""
    if not _dispatch.nvtx_enabled():
        yield
        return
    dom = _dispatch._domain()
    dom.push_range(dom.get_event_attributes(message=name))
    try:
        yield
    finally:
        dom.pop_range()

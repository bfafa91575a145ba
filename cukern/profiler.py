"""Where the time of a decode step goes, without nsys: CUDA events around every dispatch.

:class:`KernelTimer` installs itself as the launch timer of
:mod:`cukern.dispatch` (``set_launch_timer``): every ``Dispatch._launch`` inside
its ``with`` block is bracketed by two CUDA events on the launch stream, and
:meth:`KernelTimer.table` sums the event times by kernel name, as a share of
the step time measured by :meth:`KernelTimer.step`. Launches made while a
stream is being captured into a graph are not timed (events inside a capture
become graph nodes, not timestamps). Timing a launch adds two event records
(a few microseconds of host time each): read the table for the device time
of each kernel, not for the step's host-bound wall time.

:func:`nvtx_range` opens an NVTX range in the ``cukern`` domain (the one the
dispatches use) when NVTX is on, and costs nothing when it is off; nsys shows
these ranges around the per-kernel ranges (``profiling/README.md``).
"""

from __future__ import annotations

import contextlib
import re
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


def format_table(stats: list[KernelStat], step_us: float | None = None, n_steps: int = 0) -> str:
    """The per-kernel table as text: one row per kernel, then the kernel total and, when the
    steps were timed, the time between kernels (launch gaps, host work) in the steps."""
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
        lines.append(f"{'between kernels (launch gaps)':<{width}} {'':>6} {gap:>10.1f} {'':>9} {gap / step_us:>7.1%}")
        per = f", {step_us / n_steps:.1f} us per step" if n_steps else ""
        lines.append(f"{'steps':<{width}} {n_steps:>6} {step_us:>10.1f}   (event-timed{per})")
    return "\n".join(lines)


class KernelTimer:
    """Time every dispatch launched inside ``with KernelTimer() as kt:`` with CUDA events::

        with KernelTimer() as kt:
            for _ in range(n):
                with kt.step():
                    model.decode_step(...)
        print(kt.report())

    Reading the results (:meth:`records`, :meth:`table`, :meth:`report`) synchronises on
    the recorded events; nothing synchronises while the timer records."""

    def __init__(self):
        self._free: list = []  # events ready for reuse
        self._pending: list = []  # (kernel, start, end) not yet read
        self._pending_steps: list = []  # (start, end)
        self._records: list[tuple[str, float]] = []  # (kernel, us)
        self._step_us: list[float] = []
        self._open_step = None  # (start event, stream) between begin_step and end_step
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
        start = self._event()
        start.record(stream)
        self._open_step = (start, stream)

    def end_step(self) -> None:
        """End the step :meth:`begin_step` started."""
        if self._open_step is None:
            raise RuntimeError("end_step: no step was begun")
        (start, stream), self._open_step = self._open_step, None
        end = self._event()
        end.record(stream)
        self._pending_steps.append((start, end))

    def reset(self) -> None:
        """Forget what was recorded (e.g. after warm-up steps); a step begun stays open."""
        self._collect()
        self._records.clear()
        self._step_us.clear()

    def records(self) -> list[tuple[str, float]]:
        """Every timed launch so far as (kernel, device us), in launch order."""
        self._collect()
        return list(self._records)

    @property
    def step_us(self) -> list[float]:
        self._collect()
        return list(self._step_us)

    def table(self, *, strip_templates: bool = False) -> list[KernelStat]:
        self._collect()
        return summarize(self._records, sum(self._step_us) or None, strip_templates=strip_templates)

    def report(self, *, strip_templates: bool = False) -> str:
        stats = self.table(strip_templates=strip_templates)
        return format_table(stats, sum(self._step_us) or None, len(self._step_us))

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

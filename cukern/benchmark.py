"""What every benchmark of cukern shares: the ceilings it measures in the same
run, input rotation, and the one-row-per-configuration table.

A row reports the median device time (CUDA events, after warm-up, through
``cupyx.profiler.benchmark``), the achieved GB/s or TFLOP/s from counted
bytes or FLOPs, the fraction of the ceiling measured in this run, and the
ratio to a peer measured in this run (peer time / cukern time: > 1 means
cukern is faster).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import cupy

from cukern.streams import benchmark as _time

__all__ = ["Row", "Ceilings", "measure_ceilings", "rotating", "time_us", "print_table", "rows_to_json"]


@dataclass
class Row:
    family: str
    kernel: str
    shape: str
    us: float  # median device time
    gbs: float | None = None  # achieved bandwidth (bytes counted by the benchmark / time)
    tflops: float | None = None
    pct_ceiling: float | None = None  # of the ceiling measured in this run
    peer: str = ""
    peer_us: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def speedup(self) -> float | None:
        return self.peer_us / self.us if self.peer_us else None


@dataclass(frozen=True)
class Ceilings:
    copy_gbs: float  # device-to-device copy, bytes read + written
    device: str


def measure_ceilings(nbytes: int = 1 << 30) -> Ceilings:
    """A large device-to-device copy (bytes read + written) on this GPU, now."""
    src = cupy.empty(nbytes // 4, dtype=cupy.float32)
    src.fill(1.0)
    dst = cupy.empty_like(src)
    t = _time(lambda: cupy.copyto(dst, src), name="copy", n_warmup=3, n_repeat=20)
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    del src, dst
    return Ceilings(copy_gbs=2 * nbytes / (t.median_ms * 1e-3) / 1e9, device=name)


def rotating(n_sets: int, make):
    """``make(i)`` for i < n_sets, returned as a list plus a cursor function that yields the
    next set on each call, so that repeated timings do not read the same bytes from L2."""
    sets = [make(i) for i in range(n_sets)]
    state = {"i": 0}

    def next_set():
        s = sets[state["i"] % n_sets]
        state["i"] += 1
        return s
    return sets, next_set


def time_us(fn, *, n_warmup: int = 10, n_repeat: int = 100) -> float:
    return _time(fn, n_warmup=n_warmup, n_repeat=n_repeat).median_us


def print_table(rows: list[Row], ceilings: Ceilings, title: str = "") -> None:
    if title:
        print(f"\n{title}")
    print(f"device: {ceilings.device}; copy ceiling measured in this run: {ceilings.copy_gbs:,.0f} GB/s")
    head = f"{'kernel':<28} {'shape':<22} {'us':>9} {'GB/s':>8} {'TFLOP/s':>8} {'%ceil':>6}  {'peer':<26} {'peer us':>9} {'x peer':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        gbs = f"{r.gbs:,.0f}" if r.gbs is not None else ""
        tf = f"{r.tflops:.1f}" if r.tflops is not None else ""
        pct = f"{r.pct_ceiling:.0%}" if r.pct_ceiling is not None else ""
        pus = f"{r.peer_us:.2f}" if r.peer_us is not None else ""
        sp = f"{r.speedup:.2f}" if r.speedup is not None else ""
        print(f"{r.kernel:<28} {r.shape:<22} {r.us:>9.2f} {gbs:>8} {tf:>8} {pct:>6}  {r.peer:<26} {pus:>9} {sp:>7}")


def rows_to_json(rows: list[Row], ceilings: Ceilings) -> str:
    return json.dumps({"ceilings": asdict(ceilings), "rows": [asdict(r) for r in rows]}, indent=1)

"""What every benchmark of cukern shares: the ceilings it measures in the same
run, input rotation, and the one-row-per-configuration table.

A row reports the median device time (CUDA events, after warm-up, through
``cupyx.profiler.benchmark``), the achieved GB/s or TFLOP/s from counted
bytes or FLOPs, the fraction of the ceiling measured in this run, and the
ratio to a peer measured in this run (peer time / cukern time: > 1 means
cukern is faster). A row compared with several peers names the first in
``peer``/``peer_us`` and every other one in ``extra["peers"]`` (name -> us).

``python -m cukern bench`` (:mod:`cukern.workbench`) runs every family's
``bench(quick)`` in one process and prints them with :func:`format_table`; its
ceilings also carry a cuBLAS GEMM rate (:func:`measure_gemm_tflops`).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field

import cupy

from cukern.streams import benchmark as _time
from cukern.streams import capture_graph

__all__ = ["Row", "Ceilings", "measure_ceilings", "measure_gemm_tflops", "rotating", "time_us", "time_stream_us", "time_graph_us",
           "time_torch_graph_us", "host_us_per_call", "print_table", "format_table", "rows_to_json"]


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

    def peers(self) -> dict[str, float]:
        """Every peer's median time (us): ``peer`` first, then ``extra["peers"]``."""
        out = {self.peer: self.peer_us} if self.peer and self.peer_us else {}
        out.update((k, v) for k, v in self.extra.get("peers", {}).items() if v)
        return out


@dataclass(frozen=True)
class Ceilings:
    copy_gbs: float  # device-to-device copy, bytes read + written
    device: str
    gemm_tflops: float | None = None  # cuBLAS f16 GEMM (measure_gemm_tflops), when measured


def measure_ceilings(nbytes: int = 1 << 30, rounds: int = 3) -> Ceilings:
    """A large device-to-device copy (bytes read + written) on this GPU, now: the best of ``rounds``
    medians of 20 copies (a ceiling is the highest rate seen; never below one median). Across runs it
    still moves a few per cent (2,856-2,971 GB/s over H100 runs of one day), while a kernel timed in the
    same runs moved under 0.5%; compare times, not shares of the ceiling, between runs."""
    src = cupy.empty(nbytes // 4, dtype=cupy.float32)
    src.fill(1.0)
    dst = cupy.empty_like(src)
    t = min((_time(lambda: cupy.copyto(dst, src), name="copy", n_warmup=3, n_repeat=20) for _ in range(rounds)),
            key=lambda r: r.median_ms)
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    del src, dst
    return Ceilings(copy_gbs=2 * nbytes / (t.median_ms * 1e-3) / 1e9, device=name)


def measure_gemm_tflops(n: int = 8192, dtype=cupy.float16) -> float:
    """The arithmetic ceiling on this GPU, now: ``cupy.matmul`` (cuBLAS, f32 accumulation) of
    two random ``[n, n]`` matrices, 2 n^3 FLOPs per product, median of 20 after warm-up.
    Random data, not zeros: cuBLAS runs measurably faster on zeros."""
    rng = cupy.random.default_rng(1)
    a = rng.standard_normal((n, n), dtype=cupy.float32).astype(dtype)
    b = rng.standard_normal((n, n), dtype=cupy.float32).astype(dtype)
    c = cupy.empty((n, n), dtype=dtype)
    t = _time(lambda: cupy.matmul(a, b, out=c), name="gemm", n_warmup=5, n_repeat=20)
    return 2 * n**3 / (t.median_ms * 1e-3) / 1e12


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
    """Median device time of one ``fn()`` between two events. For kernels shorter than the
    Python launch cost (~10 us) this measures the host, not the GPU: use :func:`time_graph_us`."""
    return _time(fn, n_warmup=n_warmup, n_repeat=n_repeat).median_us


def time_stream_us(fn, *, n_inner: int = 10, n_warmup: int = 3, n_repeat: int = 20) -> float:
    """Device time per ``fn()`` over ``n_inner`` eager calls issued back to back between two
    events, as a prefill loop issues them: the host's launch cost is hidden wherever it is
    shorter than the GPU work (unlike :func:`time_us`, where it idles the GPU before every call)."""
    return _time(lambda: [fn() for _ in range(n_inner)], n_warmup=n_warmup, n_repeat=n_repeat).median_us / n_inner


def medians_in_turns(fns: dict, rounds: int) -> dict:
    """Each ``fns[key]()`` (a time) measured ``rounds`` times in turns, the order rotating every round so
    that clock drift under load spreads over all of them; the median of each, by key."""
    times: dict = {key: [] for key in fns}
    keys = list(fns)
    for r in range(rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            times[key].append(fns[key]())
    return {key: sorted(t)[len(t) // 2] for key, t in times.items()}


def time_graph_us(fn, *, n_inner: int = 50, n_repeat: int = 20) -> float:
    """Device time per ``fn()`` when ``n_inner`` calls are captured into one CUDA graph and
    replayed, as a decode loop runs them: the launch cost leaves the measurement."""
    fn()  # compile and warm outside the capture
    graph = capture_graph(lambda stream: [fn() for _ in range(n_inner)])
    # replay on the current stream: cupyx.profiler.benchmark records its events there
    replay = lambda: graph.replay(cupy.cuda.get_current_stream())  # noqa: E731
    return _time(replay, n_warmup=2, n_repeat=n_repeat).median_us / n_inner


def time_torch_graph_us(fn, *, n_inner: int = 50, n_repeat: int = 20) -> float:
    """The peer's counterpart of :func:`time_graph_us`, captured with torch's own graph API (its
    caching allocator must see the capture)."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n_inner):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(n_repeat + 2):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times = sorted(times[2:])
    return times[len(times) // 2] * 1e3 / n_inner


def host_us_per_call(fn, n: int = 2000) -> float:
    """Host time per ``fn()`` (validation, packing, launch), with the GPU kept busy enough
    not to stall the queue only for short loops: a launch-overhead figure, not a kernel time."""
    fn()
    cupy.cuda.get_current_stream().synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    cupy.cuda.get_current_stream().synchronize()
    return (t1 - t0) / n * 1e6


def print_table(rows: list[Row], ceilings: Ceilings, title: str = "") -> None:
    """Print ``title`` (if any), then :func:`format_table`."""
    if title:
        print(f"\n{title}")
    print(format_table(rows, ceilings))


def format_table(rows: list[Row], ceilings: Ceilings) -> str:
    """Every row of one or several families as one table: family, kernel, shape, median us,
    GB/s or TFLOP/s, % of the ceiling measured in the same run, and the ratio to each peer
    (peer us / cukern us: > 1 means cukern is faster; further peers on indented lines)."""
    gemm = f", cuBLAS f16 GEMM {ceilings.gemm_tflops:,.0f} TFLOP/s" if ceilings.gemm_tflops else ""
    out = [f"device: {ceilings.device}; ceilings measured in this run: copy {ceilings.copy_gbs:,.0f} GB/s{gemm}"]
    kw = max([len(r.kernel) for r in rows] + [20])
    sw = max([len(r.shape) for r in rows] + [12])
    head = (f"{'family':<12} {'kernel':<{kw}} {'shape':<{sw}} {'us':>9} {'GB/s':>7} {'TFLOP/s':>7} {'%ceil':>6}"
            f"  {'peer':<26} {'peer us':>9} {'x peer':>6}")
    out += [head, "-" * len(head)]
    for r in rows:
        gbs = f"{r.gbs:,.0f}" if r.gbs is not None else ""
        tf = f"{r.tflops:.1f}" if r.tflops is not None else ""
        pct = f"{r.pct_ceiling:.0%}" if r.pct_ceiling is not None else ""
        left = f"{r.family:<12} {r.kernel:<{kw}} {r.shape:<{sw}} {r.us:>9.2f} {gbs:>7} {tf:>7} {pct:>6}"
        for name, us in list(r.peers().items()) or [("", None)]:
            ratio, pus = (f"{us / r.us:.2f}", f"{us:.2f}") if us else ("", "")
            out.append(f"{left}  {name[:26]:<26} {pus:>9} {ratio:>6}".rstrip())
            left = " " * len(left)
    return "\n".join(out)


def rows_to_json(rows: list[Row], ceilings: Ceilings) -> str:
    return json.dumps({"ceilings": asdict(ceilings), "rows": [asdict(r) for r in rows]}, indent=1)


def script_main(bench, doc: str, *, title: str, quick_help: str, argv=None, add_args=None,
                bench_kwargs=None) -> int:
    """The command line every ``profiling/bench_<family>.py`` shares: ``--quick``, ``--json``.

    ``bench(quick, **bench_kwargs(args))`` returns ``(rows, ceilings)``; ``add_args(parser)``
    adds a script's own flags."""
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    ap.add_argument("--json", metavar="FILE", help="write the rows and ceilings here")
    ap.add_argument("--quick", action="store_true", help=quick_help)
    if add_args is not None:
        add_args(ap)
    args = ap.parse_args(argv)
    rows, ceilings = bench(args.quick, **(bench_kwargs(args) if bench_kwargs else {}))
    print_table(rows, ceilings, title)
    if args.json:
        with open(args.json, "w") as f:
            f.write(rows_to_json(rows, ceilings))
    return 0

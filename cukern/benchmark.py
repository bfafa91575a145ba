"""What every benchmark of cukern shares: the ceilings it measures in the same
run, input rotation, and the one-row-per-configuration table.

A row reports the median device time (CUDA events, after warm-up, through
``cupyx.profiler.benchmark``), the achieved GB/s or TFLOP/s from counted
bytes or FLOPs, the fraction of the ceiling measured in this run, and the
ratio to a peer measured in this run (peer time / cukern time: > 1 means
cukern is faster). A row compared with several peers names the first in
``peer``/``peer_us`` and every other one in ``extra["peers"]`` (name -> us).

A family's rows are data: a list of :class:`RowSpec` (name, shape, the inputs to build, the call,
the :mod:`cukern.traffic` function counting its bytes or FLOPs, the peers, the timing), which
:func:`run_specs` times and turns into rows.

``python -m cukern bench`` (:mod:`cukern.workbench`) runs every family's
``bench(quick)`` in one process and prints them with :func:`format_table`; its
ceilings also carry a cuBLAS GEMM rate (:func:`measure_gemm_tflops`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import cupy

from cukern.streams import benchmark as _time
from cukern.streams import capture_graph

__all__ = ["Row", "Ceilings", "measure_ceilings", "measure_gemm_tflops", "rotating", "time_us", "time_stream_us",
           "time_graph_us", "time_torch_graph_us", "host_us_per_call", "print_table", "format_table", "rows_to_json",
           "Timing", "Peer", "RowSpec", "run_specs", "work", "in_turns", "free_device_memory"]


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


def in_turns(fns: dict, rounds: int) -> dict:
    """Each ``fns[key]()`` (a time) measured ``rounds`` times in turns, the order rotating every round so
    that clock drift under load spreads over all of them: the list of times by key. A function that
    raises is reported on stderr, keeps the times it had and leaves the later rounds."""
    times: dict = {key: [] for key in fns}
    keys = list(fns)
    for r in range(rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            if times[key] is None:
                continue
            try:
                times[key].append(fns[key]())
            except Exception as e:  # report and go on: one broken timer must not hide the others
                print(f"{key} failed: {type(e).__name__}: {e}", file=sys.stderr)
                times[key] = None
    return {key: t or [] for key, t in times.items()}


def median(times: list) -> float:
    """The middle of the sorted times (the upper one of an even count)."""
    return sorted(times)[len(times) // 2]


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


# ------------------------------------------------------------------ rows as data
@dataclass(frozen=True)
class Timing:
    """How a callable is timed: ``how`` names the timer, the counts are its keywords (None: its default).

    graph: :func:`time_graph_us`; torch_graph: :func:`time_torch_graph_us`; torch_graph_or_eager: that,
    or :func:`time_us` with a note where torch cannot capture the peer; stream: :func:`time_stream_us`
    (``n_inner`` eager calls between two events); eager: :func:`time_us` (one call between events);
    host: :func:`host_us_per_call` (host time per call: validation, packing, launch)."""
    how: str = "graph"
    n_inner: int | None = None
    n_warmup: int | None = None
    n_repeat: int | None = None

    HOWS = ("graph", "torch_graph", "torch_graph_or_eager", "stream", "eager", "host")

    def __post_init__(self):
        if self.how not in self.HOWS:
            raise ValueError(f"Timing.how: {self.how!r} is none of {', '.join(self.HOWS)}")

    def us(self, fn) -> float:
        kw = {k: v for k, v in (("n_inner", self.n_inner), ("n_warmup", self.n_warmup), ("n_repeat", self.n_repeat))
              if v is not None}
        if self.how == "graph":
            return time_graph_us(fn, **kw)
        if self.how in ("torch_graph", "torch_graph_or_eager"):
            kw.pop("n_warmup", None)
            try:
                return time_torch_graph_us(fn, **kw)
            except Exception as e:
                if self.how == "torch_graph":
                    raise
                print(f"note: torch graph capture failed ({type(e).__name__}); peer timed eagerly")
                return time_us(fn)
        if self.how == "stream":
            return time_stream_us(fn, **kw)
        if self.how == "eager":
            kw.pop("n_inner", None)
            return time_us(fn, **kw)
        assert self.how == "host"
        return host_us_per_call(fn)


@dataclass(frozen=True)
class Peer:
    """What a row is compared with: ``call(s)`` on the row's next input set (or on sets of its own
    ``inputs``, measured once per run), timed as the row is unless ``how`` says otherwise; or, with
    ``row``, the time of this family's row of that kernel name and the same shape, measured earlier in
    the table. Peers of one name in a group of rows sharing their inputs are one measurement."""
    name: str
    call: Callable | None = None
    how: str | None = None  # a Timing.how; None: the row's
    row: str = ""
    inputs: tuple = ()  # (builder, *args), as RowSpec.inputs
    torch: bool = False  # runs torch ops: left out where torch is not installed (implied by a torch timing)

    def __post_init__(self):
        if self.how is not None:
            Timing(self.how)  # a clear error for a misspelt timing
        if (self.call is None) == (not self.row):
            raise ValueError(f"Peer {self.name!r}: give a call or a row, not both or neither")

    @property
    def needs_torch(self) -> bool:
        return self.torch or (self.how or "").startswith("torch")


@dataclass(frozen=True)
class RowSpec:
    """One row of a family's benchmark, as data.

    ``inputs`` is ``(builder, *args)``: ``builder(ctx, *args)`` returns a list of input sets (any
    objects); consecutive specs with equal ``inputs`` share one build, released after the last. Each
    timed call ``call(s)`` takes the next set, so that calls rotate through them (sets spanning more
    than the L2 read their bytes from memory). ``bytes`` and ``flops`` are ``(traffic_function, *args)``
    of :mod:`cukern.traffic`. ``shape`` may name fields of the first set in braces (``{n_splits}``),
    filled in once built: what only the device knows. With ``rounds`` > 1 the row, the other rows of
    its group and shape with ``rounds`` > 1 and all their peers are timed in turns (:func:`in_turns`),
    ``rounds`` times where a peer is there to alternate with, and each keeps ``pick`` of its times.
    ``ceiling``: what % ceil is of: "copy" (bytes rows), "gemm" (FLOPs rows; empty where the run
    measured no GEMM rate) or "peers" (the fastest peer: peer time / row time); None: by the row's
    work. ``when(s)``, on the first set, says whether the row exists on this device (an sm_90a path)."""
    kernel: str
    shape: str
    inputs: tuple
    call: Callable[[Any], Any]
    bytes: tuple = ()
    flops: tuple = ()
    peers: tuple = ()
    timing: Timing = Timing()
    rounds: int = 1
    pick: Callable = median
    ceiling: str | None = None
    when: Callable[[Any], bool] | None = None

    def __post_init__(self):
        if not (self.inputs and callable(self.inputs[0])):
            raise ValueError(f"RowSpec {self.kernel!r}: inputs must be (builder, *args)")
        if self.ceiling not in (None, "copy", "gemm", "peers") or self.rounds < 1:
            raise ValueError(f"RowSpec {self.kernel!r}: ceiling {self.ceiling!r} (None, copy, gemm or peers), "
                             f"rounds {self.rounds} (>= 1)")


def work(count: tuple) -> float | None:
    """A ``RowSpec.bytes`` or ``.flops`` evaluated: ``(fn, *args)`` is ``fn(*args)``, a trailing dict its
    keywords (``(traffic.gemm_flops, m, n, k, {"glu": True})``); None for ``()``."""
    if not count:
        return None
    fn, *args = count
    kw = args.pop() if args and isinstance(args[-1], dict) else {}
    return fn(*args, **kw)


def free_device_memory() -> None:
    """Give CuPy's (and torch's, where loaded) cached blocks back between groups of rows."""
    cupy.get_default_memory_pool().free_all_blocks()
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        sys.modules["torch"].cuda.empty_cache()


def _torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _rotation(sets: list, call: Callable) -> Callable[[], Any]:
    """A zero-argument function calling ``call`` on the next set each time (on the one set: no cursor,
    so that a host-time row counts no more than the call)."""
    if len(sets) == 1:
        return functools.partial(call, sets[0])
    state = {"i": 0}

    def step():
        s = sets[state["i"] % len(sets)]
        state["i"] += 1
        return call(s)
    return step


def run_specs(family: str, specs: list[RowSpec], ceilings: Ceilings, ctx: Any = None, *, timer=None,
              on_row=None, release=None) -> list[Row]:
    """Time ``specs`` in order and return their rows. ``timer(timing, fn) -> us`` (default
    ``timing.us(fn)``); ``on_row(row)`` sees each row as it comes; ``release()`` (default
    :func:`free_device_memory`) runs after each group of specs sharing inputs. A build, a call or a
    peer that fails is reported on stderr and leaves its row (or its peer) out: one broken row must
    not hide the others."""
    timer = timer or (lambda timing, fn: timing.us(fn))
    release = release or free_device_memory
    if _KERNEL_PATTERN is not None:
        specs = [s for s in specs if _KERNEL_PATTERN.search(s.kernel)]
    torch_ok = _torch_available()
    rows: list[Row] = []
    peer_memo: dict = {}  # (name, inputs) -> us of peers with inputs of their own
    i = 0
    while i < len(specs):
        j = i + 1
        while j < len(specs) and specs[j].inputs == specs[i].inputs:
            j += 1
        group = specs[i:j]
        try:
            sets = _build(group[0].inputs, ctx)
        except Exception as e:
            print(f"inputs of {group[0].kernel} {group[0].shape} failed: {type(e).__name__}: {e}", file=sys.stderr)
            sets = None
        if sets is not None:
            _run_group(family, group, sets, ceilings, ctx, timer, torch_ok, rows, peer_memo, on_row, release)
        sets = None
        release()
        i = j
    return rows


def _build(inputs: tuple, ctx) -> list:
    sets = inputs[0](ctx, *inputs[1:])
    if not isinstance(sets, list) or not sets:
        raise TypeError(f"{getattr(inputs[0], '__name__', inputs[0])} must return a non-empty list of input sets")
    return sets


def _run_group(family, group, sets, ceilings, ctx, timer, torch_ok, rows, peer_memo, on_row, release) -> None:
    """The rows of one group of specs sharing their input sets, a shape at a time: rows of one shape are
    the ones timed in turns, and peers of one name there are one measurement."""
    group = [s for s in group if s.when is None or s.when(sets[0])]
    shapes = [_shape(spec, sets) for spec in group]
    i = 0
    while i < len(group):
        j = i + 1
        while j < len(group) and shapes[j] == shapes[i]:
            j += 1
        for row in _run_shape(family, group[i:j], shapes[i], sets, ceilings, ctx, timer, torch_ok, rows, peer_memo,
                              release):
            rows.append(row)
            if on_row is not None:
                on_row(row)
        i = j


def _run_shape(family, specs, shape, sets, ceilings, ctx, timer, torch_ok, rows, peer_memo, release) -> list[Row]:
    def peer_timer(spec, peer):
        if peer.row:
            return lambda: next((r.us for r in rows + out if r.kernel == peer.row and r.shape == shape), None)
        timing = replace(spec.timing, how=peer.how or spec.timing.how)
        if not peer.inputs:
            return lambda: timer(timing, _rotation(sets, peer.call))

        def own():  # a peer on inputs of its own: measured once per run
            key = (peer.name, peer.inputs)
            if key not in peer_memo:
                own_sets = _build(peer.inputs, ctx)
                peer_memo[key] = timer(timing, _rotation(own_sets, peer.call))
                own_sets = None
                release()
            return peer_memo[key]
        return own

    def usable(peer):
        return peer.row or not peer.needs_torch or torch_ok

    out: list[Row] = []
    times: dict = {}  # ("row", index) or ("peer", name) -> us, or None where it failed
    turns = [k for k, s in enumerate(specs) if s.rounds > 1]
    if turns:
        fns = {("row", k): (lambda s=specs[k]: timer(s.timing, _rotation(sets, s.call))) for k in turns}
        picks = {("row", k): specs[k].pick for k in turns}
        for k in turns:
            for p in specs[k].peers:
                if usable(p) and not p.row and ("peer", p.name) not in fns:
                    fns[("peer", p.name)] = peer_timer(specs[k], p)
                    picks[("peer", p.name)] = specs[k].pick
        rounds = max(specs[k].rounds for k in turns) if any(key[0] == "peer" for key in fns) else 1
        names = {key: f"row {specs[key[1]].kernel} {shape}" if key[0] == "row" else f"peer {key[1]} at {shape}"
                 for key in fns}
        measured = in_turns({names[key]: fn for key, fn in fns.items()}, rounds)
        for key in fns:
            times[key] = picks[key](measured[names[key]]) if measured[names[key]] else None
    for k, spec in enumerate(specs):
        if ("row", k) not in times:
            times[("row", k)] = _try(lambda: timer(spec.timing, _rotation(sets, spec.call)), f"row {spec.kernel} {shape}")
        if times[("row", k)] is None:
            continue
        peer_us = {}
        for p in spec.peers:
            if not usable(p):
                continue
            if ("peer", p.name) not in times or p.row:
                times[("peer", p.name)] = _try(peer_timer(spec, p), f"peer {p.name} of {spec.kernel} {shape}")
            if times[("peer", p.name)]:
                peer_us[p.name] = times[("peer", p.name)]
        out.append(_row(family, spec, shape, times[("row", k)], peer_us, ceilings))
    return out


def _try(fn, what: str):
    try:
        return fn()
    except Exception as e:  # report and go on: one broken row must not hide the others
        print(f"{what} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def _shape(spec: RowSpec, sets: list) -> str:
    return spec.shape.format_map(vars(sets[0])) if "{" in spec.shape else spec.shape


def _row(family, spec: RowSpec, shape: str, us: float, peer_us: dict, ceilings: Ceilings) -> Row:
    nbytes, flops = work(spec.bytes), work(spec.flops)
    gbs = nbytes / (us * 1e-6) / 1e9 if nbytes else None
    tflops = flops / (us * 1e-6) / 1e12 if flops else None
    ceiling = spec.ceiling or ("copy" if gbs else "gemm")
    if ceiling == "copy":
        pct = gbs / ceilings.copy_gbs if gbs else None
    elif ceiling == "gemm":
        pct = tflops / ceilings.gemm_tflops if tflops and ceilings.gemm_tflops else None
    else:  # "peers"
        pct = min(peer_us.values()) / us if peer_us else None
    first = next((p.name for p in spec.peers if p.name in peer_us), "")
    others = {name: t for name, t in peer_us.items() if name != first}
    return Row(family, spec.kernel, shape, us, gbs=gbs, tflops=tflops, pct_ceiling=pct, peer=first,
               peer_us=peer_us.get(first), extra={"peers": others} if others else {})


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


# set by `selecting` (script_main's and `cukern bench`'s --kernel): run_specs keeps only the specs whose
# kernel name it matches
_KERNEL_PATTERN: re.Pattern | None = None


@contextlib.contextmanager
def selecting(pattern: re.Pattern | str | None):
    """Within the block, :func:`run_specs` times only the specs whose kernel name ``pattern`` matches
    (``re.search``; None: every spec)."""
    global _KERNEL_PATTERN
    old, _KERNEL_PATTERN = _KERNEL_PATTERN, None if pattern is None else re.compile(pattern)
    try:
        yield
    finally:
        _KERNEL_PATTERN = old


def script_main(bench, doc: str, *, title: str, quick_help: str, argv=None, add_args=None,
                bench_kwargs=None) -> int:
    """The command line every ``profiling/bench_<family>.py`` shares: ``--quick``, ``--json``,
    ``--kernel REGEX`` (only the rows whose kernel name it matches, as pytest's ``-k`` selects tests).

    ``bench(quick, **bench_kwargs(args))`` returns ``(rows, ceilings)``; ``add_args(parser)``
    adds a script's own flags."""
    from cukern.cli import regex_arg
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    ap.add_argument("--json", metavar="FILE", help="write the rows and ceilings here")
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--kernel", metavar="REGEX", type=regex_arg,
                    help="only the rows whose kernel name matches (re.search), e.g. 'bwd|chain'")
    if add_args is not None:
        add_args(ap)
    args = ap.parse_args(argv)
    with selecting(args.kernel):
        rows, ceilings = bench(args.quick, **(bench_kwargs(args) if bench_kwargs else {}))
    print_table(rows, ceilings, title)
    if args.json:
        with open(args.json, "w") as f:
            f.write(rows_to_json(rows, ceilings))
    return 0

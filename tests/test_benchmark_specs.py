"""The benchmarks' rows as data, without a GPU: every ``profiling/bench_<family>.py`` table (names unique,
bytes and FLOPs from cukern.traffic functions, peers that resolve), and ``benchmark.run_specs`` timing
fake calls with a fake timer (rotation, groups, peers, turns, failures, the row's figures)."""

from __future__ import annotations

import importlib.util
import inspect
import math
from types import SimpleNamespace

import pytest

from cukern import benchmark, traffic, workbench
from cukern.benchmark import Ceilings, Peer, RowSpec, Timing, run_specs, work

SPEC_FAMILIES = ["attention", "dmmv", "elementwise", "matmul", "tokens"]


def _module(family):
    path = workbench.bench_scripts([family])[family]
    spec = importlib.util.spec_from_file_location(f"cukern_profiling_spec_{family}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", params=[(f, q) for f in SPEC_FAMILIES for q in (True, False)],
                ids=lambda p: f"{p[0]}-{'quick' if p[1] else 'full'}")
def table(request):
    family, quick = request.param
    return family, _module(family).specs(quick)


def _traffic_function(fn) -> bool:
    return getattr(fn, "__module__", None) == "cukern.traffic" and getattr(traffic, fn.__name__, None) is fn


def test_every_bench_module_with_a_table_is_checked():
    """A family benchmark that builds its rows as data is in SPEC_FAMILIES (bench_models is end to end)."""
    with_specs = {f for f in workbench.bench_scripts() if callable(getattr(_module(f), "specs", None))}
    assert with_specs == set(SPEC_FAMILIES)


def test_names_are_unique(table):
    family, specs = table
    assert specs and all(isinstance(s, RowSpec) for s in specs)
    names = [(s.kernel, s.shape) for s in specs]
    dup = {n for n in names if names.count(n) > 1}
    assert not dup, f"{family}: rows named twice: {sorted(dup)}"


def test_work_comes_from_traffic(table):
    """Each row's bytes and FLOPs: a cukern.traffic function, positive on the row's arguments (bytes a
    whole number but for packed MoE's average of experts read)."""
    averaged = (traffic.moe_packed, traffic.moe_packed_sum)
    family, specs = table
    for s in specs:
        assert s.bytes or s.flops or s.timing.how == "host", f"{family} {s.kernel}: neither bytes nor FLOPs"
        for count in (s.bytes, s.flops):
            if count:
                assert _traffic_function(count[0]), f"{family} {s.kernel}: {count[0]} is not a cukern.traffic function"
                value = work(count)
                assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (family, s.kernel, value)
        if s.bytes and s.bytes[0] not in averaged:
            assert isinstance(work(s.bytes), int), (family, s.kernel, work(s.bytes))


def test_specs_are_well_formed(table):
    """Inputs a builder and its arguments; row peers name a row of the same shape before them; peers of one
    name in one group and shape are one measurement, so they must be one peer."""
    family, specs = table
    seen: set = set()
    by_name: dict = {}
    for s in specs:
        assert callable(s.inputs[0]) and callable(s.call) and s.rounds >= 1, (family, s.kernel)
        for p in s.peers:
            if p.row:
                assert (p.row, s.shape) in seen, f"{family} {s.kernel}: peer row {p.row!r} not measured before"
            else:
                key = (s.inputs, s.shape, p.name)
                assert by_name.setdefault(key, p) == p, f"{family} {s.kernel}: two peers named {p.name!r}"
        seen.add((s.kernel, s.shape))


def test_quantized_x_bytes_is_the_dmmv_layout():
    from cukern.dmmv.weights import _q8x_col_bytes
    for k in (32, 640, 2048, 4096, 14336, 7168 + 32):
        assert traffic.quantized_x_bytes(k) == _q8x_col_bytes(k)
        assert traffic.quantized_x_bytes(k, n=3) == 3 * _q8x_col_bytes(k)


def test_ssm_and_model_formulas():
    assert traffic.conv1d_silu(1, 8192, 4) == 4 * (2 * 8192 + 2 * 3 * 8192 + 4 * 8192)
    state, q, v = 32 * 128 * 128 * 4, 5 * 16 * 128 * 4, 5 * 32 * 128 * 4
    assert traffic.deltanet(5, 16, 32, 128, 128) == 2 * state + 2 * q + 2 * v
    assert traffic.decode_step([10, 20, 30]) == 60


def test_fusion_and_variant_formulas():
    kv = 7 * 8 * 128
    assert traffic.kv_pair_write(7, 8, 128) == 2 * kv * (4 + 2) == 2 * traffic.kv_write(7, 8, 128)
    assert traffic.deltanet_gates(5, 32) == 4 * (4 * 5 * 32 + 2 * 32)
    assert traffic.conv1d_silu(1, 8192, 4, ring=True) == 4 * (2 * 8192 + (3 + 1) * 8192 + 4 * 8192)
    assert traffic.conv1d_silu(9, 8192, 4, ring=True) == traffic.conv1d_silu(9, 8192, 4)  # every ring row rewritten
    assert traffic.dmmv_pair(100, 32, 2048) == 200 + 4 * (2048 + 64)
    assert traffic.dmmv_pair(100, 32, 2048, normed=True) == 200 + 4 * (2 * 2048 + 64)
    assert traffic.moe_packed_sum(10, 2048, 512, 10, 16, 2.5) == 25 + 4 * (16 * 10 * 513 + 2 * 16 * 2048)
    assert traffic.count_experts(4096, 10, 512) == 4 * (40960 + 512)


# ----------------------------------------------------------------------------- the fusions' rows
# Rows of the fused kernels and variants, each against its unfused chain (or the variant's base) measured in the
# same run: kernel names as written (decode elementwise rows add " (graph)"), the one row of each family --quick keeps.
FUSION_ROWS = {
    "elementwise": ["k_norm_rope_kv_write +V", "k_norm_rope_kv_write +V v_norm", "qk_norm_rope_kv_write v_norm",
                    "kv_write (bf16 cache)", "qk_norm_rope_kv_write (bf16 cache)", "rope neox yarn", "softmax_topk slot",
                    "conv1d_silu ring (K=4)", "conv1d_silu ring in place (K=4)", "deltanet_gates",
                    "deltanet_tiled qk_l2norm", "deltanet (baseline) qk_l2norm"],
    "dmmv": ["dmmv_pair NormedX Q4_K pdl", "moe_dmmv_packed weights= Q4_K T=16", "moe_dmmv_packed weights= MXFP4 T=16",
             "moe_count_experts layer="],
    "attention": ["decode contiguous (graph)", "decode sinks (graph)", "varlen f32 (+lse)", "varlen f16 upper_left (+lse)"],
}
QUICK_FUSION_ROWS = {"elementwise": "k_norm_rope_kv_write +V (graph)", "dmmv": "dmmv_pair NormedX Q4_K pdl",
                     "attention": "decode contiguous (graph)"}


def _fusion_specs(family, quick):
    names = set(FUSION_ROWS[family])
    return [s for s in _module(family).specs(quick) if {s.kernel, s.kernel.removesuffix(" (graph)")} & names]


@pytest.mark.parametrize("family", sorted(FUSION_ROWS))
def test_fusion_rows_are_there_with_peers(family):
    """Every fusion row in the full table, each with a peer; --quick keeps one of them, at one shape."""
    specs = _fusion_specs(family, False)
    assert {s.kernel if s.kernel in FUSION_ROWS[family] else s.kernel.removesuffix(" (graph)")
            for s in specs} == set(FUSION_ROWS[family])
    assert all(s.peers for s in specs), [s.kernel for s in specs if not s.peers]
    assert [s.kernel for s in _fusion_specs(family, True)] == [QUICK_FUSION_ROWS[family]]


class _Value:
    """Any input of a set: arithmetic and attributes give another one."""

    def __getattr__(self, name):
        return _Value()

    def __call__(self, *args, **kwargs):
        return _Value()

    __mul__ = __rmul__ = __add__ = __radd__ = __call__


class _Set(SimpleNamespace):
    """An input set: the dispatches given, a stand-in for every other field."""

    def __getattr__(self, name):
        return _Value()


class _Recorder:
    """A dispatch whose methods bind their arguments to the real method's signature and record the call."""

    def __init__(self, cls, calls):
        self._cls, self._calls = cls, calls

    def __getattr__(self, name):
        method = getattr(self._cls, name)

        def call(*args, **kwargs):
            inspect.signature(method).bind(None, *args, **kwargs)
            self._calls.append(name)
        return call


def _dispatches(family) -> dict:
    from cukern.attention import AttentionDispatch
    from cukern.dmmv import DmmvDispatch
    from cukern.elementwise import ElementwiseDispatch
    if family == "attention":
        return dict.fromkeys(("attn", "attn_pdl"), AttentionDispatch)
    out = dict.fromkeys(("ew", "ew_pdl"), ElementwiseDispatch)
    if family == "dmmv":
        out.update(dict.fromkeys(("d", "d_pdl", "d_f32", "d_f32_pdl"), DmmvDispatch))
    else:
        out["d"] = ElementwiseDispatch
    return out


@pytest.mark.parametrize("family", sorted(FUSION_ROWS))
def test_fusion_calls_match_the_dispatch_signatures(family):
    """The fusion rows' calls and their cukern peers, run on a set of stand-ins: every method exists and takes
    the arguments given (keywords included); a chain peer ("+" in its name) makes two launches or more. The
    rows whose kernel runs inside the builder (the varlen's ``s.run``) make none here."""
    dispatches = _dispatches(family)
    for spec in _fusion_specs(family, False):
        calls: list = []
        s = _Set(**{k: _Recorder(cls, calls) for k, cls in dispatches.items()})
        spec.call(s)
        if "varlen" in spec.kernel:
            continue
        assert calls, spec.kernel
        for p in spec.peers:
            if p.row or p.needs_torch:
                continue
            calls.clear()
            p.call(s)
            assert len(calls) >= (2 if "+" in p.name else 1), (spec.kernel, p.name, calls)


# ----------------------------------------------------------------------------- the runner

CEIL = Ceilings(copy_gbs=2000.0, device="fake", gemm_tflops=400.0)


class FakeTimer:
    """Runs each timed function three times; the time is the first call's ``us`` attribute result."""

    def __init__(self):
        self.timings = []

    def __call__(self, timing, fn):
        self.timings.append(timing)
        results = [fn() for _ in range(3)]
        return results[0]


def _sets(log, n, us=10.0):
    def build(ctx, tag):
        log.append(("build", tag))
        return [SimpleNamespace(i=i, us=us, tag=tag, seen=[]) for i in range(n)]
    return build


def _call(s):
    s.seen.append(s.i)
    return s.us


def _run(specs, **kw):
    log = []
    rows = run_specs("fake", specs, CEIL, timer=kw.pop("timer", FakeTimer()), release=lambda: log.append("release"),
                     **kw)
    return rows, log


def test_rows_carry_the_counted_work_and_the_ceilings():
    log = []
    build = _sets(log, 3)
    specs = [RowSpec("copy", "n=1000", (build, "a"), _call, bytes=(traffic.rows, "scale", 1000, 1000)),
             RowSpec("gemm", "64x64", (build, "a"), _call, flops=(traffic.gemm_flops, 64, 64, 64)),
             RowSpec("gemm glu", "64x64", (build, "a"), _call, flops=(traffic.gemm_flops, 64, 64, 64, {"glu": True}))]
    rows, _ = _run(specs)
    nbytes = traffic.rows("scale", 1000, 1000)
    assert [r.kernel for r in rows] == ["copy", "gemm", "gemm glu"]
    assert rows[0].gbs == pytest.approx(nbytes / 10e-6 / 1e9) and rows[0].pct_ceiling == pytest.approx(rows[0].gbs / 2000)
    assert rows[1].gbs is None and rows[1].tflops == pytest.approx(2 * 64**3 / 10e-6 / 1e12)
    assert rows[1].pct_ceiling == pytest.approx(rows[1].tflops / 400) and rows[2].tflops == pytest.approx(2 * rows[1].tflops)
    assert log == [("build", "a")]  # one build for the three rows sharing their inputs


def test_calls_rotate_through_the_sets_and_groups_are_released():
    log = []
    b3, b1 = _sets(log, 3), _sets(log, 1)
    seen = []

    def call(s):
        seen.append((s.tag, s.i))
        return 1.0
    specs = [RowSpec("a", "s", (b3, "x"), call, bytes=(traffic.sample, 1, 10)),
             RowSpec("b", "s", (b1, "y"), call, bytes=(traffic.sample, 1, 10)),
             RowSpec("c", "s", (b3, "x"), call, bytes=(traffic.sample, 1, 10))]
    timer = FakeTimer()
    rows, log_ = _run(specs, timer=timer)
    assert [r.kernel for r in rows] == ["a", "b", "c"]
    assert seen == [("x", 0), ("x", 1), ("x", 2), ("y", 0), ("y", 0), ("y", 0), ("x", 0), ("x", 1), ("x", 2)]
    assert log == [("build", "x"), ("build", "y"), ("build", "x")]  # equal inputs share a build only when consecutive
    assert log_ == ["release"] * 3 and all(t == Timing() for t in timer.timings)


def test_peers_by_call_by_row_and_with_inputs_of_their_own():
    log = []
    build = _sets(log, 2)
    own = _sets(log, 1, us=40.0)
    gemv = Peer("own", _call, how="stream", inputs=(own, "peer"))
    specs = [RowSpec("slow", "s", (build, "a"), lambda s: 20.0, bytes=(traffic.sample, 1, 10)),
             RowSpec("fast", "s", (build, "a"), _call, bytes=(traffic.sample, 1, 10),
                     peers=(Peer("slow path", row="slow"), Peer("chain", lambda s: 30.0), gemv)),
             RowSpec("fast2", "s", (build, "a"), _call, bytes=(traffic.sample, 1, 10), peers=(gemv,)),
             RowSpec("other shape", "t", (build, "a"), _call, bytes=(traffic.sample, 1, 10),
                     peers=(Peer("slow path", row="slow"),))]
    timer = FakeTimer()
    rows, _ = _run(specs, timer=timer)
    fast = rows[1]
    assert fast.peer == "slow path" and fast.peer_us == 20.0 and fast.speedup == 2.0
    assert fast.extra == {"peers": {"chain": 30.0, "own": 40.0}}
    assert rows[2].peer == "own" and rows[2].peer_us == 40.0
    assert log.count(("build", "peer")) == 1  # a peer on inputs of its own: measured once per run
    assert rows[3].peer == "" and rows[3].peer_us is None  # the row peer has another shape
    assert Timing("stream") in timer.timings


def test_torch_peers_are_left_out_without_torch(monkeypatch):
    monkeypatch.setattr(benchmark, "_torch_available", lambda: False)
    log = []
    specs = [RowSpec("k", "s", (_sets(log, 1), "a"), _call, bytes=(traffic.sample, 1, 10),
                     peers=(Peer("torch op", lambda s: 1 / 0, how="torch_graph"), Peer("eager torch", lambda s: 1 / 0,
                                                                                       torch=True)))]
    rows, _ = _run(specs)
    assert len(rows) == 1 and rows[0].peer == "" and rows[0].extra == {}


def test_a_failure_leaves_out_its_row_or_peer_and_says_so(capsys):
    log = []

    def broken_build(ctx):
        raise RuntimeError("no memory")
    specs = [RowSpec("broken", "s", (_sets(log, 1), "a"), lambda s: 1 / 0, bytes=(traffic.sample, 1, 10)),
             RowSpec("ok", "s", (_sets(log, 1), "a"), _call, bytes=(traffic.sample, 1, 10),
                     peers=(Peer("bad peer", lambda s: 1 / 0),)),
             RowSpec("no inputs", "s", (broken_build,), _call, bytes=(traffic.sample, 1, 10))]
    rows, _ = _run(specs)
    err = capsys.readouterr().err
    assert [r.kernel for r in rows] == ["ok"] and rows[0].peer == ""
    assert "row broken s failed: ZeroDivisionError" in err and "peer bad peer of ok s failed" in err
    assert "inputs of no inputs s failed: RuntimeError: no memory" in err


def test_shape_fields_from_the_sets_and_rows_the_device_leaves_out():
    def build(ctx):
        return [SimpleNamespace(n_splits=7, packed=None, us=5.0, i=0, seen=[])]
    specs = [RowSpec("decode", "B1 s{n_splits}", (build,), _call, bytes=(traffic.sample, 1, 10)),
             RowSpec("packed", "B1 s{n_splits}", (build,), _call, bytes=(traffic.sample, 1, 10),
                     when=lambda s: s.packed is not None)]
    rows, _ = _run(specs)
    assert [(r.kernel, r.shape) for r in rows] == [("decode", "B1 s7")]


def test_rows_in_turns_with_their_peers():
    """rounds > 1: the rows of one shape with rounds and their peers alternate, each keeping pick(times);
    the peer's ratio and the 'peers' ceiling (fastest peer time / row time) follow."""
    order = []
    times = {"a": iter([9.0, 7.0, 8.0]), "b": iter([6.0, 4.0, 5.0]), "flash": iter([12.0, 10.0, 11.0]),
             "cudnn": iter([3.0, 14.0, 13.0])}

    def timer(timing, fn):
        return fn()

    def timed(name):
        def call(s):
            order.append(name)
            return next(times[name])
        return call
    peers = (Peer("flash", timed("flash")), Peer("cudnn", timed("cudnn")))

    def build(ctx):
        return [SimpleNamespace()]
    specs = [RowSpec("a", "s", (build,), timed("a"), flops=(traffic.gemm_flops, 8, 8, 8), peers=peers, rounds=3, pick=min,
                     ceiling="peers"),
             RowSpec("b", "s", (build,), timed("b"), flops=(traffic.gemm_flops, 8, 8, 8), peers=peers, rounds=3)]
    rows, _ = _run(specs, timer=timer)
    assert order == ["a", "b", "flash", "cudnn", "b", "flash", "cudnn", "a", "flash", "cudnn", "a", "b"]
    a, b = rows
    assert a.us == 7.0 and b.us == 5.0  # min for a, the median for b
    assert a.peer == "flash" and a.peer_us == 10.0 and a.extra == {"peers": {"cudnn": 3.0}}
    assert a.pct_ceiling == pytest.approx(3.0 / 7.0)
    assert b.pct_ceiling == pytest.approx(b.tflops / 400)


def test_rounds_without_a_peer_time_once():
    calls = []

    def build(ctx):
        return [SimpleNamespace()]
    specs = [RowSpec("a", "s", (build,), lambda s: calls.append(1) or 1.0, bytes=(traffic.sample, 1, 10), rounds=3)]
    rows, _ = _run(specs, timer=lambda timing, fn: fn())
    assert len(calls) == 1 and rows[0].us == 1.0


def test_bad_timing_and_peers_are_refused_when_written():
    with pytest.raises(ValueError, match="Timing.how"):
        Timing("graphs")
    with pytest.raises(ValueError, match="Timing.how"):
        Peer("p", lambda s: None, how="eagr")
    with pytest.raises(ValueError, match="a call or a row"):
        Peer("p")
    with pytest.raises(ValueError, match="a call or a row"):
        Peer("p", lambda s: None, row="k")
    with pytest.raises(ValueError, match="ceiling"):
        RowSpec("k", "s", (_sets([], 1), "a"), _call, ceiling="roof")
    with pytest.raises(ValueError, match="inputs"):
        RowSpec("k", "s", (), _call)


def test_kernel_option_selects_rows_by_name(capsys):
    """``--kernel REGEX`` (every bench script's command line) keeps the rows whose kernel name it matches,
    and only for that call."""
    from cukern.benchmark import script_main
    log = []
    build = _sets(log, 1)
    specs = [RowSpec(name, "s", (build, "a"), _call, bytes=(traffic.sample, 1, 10))
             for name in ("varlen bwd f16", "decode", "varlen f16")]
    seen = []

    def bench(quick):
        rows, _ = _run(specs)
        seen.append([r.kernel for r in rows])
        return rows, CEIL
    assert script_main(bench, "fake bench", title="t", quick_help="q", argv=["--kernel", "bwd|^dec"]) == 0
    assert script_main(bench, "fake bench", title="t", quick_help="q", argv=[]) == 0
    assert seen == [["varlen bwd f16", "decode"], ["varlen bwd f16", "decode", "varlen f16"]]
    assert "varlen bwd f16" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        script_main(bench, "fake bench", title="t", quick_help="q", argv=["--kernel", "bwd("])
    assert "not a regular expression" in capsys.readouterr().err
    from cukern.benchmark import selecting
    with selecting("^dec"):
        assert [r.kernel for r in _run(specs)[0]] == ["decode"]
    assert len(_run(specs)[0]) == 3

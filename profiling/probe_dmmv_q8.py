"""Scratch probe (not part of the suite): the int8 dmmv (cuda_src/dmmv/q8.cuh) at the issue's two
shapes as a decode loop runs it (programmatic dependent launch, graph-replayed, rotating weights),
% of the copy ceiling measured in the same run.

  --sweep   per type: ring depth ST (LU units per lane), grid (resident blocks "r", or the fewest
            with the same most rows per block "b", DmmvDispatch's), warps per block at k = 14336
            (32, DmmvDispatch's, or 16: "w16"); the default shape also without pdl ("plain")
  --configs 1x3,4x2,7x2@16   the sweep's (LU x ST[@warps at k = 14336]) configurations instead of
            2x2, 2x3, 2x4 and w16
  --grids bal         the sweep's grids only ("res", "bal")
  --adopt F after the sweep, each type's best configuration (the highest lower of the two shapes'
            pdl figures) written to F as a value of CUKERN_DMMV_Q8_CONFIG, under which the GPU tests
            and bench_dmmv can then run in the same call (see cukern/dmmv.py)
  --shapes 4096x14336,...   the shapes of --sweep and --l2 (the issue's two by default)
  --fit     time over m at k = 4096 (plain and pdl): intercept (fixed cost) and slope (GB/s) per type
  --moe     moe_dmmv top-8/128 2048x7168 as bench_dmmv times it
  --l2 0,1,2  per type and shape (pdl, the table's configuration, balanced grid): % of copy with
            each listed CUKERN_DMMV_Q8_L2 (items per warp L2-prefetched while x is quantized), or
            with each listed NAME=VALUE define (an A/B of a macro-guarded variant)
  --ncu T   one launch per listed type at 14336x4096 (and T@4096x14336): run under ncu
  --ncu-summary F   key metrics of each kernel in ncu's raw csv F

What it showed on an H100 (this session; pdl, % of copy): three ring slots beat two by 5-10 points
(MXFP4 excepted) and four or more lose again, as does an L2 prefetch of later items before the
wait; the balanced grid gains ~3 points at 4096 rows; 16-warp blocks at k = 14336 and 2-block
clusters sharing x's quantization lose 1-6; skipping x's quantization altogether (a timing-only
variant) gains 5-9 points: what is left is mostly that step after the wait. 2026-11-25: an L2
prefetch of each warp's next 1/2/4 items issued after the wait, while x is quantized (--l2), lost
3-12 points at both shapes, monotonically in the items; a quantizer with a quarter of the
conversions and one scale division per block (bit-identical x^) gained ~2% of time at k = 14336.
2026-11-26 (ncu source counters, MXFP4 4096x14336): the kernel issues ~70% of its cycles, and x's
quantization was ~600 of the instructions of every warp (a quarter of the kernel); four lanes per
32-block (q8::quantize_x_range, ~295) gained 1-2 points at 4096x14336 for every type and MXFP4's
once-per-item addressing (Unit::kHoist, measured with --l2 CUKERN_Q8_HOIST=0,1 while it was a
macro) 1.3 more, while it lost the other types 0-3; 2- and 4-block clusters multicasting f32 x
(one L2 read per cluster) lost 7-9 and 25-36 points (H200); --configs 7x2@16, 7x2@24, 4x2@24,
14x2@8 (no half-item row tails at k = 14336) all lost 5-16 points to 4x2 on 32 warps. Also lost
(macro-guarded variants side by side, not kept): the ring's last slot filled before pdl_wait too
(MXFP4 -5, others -0 to -6), the ring's first items issued after pdl_wait (-8 to -12) or after x's
quantization (-12 to -20), an L2 prefetch of the first 1/2/4 items in place of the copies before
pdl_wait (-10 to -15), MXFP4's selector shifts by __umulhi on the FMA pipe (-1.5), MXFP4's row
tails (k % 1024 == 0) by the hoisted path (-1), 32-bit item window arithmetic (within +-1); half
of each prologue item's bulk copy before pdl_wait and the rest once x's loads are in flight: MXFP4
+0.7 to +0.9 (78.5 at 4096x14336), the other types -0 to -5 (a prepare() hook through every int8
kernel for under a point on one type: not kept). 2026-11-26, later: x quantized progressively (chunks of
one item along k, each warp quantizing its share of a chunk before its first item of that chunk, one
chunk ahead after, an mbarrier per chunk) so that the first dot products wait for one chunk of x, not
all of it: correct (238 GPU tests passed) but far slower (--l2 CUKERN_Q8_XPIPE=0,1): 4096x14336 MXFP4
77.4 -> 53.0, Q4_0 84.5 -> 48.9; 14336x4096 Q4_K 89.9 -> 66.8 (MXFP4 there: one item per row, unchanged)
-- the warps wait for each other at every item and each chunk's x loads cost an L2 round trip. Not kept.
Row balance (would splitting rows across blocks so that all 132 SMs share 4096 rows pay?): the default
path at k = 14336 by row count, pdl, copy 2,895 GB/s that run: MXFP4 3968 rows 13.99 us, 4096 13.62
(79.1% of that run's copy), 4224 (32 rows on every SM) 14.58, 4352 15.61; Q4_0 13.15 / 13.27 / 13.84 /
14.61. 4224 rows take 7% longer than 4096 with the same most rows per SM, so the time is not set by the
busiest SM's rows and the 4 idle SMs are not where the missing points are. Not built.
Ring depth against what is in flight while x is quantized (a prefill-count macro, same run per line):
MXFP4 4x3 (fits 32 warps at k = 14336 with 1.5 KB to spare) 68.9% at 4096x14336 with two items
prefilled, 72.0% with one, against 78.8% for the table's 4x2; 4x2 with nothing prefilled 65.7%. Q4_0 /
Q4_K / Q5_K / Q5_0 at 2x4: 81.4 / 80.3 / 75.8 / 80.1% with three prefilled, 83.4 / 83.7 / 83.5 / 83.9 with
two (the 2x3 amount; 2x3 itself measured 84.5 / 85.1 / 85.4 / 87.4 in another run), 72-76 with one. A
deeper ring does not pay at either prefill count. Not kept.
2026-11-26, sixth session (--l2 A/B against the previous q8.cuh, macro-guarded, same run; H100):
x's quantizer rounding by an FMA with 1.5 * 2^23 instead of a quarter-rate F2I per value, d by a
multiplication, 1/d by __frcp_rn's fast path, no half sums for MXFP4 / Q8_0 (kept): MXFP4 4096x14336
77.7 -> 78.9 (FMA alone) -> 79.2-79.5, the other types +1 to +1.5 at 4096x14336. Not kept, each
against that: two lanes per block (16 values each, one shuffle per reduction, ~30% fewer prologue
instructions) -1 to -3 at both shapes for every type (MXFP4 79.1 -> 76.6); four lanes holding float4s
j and 4 + j (every load whole 64-byte halves, interleaving without shuffles) -1.5 to -2 (Q8_0, no sums,
equal); issue() taking a row's non-last items without the matrix-end arithmetic (~22 fewer
instructions per item) MXFP4 equal, Q4_0 14336x4096 -1.8. ncu (MXFP4 vs Q4_0 at 4096x14336, no pdl):
MXFP4 executes fewer instructions (7.9 M vs 8.2 M) but stalls more on MIO throttle (1.47 vs 0.65 per
issue; LSU wavefronts 47% vs 41% of peak): its 17-byte stride makes the weight words' shared loads
3-way bank conflicted (2-way for the other 32-blocks). A timing-only variant reading each lane's
four units from one 68-byte run (conflict-free; x left unmatched) gained 2 points at 14336x4096 and
lost 0.6 at 4096x14336, so the missing points there are not the weights' loads. Not built.
x by bulk copies after pdl_wait (2 KB per warp into its free ring slot, quantized from shared
memory) in place of the float4 loads: MXFP4 4096x14336 79.2 -> 71.8, 14336x4096 83.8 -> 82.7. Not kept.
2026-11-26, eighth session (--sweep --configs 4x2 --grids bal --shapes ..., two runs, copy 2,964 / 2,929
GB/s): is MXFP4's shortfall at 4096x14336 its half-item row tails (k = 14336 is 3.5 items of 128 units)?
No. % of copy under pdl by shape, MXFP4 / Q4_0 (both at 4x2): 4096x12288 (3 whole items a row) 78.0-80.1
/ 81.1-82.9; 4096x14336 78.4-79.6 / 81.1-82.8; 4096x16384 (4 whole) 81.4-82.1 / 85.1-85.7; 4096x13312
77.4-78.2; 4096x15360 80.7-81.6; and 3584x16384 (the bytes of 4096x14336, longer x) 76.9-78.5 / 78.9-81.0.
The figure follows the bytes and, at equal bytes, falls with k (x's quantization after pdl_wait, ~0.09 us
per 1k elements: ~1.3 us of the ~2.7 us over the copy-rate time at 4096x14336), not with the tails.
Then (--l2 CUKERN_MX_E=0,1 while it was a macro, three runs): MXFP4's scale byte taken from the first of the
five aligned words around its block (a byte permute) instead of a shared byte load: 14336x4096 84.0 / 84.8 /
84.6 -> 85.7 / 86.6 / 86.4%, 4096x14336 79.5 / 80.2 / 80.2 -> 79.4 / 80.1 / 79.8. Kept for one column
(Unit<QT_MXFP4>::dot; with 8 columns it spilled). The q8x matvec alone (one run, a scratch variant of
probe_dmmv_chain.py, which measures the two-launch chain: it still loses 8-10 points) is within +-1 point of
the f32-x one for every type but MXFP4 (4096x14336 81.6 against 78.4): x's quantization is no longer what
holds the other types back. Nor is MXFP4's interleaved quantization or its missing half sums the difference at 4096x14336
(--l2 with timing-only macros, two runs: x quantized in element order 79.3 / 80.1 against 79.3 / 79.0;
with the half sums computed 78.9 / 79.2; Q4_0 beside them 86.5-87.0 in all three), though there the q8x
matvec is 0.45 us faster than the f32-x one for MXFP4 and 0.03 us for Q4_0.
2026-11-26, eleventh session (H100): MXFP4's scale as e << 23 (2^(e - 127): two instructions per unit where
the clamped (max(e, 1) - 1) << 23 takes four, the doubled codes' 1/2 applied once to each row sum; --l2
CUKERN_MX_D=0,1 and 1,0 while it was a macro, copy 2,950 / 2,858 GB/s): 14336x4096 85.6 -> 86.3, 88.4 vs
87.7; 4096x14336 79.3 -> 79.8, 81.2 vs 81.3 (Q4_0 beside it within 0.3). Within the spread between runs, and
for e = 255 it gives inf where the gguf reference gives 2^127: not kept. In the same runs the copy ceiling
moved 3% (2,858-2,963 GB/s) while MXFP4's 4096x14336 time stayed at 13.45-13.58 us, so its % of copy read
78-81 by the ceiling alone; in time it needs ~13.2 us for 80% of a 2,950 GB/s copy, its q8x form takes 13.09.
Where MXFP4 loses the points against the other 4-bit types at k = 14336 (bench_dmmv --quick, same run):
the f32-x matvec takes 0.49 us longer than the q8x one for MXFP4, 0.08 for Q4_K and 0.20 for Q4_0, and
MXFP4's q8x time equals Q4_K's f32-x time on 6% fewer bytes.
Then (--l2 with macro sets while they were macros, two runs in opposite orders, copy 2,953 / 2,904 GB/s): the
weights' bulk copies with an L2 evict-first policy (EF), and lane 0 of each warp asking L2 for its next 1 or 2
items before the wait (PF). 4096x14336: MXFP4 none 79.0 / 80.8, EF 80.6 / 82.0, EF+PF1 82.1 / 83.4, EF+PF2
74.8 / 76.1, PF1 alone 77.1 / 78.3; Q4_K 86.4 / 88.1, EF 87.3 / 88.9, EF+PF1 86.2 / 88.0; Q5_K 85.4 / 86.9,
EF 86.9 / 88.1, EF+PF1 84.3 / 85.8. 14336x4096: MXFP4 84.9 / 86.9, EF 87.5 / 88.9, EF+PF1 84.6 / 85.8; Q4_K
89.0 / 90.5, EF 90.4 / 92.3; Q8_0 (cp.async copies, untouched by EF) equal throughout. Kept: EF for the dense
matvecs' bulk copies, PF1 for MXFP4 at k >= 12288 (DmmvDispatch._l2_items). bench_dmmv --quick after both
(H100, copy 2,959 GB/s): MXFP4 4096x14336 pdl 12.94 us, 82% (13.58 us before EF in an earlier run).

Run: PYTHONPATH=. python profiling/probe_dmmv_q8.py --sweep [--types Q4_K,MXFP4]"""
import argparse
import itertools

import cupy
import numpy as np

import cukern.dmmv as D
from cukern.benchmark import measure_ceilings, time_graph_us
from cukern.runtime import FamilySpec, KernelSpec
from profiling.bench_dmmv import _weights

ap = argparse.ArgumentParser()
ap.add_argument("--types", default="Q4_0,Q5_0,Q8_0,MXFP4,Q4_K,Q5_K,Q6_K")
ap.add_argument("--shapes", default="14336x4096,4096x14336", help="MxK,... (the issue's two by default)")
ap.add_argument("--sweep", action="store_true")
ap.add_argument("--configs", default="")
ap.add_argument("--grids", default="res,bal")
ap.add_argument("--adopt", default="", metavar="FILE")
ap.add_argument("--moe", action="store_true")
ap.add_argument("--l2", default="", help="L2 items per warp prefetched while x is quantized, e.g. 0,1,2, "
                                        "or NAME=VALUE defines to compare")
ap.add_argument("--fit", action="store_true")
ap.add_argument("--ncu", default="")
ap.add_argument("--ncu-summary", default="", help="a raw ncu csv (--page raw --csv): the key metrics per kernel")
args = ap.parse_args()
TYPES = [D.qtype_id(t) for t in args.types.split(",") if t]
SHAPES = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
d = D.DmmvDispatch()


# (LU, ST) configs of dmmv_q8 per variant, and the warps per block at k = 14336 (None: DmmvDispatch's)
VARIANTS = {"": ([(2, 2), (2, 3), (2, 4)], None), "w16": ([(2, 3)], 16)}
if args.configs:  # LUxST, or LUxST@W for W warps per block at k = 14336
    VARIANTS = {}
    for c in args.configs.split(","):
        cfg, _, w = c.partition("@")
        VARIANTS.setdefault(f"w{w}" if w else "", ([], int(w) if w else None))[0].append(
            tuple(int(v) for v in cfg.split("x")))
GRIDS = tuple(g for g in ("res", "bal") if g in args.grids.split(","))


def kname(qt, lu, st, bulk=None):
    bulk = D._Q8_CONFIG[qt][2] if bulk is None else bulk
    return f"dmmv_q8<{qt}, 1, {lu}, {st}, {'true' if bulk else 'false'}>"


def unit(name, kernels, defines=()):
    return D._Unit(FamilySpec(name, tuple(KernelSpec(k, "DmmvParams") for k in kernels), source="dmmv/dmmv.cu",
                              params_header="dmmv/params.cuh", defines=defines))


def plan(qt, k, lu, st, first=None):
    """(warps, dynamic smem, resident blocks) as DmmvDispatch._q8_plan picks them for this config."""
    limit = d.max_shared_optin()
    first = first or (16 if k <= D._Q8_SPLIT_K else 32)
    for nw in (first, first // 2, first // 4):
        smem = D._q8_smem(qt, nw, 1, k, (lu, st, 1))
        if smem <= limit:
            return nw, smem, d.sm_count() * max(1, min(32 // nw, (limit + 1024) // (smem + 1024)))
    return None


def timed(u, kern, qt, m, k, lu, st, grid_mode, pdl, first=None):
    pl = plan(qt, k, lu, st, first)
    if pl is None:
        return None, ""
    nw, smem, resident = pl
    blocks = min(m, resident) if grid_mode == "res" else D._q8_blocks(m, resident)
    u._function(kern, smem)
    (sets, nxt), wb = _weights(qt, m, k)
    x = cupy.random.standard_normal(k, dtype=cupy.float32)
    y = cupy.empty(m, cupy.float32)
    p = d._params(nxt(), blocks1=blocks, y_stride=m)
    us = time_graph_us(lambda: u._launch(kern, blocks, nw * 32, (y, nxt().buf, x, y), p, shared_mem=smem, pdl=pdl))
    del sets
    cupy.get_default_memory_pool().free_all_blocks()
    return (wb + 4 * (m + k)) / us / 1e3, f"w{nw}x{resident // d.sm_count()}g{blocks}"


def sweep() -> dict:
    """Prints a line per (shape, type); returns {(type, (LU, ST)): [% of copy per shape]} of the
    default warps and the balanced grid under pdl."""
    cfgs = sorted({c for cs, _ in VARIANTS.values() for c in cs} | {D._Q8_CONFIG[q][:2] for q in TYPES})
    u = unit("dmmv_q8_probe", [kname(q, *c) for q in TYPES for c in cfgs])
    ceil = measure_ceilings()
    print(f"copy {ceil.copy_gbs:.0f} GB/s, {d.sm_count()} SMs; % of copy, pdl unless 'plain'", flush=True)
    found: dict = {}
    for (m, k), qt in itertools.product(SHAPES, TYPES):
        lu, st, _ = D._Q8_CONFIG[qt]
        g, _ = timed(u, kname(qt, lu, st), qt, m, k, lu, st, "bal", False)
        out = [f"plain-L{lu}S{st}b:{g / ceil.copy_gbs:.1%}"]
        for v, (cs, first) in VARIANTS.items():
            if first and k <= D._Q8_SPLIT_K:
                continue
            for (lu, st), gm in itertools.product(cs, GRIDS):
                g, shape = timed(u, kname(qt, lu, st), qt, m, k, lu, st, gm, True, first)
                if g is not None:
                    out.append(f"{v}L{lu}S{st}{gm[0]}:{g / ceil.copy_gbs:.1%}")
                    if not v and gm == "bal":
                        found.setdefault((qt, (lu, st)), []).append(g / ceil.copy_gbs)
        print(f"{m}x{k} {D.QTYPES[qt][0]:6s} " + " ".join(out), flush=True)
    return found


def l2_sweep():
    values = [v for v in args.l2.split(",")]
    units = {v: unit(f"dmmv_q8_l2_{i}", [kname(q, *D._Q8_CONFIG[q][:2]) for q in TYPES],
                     tuple(v.split(";")) if "=" in v else (f"CUKERN_DMMV_Q8_L2={v}",))
             for i, v in enumerate(values)}
    ceil = measure_ceilings()
    print(f"copy {ceil.copy_gbs:.0f} GB/s; % of copy under pdl by CUKERN_DMMV_Q8_L2 = {values}", flush=True)
    for (m, k), qt in itertools.product(SHAPES, TYPES):
        lu, st, _ = D._Q8_CONFIG[qt]
        figs = [timed(units[v], kname(qt, lu, st), qt, m, k, lu, st, "bal", True)[0] / ceil.copy_gbs for v in values]
        print(f"{m}x{k} {D.QTYPES[qt][0]:6s} " + " ".join(f"L2={v}:{f:.1%}" for v, f in zip(values, figs)), flush=True)


def adopt(found: dict, path: str) -> None:
    """Each type's best configuration (the highest lower figure of the two shapes) as
    CUKERN_DMMV_Q8_CONFIG's value, printed and written to ``path``."""
    picks = []
    for qt in TYPES:
        ranked = sorted(((min(v), c) for (q, c), v in found.items() if q == qt and len(v) == len(SHAPES)), reverse=True)
        if ranked:
            worst, (lu, st) = ranked[0]
            print(f"best {D.QTYPES[qt][0]}: L{lu}S{st} (worse shape {worst:.1%}; table {D._Q8_CONFIG[qt][:2]})")
            picks.append(f"{D.QTYPES[qt][0]}={lu}x{st}")
    with open(path, "w") as f:
        f.write(",".join(picks))
    print("CUKERN_DMMV_Q8_CONFIG=" + ",".join(picks), flush=True)


def moe():
    from profiling.bench_dmmv import _moe_weight, _rotating_ids
    ceil = measure_ceilings()
    n_e, top_k, m, k = 128, 8, 2048, 7168
    for qt in TYPES:
        w, ebytes = _moe_weight(qt, n_e, m, k)
        ids = _rotating_ids(np.random.default_rng(2), n_e, top_k)
        x = cupy.random.standard_normal((1, k), dtype=cupy.float32)
        y = cupy.empty((1, top_k, m), cupy.float32)
        us = time_graph_us(lambda: d.moe_dmmv(w, x, ids(), y))
        gbs = (top_k * ebytes + 4 * (k + top_k * m)) / us / 1e3
        print(f"moe_dmmv {D.QTYPES[qt][0]:6s} top{top_k}/{n_e} {m}x{k}: {us:.1f} us {gbs / ceil.copy_gbs:.1%} of copy",
              flush=True)
        cupy.get_default_memory_pool().free_all_blocks()


def fit():
    ceil = measure_ceilings()
    dp = D.DmmvDispatch(pdl=True)
    print(f"copy {ceil.copy_gbs:.0f} GB/s", flush=True)
    for qt in TYPES:
        for dd, tag in ((d, "plain"), (dp, "pdl")):
            pts = []
            for m in (7168, 14336, 28672, 57344):
                (sets, nxt), wb = _weights(qt, m, 4096)
                x = cupy.random.standard_normal(4096, dtype=cupy.float32)
                y = cupy.empty(m, cupy.float32)
                pts.append((wb, time_graph_us(lambda: dd.dmmv(nxt(), x, y))))
                del sets
                cupy.get_default_memory_pool().free_all_blocks()
            b, a = np.polyfit([q[0] for q in pts], [q[1] for q in pts], 1)
            print(f"{D.QTYPES[qt][0]:6s} {tag:5s} " + " ".join(f"{q[0] / 1e6:.0f}MB:{q[1]:.1f}us" for q in pts)
                  + f"  fit {a:.2f} us + bytes / {1e-3 / b:.0f} GB/s", flush=True)


def ncu():
    for spec in args.ncu.split(","):
        name, _, shape = spec.partition("@")
        m, k = (int(v) for v in shape.split("x")) if shape else (14336, 4096)
        qt = D.qtype_id(name)
        (sets, nxt), _ = _weights(qt, m, k)
        x = cupy.random.standard_normal(k, dtype=cupy.float32)
        y = cupy.empty(m, cupy.float32)
        d.dmmv(nxt(), x, y)
        cupy.cuda.Device().synchronize()
        del sets


def ncu_summary(path):
    import csv
    import re
    rows = list(csv.reader(open(path)))
    head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    names, units, data = rows[head], rows[head + 1], rows[head + 2:]
    keys = [r"gpu__time_duration.sum$", r"dram__throughput.avg.pct_of_peak_sustained_elapsed$",
            r"dram__bytes_read.sum$", r"smsp__issue_active.avg.pct_of_peak_sustained_active$",
            r"sm__throughput.avg.pct_of_peak_sustained_elapsed$", r"smsp__inst_executed.sum$",
            r"smsp__warps_active.avg.per_cycle_active$", r"launch__registers_per_thread$", r"launch__grid_size$",
            r"launch__block_size$", r"l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum$",
            r"smsp__average_warps_issue_stalled_.*_per_issue_active.ratio$", r"sm__cycles_elapsed.avg$"]
    for r in data:
        if len(r) != len(names):
            continue
        print("---", r[names.index("Kernel Name")][:60])
        for i, n in enumerate(names):
            if any(re.search(k, n) for k in keys):
                v = r[i]
                try:
                    if "stalled" in n and float(v.replace(",", "")) < 0.05:
                        continue
                except ValueError:
                    pass
                print(f"  {n.replace('smsp__average_warps_issue_stalled_', 'stall_')}: {v} {units[i]}")


if args.ncu_summary:
    ncu_summary(args.ncu_summary)
if args.sweep:
    found = sweep()
    if args.adopt:
        adopt(found, args.adopt)
if args.l2:
    l2_sweep()
if args.moe:
    moe()
if args.fit:
    fit()
if args.ncu:
    ncu()

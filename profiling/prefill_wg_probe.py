"""prefill_wg (Hopper wgmma) against prefill (mma.sync) and torch SDPA, in one GPU run:

1. correctness of both kernels against the float64 reference on ragged varlen and paged batches (f16 and
   bf16, causal / window+sinks / softcap / non-causal), printed as max |err| / tolerance;
2. the bench's prefill row (B4 L4096 32/32 D128 causal, paged) and varlen row, ours (wgmma and mma.sync)
   beside torch SDPA's flash and cuDNN backends, timed in alternating rounds (bench_attention's helpers).

With ``--variants``, each entry of VARIANTS (defines of the prefill_wg units, e.g. the profiling switch
CUKERN_PREFILL_WG_SKIP) is then timed on the B4 L4096 rows in its own process (PROBE_VARIANTS=a,b: only those).

``--bench-rows``: only bench_attention.py --quick's prefill / varlen rows (same helpers, same table).

Run: PYTHONPATH=. python profiling/prefill_wg_probe.py [--variants] [--no-time] [--bench-rows]

Tried and not kept (H100, 2026-11-27, this probe's rows): each warpgroup overlapping its own softmax with its
products instead of the pingpong between warpgroups (S of tile t + 1 and O += P V of tile t in flight while tile
t + 1's softmax runs, K copied a tile ahead of V, four page-table slots; D128 only, 220 registers, the check
passed): paged B4 L4096 1766.9 us against the pingpong's 1524.8 (flash 1772-1807), varlen 1597.6 against 1355.6.
Presumably because, with one block barrier per tile, both warpgroups issue their products together and then both
run their softmax (not measured).
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
# name -> (old, new) text substitutions in attention/prefill_wg.cuh
# name -> defines of the prefill_wg units (a variant named "*check*" is also checked against the reference)
VARIANTS: dict[str, tuple[str, ...]] = {
    "no_pingpong": ("CUKERN_PREFILL_WG_PINGPONG=0",),
    **{f"skip{k}": (f"CUKERN_PREFILL_WG_SKIP={k}",) for k in (2, 1)},
}
TOL = {"float16": (1e-3, 2e-3), "bfloat16": (1e-2, 1.6e-2)}


def _bench():
    spec = importlib.util.spec_from_file_location("bench_attention", ROOT / "profiling" / "bench_attention.py")
    b = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(b)
    return b


def _err(got, want, kind) -> float:
    """max |got - want| / (atol + rtol |want|): <= 1 passes the tests' tolerance."""
    atol, rtol = TOL[kind]
    return float(np.nanmax(np.abs(got - want) / (atol + rtol * np.abs(want)))) if np.isfinite(got).all() else np.inf


def check(attn) -> bool:
    import cupy
    from cukern.attention import PagedKVCache
    from cukern.reference import attention as ref
    rng = np.random.default_rng(1)
    ok = True

    def store(x, kind):
        return cupy.asarray(ref.bf16_bits(x)) if kind == "bfloat16" else cupy.asarray(x.astype(kind))

    variants = {"causal": (True, {}), "window+sinks": (True, dict(window_left=150, sinks=None)),
                "softcap": (True, dict(softcap=4.0, scale=0.25)), "noncausal": (False, {})}
    for kind in ("float16", "bfloat16"):
        # varlen, ragged: lengths around the 128-row / 128-key tiles
        q_lens, k_lens = [1, 127, 128, 129, 300, 64], [1, 127, 200, 129, 300, 700]
        cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
        h, hk, d = 4, 2, 128
        q = store(rng.standard_normal((cu_q[-1], h, d)).astype(np.float32), kind)
        k = store(rng.standard_normal((cu_k[-1], hk, d)).astype(np.float32), kind)
        v = store(rng.standard_normal((cu_k[-1], hk, d)).astype(np.float32), kind)
        qh, kh, vh = (ref.as_float64(x, kind) for x in (q, k, v))
        for name, (causal, kw) in variants.items():
            kw = dict(kw)
            sinks = None
            if "sinks" in kw:
                sinks = rng.standard_normal(h).astype(np.float32)
                kw["sinks"] = sinks
            want_o, want_lse = ref.varlen(qh, kh, vh, cu_q, cu_k, causal=causal, **kw)
            for wg in (True, False):
                out = cupy.full(q.shape, 0xFFFF, cupy.uint16).view(q.dtype)
                lse = cupy.full((cu_q[-1], h), np.nan, cupy.float32)
                dev_kw = dict(kw)
                if sinks is not None:
                    dev_kw["sinks"] = cupy.asarray(sinks)
                attn.flash_attn_varlen(q, k, v, cupy.asarray(cu_q), cupy.asarray(cu_k), out, max_seqlen_q=max(q_lens),
                                       causal=causal, lse=lse, wgmma=wg, **dev_kw)
                e = _err(ref.as_float64(out, kind), want_o, kind)
                el = float(np.nanmax(np.abs(lse.get() - want_lse))) if np.isfinite(lse.get()).all() else np.inf
                good = e <= 1 and el <= (2e-3 if kind == "float16" else 1e-2)
                ok &= good
                print(f"check varlen {kind:8s} {name:12s} {'wgmma' if wg else 'mma  '}: err/tol {e:8.3f} "
                      f"lse {el:.2e} {'ok' if good else 'FAIL'}", flush=True)
        # paged: page 64 (a 128-key tile spans two pages) and page 16, extending sequences
        for ps, lengths, ql in ((64, [700, 129, 1], [700, 40, 1]), (16, [257, 300], [130, 300])):
            n_pages = sum(-(-n // ps) for n in lengths) + 2
            cache = PagedKVCache(1, n_pages, ps, hk, d, max_seqs=len(lengths) + 1, dtype=kind)
            slots = []
            for n in lengths:
                s = cache.add(n)
                kk = rng.standard_normal((n, hk, d)).astype(np.float32)
                vv = rng.standard_normal((n, hk, d)).astype(np.float32)
                attn.write_kv_run(cache, 0, cupy.asarray(kk), cupy.asarray(vv), s, 0)
                slots.append(s)
            qp = store(rng.standard_normal((sum(ql), h, d)).astype(np.float32), kind)
            plan = attn.plan_batched(cache, slots, ql)
            kp, vp = ref.as_float64(cache.k_pools[0], kind), ref.as_float64(cache.v_pools[0], kind)
            want_o, _ = ref.paged_attention(ref.as_float64(qp, kind), kp, vp, cache.page_table.get(),
                                            cache.lengths.get(), slots, ql, ps, window_left=200)
            for wg in (True, False):
                out = cupy.full(qp.shape, 0xFFFF, cupy.uint16).view(qp.dtype)
                attn.flash_attn_batched(plan, 0, qp, out, window_left=200, wgmma=wg)
                e = _err(ref.as_float64(out, kind), want_o, kind)
                ok &= e <= 1
                print(f"check paged  {kind:8s} page {ps:3d} window  {'wgmma' if wg else 'mma  '}: err/tol {e:8.3f} "
                      f"{'ok' if e <= 1 else 'FAIL'}", flush=True)
    return ok


def timing(attn, short: bool = False) -> None:
    """The bench's B4 L4096 rows (paged, varlen), ours through both kernels beside SDPA; short: wgmma and
    flash only."""
    import cupy
    b = _bench()
    rng = cupy.random.default_rng(0)
    for label, make in (("prefill paged", b._prefill_fn), ("varlen (+lse)", b._varlen_fn)):
        for bb, L, h, hk, d in ((4, 4096, 32, 32, 128),):
            fn = make(attn, rng, bb, L, h, hk, d)
            fns = {"wgmma": lambda fn=fn: _with(attn, fn, True), "mma": lambda fn=fn: _with(attn, fn, False),
                   **b._sdpa_fns(bb, h, hk, L, d, True)}
            if short:
                fns = {k: fns[k] for k in ("wgmma", "flash") if k in fns}
            t = b._rounds_us(fns)
            fl = b._flops(bb, h, L, d, True)
            row = "  ".join(f"{k} {v:8.1f} us {fl / v / 1e6:5.0f} TF" for k, v in t.items())
            ratio = t["flash"] / t["wgmma"] if "flash" in t else float("nan")
            print(f"time {label} B{bb} L{L} {h}/{hk} D{d} causal: {row}  wgmma/flash {ratio:.3f}x", flush=True)


_FORCE = {"wgmma": None}


def _with(attn, fn, wg):
    """Run a bench closure with wgmma forced (the closures call the dispatch without the keyword)."""
    _FORCE["wgmma"] = wg
    return fn()


def _patch(attn):
    """Route the forced choice into _use_wg (the bench closures pass no wgmma=)."""
    orig = attn._use_wg

    def use_wg(kind, d, h, wgmma):
        return orig(kind, d, h, _FORCE["wgmma"] if wgmma is None else wgmma)
    attn._use_wg = use_wg


def bench_rows() -> None:
    """bench_attention.py --quick's prefill and varlen rows (its own helpers and table), default kernels."""
    import cupy
    from cukern.attention import AttentionDispatch
    from cukern.benchmark import measure_ceilings, print_table
    b = _bench()
    attn, rng = AttentionDispatch(), cupy.random.default_rng(0)
    rows = []
    for bb, L, h, hk, d in [(4, 4096, 32, 32, 128), (1, 1024, 32, 32, 128), (4, 4096, 16, 16, 256)]:
        rows.append(b._tc_rows("prefill paged f16", b._prefill_fn(attn, rng, bb, L, h, hk, d), bb, L, h, hk, d, True))
    rows.append(b._tc_rows("varlen f16 (+lse)", b._varlen_fn(attn, rng, 4, 4096, 32, 32, 128, True), 4, 4096, 32, 32,
                           128, True))
    print_table(rows, measure_ceilings(), b.TITLE)


def ptxas_log() -> None:
    """Registers, spills and wgmma advisories of prefill_wg as this machine's NVRTC builds it."""
    from cukern import runtime
    from cukern.attention import FAMILIES
    spec = FAMILIES["attention_prefill_wg_f16"]
    nvrtc = runtime._nvrtc()
    prog = nvrtc.createProgram(spec.unit_source(), "prefill_wg.cu", [], [])
    names = [k.name for k in spec.kernels]
    for n in names:
        nvrtc.addNameExpression(prog, n)
    nvrtc.compileProgram(prog, ["-arch=sm_90a", "-ftz=true", "--ptxas-options=-v",
                                *runtime.compile_options(90, spec.defines)])
    print("ptxas:", nvrtc.getProgramLog(prog).strip().replace("\n", "\nptxas: "), flush=True)
    nvrtc.destroyProgram(prog)


def run(do_time: bool, time_only: bool) -> int:
    import dataclasses

    import cukern.attention as A
    defines = tuple(x for x in os.environ.get("PREFILL_WG_DEFINES", "").split(",") if x)
    for name in list(A.FAMILIES):
        if name.startswith("attention_prefill_wg"):
            A.FAMILIES[name] = dataclasses.replace(A.FAMILIES[name], defines=A.FAMILIES[name].defines + defines)
    attn = A.AttentionDispatch()
    _patch(attn)
    if time_only:
        timing(attn, short=True)
        return 0
    try:
        ptxas_log()
    except Exception as e:  # a diagnostic only
        print(f"ptxas log unavailable: {type(e).__name__}: {e}")
    ok = check(attn)
    print(f"CHECK {'PASS' if ok else 'FAIL'}", flush=True)
    if do_time:
        timing(attn, short="--short" in sys.argv)
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    do_time = "--no-time" not in argv
    if "--bench-rows" in argv:
        bench_rows()
        return 0
    if "--child" in argv:
        return run(do_time, "--time-only" in argv)
    rc = subprocess.call([sys.executable, __file__, "--child", *[a for a in argv if a != "--variants"]])
    if "--variants" in argv:
        only = [x for x in os.environ.get("PROBE_VARIANTS", "").split(",") if x]  # names to run (default: all)
        for name, defines in VARIANTS.items():
            if only and name not in only:
                continue
            print(f"=== variant {name}: {' '.join(defines)}", flush=True)
            subprocess.call([sys.executable, __file__, "--child", *argv, "--short",
                             *([] if "check" in name else ["--time-only"])],
                            env={**os.environ, "PREFILL_WG_DEFINES": ",".join(defines)})
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

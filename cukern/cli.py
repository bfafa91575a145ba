"""``python -m cukern``: info, check, bench, compare, roofline, notebooks.

* ``info``  - GPU, compute capability, SMs, memory, driver/runtime/NVRTC/CuPy
  versions and the kernel cache location; says plainly when there is no GPU.
* ``check`` - compile every kernel with NVRTC for the given archs (no GPU
  needed) and list each kernel with its parameter-struct size from the PTX;
  exits 1 on any error. ``check --gpu`` instead runs every kernel against its
  reference (the quick GPU tests) and prints the error against the tolerance
  (:mod:`cukern.selfcheck`).
* ``bench`` - every family's benchmark in one process, one table, ``--json``
  and ``--plot`` (:mod:`cukern.workbench`, :mod:`cukern.roofline`).
* ``compare`` - the change per row between two ``bench --json`` files.
* ``roofline`` - the ``bench --plot`` chart of saved results (no GPU needed).
* ``notebooks`` - check (CPU) or run headless (GPU) the checkout's notebooks
  (:mod:`cukern.notebooks`).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys


def _version(fn) -> str:
    try:
        return fn()
    except Exception as e:  # a missing driver or library is a fact to report, not a crash
        return f"unavailable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def cmd_info(args) -> int:
    import numpy as np

    import cukern
    print(f"cukern          {cukern.__version__}")
    print(f"python          {platform.python_version()}")
    print(f"numpy           {np.__version__}")
    try:
        import cupy
    except ImportError:
        print("cupy            not installed (pip install 'cukern[cuda12]' or 'cukern[cuda13]')")
        return 0
    from cupy.cuda import nvrtc, runtime as cudart

    from cukern import runtime
    print(f"cupy            {cupy.__version__}")
    print(f"nvrtc           {_version(lambda: '.'.join(map(str, nvrtc.getVersion())))}")
    print(f"cuda runtime    {_version(lambda: _cuda_version(cudart.runtimeGetVersion()))}")
    print(f"cuda driver     {_version(lambda: _cuda_version(cudart.driverGetVersion()))}")
    print(f"cuda headers    {_version(lambda: runtime.cuda_include_dir() or 'not found')}")
    print(f"kernel cache    {os.environ.get('CUPY_CACHE_DIR', os.path.expanduser('~/.cupy/kernel_cache'))}")
    print(f"sources         {_version(lambda: str(runtime.source_root()))}")
    try:
        count = cudart.getDeviceCount()
    except Exception as e:
        count, reason = 0, f"{type(e).__name__}: {e}"
    else:
        reason = "the driver reports 0 devices"
    if count == 0:
        print(f"gpu             none: no CUDA device is visible ({reason})")
        return 0
    for i in range(count):
        p = cudart.getDeviceProperties(i)
        name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
        free, total = cupy.cuda.Device(i).mem_info
        print(f"gpu {i}           {name}, sm_{p['major']}{p['minor']}, {p['multiProcessorCount']} SMs, "
              f"{total / 2**30:.1f} GiB ({free / 2**30:.1f} free), L2 {p['l2CacheSize'] / 2**20:.0f} MiB")
    return 0


def cmd_check(args) -> int:
    if args.gpu:
        from cukern import selfcheck
        return selfcheck.run(args.tests or None, keyword=args.keyword, by_function=not args.verbose)
    from cukern import check, runtime
    try:
        targets = [runtime.parse_target(a) for a in (args.arch or ["sm_90"])]
        rows = check.run(targets, args.family)
    except (runtime.CukernError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    width = max(len(r.kernel) for r in rows) if rows else 10
    print(f"{'arch':<7} {'unit':<28} {'kernel':<{width}} {'params':<18} {'struct':>7} {'ptx':>7}  status")
    for r in rows:
        size = f"{r.struct_size} B" if r.struct_size else ""
        ptx = f"{r.ptx_size} B" if r.ptx_size > 0 else ""
        status = "ok" if r.ok else "ERROR"
        print(f"{r.target:<7} {r.unit:<28} {r.kernel:<{width}} {r.struct:<18} {size:>7} {ptx:>7}  {status}")
    errors = [r for r in rows if not r.ok]
    for r in errors:
        print(f"\nERROR {r.target} {r.unit} {r.kernel}:\n{r.error}", file=sys.stderr)
    n_kernels = sum(1 for r in rows if not r.unit.startswith("probe:"))
    print(f"\n{n_kernels} kernel rows, {len(rows) - n_kernels} layout probes, {len(errors)} errors "
          f"({', '.join(f'sm_{a}' + ('a' if specific else '') for a, specific in targets)}; on sm_90 the "
          f"Hopper units as sm_90a)")
    return 1 if errors else 0


def cmd_bench(args) -> int:
    from cukern import runtime, workbench
    from cukern.benchmark import format_table
    try:
        result = workbench.run_bench(args.family or None, quick=args.quick, gemm=not args.no_gemm)
    except runtime.CukernError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rows, ceilings = workbench.rows_of(result)
    print(format_table(rows, ceilings))
    for family, tb in result["errors"].items():
        print(f"\nERROR in bench_{family}.py:\n{tb}", file=sys.stderr)
    if args.json:
        workbench.write_result(result, args.json)
        print(f"\nwrote {args.json}")
    if args.plot:
        from cukern.roofline import plot_roofline
        try:
            plot_roofline(result, args.plot)
        except ImportError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"wrote {args.plot}")
    return 1 if result["errors"] else 0


def cmd_compare(args) -> int:
    from cukern import runtime, workbench
    try:
        a, b = workbench.load_result(args.a), workbench.load_result(args.b)
    except runtime.CukernError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(workbench.format_compare(a, b, workbench.compare(a, b), args.threshold))
    return 0


def cmd_roofline(args) -> int:
    from cukern import runtime, workbench
    try:
        result = workbench.merge_results([workbench.load_result(p) for p in args.results])
        from cukern.roofline import plot_roofline
        plot_roofline(result, args.out)
    except (runtime.CukernError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} ({len(result['rows'])} rows)")
    return 0


def cmd_notebooks(args) -> int:
    from cukern import notebooks, runtime
    try:
        if args.run:
            return notebooks.main_run(args.paths, args.figures)
        return notebooks.main_check(args.paths)
    except runtime.CukernError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cukern", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="GPU, versions and cache location")
    p.set_defaults(fn=cmd_info)
    p = sub.add_parser("check", help="compile every kernel with NVRTC (no GPU needed) and check struct sizes")
    p.add_argument("--arch", action="append", metavar="sm_XX",
                   help="target arch, repeatable (default sm_90); sm_80 or newer")
    p.add_argument("--family", action="append", metavar="NAME", help="only this family (repeatable)")
    p.add_argument("--gpu", action="store_true",
                   help="instead: run every kernel against its reference on this GPU (the quick GPU tests of "
                        "the checkout's tests/, -m 'gpu and not slow') and print error vs tolerance per test")
    p.add_argument("-k", dest="keyword", metavar="EXPR", help="with --gpu: only tests matching this pytest -k EXPR")
    p.add_argument("--verbose", "-v", action="store_true", help="with --gpu: one row per parametrised case")
    p.add_argument("tests", nargs="*", metavar="PATH", help="with --gpu: test files or folders (default: tests/)")
    p.set_defaults(fn=cmd_check)

    p = sub.add_parser("bench", help="run the benchmarks of every family (or those named) and print one table",
                       description="Run profiling/bench_<family>.py of the source checkout in one process "
                                   "(found above the cukern package, in the current directory or at "
                                   "$CUKERN_ROOT) and print one table: median CUDA-event time, GB/s or "
                                   "TFLOP/s, %% of the ceiling measured in this run, ratio to each peer.")
    p.add_argument("family", nargs="*", help="families to run (default: every profiling/bench_*.py)")
    p.add_argument("--quick", action="store_true", help="small sizes only")
    p.add_argument("--json", metavar="OUT.json", help="write every figure, with device, versions and date")
    p.add_argument("--plot", metavar="OUT.png", help="save a roofline chart of the run (needs matplotlib)")
    p.add_argument("--no-gemm", action="store_true", help="skip the cuBLAS GEMM ceiling (about a second)")
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("compare", help="the change per row between two `bench --json` files",
                       description="Match the rows of two `bench --json` results by family, kernel and shape "
                                   "and print A time, B time and the change (B/A - 1: negative is faster).")
    p.add_argument("a", metavar="A.json")
    p.add_argument("b", metavar="B.json")
    p.add_argument("--threshold", type=float, default=0.05,
                   help="mark rows whose time moved by more than this fraction (default 0.05)")
    p.set_defaults(fn=cmd_compare)

    p = sub.add_parser("roofline", help="the roofline chart of saved `bench --json` results (no GPU needed)",
                       description="Plot one or more saved results (`bench --json`, or a bench_<family>.py "
                                   "--json file) as the chart `bench --plot` draws; several files are merged.")
    p.add_argument("results", nargs="+", metavar="RESULT.json")
    p.add_argument("-o", "--out", default="roofline.png", help="PNG to write (default roofline.png)")
    p.set_defaults(fn=cmd_roofline)

    p = sub.add_parser("notebooks", help="check (CPU) or run headless (GPU) the notebooks",
                       description="Without --run: parse every notebook and compile its code cells (no GPU). "
                                   "With --run: execute the code cells in order, headless (Agg backend), "
                                   "as Jupyter would; no Jupyter needed.")
    p.add_argument("paths", nargs="*", metavar="NOTEBOOK", help="notebooks (default: the checkout's notebooks/)")
    p.add_argument("--run", action="store_true", help="execute them (needs a GPU)")
    p.add_argument("--figures", metavar="DIR", help="with --run: save the figures each cell draws here as PNG")
    p.set_defaults(fn=cmd_notebooks)
    from cukern.models.cli import add_generate_parser  # light import: the model code loads when it runs
    add_generate_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)

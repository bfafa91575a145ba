"""``python -m cukern``: info, check, bench, compare, roofline, notebooks.

* ``info``  - GPU, compute capability, SMs, memory, driver/runtime/NVRTC/CuPy
  versions and the kernel cache location; says plainly when there is no GPU.
* ``check`` - compile every kernel with NVRTC for the given archs (no GPU
  needed) and list each kernel with its parameter-struct size from the PTX;
  exits 1 on any error. The units compile in parallel (``-j``) behind a progress
  bar on a terminal, and their PTX is cached (:mod:`cukern.check`); ``--family``
  takes every unit of a family, ``--unit`` one unit. ``check --gpu`` instead
  runs every kernel against its reference (the quick GPU tests) and prints the
  error against the tolerance (:mod:`cukern.selfcheck`).
* ``bench`` - every family's benchmark in one process, one table, ``--json``
  and ``--plot`` (:mod:`cukern.workbench`, :mod:`cukern.roofline`).
* ``compare`` - the change per row between two ``bench --json`` files;
  ``--fail-above PCT`` exits 1 on a row slower by more than PCT percent.
* ``roofline`` - the ``bench --plot`` chart of saved results (no GPU needed),
  one labelled run per file.
* ``notebooks`` - check (CPU) or run headless (GPU) the checkout's notebooks
  (:mod:`cukern.notebooks`).

``info``, ``check`` and ``compare`` take ``--json``: what they print, as one JSON object
on stdout. ``python -m cukern --version`` prints the version.

Bad input ends in one line on stderr, never a traceback: exit 2 for a flag or argument of the
wrong form (a NaN threshold, an output folder that does not exist), exit 1 for a file that cannot
be read or is not what the command reads, or a failed run.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (the usage itself is in ``--help``); exit 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def number_arg(kind: str, lo=None):
    """An argparse ``type=``: the flag's text as a finite ``float`` (kind ``"real"``) or an ``int``
    (kind ``"int"``), at least ``lo`` where given (:func:`cukern.params.check_real` /
    :func:`~cukern.params.check_int`); otherwise a usage error saying why."""
    def parse(text: str):
        from cukern.params import check_int, check_real
        try:
            raw = float(text) if kind == "real" else int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'a number' if kind == 'real' else 'an integer'}, "
                                             f"got {text!r}") from None
        try:
            value = check_real("value", raw) if kind == "real" else check_int("value", raw, lo)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if lo is not None and value < lo:   # check_real has no range
            raise argparse.ArgumentTypeError(f"value must be >= {lo}, got {value}")
        return value
    parse.__name__ = kind   # argparse names the type in some messages
    return parse


def regex_arg(text: str):
    """An argparse ``type=`` for ``--kernel``: the compiled regular expression, a usage error otherwise."""
    import re
    try:
        return re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"not a regular expression ({e}): {text!r}") from None


def arch_arg(text: str) -> tuple[int, bool]:
    """An argparse ``type=`` for ``--arch``: :func:`cukern.runtime.parse_target`, a usage error otherwise."""
    from cukern import runtime
    try:
        return runtime.parse_target(text)
    except runtime.CukernError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def out_path_problem(flag: str, path) -> str | None:
    """Why ``path`` cannot be written as the output of ``flag`` (its folder is missing, or it is a
    folder), or None; checked before a command runs, so a long run is not lost at the end."""
    from pathlib import Path
    p = Path(path)
    if p.is_dir():
        return f"{flag} {path}: is a folder, not a file"
    if not p.parent.is_dir():
        return f"{flag} {path}: the folder {p.parent} does not exist"
    return None


def _usage_error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _version(fn) -> str:
    try:
        return fn()
    except Exception as e:  # a missing driver or library is a fact to report, not a crash
        return f"unavailable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def _print_json(value) -> None:
    import json
    print(json.dumps(value, indent=1))


def info() -> dict:
    """What ``info`` prints, as a dict: versions, paths, and ``gpus`` (a list; empty, with
    ``no_gpu`` saying why, when no device is visible)."""
    import numpy as np

    import cukern
    out = {"cukern": cukern.__version__, "python": platform.python_version(), "numpy": np.__version__}
    try:
        import cupy
    except ImportError:
        return {**out, "cupy": None, "gpus": [], "no_gpu": "cupy is not installed"}
    from cupy.cuda import nvrtc, runtime as cudart

    from cukern import check, runtime
    out.update({
        "cupy": cupy.__version__,
        "nvrtc": _version(lambda: ".".join(map(str, nvrtc.getVersion()))),
        "cuda_runtime": _version(lambda: _cuda_version(cudart.runtimeGetVersion())),
        "cuda_driver": _version(lambda: _cuda_version(cudart.driverGetVersion())),
        "cuda_headers": _version(lambda: runtime.cuda_include_dir() or "not found"),
        "kernel_cache": os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache")),
        "check_cache": str(check.cache_dir()),
        "sources": _version(lambda: str(runtime.source_root())),
        "gpus": []})
    try:
        count = cudart.getDeviceCount()
    except Exception as e:
        count, reason = 0, f"{type(e).__name__}: {e}"
    else:
        reason = "the driver reports 0 devices"
    if count == 0:
        out["no_gpu"] = f"no CUDA device is visible ({reason})"
    for i in range(count):
        p = cudart.getDeviceProperties(i)
        free, total = cupy.cuda.Device(i).mem_info
        out["gpus"].append({"index": i, "name": p["name"].decode() if isinstance(p["name"], bytes) else p["name"],
                            "sm": f"sm_{p['major']}{p['minor']}", "sms": p["multiProcessorCount"],
                            "memory_bytes": total, "free_bytes": free, "l2_bytes": p["l2CacheSize"]})
    return out


_INFO_LINES = (("cukern", "cukern"), ("python", "python"), ("numpy", "numpy"), ("cupy", "cupy"),
               ("nvrtc", "nvrtc"), ("cuda_runtime", "cuda runtime"), ("cuda_driver", "cuda driver"),
               ("cuda_headers", "cuda headers"), ("kernel_cache", "kernel cache"),
               ("check_cache", "check cache"), ("sources", "sources"))


def cmd_info(args) -> int:
    facts = info()
    if args.json:
        _print_json(facts)
        return 0
    for key, label in _INFO_LINES:
        if key == "cupy" and facts["cupy"] is None:
            print("cupy            not installed (pip install 'cukern[cuda12]' or 'cukern[cuda13]')")
            return 0
        print(f"{label:<15} {facts[key]}")
    if not facts["gpus"]:
        print(f"gpu             none: {facts['no_gpu']}")
    for g in facts["gpus"]:
        print(f"gpu {g['index']:<11} {g['name']}, {g['sm']}, {g['sms']} SMs, {g['memory_bytes'] / 2**30:.1f} GiB "
              f"({g['free_bytes'] / 2**30:.1f} free), L2 {g['l2_bytes'] / 2**20:.0f} MiB")
    return 0


def _progress(desc: str):
    """A ``progress(item, done, total)`` callback drawing a tqdm bar on stderr when stderr is a
    terminal and tqdm is installed; None (quiet) otherwise, as in a log or a pipe."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    bar = None

    def update(item, done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=desc, unit="unit", file=sys.stderr, dynamic_ncols=True, leave=False)
        bar.set_postfix_str(item[0] if isinstance(item, tuple) else str(item), refresh=False)
        bar.update(1)
        if done == total:
            bar.close()
    return update


def cmd_check(args) -> int:
    if args.gpu:
        if args.json or args.unit:
            return _usage_error(f"{'--json' if args.json else '--unit'} is for the compile check, not --gpu")
        from cukern import selfcheck
        return selfcheck.run(args.tests or None, keyword=args.keyword, by_function=not args.verbose)
    from pathlib import Path

    from cukern import check, runtime
    targets = args.arch or [runtime.parse_target("sm_90")]
    cache = None if args.no_cache else Path(args.cache_dir) if args.cache_dir else check.cache_dir()
    try:
        rows = check.run(targets, args.family, args.unit, jobs=args.jobs, cache=cache,
                         progress=_progress("check"))
    except (runtime.CukernError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    errors = [r for r in rows if not r.ok]
    n_kernels = sum(1 for r in rows if not r.unit.startswith("probe:"))
    names = [f"sm_{a}" + ("a" if specific else "") for a, specific in targets]
    if args.json:
        _print_json({"targets": names, "kernel_rows": n_kernels, "layout_probes": len(rows) - n_kernels,
                     "errors": len(errors),
                     "rows": [{"target": r.target, "unit": r.unit, "kernel": r.kernel, "params": r.struct,
                               "struct_bytes": r.struct_size or None, "ptx_bytes": r.ptx_size if r.ptx_size > 0
                               else None, "ok": r.ok, "error": r.error or None} for r in rows]})
        return 1 if errors else 0
    width = max(len(r.kernel) for r in rows) if rows else 10
    print(f"{'arch':<7} {'unit':<28} {'kernel':<{width}} {'params':<18} {'struct':>7} {'ptx':>7}  status")
    for r in rows:
        size = f"{r.struct_size} B" if r.struct_size else ""
        ptx = f"{r.ptx_size} B" if r.ptx_size > 0 else ""
        status = "ok" if r.ok else "ERROR"
        print(f"{r.target:<7} {r.unit:<28} {r.kernel:<{width}} {r.struct:<18} {size:>7} {ptx:>7}  {status}")
    for r in errors:
        print(f"\nERROR {r.target} {r.unit} {r.kernel}:\n{r.error}", file=sys.stderr)
    print(f"\n{n_kernels} kernel rows, {len(rows) - n_kernels} layout probes, {len(errors)} errors "
          f"({', '.join(names)}; on sm_90 the Hopper units as sm_90a)")
    return 1 if errors else 0


def cmd_bench(args) -> int:
    from cukern import runtime, workbench
    from cukern.benchmark import format_table
    from cukern.roofline import output_path
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        problem = path and out_path_problem(flag, path)
        if problem:
            return _usage_error(problem)
    try:
        plot = args.plot and output_path(args.plot)
    except ValueError as e:
        return _usage_error(f"--plot {e}")
    try:
        result = workbench.run_bench(args.family or None, quick=args.quick, gemm=not args.no_gemm,
                                     kernel=args.kernel)
    except runtime.CukernError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rows, ceilings = workbench.rows_of(result)
    print(format_table(rows, ceilings))
    for family, tb in result["errors"].items():
        print(f"\nERROR in bench_{family}.py:\n{tb}", file=sys.stderr)
    try:
        if args.json:
            workbench.write_result(result, args.json)
            print(f"\nwrote {args.json}")
        if plot:
            from cukern.roofline import plot_roofline
            plot_roofline(result, plot)
            print(f"wrote {plot}")
    except (ImportError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 1 if result["errors"] else 0


def cmd_compare(args) -> int:
    from cukern import runtime, workbench
    try:
        a, b = workbench.load_result(args.a), workbench.load_result(args.b)
    except runtime.CukernError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    changes = workbench.compare(a, b)
    regressed = [] if args.fail_above is None else workbench.regressions(changes, args.fail_above)
    if args.json:
        _print_json(workbench.compare_json(a, b, changes, args.threshold, args.fail_above))
    else:
        print(workbench.format_compare(a, b, changes, args.threshold))
    if regressed:
        print(f"FAIL: {len(regressed)} rows slower by more than {args.fail_above:g}% (--fail-above): "
              + ", ".join(f"{c.family} {c.kernel} {c.shape} {c.ratio - 1:+.1%}" for c in regressed[:5])
              + (", ..." if len(regressed) > 5 else ""), file=sys.stderr)
    return 1 if regressed else 0


def cmd_roofline(args) -> int:
    from cukern import runtime, workbench
    from cukern.roofline import output_path, plot_roofline
    problem = out_path_problem("-o", args.out)
    if problem:
        return _usage_error(problem)
    try:
        out = output_path(args.out)
    except ValueError as e:
        return _usage_error(f"-o {e}")
    try:
        runs = workbench.label_runs([(p, workbench.load_result(p)) for p in args.results])
        plot_roofline(runs if len(runs) > 1 else runs[0][1], out)
    except (runtime.CukernError, ImportError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    n = sum(len(r["rows"]) for _, r in runs)
    print(f"wrote {out} ({n} rows" + (f", {len(runs)} runs: {', '.join(label for label, _ in runs)})"
                                      if len(runs) > 1 else ")"))
    return 0


def cmd_notebooks(args) -> int:
    from cukern import notebooks, runtime
    for flag, folder in (("--figures", args.figures), ("--write-to", args.write_to)):
        if folder is not None and os.path.exists(folder) and not os.path.isdir(folder):
            return _usage_error(f"{flag} {folder}: is a file, not a folder")
    if not args.run and (args.write or args.write_to is not None):
        return _usage_error("--write and --write-to go with --run")
    try:
        if args.run:
            return notebooks.main_run(args.paths, args.figures, write=args.write, write_to=args.write_to,
                                      timeout=args.timeout)
        return notebooks.main_check(args.paths)
    except (runtime.CukernError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    import cukern
    parser = _Parser(prog="python -m cukern", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"cukern {cukern.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="GPU, versions and cache location")
    p.add_argument("--json", action="store_true", help="print the same facts as one JSON object")
    p.set_defaults(fn=cmd_info)
    p = sub.add_parser("check", help="compile every kernel with NVRTC (no GPU needed) and check struct sizes")
    p.add_argument("--arch", action="append", metavar="sm_XX", type=arch_arg,
                   help="target arch, repeatable (default sm_90); sm_80 or newer")
    p.add_argument("--family", action="append", metavar="NAME",
                   help="only the units of this family, all of them (attention: its 13 units; repeatable)")
    p.add_argument("--unit", action="append", metavar="NAME",
                   help="only this compilation unit (e.g. attention_bf16; repeatable)")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    p.add_argument("-j", "--jobs", type=number_arg("int", lo=1), default=cpus, metavar="N",
                   help=f"compile N units at once, one process each (default: the CPUs this process may use, {cpus})")
    p.add_argument("--cache-dir", metavar="DIR",
                   help="keep the PTX here (default $CUKERN_CACHE_DIR, else $XDG_CACHE_HOME/cukern, else "
                        "~/.cache/cukern); keyed by the sources, options, arch and NVRTC version")
    p.add_argument("--no-cache", action="store_true", help="compile every unit, read and write no cache")
    p.add_argument("--json", action="store_true", help="print the rows and the summary as one JSON object")
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
    p.add_argument("--kernel", metavar="REGEX", type=regex_arg,
                   help="only the rows whose kernel name matches (re.search), e.g. 'bwd|chain'")
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("compare", help="the change per row between two `bench --json` files",
                       description="Match the rows of two `bench --json` results by family, kernel and shape "
                                   "and print A time, B time and the change (B/A - 1: negative is faster).")
    p.add_argument("a", metavar="A.json")
    p.add_argument("b", metavar="B.json")
    p.add_argument("--threshold", type=number_arg("real", lo=0.0), default=0.05,
                   help="mark rows whose time moved by more than this fraction (default 0.05)")
    p.add_argument("--fail-above", type=number_arg("real", lo=0.0), metavar="PCT",
                   help="exit 1 when a row present in both is slower in B by more than PCT percent "
                        "(e.g. 5), to gate CI; the rows are listed on stderr")
    p.add_argument("--json", action="store_true", help="print the rows and the summary as one JSON object")
    p.set_defaults(fn=cmd_compare)

    p = sub.add_parser("roofline", help="the roofline chart of saved `bench --json` results (no GPU needed)",
                       description="Plot one or more saved results (`bench --json`, or a bench_<family>.py "
                                   "--json file) as the chart `bench --plot` draws; with several files each "
                                   "is a run, drawn with its own marker and named in the legend by its file "
                                   "name (and device, where the files ran on different devices).")
    p.add_argument("results", nargs="+", metavar="RESULT.json")
    p.add_argument("-o", "--out", default="roofline.png",
                   help="chart to write (default roofline.png; .png is added to a name without a suffix)")
    p.set_defaults(fn=cmd_roofline)

    p = sub.add_parser("notebooks", help="check (CPU) or run headless (GPU) the notebooks",
                       description="Without --run: parse every notebook, compile its code cells and check "
                                   "that committed outputs are a clean top-to-bottom run (no GPU). With --run: "
                                   "execute the code cells top to bottom, headless: through nbclient on this "
                                   "interpreter's ipykernel when both are importable (outputs kept, so they "
                                   "can be written), else exec'd in one namespace (Agg backend).")
    p.add_argument("paths", nargs="*", metavar="NOTEBOOK", help="notebooks (default: the checkout's notebooks/)")
    p.add_argument("--run", action="store_true", help="execute them (needs a GPU)")
    p.add_argument("--figures", metavar="DIR", help="with --run: save the figures each cell draws here as PNG")
    p.add_argument("--write", action="store_true",
                   help="with --run (nbclient): write each executed notebook back in place, with its outputs, "
                        "when every cell succeeded")
    p.add_argument("--write-to", metavar="DIR",
                   help="with --run (nbclient): write a copy of each executed notebook here (failed ones too)")
    p.add_argument("--timeout", type=number_arg("real", lo=1.0), default=600.0, metavar="SECONDS",
                   help="with --run (nbclient): seconds one cell may run (default 600)")
    p.set_defaults(fn=cmd_notebooks)
    from cukern.models.cli import add_generate_parser  # light import: the model code loads when it runs
    add_generate_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)

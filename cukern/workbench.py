"""``python -m cukern bench`` and ``compare``: every family's benchmark in one process, one
table, one JSON file per run, and the change between two runs.

The benchmark scripts live in the checkout's ``profiling/`` folder, not in the
installed package (they import torch and other peers the package does not
need). :func:`checkout_root` finds that folder: ``$CUKERN_ROOT`` first, then
the folder above the imported ``cukern`` package (a source checkout or an
editable install), then the current directory; it raises a
:class:`~cukern.runtime.CukernError` saying where it looked when none holds
one. Each ``profiling/bench_<family>.py`` exposes
``bench(quick: bool) -> (list[Row], Ceilings)``.

A result (what ``--json`` writes, what :func:`compare` and
:func:`cukern.roofline.plot_roofline` read) is a dict::

    {"schema": "cukern-bench/1",
     "meta": {"date", "device", "cukern", "python", "numpy", "cupy", "cuda_runtime",
              "cuda_driver", "nvrtc", "torch", "quick", "families", "argv"},
     "ceilings": {"copy_gbs", "device", "gemm_tflops"},   # measured by the command, this run
     "family_ceilings": {family: {"copy_gbs", ...}},        # measured by each script, this run
     "errors": {family: traceback text},
     "rows": [{"family", "kernel", "shape", "us", "gbs", "tflops", "pct_ceiling",
               "peer", "peer_us", "extra", "speedup"}, ...]}

A row that reports TFLOP/s but no % of a ceiling gets it from the command's
GEMM ceiling (``extra["ceiling"] = "gemm"``).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import json
import math
import os
import platform
import signal
import sys
import threading
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from cukern.runtime import CukernError

__all__ = ["checkout_root", "bench_scripts", "no_gpu_reason", "interruptible", "progress", "run_bench",
           "environment", "rows_of", "write_result", "load_result", "merge_results", "label_runs", "compare",
           "format_compare", "compare_json", "regressions", "Change", "SCHEMA"]

SCHEMA = "cukern-bench/1"


# ----------------------------------------------------------------------------- the checkout

def checkout_root(need: str = "profiling") -> Path:
    """The cukern checkout that holds the folder ``need`` (profiling, tests or notebooks)."""
    import cukern
    candidates = []
    if os.environ.get("CUKERN_ROOT"):
        candidates.append(("$CUKERN_ROOT", Path(os.environ["CUKERN_ROOT"])))
    candidates.append(("above the cukern package", Path(cukern.__file__).resolve().parents[1]))
    candidates.append(("the current directory", Path.cwd()))
    for _, root in candidates:
        if (root / need).is_dir() and (root / "cukern").is_dir():
            return root
    looked = "; ".join(f"{what} ({root})" for what, root in candidates)
    raise CukernError(f"no cukern checkout with a {need}/ folder found (looked at {looked}). "
                      f"{need}/ is not part of the installed package: run from a source checkout "
                      f"(PYTHONPATH=<checkout>) or set CUKERN_ROOT=<checkout>.")


def bench_scripts(families=None) -> dict[str, Path]:
    """``profiling/bench_<family>.py`` by family name, all of them or those named."""
    folder = checkout_root("profiling") / "profiling"
    found = {p.stem[len("bench_"):]: p for p in sorted(folder.glob("bench_*.py"))}
    if not families:
        if not found:
            raise CukernError(f"no bench_*.py in {folder}")
        return found
    missing = [f for f in families if f not in found]
    if missing:
        raise CukernError(f"no benchmark for {', '.join(missing)} in {folder} "
                          f"(there are: {', '.join(found) or 'none'})")
    return {f: found[f] for f in families}


def _import_script(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(f"cukern_profiling_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "bench", None)):
        raise CukernError(f"{path} defines no bench(quick) -> (rows, ceilings)")
    return module


def no_gpu_reason() -> str | None:
    """Why nothing can run on a GPU here (no CuPy, no driver, no device), or None."""
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return f"no CUDA device ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None if n > 0 else "no CUDA device (the driver reports 0)"


@contextlib.contextmanager
def interruptible():
    """Turn SIGTERM (what ``timeout`` sends) into KeyboardInterrupt for the enclosed block, so
    that a time-limited run still reports what it finished."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ----------------------------------------------------------------------------- progress

def progress(iterable, desc: str = "", total: int | None = None, unit: str = "it"):
    """tqdm over ``iterable`` on stderr when tqdm is installed (``pip install tqdm``), else a
    plain ``[i/n] item`` line per item: long runs always say where they are."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        items = list(iterable)
        n = len(items)

        def plain():
            for i, item in enumerate(items):
                print(f"{desc} [{i + 1}/{n}] {item if isinstance(item, (str, Path)) else ''}",
                      file=sys.stderr, flush=True)
                yield item
        return plain()
    return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, dynamic_ncols=True)


# ----------------------------------------------------------------------------- running

def environment() -> dict:
    """Date, device and versions, for a result's ``meta``."""
    import numpy as np

    import cukern
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cukern": cukern.__version__, "python": platform.python_version(), "numpy": np.__version__}
    try:
        import cupy
        from cupy.cuda import nvrtc, runtime as cudart
        meta["cupy"] = cupy.__version__
        meta["nvrtc"] = ".".join(map(str, nvrtc.getVersion()))
        meta["cuda_runtime"] = cudart.runtimeGetVersion()
        meta["cuda_driver"] = cudart.driverGetVersion()
        props = cudart.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"]
        meta["device"] = name.decode() if isinstance(name, bytes) else name
        meta["sm"] = f"sm_{props['major']}{props['minor']}"
    except Exception as e:  # no GPU: the meta says so rather than failing the run
        meta.setdefault("device", f"unavailable ({type(e).__name__})")
    try:
        import torch
        meta["torch"] = torch.__version__
    except ImportError:
        meta["torch"] = None
    return meta


def run_bench(families=None, *, quick: bool = False, show_progress: bool = True, gemm: bool = True,
              kernel=None) -> dict:
    """Measure the ceilings, run each family's ``bench(quick)`` and return the result dict
    (module docstring). A family whose script raises is recorded under ``errors``; the
    others still run. ``kernel``: a regular expression (or compiled pattern); only the rows whose
    kernel name it matches are timed."""
    from cukern.benchmark import measure_ceilings, measure_gemm_tflops, selecting

    scripts = bench_scripts(families)
    reason = no_gpu_reason()
    if reason:
        raise CukernError(f"bench needs a GPU: {reason}")
    root = str(checkout_root("profiling"))
    if root not in sys.path:  # the scripts import cukern from the checkout they sit in
        sys.path.insert(0, root)
    ceil = measure_ceilings()
    if gemm:
        ceil = replace(ceil, gemm_tflops=measure_gemm_tflops())
    result = {"schema": SCHEMA, "meta": {**environment(), "quick": quick, "families": list(scripts),
                                         "argv": sys.argv[1:]},
              "ceilings": asdict(ceil), "family_ceilings": {}, "errors": {}, "rows": []}
    names = list(scripts)
    for name in progress(names, desc="bench", unit="family") if show_progress else names:
        try:
            # a script's own prints (progress, notes) go to stderr: stdout keeps the one table
            with interruptible(), contextlib.redirect_stdout(sys.stderr), selecting(kernel):
                rows, fam_ceil = _import_script(name, scripts[name]).bench(quick)
        except KeyboardInterrupt:  # Ctrl-C or a time limit's SIGTERM: keep what was measured
            result["errors"][name] = "interrupted"
            break
        except Exception:
            result["errors"][name] = traceback.format_exc()
            continue
        result["family_ceilings"][name] = asdict(fam_ceil)
        for r in rows:
            if r.pct_ceiling is None and r.tflops is not None and ceil.gemm_tflops:
                r = replace(r, pct_ceiling=r.tflops / ceil.gemm_tflops, extra={**r.extra, "ceiling": "gemm"})
            result["rows"].append({**asdict(r), "speedup": r.speedup})
    return result


def rows_of(result: dict):
    """The result's rows as :class:`cukern.benchmark.Row` objects, and its :class:`Ceilings`."""
    from cukern.benchmark import Ceilings, Row
    fields = Row.__dataclass_fields__
    rows = [Row(**{k: v for k, v in r.items() if k in fields}) for r in result["rows"]]
    c = result["ceilings"]
    return rows, Ceilings(copy_gbs=c["copy_gbs"], device=c["device"], gemm_tflops=c.get("gemm_tflops"))


def _plain(value):
    """JSON for the NumPy scalars and arrays a script may leave in a row's extra."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def write_result(result: dict, path) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=_plain)
        f.write("\n")


def _number(value, positive: bool = False) -> bool:
    """A finite int or float (not a bool), > 0 when ``positive`` else >= 0."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and (value > 0 if positive else value >= 0))


def _result_problem(result) -> str | None:
    """What makes ``result`` unlike a ``bench --json`` result where :func:`compare`,
    :func:`rows_of` and the roofline read it, or None: ceilings are numbers > 0 (they divide),
    every row names its family, kernel and shape and has a time > 0 and figures >= 0."""
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list) \
            or not isinstance(result.get("ceilings"), dict):
        return "no rows/ceilings"
    c = result["ceilings"]
    if not _number(c.get("copy_gbs"), positive=True):
        return f"ceilings.copy_gbs must be a number > 0, got {c.get('copy_gbs')!r}"
    if c.get("gemm_tflops") is not None and not _number(c["gemm_tflops"], positive=True):
        return f"ceilings.gemm_tflops must be a number > 0 or null, got {c['gemm_tflops']!r}"
    if not isinstance(c.get("device", ""), str) or not isinstance(result.get("meta", {}), dict):
        return "ceilings.device must be a string and meta an object"
    for i, row in enumerate(result["rows"]):
        if not isinstance(row, dict):
            return f"row {i} is {type(row).__name__}, not an object"
        bad = ([k for k in ("family", "kernel", "shape") if not isinstance(row.get(k), str)]
               + ([] if _number(row.get("us"), positive=True) else ["us"])
               + [k for k in ("gbs", "tflops", "pct_ceiling", "peer_us") if row.get(k) is not None
                  and not _number(row[k])])
        extra = row.get("extra", {})
        if not isinstance(extra, dict) or not isinstance(row.get("peer", ""), str):
            bad.append("extra" if not isinstance(extra, dict) else "peer")
        else:
            bad += [f"extra.{k}" for k in ("flops", "bytes") if extra.get(k) is not None
                    and not _number(extra[k])]
        if bad:
            return (f"row {i} has bad {', '.join(bad)} (family, kernel, shape: strings; us: a number > 0; "
                    f"figures: numbers >= 0 or null)")
    return None


def load_result(path) -> dict:
    """Read a ``bench --json`` file; a clear error when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
    except (OSError, ValueError) as e:   # ValueError: not JSON, or not UTF-8
        raise CukernError(f"{path}: not a readable JSON file ({e})") from None
    problem = _result_problem(result)
    if problem:
        raise CukernError(f"{path}: not a `python -m cukern bench --json` result ({problem})")
    return result


def merge_results(results: list[dict]) -> dict:
    """One result from several (e.g. the per-family ``bench_<family>.py --json`` files of one
    device_check.sh run): every row, the first copy ceiling and the first GEMM ceiling found.
    The rows keep their own "% ceil" (against their own run's ceiling)."""
    if len(results) == 1:
        return results[0]
    ceil = dict(results[0]["ceilings"])
    ceil["gemm_tflops"] = next((r["ceilings"].get("gemm_tflops") for r in results
                                if r["ceilings"].get("gemm_tflops")), None)
    meta = dict(results[0].get("meta", {}))
    meta["date"] = f"{meta.get('date', 'date not recorded')}; merged from {len(results)} results"
    return {"schema": SCHEMA, "meta": meta, "ceilings": ceil, "family_ceilings": {}, "errors": {},
            "rows": [row for r in results for row in r["rows"]]}


def label_runs(runs: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """``(path, result)`` pairs as ``(label, result)``: the file's name without ``.json``, the
    device added where the runs are not all on one device, the folder added where two names
    are equal (``a/run.json``, ``b/run.json``)."""
    names = [Path(p).stem for p, _ in runs]
    if len(set(names)) < len(names):
        names = [str(Path(p).with_suffix("")) for p, _ in runs]
    devices = [_device(r) for _, r in runs]
    if len(set(devices)) > 1:
        names = [f"{n} ({d})" for n, d in zip(names, devices)]
    return [(n, r) for n, (_, r) in zip(names, runs)]


# ----------------------------------------------------------------------------- compare

@dataclass(frozen=True)
class Change:
    family: str
    kernel: str
    shape: str
    a_us: float | None  # None: the row is only in B
    b_us: float | None  # None: the row is only in A
    a_gbs: float | None = None
    b_gbs: float | None = None

    @property
    def ratio(self) -> float | None:
        """B time over A time: < 1 means B is faster."""
        return self.b_us / self.a_us if self.a_us and self.b_us else None


def compare(a: dict, b: dict) -> list[Change]:
    """Match rows of two results by (family, kernel, shape); A's order, then rows only in B."""
    def key(r):
        return r["family"], r["kernel"], r["shape"]
    b_rows = {key(r): r for r in b["rows"]}
    out, seen = [], set()
    for r in a["rows"]:
        k = key(r)
        s = b_rows.get(k)
        seen.add(k)
        out.append(Change(*k, r["us"], s["us"] if s else None, r.get("gbs"), s.get("gbs") if s else None))
    out += [Change(*key(r), None, r["us"], None, r.get("gbs")) for r in b["rows"] if key(r) not in seen]
    return out


def _device(result: dict) -> str:
    return result.get("meta", {}).get("device") or result["ceilings"].get("device", "?")


def format_compare(a: dict, b: dict, changes: list[Change], threshold: float = 0.05) -> str:
    """The comparison as a table; rows whose time moved by more than ``threshold`` are marked."""
    def ident(r):
        m, c = r.get("meta", {}), r["ceilings"]
        gemm = f", GEMM {c['gemm_tflops']:,.0f} TFLOP/s" if c.get("gemm_tflops") else ""
        return f"{_device(r)}, {m.get('date', 'date not recorded')}; copy {c['copy_gbs']:,.0f} GB/s{gemm}"
    lines = [f"A: {ident(a)}", f"B: {ident(b)}"]
    if _device(a) != _device(b):
        lines.append("note: A and B ran on different devices; compare % of ceiling, not times")
    kw = max([len(c.kernel) for c in changes] + [20])
    sw = max([len(c.shape) for c in changes] + [12])
    head = (f"{'family':<12} {'kernel':<{kw}} {'shape':<{sw}} {'A us':>9} {'B us':>9} {'change':>14} "
            f"{'A GB/s':>7} {'B GB/s':>7}")
    lines += [head, "-" * len(head)]

    def num(v, fmt):
        return format(v, fmt) if v is not None else ""
    for c in changes:
        if c.ratio is None:
            change = "only A" if c.b_us is None else "only B"
        else:
            change = f"{c.ratio - 1:+.1%}" + (f" {_moved(c, threshold)}" if _moved(c, threshold) else "")
        lines.append(f"{c.family:<12} {c.kernel:<{kw}} {c.shape:<{sw}} {num(c.a_us, '9.2f'):>9} "
                     f"{num(c.b_us, '9.2f'):>9} {change:>14} {num(c.a_gbs, ',.0f'):>7} {num(c.b_gbs, ',.0f'):>7}")
    moved = [c for c in changes if _moved(c, threshold)]
    lines.append(f"\n{len(changes)} rows, {len(moved)} moved by more than {threshold:.0%} "
                 f"(change = B time / A time - 1: negative is faster)")
    return "\n".join(lines)


def _moved(c: Change, threshold: float) -> str | None:
    """"faster" or "slower" when the row's time moved by more than ``threshold`` (a fraction)."""
    if c.ratio is None or abs(c.ratio - 1) <= threshold:
        return None
    return "faster" if c.ratio < 1 else "slower"


def compare_json(a: dict, b: dict, changes: list[Change], threshold: float = 0.05,
                 fail_above: float | None = None) -> dict:
    """What :func:`format_compare` prints, as a dict (``compare --json``): both runs' device,
    date and ceilings, one entry per row (``change`` = B time / A time - 1, null for a row in
    one run only; ``moved``: "faster", "slower" or null) and the counts. ``fail_above`` (percent)
    adds ``regressed``: the rows slower by more than it."""
    def run(r):
        return {"device": _device(r), "date": r.get("meta", {}).get("date"), "ceilings": r["ceilings"]}
    rows = [{"family": c.family, "kernel": c.kernel, "shape": c.shape, "a_us": c.a_us, "b_us": c.b_us,
             "a_gbs": c.a_gbs, "b_gbs": c.b_gbs, "change": None if c.ratio is None else c.ratio - 1,
             "moved": _moved(c, threshold)} for c in changes]
    out = {"a": run(a), "b": run(b), "threshold": threshold, "rows": rows,
           "moved": sum(1 for r in rows if r["moved"])}
    if fail_above is not None:
        out["fail_above_pct"] = fail_above
        out["regressed"] = len(regressions(changes, fail_above))
    return out


def regressions(changes: list[Change], pct: float) -> list[Change]:
    """The rows of both runs whose B time is more than ``pct`` percent above A's (``--fail-above``)."""
    return [c for c in changes if c.ratio is not None and c.ratio - 1 > pct / 100]

"""Compile every kernel unit for this GPU into CuPy's kernel cache, one process per unit, in parallel.

A fresh GPU machine starts with an empty cache, and pytest-xdist workers that meet the same unit at
once each compile it; run this first (device_check.sh does) so that every worker loads cubins instead.
Units the device runs built for sm_90a (check.sm90a_units) go through runtime.load_module_sm90a, the
others through runtime.load_module, exactly as the dispatches load them.

    CUPY_CACHE_DIR=/tmp/cukern-kernel-cache PYTHONPATH=. python profiling/warm_cache.py [-j JOBS]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed


def _compile(name: str) -> tuple[str, float]:
    from cukern import check, family, runtime
    t0 = time.perf_counter()
    spec = family(name)
    names = tuple(k.name for k in spec.kernels)
    arch = runtime.device_arch()
    if arch == 90 and name in check.sm90a_units():
        runtime.load_module_sm90a(name, spec.unit_source(), names, spec.defines)
    else:
        runtime.load_module(name, spec.unit_source(), names, arch, spec.defines)
    return name, time.perf_counter() - t0


def main(argv=None) -> int:
    from cukern import FAMILY_MODULES
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="processes (default: all cores)")
    args = ap.parse_args(argv)
    t0, failed = time.perf_counter(), []
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(_compile, name): name for name in FAMILY_MODULES}
        for f in as_completed(futures):
            try:
                name, s = f.result()
                print(f"  {name:28s} {s:6.1f} s", flush=True)
            except Exception as e:  # report every unit, then fail
                failed.append(futures[f])
                print(f"  {futures[f]:28s} FAILED: {type(e).__name__}: {e}", flush=True)
    print(f"warm_cache: {len(FAMILY_MODULES) - len(failed)} of {len(FAMILY_MODULES)} units in "
          f"{time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

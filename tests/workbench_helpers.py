"""Shared helpers of the workbench tests (test_workbench*.py): the repository root and CLI runners."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cukern import workbench


REPO = Path(__file__).resolve().parents[1]


def _run(*args, cwd=REPO):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, timeout=300,
                          env={**os.environ, "MPLBACKEND": "Agg"})


def _result(rows, device="NVIDIA H100 80GB HBM3", copy=2900.0, gemm=700.0, date="2026-11-22T19:00:00+00:00"):
    full = []
    for fam, kernel, shape, us, gbs, tflops, extra in rows:
        full.append({"family": fam, "kernel": kernel, "shape": shape, "us": us, "gbs": gbs, "tflops": tflops,
                     "pct_ceiling": gbs / copy if gbs else None, "peer": "", "peer_us": None, "extra": extra,
                     "speedup": None})
    return {"schema": workbench.SCHEMA, "meta": {"device": device, "date": date},
            "ceilings": {"copy_gbs": copy, "device": device, "gemm_tflops": gemm}, "family_ceilings": {},
            "errors": {}, "rows": full}


A = _result([("elementwise", "rms_norm", "1x4096", 4.0, 10.0, None, {}),
             ("elementwise", "add_scaled", "4194304", 20.0, 2500.0, None, {}),
             ("attention", "decode", "B1 L32k", 40.0, 1800.0, None, {"flops": 6.7e7, "bytes": 6.7e7}),
             ("attention", "prefill", "B4 L4096", 900.0, 300.0, 350.0, {})])
B = _result([("elementwise", "rms_norm", "1x4096", 3.0, 13.3, None, {}),
             ("elementwise", "add_scaled", "4194304", 20.4, 2450.0, None, {}),
             ("attention", "prefill", "B4 L4096", 1000.0, 270.0, 315.0, {}),
             ("dmmv", "q4_k", "4096x14336", 17.0, 1900.0, None, {})], date="2026-11-23T10:00:00+00:00")


def _cli(capsys, *argv) -> tuple[int, str, str]:
    """``python -m cukern *argv`` in this process: exit status, stdout, stderr. An exception other
    than argparse's SystemExit escapes, and fails the test: the user would see a traceback."""
    from cukern.cli import main
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line_error(rc, err, code):
    assert rc == code and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (rc, err)

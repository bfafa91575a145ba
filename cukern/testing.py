"""Helpers shared by the tests, the benchmarks and the notebooks.

* :func:`assert_close` - ``|out - ref| <= atol + rtol * |ref|`` elementwise,
  per-dtype defaults, and a report of the worst and first bad elements;
* :func:`nmse` - normalised mean squared error, for quantized paths where
  element-wise bounds say little;
* :func:`poison` - fill an output with NaN (or a sentinel) before a launch, so
  an element the kernel never wrote cannot pass;
* :func:`set_recorder` - an opt-in hook that sees every :func:`assert_close`
  and :func:`nmse` (``python -m cukern check --gpu`` builds its table from it).
"""

from __future__ import annotations

import numpy as np

# (atol, rtol) of a kernel computing in f32 with inputs/outputs stored in the given dtype,
# against a float64 reference (the peers test f16 ~1e-3 and bf16 ~1e-2 relative).
TOLERANCES = {
    np.dtype(np.float32): (1e-5, 1e-5),
    np.dtype(np.float16): (1e-3, 2e-3),
    "bfloat16": (1e-2, 1.6e-2),
}


# Opt-in observer of every comparison: None (the default) costs one global read per call.
_recorder = None


def set_recorder(fn):
    """Call ``fn(name, kind, error, bound, passed)`` on every :func:`assert_close`
    (kind ``"max_abs"``: ``|out - ref|`` and the bound ``atol + rtol*|ref|`` at the
    element with the largest ``err / bound``) and every :func:`nmse`
    (kind ``"nmse"``, bound None: the caller compares it). ``None`` turns it off.
    Returns the recorder it replaces, so that nested users can put it back."""
    global _recorder
    previous, _recorder = _recorder, fn
    return previous


def _to_numpy(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


def tolerance(dtype) -> tuple[float, float]:
    key = "bfloat16" if str(dtype) == "bfloat16" else np.dtype(dtype)
    return TOLERANCES[key]


def assert_close(out, ref, *, dtype=None, atol: float | None = None, rtol: float | None = None,
                 name: str = "out", max_report: int = 5) -> None:
    """Raise AssertionError unless every element satisfies |out - ref| <= atol + rtol*|ref|.

    NaN anywhere in ``out`` fails (a poisoned element the kernel never wrote)."""
    out = _to_numpy(out).astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        raise AssertionError(f"{name}: shape {out.shape} != reference shape {ref.shape}")
    d_atol, d_rtol = tolerance(dtype if dtype is not None else np.float32)
    atol = d_atol if atol is None else atol
    rtol = d_rtol if rtol is None else rtol
    err = np.abs(out - ref)
    bound = atol + rtol * np.abs(ref)
    bad = ~(err <= bound)  # NaN compares False: counted as bad
    if _recorder is not None:
        _record_close(name, err, bound, bad)
    if bad.any():
        idx = np.argwhere(bad)
        lines = [f"{name}: {bad.sum()} of {bad.size} elements outside atol={atol:g} + rtol={rtol:g}*|ref|"
                 f" (max abs err {np.nanmax(err) if not np.isnan(err).all() else float('nan'):.3e})"]
        for i in idx[:max_report]:
            t = tuple(int(v) for v in i)
            lines.append(f"  at {t}: out={out[t]!r} ref={ref[t]!r} err={err[t]:.3e}")
        raise AssertionError("\n".join(lines))


def _record_close(name: str, err: np.ndarray, bound: np.ndarray, bad: np.ndarray) -> None:
    if err.size == 0:
        _recorder(name, "max_abs", 0.0, 0.0, True)
        return
    ratio = np.divide(err, bound, out=np.zeros_like(err), where=bound > 0)
    ratio[((bound <= 0) & (err > 0)) | np.isnan(err)] = np.inf
    i = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    _recorder(name, "max_abs", float(err[i]), float(bound[i]), not bad.any())


def nmse(out, ref) -> float:
    """sum((out - ref)^2) / sum(ref^2)."""
    out = _to_numpy(out).astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    denom = float(np.sum(ref * ref))
    value = float(np.sum((out - ref) ** 2)) / (denom if denom > 0 else 1.0)
    if _recorder is not None:
        _recorder("nmse", "nmse", value, None, value == value)
    return value


def poison(a):
    """Fill a device or host array with NaN (floats) or its maximum (integers); returns it."""
    dt = np.dtype(a.dtype)
    a.fill(np.nan if dt.kind in "fc" or str(dt) == "bfloat16" else np.iinfo(dt).max)
    return a

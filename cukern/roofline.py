"""A roofline chart of a ``python -m cukern bench --json`` result (``bench --plot out.png``).

Two panels, both against the ceilings measured in the same run:

* left, the roofline: achieved TFLOP/s against arithmetic intensity (FLOPs per
  byte of device memory), under the memory roof (copy GB/s x intensity) and the
  compute roof (cuBLAS f16 GEMM TFLOP/s). A row is placed here when its
  intensity is known: ``extra["flops"]`` and ``extra["bytes"]`` (per call), or
  both ``gbs`` and ``tflops``;
* right, every bandwidth row: achieved GB/s as a fraction of the copy ceiling
  (most decode kernels are bandwidth-bound and report no FLOPs).

Uses matplotlib's object API (no pyplot state), so it runs headless and returns
a Figure that a notebook displays as is.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["intensity", "plot_roofline"]


def intensity(row: dict) -> float | None:
    """FLOPs per byte of one result row, or None when the row does not say."""
    extra = row.get("extra") or {}
    if extra.get("flops") and extra.get("bytes"):
        return extra["flops"] / extra["bytes"]
    if row.get("gbs") and row.get("tflops"):
        return row["tflops"] * 1e12 / (row["gbs"] * 1e9)
    return None


def _label(row: dict) -> str:
    return f"{row['kernel']} {row['shape']}"


def plot_roofline(result, path=None, *, title: str | None = None):
    """Draw ``result`` (a result dict, or the path of a ``--json`` file) and return the Figure;
    with ``path``, also save it there as PNG."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("the roofline plot needs matplotlib: pip install matplotlib "
                          "(or the cukern[test] / cukern[notebooks] extra)") from None
    import numpy as np
    if not isinstance(result, dict):
        from cukern.workbench import load_result
        result = load_result(result)
    ceil = result["ceilings"]
    copy_gbs, gemm = ceil["copy_gbs"], ceil.get("gemm_tflops")
    rows = result["rows"]
    families = sorted({r["family"] for r in rows})
    colours = {f: f"C{i % 10}" for i, f in enumerate(families)}

    bw_rows = [r for r in rows if r.get("gbs")]
    fig = Figure(figsize=(14, max(5.0, 0.28 * len(bw_rows) + 1.8)), layout="constrained")
    FigureCanvasAgg(fig)
    ax, bx = fig.subplots(1, 2, width_ratios=(1, 1.1))

    # left: the roofline
    placed = [(intensity(r), r) for r in rows]
    placed = [(ai, r) for ai, r in placed if ai]
    lo = min([ai for ai, _ in placed] + [0.05]) / 2
    hi = max([ai for ai, _ in placed] + [2 * (gemm * 1e3 / copy_gbs if gemm else 100)]) * 2
    x = np.geomspace(lo, hi, 200)
    mem = copy_gbs * x / 1e3  # TFLOP/s the memory system allows at intensity x
    ax.loglog(x, np.minimum(mem, gemm) if gemm else mem, "k-", lw=1.5,
              label=f"ceiling: copy {copy_gbs:,.0f} GB/s" + (f", GEMM {gemm:,.0f} TFLOP/s" if gemm else ""))
    if gemm:
        ax.axvline(gemm * 1e3 / copy_gbs, color="0.7", ls=":", lw=1)
    for ai, r in placed:
        tf = r["tflops"] if r.get("tflops") else r["extra"]["flops"] / (r["us"] * 1e-6) / 1e12
        ax.loglog(ai, tf, "o", color=colours[r["family"]])
        ax.annotate(_label(r), (ai, tf), fontsize=7, xytext=(4, 2), textcoords="offset points")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title("roofline")
    ax.grid(True, which="both", alpha=0.3)
    if not placed:
        ax.text(0.5, 0.5, "no row reports both FLOPs and bytes", transform=ax.transAxes,
                ha="center", color="0.4")
    ax.legend(loc="lower right", fontsize=8)

    # right: bandwidth rows as a fraction of the copy ceiling
    y = np.arange(len(bw_rows))
    frac = [r["gbs"] / copy_gbs for r in bw_rows]
    bx.barh(y, frac, color=[colours[r["family"]] for r in bw_rows])
    bx.set_yticks(y, [_label(r) for r in bw_rows], fontsize=7)
    bx.invert_yaxis()
    bx.axvline(1.0, color="k", lw=1.5)
    for yi, (f, r) in enumerate(zip(frac, bw_rows)):
        bx.text(f, yi, f" {r['gbs']:,.0f} GB/s", va="center", fontsize=7)
    bx.set_xlim(0, max(frac + [1.0]) * 1.25)
    bx.set_xlabel(f"achieved GB/s / copy ceiling ({copy_gbs:,.0f} GB/s, this run)")
    bx.set_title("bandwidth")
    if bw_rows:
        from matplotlib.patches import Patch
        bx.legend(handles=[Patch(color=colours[f], label=f) for f in families], loc="lower right", fontsize=8)

    meta = result.get("meta", {})
    fig.suptitle(title or f"cukern on {meta.get('device', ceil.get('device', '?'))} ({meta.get('date', '')})")
    if path is not None:
        fig.savefig(Path(path), dpi=120)
    return fig

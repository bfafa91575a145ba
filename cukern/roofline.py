"""A roofline chart of a ``python -m cukern bench --json`` result (``bench --plot out.png``).

Three panels, all against the ceilings measured in the same run:

* top, the roofline: achieved TFLOP/s against arithmetic intensity (FLOPs per
  byte of device memory), under the memory roof (copy GB/s x intensity) and the
  compute roof (cuBLAS f16 GEMM TFLOP/s). A row is placed here when its
  intensity is known: ``extra["flops"]`` and ``extra["bytes"]`` (per call), or
  both ``gbs`` and ``tflops``;
* bottom left, every row that reports GB/s, as a fraction of the copy ceiling
  (most decode kernels are bandwidth-bound and report no FLOPs);
* bottom right, every row that reports TFLOP/s, as a fraction of the GEMM
  ceiling (prefill GEMMs and attention, which often report no bytes).

Uses matplotlib's object API (no pyplot state), so it runs headless and returns
a Figure that a notebook displays as is.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["intensity", "plot_roofline", "output_path"]


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


def _roofline(ax, rows, colours, copy_gbs: float, gemm: float | None) -> None:
    import numpy as np
    placed = [(intensity(r), r) for r in rows]
    placed = [(ai, r) for ai, r in placed if ai]
    ridge = gemm * 1e3 / copy_gbs if gemm else None
    lo = min([ai for ai, _ in placed] + [0.05]) / 2
    hi = max([ai for ai, _ in placed] + [2 * (ridge or 100)]) * 2
    x = np.geomspace(lo, hi, 200)
    mem = copy_gbs * x / 1e3  # TFLOP/s the memory system allows at intensity x
    ax.loglog(x, np.minimum(mem, gemm) if gemm else mem, "k-", lw=1.5,
              label=f"ceiling: copy {copy_gbs:,.0f} GB/s" + (f", GEMM {gemm:,.0f} TFLOP/s" if gemm else ""))
    if ridge:
        ax.axvline(ridge, color="0.7", ls=":", lw=1)
    for ai, r in placed:
        tf = r["tflops"] if r.get("tflops") else r["extra"]["flops"] / (r["us"] * 1e-6) / 1e12
        ax.loglog(ai, tf, "o", color=colours[r["family"]])
        if len(placed) <= 30:
            ax.annotate(_label(r), (ai, tf), fontsize=7, xytext=(4, 2), textcoords="offset points")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(f"roofline: the {len(placed)} rows that report both FLOPs and bytes")
    ax.grid(True, which="both", alpha=0.3)
    if not placed:
        ax.text(0.5, 0.5, "no row reports both FLOPs and bytes", transform=ax.transAxes, ha="center", color="0.4")


def _bars(ax, rows, colours, key: str, ceiling: float | None, unit: str, xlabel: str, title: str) -> None:
    """One horizontal bar per row: its ``key`` figure over ``ceiling`` (or absolute without one)."""
    import numpy as np
    y = np.arange(len(rows))
    vals = [r[key] / ceiling if ceiling else r[key] for r in rows]
    ax.barh(y, vals, color=[colours[r["family"]] for r in rows])
    ax.set_yticks(y, [_label(r) for r in rows], fontsize=6)
    ax.invert_yaxis()
    if ceiling:
        ax.axvline(1.0, color="k", lw=1.5)
    for yi, (v, r) in enumerate(zip(vals, rows)):
        ax.text(v, yi, f" {r[key]:,.0f} {unit}" if r[key] >= 10 else f" {r[key]:.2f} {unit}", va="center", fontsize=6)
    ax.set_xlim(0, max(vals + [1.0 if ceiling else 0.0]) * 1.25 or 1.0)
    ax.set_xlabel(xlabel)
    ax.set_title(f"{title}: {len(rows)} rows")
    if not rows:
        ax.text(0.5, 0.5, f"no row reports {unit}", transform=ax.transAxes, ha="center", color="0.4")


def output_path(path) -> Path:
    """The file :func:`plot_roofline` writes for ``path``: ``path`` itself, with ``.png`` added when
    it has no suffix (matplotlib's rule); ValueError for a suffix matplotlib cannot write."""
    path = Path(path)
    if not path.suffix:
        return path.with_name(path.name + ".png")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:   # plot_roofline says that matplotlib is missing
        return path
    kinds = FigureCanvasBase.get_supported_filetypes()
    if path.suffix[1:].lower() not in kinds:
        raise ValueError(f"{path}: matplotlib cannot write {path.suffix} files (it writes "
                         f"{', '.join('.' + k for k in sorted(kinds))})")
    return path


def plot_roofline(result, path=None, *, title: str | None = None):
    """Draw ``result`` (a result dict, or the path of a ``--json`` file) and return the Figure;
    with ``path``, also save it at :func:`output_path` of it (PNG unless its suffix names another
    format)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("the roofline plot needs matplotlib: pip install matplotlib "
                          "(or the cukern[test] / cukern[notebooks] extra)") from None
    if not isinstance(result, dict):
        from cukern.workbench import load_result
        result = load_result(result)
    ceil = result["ceilings"]
    copy_gbs, gemm = ceil["copy_gbs"], ceil.get("gemm_tflops")
    rows = result["rows"]
    families = sorted({r["family"] for r in rows})
    colours = {f: f"C{i % 10}" for i, f in enumerate(families)}

    bw_rows = [r for r in rows if r.get("gbs")]
    tf_rows = [r for r in rows if r.get("tflops")]
    bars_h = 0.16 * max(len(bw_rows), len(tf_rows), 8) + 1.0
    fig = Figure(figsize=(15, 5.5 + bars_h), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 2, height_ratios=(5.5, bars_h))
    ax = fig.add_subplot(grid[0, :])
    _roofline(ax, rows, colours, copy_gbs, gemm)
    _bars(fig.add_subplot(grid[1, 0]), bw_rows, colours, "gbs", copy_gbs, "GB/s",
          f"achieved GB/s / copy ceiling ({copy_gbs:,.0f} GB/s)", "bandwidth")
    if gemm:
        _bars(fig.add_subplot(grid[1, 1]), tf_rows, colours, "tflops", gemm, "TFLOP/s",
              f"achieved TFLOP/s / cuBLAS f16 GEMM ({gemm:,.0f} TFLOP/s)", "arithmetic")
    else:
        _bars(fig.add_subplot(grid[1, 1]), tf_rows, colours, "tflops", None, "TFLOP/s",
              "achieved TFLOP/s (no GEMM ceiling in this result)", "arithmetic")
    from matplotlib.patches import Patch
    ax.legend(handles=ax.get_legend_handles_labels()[0] + [Patch(color=colours[f], label=f) for f in families],
              loc="lower right", fontsize=8)

    meta = result.get("meta", {})
    fig.suptitle(title or f"cukern on {meta.get('device', ceil.get('device', '?'))} ({meta.get('date', '')})")
    if path is not None:
        fig.savefig(output_path(path), dpi=120)
    return fig

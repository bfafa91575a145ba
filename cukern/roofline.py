"""A roofline chart of a ``python -m cukern bench --json`` result (``bench --plot out.png``), or of
several runs side by side (``python -m cukern roofline a.json b.json``).

Four panels, all against the ceilings measured in the same run:

* top left, the roofline: achieved TFLOP/s against arithmetic intensity (FLOPs per
  byte of device memory), under the memory roof (copy GB/s x intensity) and the
  compute roof (cuBLAS f16 GEMM TFLOP/s). A row is placed here when its
  intensity is known: ``extra["flops"]`` and ``extra["bytes"]`` (per call), or
  both ``gbs`` and ``tflops``;
* top right, the bandwidth roof: every row that reports bytes (``extra["bytes"]`` or
  GB/s), as achieved GB/s against the bytes it moves per call, under the copy ceiling.
  Most decode kernels report bytes and no FLOPs: an intensity would have to be made up
  to put them on the roofline, while GB/s against transfer size shows what a kernel
  engineer asks of them, how near the copy roof they run and whether a small shape is
  latency-bound (the left of the panel) rather than bandwidth-bound;
* bottom left, every row that reports GB/s, as a fraction of the copy ceiling;
* bottom right, every row that reports TFLOP/s, as a fraction of the GEMM
  ceiling (prefill GEMMs and attention, which often report no bytes).

With several runs, the colour is still the family and the marker shape is the run; the
legend names each run, and each run's roofs are drawn where its ceilings differ.

Uses matplotlib's object API (no pyplot state), so it runs headless and returns
a Figure that a notebook displays as is.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["intensity", "bytes_moved", "plot_roofline", "output_path"]


def intensity(row: dict) -> float | None:
    """FLOPs per byte of one result row, or None when the row does not say."""
    extra = row.get("extra") or {}
    if extra.get("flops") and extra.get("bytes"):
        return extra["flops"] / extra["bytes"]
    if row.get("gbs") and row.get("tflops"):
        return row["tflops"] * 1e12 / (row["gbs"] * 1e9)
    return None


def bytes_moved(row: dict) -> float | None:
    """Bytes of device memory one call of the row moves: ``extra["bytes"]``, else GB/s x time;
    None when the row reports neither."""
    extra = row.get("extra") or {}
    if extra.get("bytes"):
        return float(extra["bytes"])
    if row.get("gbs"):
        return row["gbs"] * row["us"] * 1e3
    return None


MARKERS = "osD^vPX*<>"


class _Runs:
    """The runs of one chart: their rows (each tagged with its run's index), the colour of each
    family and the marker and label of each run."""

    def __init__(self, runs: list[tuple[str | None, dict]]):
        self.runs = runs
        self.rows = [(k, r) for k, (_, result) in enumerate(runs) for r in result["rows"]]
        self.families = sorted({r["family"] for _, r in self.rows})
        self.colour = {f: f"C{i % 10}" for i, f in enumerate(self.families)}

    def marker(self, k: int) -> str:
        return MARKERS[k % len(MARKERS)]

    def ceilings(self, k: int) -> tuple[float, float | None]:
        c = self.runs[k][1]["ceilings"]
        return c["copy_gbs"], c.get("gemm_tflops")

    def roofs(self) -> list[tuple[float, float | None, str]]:
        """One (copy GB/s, GEMM TFLOP/s, label) per distinct pair of ceilings, naming its runs."""
        out: dict[tuple, list[str]] = {}
        for k, (label, _) in enumerate(self.runs):
            out.setdefault(self.ceilings(k), []).append(label or "")
        several = len(out) > 1
        return [(copy, gemm, f" ({', '.join(labels)})" if several else "") for (copy, gemm), labels in out.items()]

    def label(self, k: int, row: dict) -> str:
        run = self.runs[k][0]
        return f"{row['kernel']} {row['shape']}" + (f" [{run}]" if run and len(self.runs) > 1 else "")


def _points(ax, runs: _Runs, points, xlabel: str, ylabel: str, title: str, missing: str) -> None:
    """``(x, y, run, row)`` points as markers (colour: family; shape: run), named when few, on log axes."""
    for x, y, k, r in points:
        ax.loglog(x, y, runs.marker(k), color=runs.colour[r["family"]])
        if len(points) <= 30:
            ax.annotate(runs.label(k, r), (x, y), fontsize=7, xytext=(4, 2), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    if not points:
        ax.text(0.5, 0.5, f"no row reports {missing}", transform=ax.transAxes, ha="center", color="0.4")


_ROOF_STYLES = ("-", "--", ":", "-.")   # one per distinct set of ceilings


def _roofline(ax, runs: _Runs) -> None:
    import numpy as np
    placed = [(intensity(r), k, r) for k, r in runs.rows]
    placed = [(ai, k, r) for ai, k, r in placed if ai]
    roofs = runs.roofs()
    ridges = [gemm * 1e3 / copy for copy, gemm, _ in roofs if gemm]
    lo = min([ai for ai, _, _ in placed] + [0.05]) / 2
    hi = max([ai for ai, _, _ in placed] + [2 * r for r in ridges] + [200]) * 2
    x = np.geomspace(lo, hi, 200)
    for i, (copy, gemm, names) in enumerate(roofs):
        mem = copy * x / 1e3  # TFLOP/s the memory system allows at intensity x
        ax.loglog(x, np.minimum(mem, gemm) if gemm else mem, color="k", ls=_ROOF_STYLES[i % 4], lw=1.5,
                  label=f"ceiling: copy {copy:,.0f} GB/s" + (f", GEMM {gemm:,.0f} TFLOP/s" if gemm else "") + names)
        if gemm:
            ax.axvline(gemm * 1e3 / copy, color="0.7", ls=":", lw=1)
    points = [(ai, r["tflops"] if r.get("tflops") else r["extra"]["flops"] / (r["us"] * 1e-6) / 1e12, k, r)
              for ai, k, r in placed]
    _points(ax, runs, points, "arithmetic intensity (FLOP / byte)", "achieved TFLOP/s",
            f"roofline: the {len(points)} rows that report both FLOPs and bytes", "both FLOPs and bytes")


def _bandwidth_roof(ax, runs: _Runs) -> None:
    """Achieved GB/s against bytes per call for every row that reports bytes, under each run's copy roof."""
    for i, (copy, _, names) in enumerate(runs.roofs()):
        ax.axhline(copy, color="k", ls=_ROOF_STYLES[i % 4], lw=1.5, label=f"copy {copy:,.0f} GB/s{names}")
    placed = [(bytes_moved(r), k, r) for k, r in runs.rows]
    points = [(b, b / (r["us"] * 1e-6) / 1e9, k, r) for b, k, r in placed if b]
    _points(ax, runs, points, "bytes moved per call", "achieved GB/s",
            f"bandwidth roof: the {len(points)} rows that report bytes", "bytes")


def _bars(ax, runs: _Runs, key: str, ceiling_of, unit: str, xlabel: str, title: str) -> None:
    """One horizontal bar per row: its ``key`` figure over its run's ceiling (``ceiling_of(k)``;
    absolute when that is None); with several runs, the runs of a row next to each other."""
    import numpy as np
    rows = [(k, r) for k, r in runs.rows if r.get(key)]
    if len(runs.runs) > 1:   # a row's runs side by side
        rows.sort(key=lambda kr: (kr[1]["family"], kr[1]["kernel"], kr[1]["shape"]))
    y = np.arange(len(rows))
    vals = [r[key] / ceiling_of(k) if ceiling_of(k) else r[key] for k, r in rows]
    ax.barh(y, vals, color=[runs.colour[r["family"]] for _, r in rows])
    ax.set_yticks(y, [runs.label(k, r) for k, r in rows], fontsize=6)
    ax.invert_yaxis()
    relative = bool(rows) and all(ceiling_of(k) for k, _ in rows)
    if relative:
        ax.axvline(1.0, color="k", lw=1.5)
    for yi, (v, (_, r)) in enumerate(zip(vals, rows)):
        ax.text(v, yi, f" {r[key]:,.0f} {unit}" if r[key] >= 10 else f" {r[key]:.2f} {unit}", va="center", fontsize=6)
    ax.set_xlim(0, max(vals + [1.0 if relative else 0.0]) * 1.25 or 1.0)
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
    """Draw ``result`` and return the Figure: a result dict, the path of a ``--json`` file, or
    several runs as ``[(label, result), ...]`` (:func:`cukern.workbench.label_runs`), each drawn
    with its own marker and named in the legend. With ``path``, also save it at
    :func:`output_path` of it (PNG unless its suffix names another format)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError:
        raise ImportError("the roofline plot needs matplotlib: pip install matplotlib "
                          "(or the cukern[test] / cukern[notebooks] extra)") from None
    if isinstance(result, list):
        runs = _Runs(result)
    else:
        if not isinstance(result, dict):
            from cukern.workbench import load_result
            result = load_result(result)
        runs = _Runs([(None, result)])
    n_bw = sum(1 for _, r in runs.rows if r.get("gbs"))
    n_tf = sum(1 for _, r in runs.rows if r.get("tflops"))
    bars_h = 0.16 * max(n_bw, n_tf, 8) + 1.0
    fig = Figure(figsize=(16, 5.5 + bars_h), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 2, height_ratios=(5.5, bars_h))
    ax = fig.add_subplot(grid[0, 0])
    _roofline(ax, runs)
    bw = fig.add_subplot(grid[0, 1])
    _bandwidth_roof(bw, runs)
    copy0, gemm0 = runs.ceilings(0)
    one = len(runs.runs) == 1
    _bars(fig.add_subplot(grid[1, 0]), runs, "gbs", lambda k: runs.ceilings(k)[0], "GB/s",
          f"achieved GB/s / copy ceiling ({copy0:,.0f} GB/s)" if one else "achieved GB/s / its run's copy ceiling",
          "bandwidth")
    with_gemm = all(runs.ceilings(k)[1] for k in range(len(runs.runs)))
    _bars(fig.add_subplot(grid[1, 1]), runs, "tflops", lambda k: runs.ceilings(k)[1] if with_gemm else None,
          "TFLOP/s", ("achieved TFLOP/s (no GEMM ceiling in this result)" if not with_gemm else
                      f"achieved TFLOP/s / cuBLAS f16 GEMM ({gemm0:,.0f} TFLOP/s)" if one else
                      "achieved TFLOP/s / its run's cuBLAS f16 GEMM"), "arithmetic")
    handles = [Patch(color=runs.colour[f], label=f) for f in runs.families]
    if not one:
        handles += [Line2D([], [], ls="", marker=runs.marker(k), color="0.3", label=label)
                    for k, (label, _) in enumerate(runs.runs)]
    for panel in (ax, bw):
        panel.legend(handles=panel.get_legend_handles_labels()[0] + handles, loc="lower right", fontsize=8)

    if one:
        result = runs.runs[0][1]
        meta, ceil = result.get("meta", {}), result["ceilings"]
        default = f"cukern on {meta.get('device', ceil.get('device', '?'))} ({meta.get('date', '')})"
    else:
        default = f"cukern: {len(runs.runs)} runs ({', '.join(label for label, _ in runs.runs)})"
    fig.suptitle(title or default)
    if path is not None:
        fig.savefig(output_path(path), dpi=120)
    return fig

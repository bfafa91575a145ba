"""``python -m cukern notebooks``: check and run the checkout's notebooks without Jupyter.

* :func:`check_notebook` (CPU, CI): the file is nbformat 4 JSON, has code
  cells, was committed without outputs, and every code cell compiles as Python
  (so no IPython magics or shell escapes: the notebooks are plain Python that
  runs anywhere).
* :func:`run_notebook` (GPU): executes the code cells in order in one
  namespace, in the notebook's folder, with matplotlib's non-interactive Agg
  backend, as Jupyter would run them top to bottom; optionally saves every
  figure a cell leaves open as PNG. The first failing cell stops the run and
  is reported with its number and traceback.

The GPU machine has no Jupyter (no nbclient or ipykernel), which is why this
runner exists; with Jupyter installed (``pip install 'cukern[notebooks]'``),
``jupyter nbconvert --execute`` runs the same notebooks.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

__all__ = ["code_cells", "check_notebook", "run_notebook", "NotebookRun", "notebook_paths"]


def notebook_paths(paths=None) -> list[Path]:
    """The given notebooks, or every ``notebooks/*.ipynb`` of the checkout."""
    if paths:
        return [Path(p) for p in paths]
    from cukern.workbench import checkout_root
    return sorted((checkout_root("notebooks") / "notebooks").glob("*.ipynb"))


def _load(path: Path) -> dict:
    """The notebook as a dict whose cells are objects with string sources; ValueError naming the
    file otherwise (OSError when it cannot be read)."""
    try:
        with open(path, encoding="utf-8") as f:
            nb = json.load(f)
    except ValueError as e:   # not JSON, or not UTF-8
        raise ValueError(f"{path}: not a JSON file ({e})") from None
    if not isinstance(nb, dict) or nb.get("nbformat") != 4 or not isinstance(nb.get("cells"), list):
        raise ValueError(f"{path}: not an nbformat 4 notebook")
    for i, cell in enumerate(nb["cells"]):
        src = cell.get("source", "") if isinstance(cell, dict) else None
        if not isinstance(src, str) and not (isinstance(src, list) and all(isinstance(x, str) for x in src)):
            raise ValueError(f"{path}: cell {i} is not an object with a string or list-of-strings source")
    return nb


def code_cells(path) -> list[str]:
    """The source of every code cell, in order."""
    nb = _load(Path(path))
    out = []
    for cell in nb["cells"]:
        if cell.get("cell_type") == "code":
            src = cell.get("source", "")
            out.append("".join(src) if isinstance(src, list) else src)
    return out


def check_notebook(path) -> list[str]:
    """Problems found without running anything (empty list: fine): not nbformat 4, no code
    cell, outputs or execution counts committed, a code cell that does not compile."""
    path = Path(path)
    try:
        nb = _load(path)
    except (OSError, ValueError) as e:
        return [str(e)]
    problems = []
    cells = [c for c in nb["cells"] if c.get("cell_type") == "code"]
    if not cells:
        problems.append(f"{path.name}: no code cell")
    for i, cell in enumerate(cells):
        if cell.get("outputs") or cell.get("execution_count") is not None:
            problems.append(f"{path.name} cell {i}: committed with outputs (clear them before committing)")
        src = cell.get("source", "")
        src = "".join(src) if isinstance(src, list) else src
        try:
            compile(src, f"{path.name}[{i}]", "exec")
        except SyntaxError as e:
            problems.append(f"{path.name} cell {i}: does not compile: {e.msg} (line {e.lineno})")
    return problems


@dataclass
class NotebookRun:
    path: Path
    cells_run: int
    cells: int
    seconds: float
    error: str = ""  # the failing cell's number and traceback
    figures: tuple = ()  # PNG files written

    @property
    def ok(self) -> bool:
        return not self.error


@contextlib.contextmanager
def _in_folder(folder: Path):
    old = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(old)


def run_notebook(path, *, figures_dir=None, show_progress: bool = True) -> NotebookRun:
    """Execute ``path``'s code cells in order in one namespace (see the module docstring).

    figures_dir: save every figure left open after a cell there as
    ``<notebook>_cell<i>_<n>.png`` (then close it)."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    try:
        import matplotlib
        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        plt = None
    path = Path(path).resolve()
    cells = code_cells(path)
    namespace = {"__name__": "__main__", "__file__": str(path)}
    saved, t0 = [], time.perf_counter()
    from cukern.workbench import progress
    with _in_folder(path.parent):
        for i in progress(range(len(cells)), desc=path.stem, total=len(cells), unit="cell") if show_progress \
                else range(len(cells)):
            try:
                exec(compile(cells[i], f"{path.name}[{i}]", "exec"), namespace)
            except BaseException as e:
                if isinstance(e, KeyboardInterrupt):
                    raise
                tb = traceback.format_exc()
                return NotebookRun(path, i, len(cells), time.perf_counter() - t0, f"cell {i}:\n{tb}", tuple(saved))
            finally:
                if plt is not None:
                    for n in plt.get_fignums():
                        if figures_dir is not None:
                            out = Path(figures_dir) / f"{path.stem}_cell{i}_{n}.png"
                            plt.figure(n).savefig(out, dpi=90)
                            saved.append(out)
                        plt.close(n)
    return NotebookRun(path, len(cells), len(cells), time.perf_counter() - t0, "", tuple(saved))


def main_check(paths) -> int:
    """Print each notebook's problems; 1 when there are any."""
    nbs = notebook_paths(paths)
    bad = 0
    for p in nbs:
        problems = check_notebook(p)
        bad += bool(problems)
        cells = f"{len(code_cells(p))} code cells" if not problems else "not checked further"
        print(f"{p.name:<32} {'ok' if not problems else 'PROBLEMS'} ({cells})")
        for line in problems:
            print(f"  {line}")
    if not nbs:
        print("no notebook found")
        return 1
    return 1 if bad else 0


def main_run(paths, figures_dir=None) -> int:
    """Run each notebook headless; print a table; 1 when one fails."""
    from cukern.workbench import no_gpu_reason
    reason = no_gpu_reason()
    if reason:
        print(f"notebooks --run: {reason}; `python -m cukern notebooks` (no --run) checks them without a GPU")
        return 1
    nbs = notebook_paths(paths)
    if figures_dir is not None:
        Path(figures_dir).mkdir(parents=True, exist_ok=True)
    runs = []
    for p in nbs:
        print(f"=== {p.name}", flush=True)
        try:
            runs.append(run_notebook(p, figures_dir=figures_dir))
        except (OSError, ValueError) as e:   # unreadable, or not a notebook: nothing ran
            runs.append(NotebookRun(Path(p), 0, 0, 0.0, f"loading: {e}"))
        sys.stdout.flush()
    print(f"\n{'notebook':<32} {'cells':>9} {'seconds':>8} {'figures':>7}  status")
    for r in runs:
        print(f"{r.path.name:<32} {r.cells_run:>4}/{r.cells:<4} {r.seconds:>8.1f} {len(r.figures):>7}  "
              f"{'ok' if r.ok else 'FAILED'}")
    for r in runs:
        if not r.ok:
            print(f"\n{r.path.name} failed at {r.error}", file=sys.stderr)
    if not runs:
        print("no notebook found")
        return 1
    return 0 if all(r.ok for r in runs) else 1

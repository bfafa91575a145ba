"""``python -m cukern notebooks``: check the checkout's notebooks, and run them headless.

* :func:`check_notebook` (CPU, CI): the file is nbformat 4 JSON, has code
  cells, every code cell compiles as Python (so no IPython magics or shell
  escapes: the notebooks are plain Python that runs anywhere), and its outputs,
  if any, are those of a clean top-to-bottom run: every non-empty code cell
  executed, execution counts 1, 2, 3... in order, no ``error`` output.
  Notebooks are committed either without outputs or with a GPU run's.
* :func:`run_notebook` (GPU): executes the code cells top to bottom in the
  notebook's folder, with a per-cell time limit. With nbclient and ipykernel
  importable (the ``notebooks`` extra; on the GPU machine the wheels carried in
  ``.nbw/``) through ``nbclient.NotebookClient`` on a ``python3`` kernel that
  is always ipykernel in this interpreter (``sys.executable``, whatever
  kernelspecs are installed) with this process's environment and inline
  figures, so the executed notebook (outputs, PNG figures, execution counts)
  can be written back; otherwise by a plain ``exec`` of each cell in one
  namespace with matplotlib's Agg backend, which keeps no outputs. Either way
  the figures can be saved as PNG files, and the first failing cell stops the
  run and is reported with its number and traceback.
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

__all__ = ["code_cells", "check_notebook", "run_notebook", "write_notebook", "nbclient_missing", "NotebookRun",
           "notebook_paths"]


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
    return [_source(c) for c in _load(Path(path))["cells"] if c.get("cell_type") == "code"]


def check_notebook(path) -> list[str]:
    """Problems found without running anything (empty list: fine): not nbformat 4, no code
    cell, a code cell that does not compile, outputs that are not a clean top-to-bottom run."""
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
        try:
            compile(_source(cell), f"{path.name}[{i}]", "exec")
        except SyntaxError as e:
            problems.append(f"{path.name} cell {i}: does not compile: {e.msg} (line {e.lineno})")
    return problems + _run_problems(path.name, cells)


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _run_problems(name: str, cells: list[dict]) -> list[str]:
    """Outputs committed: none at all, or a clean top-to-bottom run (every non-empty code cell
    executed, counts 1, 2, 3... in order, no error output; Jupyter skips empty cells)."""
    if not any(c.get("outputs") or c.get("execution_count") is not None for c in cells):
        return []
    problems, expected = [], 1
    for i, cell in enumerate(cells):
        count = cell.get("execution_count")
        if not _source(cell).strip():
            if count is not None or cell.get("outputs"):
                problems.append(f"{name} cell {i}: an empty cell with an execution count or outputs")
            continue
        if count != expected:
            problems.append(f"{name} cell {i}: execution_count {count}, expected {expected} "
                            "(commit a clean top-to-bottom run, or no outputs)")
        expected += 1
        for out in cell.get("outputs") or []:
            if isinstance(out, dict) and out.get("output_type") == "error":
                problems.append(f"{name} cell {i}: error output ({out.get('ename')}: {out.get('evalue')})")
    return problems


@dataclass
class NotebookRun:
    path: Path
    cells_run: int
    cells: int
    seconds: float
    error: str = ""  # the failing cell's number and traceback
    figures: tuple = ()  # PNG files written
    runner: str = "exec"  # "nbclient" or "exec"
    notebook: object = None  # nbclient: the executed notebook (an nbformat NotebookNode)

    @property
    def ok(self) -> bool:
        return not self.error


def nbclient_missing() -> str:
    """Why the nbclient runner cannot run here ("" when it can)."""
    import importlib.util
    missing = [m for m in ("nbclient", "nbformat", "ipykernel") if importlib.util.find_spec(m) is None]
    return f"{', '.join(missing)} not importable" if missing else ""


def run_notebook(path, *, figures_dir=None, show_progress: bool = True, runner: str | None = None,
                 timeout: float = 600.0) -> NotebookRun:
    """Execute ``path``'s code cells top to bottom (see the module docstring).

    figures_dir: save every figure a cell draws there as ``<notebook>_cell<i>_<n>.png``.
    runner: "nbclient", "exec", or None (nbclient where :func:`nbclient_missing` says it can run).
    timeout: seconds a cell may run (nbclient only)."""
    if runner is None:
        runner = "exec" if nbclient_missing() else "nbclient"
    if runner == "nbclient":
        return _run_nbclient(Path(path).resolve(), figures_dir, show_progress, timeout)
    if runner != "exec":
        raise ValueError(f"runner {runner!r}: expected 'nbclient' or 'exec'")
    return _run_exec(Path(path).resolve(), figures_dir, show_progress)


def _figure_path(figures_dir, path: Path, cell: int, n: int) -> Path:
    return Path(figures_dir) / f"{path.stem}_cell{cell}_{n}.png"


@contextlib.contextmanager
def _in_folder(folder: Path):
    old = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(old)


def _run_exec(path: Path, figures_dir, show_progress: bool) -> NotebookRun:
    """Each code cell exec'd in one namespace, Agg backend; every figure left open after a cell
    saved (figures_dir) and closed."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    try:
        import matplotlib
        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        plt = None
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
                            out = _figure_path(figures_dir, path, i, n)
                            plt.figure(n).savefig(out, dpi=90)
                            saved.append(out)
                        plt.close(n)
    return NotebookRun(path, len(cells), len(cells), time.perf_counter() - t0, "", tuple(saved))


def _kernel_manager_class():
    """An AsyncKernelManager whose ``python3`` is ipykernel's own spec: ``sys.executable -m
    ipykernel_launcher`` (no kernelspec folder is searched, so none installed elsewhere, for
    another interpreter, is picked; ipykernel under a ``--target`` folder on PYTHONPATH is found)."""
    from jupyter_client import AsyncKernelManager
    from jupyter_client.kernelspec import KernelSpecManager
    from traitlets import default

    class ThisPythonKernelManager(AsyncKernelManager):
        @default("kernel_spec_manager")
        def _kernel_spec_manager_default(self):
            return KernelSpecManager(kernel_dirs=[])
    return ThisPythonKernelManager


def _kernel_env() -> dict:
    """This process's environment for the kernel: PYTHONPATH entries made absolute (the kernel
    runs in the notebook's folder) and matplotlib's inline backend, so figures land in the
    notebook as image/png outputs."""
    env = dict(os.environ)
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) if p else p
                                            for p in env["PYTHONPATH"].split(os.pathsep))
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    return env


def _run_nbclient(path: Path, figures_dir, show_progress: bool, timeout: float) -> NotebookRun:
    """The notebook through nbclient.NotebookClient on the python3 kernel of this interpreter."""
    import base64
    import re

    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(path, as_version=4)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    number = {cell_index: n for n, cell_index in enumerate(code)}   # notebook cell -> code cell number
    current = [None]   # the code cell running; None until the kernel has started

    def on_start(cell, cell_index):
        if cell_index in number:
            current[0] = number[cell_index]
            if show_progress:
                print(f"{path.stem} [{current[0] + 1}/{len(code)}]", file=sys.stderr, flush=True)

    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            kernel_manager_class=_kernel_manager_class(), on_cell_start=on_start,
                            resources={"metadata": {"path": str(path.parent)}})
    t0, error = time.perf_counter(), ""
    try:
        client.execute(env=_kernel_env())
    except KeyboardInterrupt:
        raise
    except Exception as e:   # CellExecutionError, CellTimeoutError, DeadKernelError, a kernel that never started
        outputs = nb.cells[code[current[0]]].get("outputs", []) if current[0] is not None else []
        tb = next(("\n".join(o.get("traceback", [])) for o in outputs if o.get("output_type") == "error"),
                  "") or f"{type(e).__name__}: {e}"
        where = f"cell {current[0]}" if current[0] is not None else "starting the kernel"
        error = f"{where}:\n" + re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", tb)
    seconds = time.perf_counter() - t0
    saved = []
    if figures_dir is not None:
        for n_cell, cell_index in enumerate(code):
            pngs = [o["data"]["image/png"] for o in nb.cells[cell_index].get("outputs", [])
                    if "image/png" in o.get("data", {})]
            for n, png in enumerate(pngs, 1):
                out = _figure_path(figures_dir, path, n_cell, n)
                out.write_bytes(base64.b64decode(png))
                saved.append(out)
    cells_run = (current[0] or 0) if error else len(code)
    return NotebookRun(path, cells_run, len(code), seconds, error, tuple(saved), "nbclient", nb)


def write_notebook(run: NotebookRun, dest) -> Path:
    """Write an nbclient run's executed notebook to ``dest`` (a file, or a folder to write
    ``<name>.ipynb`` into)."""
    if run.notebook is None:
        raise ValueError(f"{run.path.name}: the {run.runner} runner keeps no outputs to write")
    import nbformat
    dest = Path(dest)
    if dest.is_dir():
        dest = dest / run.path.name
    nbformat.write(run.notebook, dest)
    return dest


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


def main_run(paths, figures_dir=None, *, write: bool = False, write_to=None, timeout: float = 600.0) -> int:
    """Run each notebook headless; print a table; 1 when one fails.

    write: put each executed notebook back in place, when every cell succeeded; write_to: a copy
    of each executed notebook (failed ones too) into this folder. Both need the nbclient runner."""
    from cukern.workbench import no_gpu_reason
    reason = no_gpu_reason()
    if reason:
        print(f"notebooks --run: {reason}; `python -m cukern notebooks` (no --run) checks them without a GPU")
        return 1
    missing = nbclient_missing()
    if missing and write:
        print(f"notebooks --run --write: {missing}, and the exec runner keeps no outputs to write "
              "(install the notebooks extra, or carry .nbw/ to the GPU machine)", file=sys.stderr)
        return 1
    if missing:
        print(f"runner: exec ({missing})" + ("; --write-to: nothing written" if write_to is not None else ""))
    nbs = notebook_paths(paths)
    for folder in (figures_dir, write_to):
        if folder is not None:
            Path(folder).mkdir(parents=True, exist_ok=True)
    runs, written = [], {}
    for p in nbs:
        print(f"=== {p.name}", flush=True)
        try:
            run = run_notebook(p, figures_dir=figures_dir, timeout=timeout)
        except (OSError, ValueError) as e:   # unreadable, or not a notebook: nothing ran
            run = NotebookRun(Path(p), 0, 0, 0.0, f"loading: {e}")
        runs.append(run)
        if run.notebook is not None:
            if write_to is not None:
                written[run.path] = write_notebook(run, write_to)
            if write and run.ok:
                written[run.path] = write_notebook(run, run.path)
        sys.stdout.flush()
    print(f"\n{'notebook':<32} {'runner':<8} {'cells':>9} {'seconds':>8} {'figures':>7}  status")
    for r in runs:
        print(f"{r.path.name:<32} {r.runner:<8} {r.cells_run:>4}/{r.cells:<4} {r.seconds:>8.1f} "
              f"{len(r.figures):>7}  {'ok' if r.ok else 'FAILED'}"
              + (f"  written to {written[r.path]}" if r.path in written else ""))
    for r in runs:
        if not r.ok:
            print(f"\n{r.path.name} failed at {r.error}", file=sys.stderr)
    if not runs:
        print("no notebook found")
        return 1
    return 0 if all(r.ok for r in runs) else 1

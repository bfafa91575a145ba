"""The workbench's check commands: check --gpu's recorder and table, the per-kernel event timer, check
(compile) and its cache, info, compare gates, and the notebooks (parsed and compiled on the CPU; run
headless on a GPU by ``python -m cukern notebooks --run``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from cukern import notebooks, profiler, selfcheck, testing, workbench
from workbench_helpers import A, B, REPO, _cli, _one_line_error, _run


# ----------------------------------------------------------------------------- check --gpu

def test_recorder_sees_assert_close_and_nmse():
    seen = []
    testing.set_recorder(lambda *a: seen.append(a))
    try:
        ref = np.array([0.0, 1.0, -2.0])
        testing.assert_close(ref + [0.0, 1e-6, 0.0], ref, name="y")
        with pytest.raises(AssertionError):
            testing.assert_close(ref + [0.0, 0.0, 1e-3], ref, name="z")
        testing.nmse(ref * 1.1, ref)
    finally:
        testing.set_recorder(None)
    (n1, k1, e1, b1, ok1), (n2, k2, e2, b2, ok2), (n3, k3, e3, b3, ok3) = seen
    assert (n1, k1, ok1) == ("y", "max_abs", True) and e1 == pytest.approx(1e-6) and b1 == pytest.approx(2e-5)
    assert (n2, ok2) == ("z", False) and e2 == pytest.approx(1e-3) and b2 == pytest.approx(1e-5 + 2e-5)
    assert k3 == "nmse" and e3 == pytest.approx(0.01) and b3 is None
    testing.assert_close(ref, ref)  # recorder off again: nothing more is seen
    assert len(seen) == 3


def test_check_gpu_table_from_a_pytest_run(tmp_path):
    (tmp_path / "test_fake.py").write_text(
        "import numpy as np, pytest\n"
        "from cukern.testing import assert_close, nmse\n"
        "@pytest.mark.parametrize('e', [0.0, 5e-6, 1e-3])\n"
        "def test_close(e):\n"
        "    ref = np.linspace(-1, 1, 11)\n"
        "    assert_close(ref + e, ref)\n"
        "def test_quant():\n"
        "    assert nmse(np.ones(4) * 1.01, np.ones(4)) < 1e-3\n"
        "def test_plain():\n"
        "    pass\n")
    code, col = selfcheck.run_pytest(["-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                                      str(tmp_path / "test_fake.py")])
    assert code == 1  # one case fails
    groups = {g.name.split("::")[1]: g for g in selfcheck.group(col.cases.values())}
    close = groups["test_close"]
    assert (close.count("passed"), close.count("failed")) == (2, 1) and not close.ok
    assert close.worst.worst_ratio == pytest.approx(1e-3 / 1e-5) and close.worst.nodeid.endswith("[0.001]")
    assert groups["test_quant"].max_nmse == pytest.approx(1e-4) and groups["test_quant"].ok
    assert groups["test_plain"].worst is None and groups["test_plain"].ok
    text = selfcheck.format_table(list(groups.values()))
    assert "FAIL" in text and "3 tests, 5 cases, 1 failing" in text
    assert len(selfcheck.group(col.cases.values(), by_function=False)) == 5


@pytest.mark.parametrize("command", [["check", "--gpu"], ["bench", "--quick"], ["notebooks", "--run"]])
def test_gpu_commands_without_a_gpu_say_so(command):
    if workbench.no_gpu_reason() is None:
        pytest.skip("a GPU is visible: the GPU path runs instead")
    r = _run("-m", "cukern", *command)
    assert r.returncode == 1 and "no CUDA device" in r.stdout + r.stderr
    assert "Traceback" not in r.stderr


# ----------------------------------------------------------------------------- per-kernel timer

def test_kernel_table_sums_by_name():
    records = [("rms_norm<256, true>", 2.0), ("scale<true>", 1.0), ("rms_norm<256, true>", 4.0),
               ("rms_norm<256, false>", 3.0)]
    stats = profiler.summarize(records, step_us=20.0)
    assert [(s.kernel, s.calls, s.total_us) for s in stats] == [
        ("rms_norm<256, true>", 2, 6.0), ("rms_norm<256, false>", 1, 3.0), ("scale<true>", 1, 1.0)]
    assert stats[0].pct_step == pytest.approx(0.3) and stats[0].mean_us == pytest.approx(3.0)
    grouped = profiler.summarize(records, step_us=20.0, strip_templates=True)
    assert [(s.kernel, s.calls, s.total_us) for s in grouped] == [("rms_norm", 3, 9.0), ("scale", 1, 1.0)]
    text = profiler.format_table(grouped, 20.0, 2, host_us=60.0)
    assert "all kernels" in text and "50.0%" in text  # 10 of 20 us
    assert "between kernels" in text and "10.0 us per step" in text and "30.0 us per step" in text


def _norm_inputs():
    """An elementwise dispatch, an 8 x 1024 RMS norm's x, w and out, and a non-blocking stream."""
    import cupy
    from cukern.elementwise import ElementwiseDispatch
    x = cupy.ones((8, 1024), cupy.float32)
    w, out = cupy.ones(1024, cupy.float32), cupy.empty((8, 1024), cupy.float32)
    return ElementwiseDispatch(), x, w, out, cupy.cuda.Stream(non_blocking=True)


@pytest.mark.gpu
def test_kernel_timer_times_every_dispatch():

    from cukern import dispatch
    from cukern.streams import capture_graph
    d, x, w, out, stream = _norm_inputs()
    with stream, profiler.KernelTimer() as kt:
        assert dispatch._launch_timer is kt
        for _ in range(3):
            with kt.step(stream):
                d.rms_norm(x, w, out, stream=stream)
                d.scale(x, out, alpha=2.0, stream=stream)
        capture_graph(lambda s: d.scale(x, out, alpha=2.0, stream=s), stream)  # not timed
        kt.begin_step(stream)  # steps delimited by callbacks
        d.rms_norm(x, w, out, stream=stream)
        with pytest.raises(RuntimeError, match="not ended"):
            kt.begin_step(stream)
        kt.end_step()
    assert dispatch._launch_timer is None
    names = [k for k, _ in kt.records()]
    norm, scale = names[:2]  # the variants' names are the family's business; the sequence is ours
    assert norm.startswith("rms_norm") and norm != scale
    assert names == [norm, scale] * 3 + [norm]
    assert all(us > 0 for _, us in kt.records()) and len(kt.step_us) == len(kt.host_step_us) == 4
    stats = kt.table()
    assert 0 < sum(s.pct_step for s in stats) <= 1.0


@pytest.mark.gpu
@pytest.mark.slow  # a timing claim: kernels under compute-sanitizer run many times slower
def test_kernel_timer_times_kernels_not_launches():
    d, x, w, out, stream = _norm_inputs()
    with stream, profiler.KernelTimer() as kt:
        for _ in range(3):
            with kt.step(stream):
                for _ in range(4):
                    d.rms_norm(x, w, out, stream=stream)
    # behind the runway the kernels run back to back: far less than a launch's host latency each
    assert sorted(us for _, us in kt.records())[len(kt.records()) // 2] < 8.0


# ----------------------------------------------------------------------------- notebooks

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def test_every_family_has_a_notebook():
    import cukern
    names = {p.stem for p in NOTEBOOKS}
    assert "decode_step" in names
    # a family is a cukern/<family>.py module (some hold several compilation units)
    families = {module.rsplit(".", 1)[1] for module in cukern.FAMILY_MODULES.values()}
    missing = sorted(f for f in families if f not in names)
    assert not missing, f"families without notebooks/<family>.ipynb: {missing}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_parses_and_compiles(path):
    assert notebooks.check_notebook(path) == []
    assert len(notebooks.code_cells(path)) >= 3


def _notebook(path, cells, counts=None, outputs=None):
    """Write a notebook of these code cells: execution counts and outputs per cell, or none."""
    counts = counts or [None] * len(cells)
    outputs = outputs or [[] for _ in cells]
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": "code", "id": f"c{i}", "metadata": {}, "source": c, "outputs": o, "execution_count": n}
        for i, (c, n, o) in enumerate(zip(cells, counts, outputs))]}
    path.write_text(json.dumps(nb))
    return path


def test_notebook_check_catches_syntax(tmp_path):
    path = _notebook(tmp_path / "bad.ipynb", ["x = 1\n", "%matplotlib inline\n"])
    assert [p for p in notebooks.check_notebook(path) if "cell 1: does not compile" in p]
    (tmp_path / "junk.ipynb").write_text("{")
    assert notebooks.check_notebook(tmp_path / "junk.ipynb")


def test_notebook_check_accepts_no_outputs_or_a_clean_run(tmp_path):
    cells = ["x = 1\n", "", "print(x)\n", "x\n"]
    assert notebooks.check_notebook(_notebook(tmp_path / "bare.ipynb", cells)) == []
    out = [[], [], [{"output_type": "stream", "name": "stdout", "text": "1\n"}],
           [{"output_type": "execute_result", "execution_count": 3, "metadata": {}, "data": {"text/plain": "1"}}]]
    # Jupyter skips the empty cell: it keeps no count
    clean = _notebook(tmp_path / "clean.ipynb", cells, [1, None, 2, 3], out)
    assert notebooks.check_notebook(clean) == []


def test_notebook_check_refuses_a_run_out_of_order_partial_or_failed(tmp_path):
    cells = ["x = 1\n", "y = 2\n", "z = 3\n"]
    problems = notebooks.check_notebook(_notebook(tmp_path / "order.ipynb", cells, [1, 3, 2]))
    assert [p for p in problems if "cell 1: execution_count 3, expected 2" in p]
    assert [p for p in problems if "cell 2: execution_count 2, expected 3" in p]
    problems = notebooks.check_notebook(_notebook(tmp_path / "partial.ipynb", cells, [1, 2, None]))
    assert problems == [p for p in problems if "cell 2: execution_count None, expected 3" in p] != []
    err = {"output_type": "error", "ename": "RuntimeError", "evalue": "boom", "traceback": []}
    problems = notebooks.check_notebook(_notebook(tmp_path / "err.ipynb", cells, [1, 2, 3], [[], [err], []]))
    assert problems == ["err.ipynb cell 1: error output (RuntimeError: boom)"]


def test_notebook_runner_executes_cells_in_one_namespace(tmp_path):
    pytest.importorskip("matplotlib")
    cells = ["from matplotlib import pyplot as plt\nvalue = 41\n",
             "value += 1\nfig, ax = plt.subplots()\nax.plot([1, 2], [value, value])\n",
             "assert value == 42\nraise RuntimeError('boom')\n", "never = True\n"]
    path = _notebook(tmp_path / "nb.ipynb", cells)
    run = notebooks.run_notebook(path, figures_dir=tmp_path, show_progress=False, runner="exec")
    assert not run.ok and run.cells_run == 2 and run.cells == 4 and run.runner == "exec"
    assert "cell 2:" in run.error and "RuntimeError: boom" in run.error
    assert [f.name for f in run.figures] == ["nb_cell1_1.png"] and (tmp_path / "nb_cell1_1.png").is_file()
    with pytest.raises(ValueError, match="keeps no outputs"):
        notebooks.write_notebook(run, tmp_path)


@pytest.mark.skipif(bool(notebooks.nbclient_missing()),
                    reason=f"nbclient runner: {notebooks.nbclient_missing()} (pip install 'cukern[notebooks]')")
def test_notebook_nbclient_runner_keeps_outputs_and_figures(tmp_path, monkeypatch):
    """A python3 kernelspec installed for another interpreter is not used: the kernel is this
    interpreter's ipykernel."""
    pytest.importorskip("matplotlib")
    foreign = tmp_path / "jupyter" / "kernels" / "python3"
    foreign.mkdir(parents=True)
    (foreign / "kernel.json").write_text(json.dumps({"argv": ["/no/such/python", "-f", "{connection_file}"],
                                                     "display_name": "Python 3", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    cells = ["import os\nprint('hello from', os.path.basename(os.getcwd()))\n",
             "from matplotlib import pyplot as plt\nfig, ax = plt.subplots()\nax.plot([1, 2], [3, 4]);\n",
             "", "6 * 7\n"]
    folder = tmp_path / "nbs"
    folder.mkdir()
    path = _notebook(folder / "tiny.ipynb", cells)
    run = notebooks.run_notebook(path, figures_dir=tmp_path, show_progress=False, runner="nbclient", timeout=60)
    assert run.ok, run.error
    assert run.runner == "nbclient" and run.cells_run == run.cells == 4
    assert [f.name for f in run.figures] == ["tiny_cell1_1.png"]
    assert (tmp_path / "tiny_cell1_1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = notebooks.write_notebook(run, tmp_path)
    assert written == tmp_path / "tiny.ipynb" and notebooks.check_notebook(written) == []
    code = [c for c in json.loads(written.read_text())["cells"] if c["cell_type"] == "code"]
    assert [c["execution_count"] for c in code] == [1, 2, None, 3]
    assert code[0]["outputs"][0]["text"] in ("hello from nbs\n", ["hello from nbs\n"])   # ran in its folder
    assert any("image/png" in o.get("data", {}) for o in code[1]["outputs"])
    assert code[3]["outputs"][0]["data"]["text/plain"] in ("42", ["42"])
    assert json.loads(path.read_text())["cells"][0]["outputs"] == []   # the source notebook untouched


@pytest.mark.skipif(bool(notebooks.nbclient_missing()),
                    reason=f"nbclient runner: {notebooks.nbclient_missing()} (pip install 'cukern[notebooks]')")
def test_notebook_nbclient_runner_reports_the_failing_cell(tmp_path):
    cells = ["x = 1\n", "def f():\n    raise RuntimeError('boom')\nf()\n", "never = True\n"]
    path = _notebook(tmp_path / "bad.ipynb", cells)
    run = notebooks.run_notebook(path, show_progress=False, runner="nbclient", timeout=60)
    assert not run.ok and run.cells_run == 1 and run.cells == 3
    assert run.error.startswith("cell 1:\n") and "RuntimeError: boom" in run.error
    assert "\x1b[" not in run.error   # colour codes stripped


def test_sigterm_interrupts_cleanly_inside_interruptible():
    import signal
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with workbench.interruptible():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs between bytecodes
                pass
    assert signal.getsignal(signal.SIGTERM) is before


def test_traffic_formulas():
    """The benchmarks' byte counts (cukern.traffic) on worked examples: a Q4_K matvec (the module's
    docstring), a norm row, Q8_1 blocks, and a decode step's K/V stream."""
    from cukern import traffic
    q4k = 4096 * 14336 // 256 * 144
    assert traffic.dmmv(q4k, 4096, 14336) == 33_103_872
    assert traffic.dmmv(q4k, 4096, 14336, n=8) == q4k + 4 * 8 * (14336 + 4096)
    assert traffic.rows("rms_norm", 1, 4096) == 2 * 4096 * 4 + 4096 * 4
    assert traffic.quantize_q8_1(3, 64) == 3 * 64 * 4 + 3 * 2 * 36
    assert traffic.attention_decode(1, 8192, 32, 8, 128) == 8192 * 8 * 128 * 2 * 2 + 2 * 32 * 128 * 4
    with pytest.raises(KeyError):
        traffic.rows("no_such_op", 1, 1)


# ----------------------------------------------------------------------------- check (compile), info, compare: JSON, gates

def test_version(capsys):
    import cukern
    rc, out, _ = _cli(capsys, "--version")
    assert rc == 0 and out.strip() == f"cukern {cukern.__version__}"


def test_check_family_means_every_unit_of_the_family():
    from cukern import check
    from cukern.runtime import UnknownKernelError
    attention = check.select_units(["attention"])
    assert len(attention) == 13 and all(u.startswith("attention") for u in attention)
    dmmv = check.select_units(["dmmv"])
    assert "dmmv" in dmmv and "dmmv_moe" in dmmv and all(u.startswith("dmmv") for u in dmmv) and len(dmmv) > 2
    assert check.select_units(None, ["attention_bf16"]) == ["attention_bf16"]
    assert check.select_units(["tokens"], ["attention_bf16", "tokens"]) == ["tokens", "attention_bf16"]
    assert len(check.select_units()) == len(__import__("cukern").FAMILY_MODULES)
    with pytest.raises(UnknownKernelError, match="is a unit: use --unit attention_bf16"):
        check.select_units(["attention_bf16"])
    with pytest.raises(UnknownKernelError, match="unknown family 'nope'"):
        check.select_units(None, ["nope"])


def test_check_parallel_rows_equal_serial_rows_in_order(tmp_path):
    from cukern import check
    targets = [(90, False), (80, False)]
    seen = []
    serial = check.run(targets, None, ["tokens"], jobs=1)
    parallel = check.run(targets, None, ["tokens"], jobs=2, progress=lambda *a: seen.append(a))
    assert parallel == serial and all(r.ok for r in serial)
    assert [r.target for r in serial].index("sm_80") > 0 and serial[-1].unit == "probe:tokens/params.cuh"
    assert sorted(done for _, done, _ in seen) == [1, 2, 3, 4] and {total for *_, total in seen} == {4}


def _copy_sources(tmp_path) -> Path:
    import shutil

    from cukern import runtime
    root = tmp_path / "cuda_src"
    shutil.copytree(runtime.source_root(), root)
    return root


@pytest.fixture
def own_sources(tmp_path, monkeypatch):
    """A writable copy of cuda_src/ as the sources ($CUKERN_SRC)."""
    from cukern import params, runtime
    root = _copy_sources(tmp_path)
    monkeypatch.setenv("CUKERN_SRC", str(root))
    runtime.source_root.cache_clear()
    params.load_header.cache_clear()
    yield root
    monkeypatch.delenv("CUKERN_SRC")
    runtime.source_root.cache_clear()
    params.load_header.cache_clear()


def test_check_cache_is_reused_and_a_source_edit_invalidates_it(tmp_path, capsys, own_sources, monkeypatch):
    from cukern import runtime
    cache = tmp_path / "cache"
    rc, first, _ = _cli(capsys, "check", "--unit", "tokens", "--cache-dir", cache)
    assert rc == 0 and " 0 errors" in first
    files = sorted((cache / "ptx").iterdir())
    assert len(files) == 2   # the unit and its layout probe
    compiled = []
    monkeypatch.setattr(runtime, "compile_ptx", lambda *a, **k: compiled.append(a[0]))
    rc, second, _ = _cli(capsys, "check", "--unit", "tokens", "--cache-dir", cache)
    assert rc == 0 and second == first and compiled == []   # the same table, from the cache alone
    monkeypatch.undo()
    monkeypatch.setenv("CUKERN_SRC", str(own_sources))
    # an edit the cached PTX knows nothing of: a kernel no FamilySpec declares
    with open(own_sources / "tokens" / "tokens.cu", "a") as f:
        f.write('\nextern "C" __global__ void cukern_undeclared(float* y) { y[0] = 1.0f; }\n')
    rc, third, err = _cli(capsys, "check", "--unit", "tokens", "--cache-dir", cache)
    assert rc == 1 and "cukern_undeclared" in third and "not declared in its FamilySpec" in err
    assert len(list((cache / "ptx").iterdir())) == 4
    rc, fourth, _ = _cli(capsys, "check", "--unit", "tokens", "--no-cache", "--json")
    assert rc == 1 and json.loads(fourth)["errors"] == 1


def test_check_json(tmp_path, capsys):
    rc, out, _ = _cli(capsys, "check", "--unit", "tokens", "--arch", "sm_80", "--json", "--cache-dir", tmp_path)
    assert rc == 0
    result = json.loads(out)
    assert result["targets"] == ["sm_80"] and result["errors"] == 0 and result["layout_probes"] == 1
    assert len(result["rows"]) == result["kernel_rows"] + 1
    row = result["rows"][0]
    assert row["unit"] == "tokens" and row["ok"] and row["ptx_bytes"] == row["struct_bytes"] > 0
    rc, _, err = _cli(capsys, "check", "--gpu", "--json")
    _one_line_error(rc, err, 2)


def test_info_json(capsys):
    rc, out, _ = _cli(capsys, "info", "--json")
    facts = json.loads(out)
    assert rc == 0 and facts["cukern"] and "python" in facts and isinstance(facts["gpus"], list)
    if not facts["gpus"]:
        assert "no CUDA device" in facts["no_gpu"] or "not installed" in facts["no_gpu"]
    rc, text, _ = _cli(capsys, "info")
    assert rc == 0 and text.startswith(f"cukern          {facts['cukern']}\n")


def test_compare_json_and_fail_above(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(A))
    b.write_text(json.dumps(B))
    rc, out, err = _cli(capsys, "compare", a, b, "--json")
    result = json.loads(out)
    assert rc == 0 and result["moved"] == 2 and "regressed" not in result and err == ""
    rows = {r["kernel"]: r for r in result["rows"]}
    assert rows["rms_norm"]["change"] == pytest.approx(-0.25) and rows["rms_norm"]["moved"] == "faster"
    assert rows["prefill"]["moved"] == "slower" and rows["decode"]["change"] is None
    assert result["b"]["date"] == "2026-11-23T10:00:00+00:00"
    # prefill is 11.1% slower, add_scaled 2.0%
    rc, out, err = _cli(capsys, "compare", a, b, "--fail-above", "10")
    assert rc == 1 and "+11.1% slower" in out and "1 rows slower by more than 10%" in err and "prefill" in err
    rc, out, err = _cli(capsys, "compare", a, b, "--fail-above", "12", "--json")
    assert rc == 0 and json.loads(out)["regressed"] == 0
    rc, out, err = _cli(capsys, "compare", a, b, "--fail-above", "1", "--json")
    assert rc == 1 and json.loads(out)["regressed"] == 2 and "add_scaled" in err
    rc, _, err = _cli(capsys, "compare", a, b, "--fail-above", "nan")
    _one_line_error(rc, err, 2)


def test_readme_code_compiles_and_names_what_it_uses():
    """The README's Python blocks parse, and every ``from cukern... import`` in them resolves."""
    import importlib.util
    import re
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    for block in blocks:
        compile(block, "README.md", "exec")
        for module, names in re.findall(r"^from (cukern[\w.]*) import (.+)$", block, re.M):
            m = importlib.import_module(module)
            for name in names.split(","):
                name = name.split(" as ")[0].strip()
                assert hasattr(m, name) or importlib.util.find_spec(f"{module}.{name}"), (module, name)


def test_check_progress_bar_on_a_terminal_only(monkeypatch, capsys):
    pytest.importorskip("tqdm")
    from cukern import cli
    assert cli._progress("check") is None   # stderr is captured here: not a terminal, no bar
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    update = cli._progress("check")
    for done in (1, 2, 3):
        update(("tokens", 90, False), done, 3)
    err = capsys.readouterr().err
    assert "check" in err and "0/3" in err
    rc, _, err = _cli(capsys, "check", "--jobs", "0")
    _one_line_error(rc, err, 2)

"""The workbench: command help, bench tables and JSON compare, roofline plot, check --gpu's
recorder and table, the per-kernel event timer, and the notebooks (parsed and compiled on the
CPU; run headless on a GPU by ``python -m cukern notebooks --run``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cukern import notebooks, profiler, selfcheck, testing, workbench
from cukern.runtime import CukernError

REPO = Path(__file__).resolve().parents[1]


def _run(*args, cwd=REPO):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, timeout=300,
                          env={**os.environ, "MPLBACKEND": "Agg"})


# ----------------------------------------------------------------------------- --help

@pytest.mark.parametrize("command,words", [
    ("bench", ["--quick", "--json", "--plot", "family"]),
    ("compare", ["A.json", "B.json", "--threshold", "--fail-above", "--json"]),
    ("check", ["--gpu", "--arch", "-k", "--family", "--unit", "--jobs", "--cache-dir", "--no-cache", "--json"]),
    ("info", ["--json"]),
    ("notebooks", ["--run", "--figures"]),
    ("roofline", ["RESULT.json", "--out"]),
])
def test_command_help(command, words):
    r = _run("-m", "cukern", command, "--help")
    assert r.returncode == 0, r.stderr
    for w in words:
        assert w in r.stdout, (command, w)


def test_top_level_help_lists_every_command():
    r = _run("-m", "cukern", "--help")
    assert r.returncode == 0
    for c in ("info", "check", "bench", "compare", "roofline", "notebooks"):
        assert c in r.stdout


def test_profile_decode_help():
    r = _run(str(REPO / "profiling" / "profile_decode.py"), "--help")
    assert r.returncode == 0, r.stderr
    assert "--steps" in r.stdout and "nsys" in r.stdout


# ----------------------------------------------------------------------------- bench results

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


def test_compare_matches_rows_by_family_kernel_shape():
    changes = {(c.family, c.kernel): c for c in workbench.compare(A, B)}
    assert changes["elementwise", "rms_norm"].ratio == pytest.approx(0.75)
    assert changes["attention", "prefill"].ratio == pytest.approx(1000 / 900)
    assert changes["attention", "decode"].b_us is None and changes["attention", "decode"].ratio is None
    assert changes["dmmv", "q4_k"].a_us is None
    assert list(changes)[-1] == ("dmmv", "q4_k")  # A's order, then rows only in B


def test_format_compare_marks_moves_beyond_threshold():
    text = workbench.format_compare(A, B, workbench.compare(A, B), threshold=0.05)
    lines = {ln.split()[1]: ln for ln in text.splitlines() if ln.startswith(("elementwise", "attention", "dmmv"))}
    assert "-25.0% faster" in lines["rms_norm"]
    assert "+2.0%" in lines["add_scaled"] and "slower" not in lines["add_scaled"]
    assert "+11.1% slower" in lines["prefill"]
    assert "only A" in lines["decode"] and "only B" in lines["q4_k"]
    assert "4 rows" not in text and "5 rows, 2 moved" in text


def test_compare_command(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(A))
    b.write_text(json.dumps(B))
    r = _run("-m", "cukern", "compare", str(a), str(b))
    assert r.returncode == 0, r.stderr
    assert "faster" in r.stdout and "2026-11-23" in r.stdout
    (tmp_path / "bad.json").write_text('{"rows": 3}')
    r = _run("-m", "cukern", "compare", str(a), str(tmp_path / "bad.json"))
    assert r.returncode == 1 and "not a `python -m cukern bench --json` result" in r.stderr


def test_format_table_prints_every_peer():
    from cukern.benchmark import Ceilings, Row, format_table
    rows = [Row("attention", "decode", "B1", 40.0, gbs=1800.0, pct_ceiling=0.62, peer="torch SDPA", peer_us=50.0,
                extra={"peers": {"FlashInfer": 36.0}}),
            Row("elementwise", "scale", "1024", 2.0)]
    text = format_table(rows, Ceilings(2900.0, "H100", 700.0))
    lines = text.splitlines()
    assert "copy 2,900 GB/s" in lines[0] and "GEMM 700 TFLOP/s" in lines[0]
    assert lines[3].startswith("attention") and lines[3].endswith("1.25")  # 50 / 40
    assert lines[4].startswith(" ") and "FlashInfer" in lines[4] and lines[4].endswith("0.90")  # 36 / 40
    assert lines[5].split() == ["elementwise", "scale", "1024", "2.00"]  # no peer: nothing after the time


def test_bench_scripts_found_and_unknown_family_is_clear():
    scripts = workbench.bench_scripts()
    assert "elementwise" in scripts and scripts["elementwise"].name == "bench_elementwise.py"
    with pytest.raises(CukernError, match="no benchmark for nope .*there are: .*elementwise"):
        workbench.bench_scripts(["nope"])
    with pytest.raises(CukernError, match="not part of the installed package.*CUKERN_ROOT"):
        workbench.checkout_root("no_such_folder")


def test_rows_of_round_trips_a_result():
    rows, ceil = workbench.rows_of(A)
    assert [r.kernel for r in rows] == ["rms_norm", "add_scaled", "decode", "prefill"]
    assert ceil.gemm_tflops == 700.0 and ceil.copy_gbs == 2900.0


# ----------------------------------------------------------------------------- roofline

def test_roofline_png(tmp_path):
    pytest.importorskip("matplotlib")
    from cukern.roofline import bytes_moved, intensity, plot_roofline
    assert intensity(A["rows"][2]) == pytest.approx(1.0)
    assert intensity(A["rows"][3]) == pytest.approx(350e12 / 300e9)
    assert intensity(A["rows"][0]) is None
    assert bytes_moved(A["rows"][2]) == 6.7e7 and bytes_moved(A["rows"][0]) == pytest.approx(10.0 * 4.0 * 1e3)
    path = tmp_path / "a.json"
    path.write_text(json.dumps(A))
    png = tmp_path / "roofline.png"
    fig = plot_roofline(str(path), png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    roof, bandwidth_roof, bandwidth, arithmetic = fig.axes
    assert len(roof.lines) == 1 + 1 + 2  # roof, ridge line, the two rows whose intensity is known
    assert len(bandwidth_roof.lines) == 1 + 4  # the copy roof, every row that reports bytes
    assert len(bandwidth.patches) == 4  # every row with GB/s
    assert len(arithmetic.patches) == 1  # every row with TFLOP/s


def test_roofline_places_a_bytes_only_row_on_the_bandwidth_roof():
    pytest.importorskip("matplotlib")
    from cukern.roofline import plot_roofline
    only_bytes = _result([("dmmv", "q4_k", "4096x14336", 17.0, None, None, {"bytes": 3.4e7})])
    roof, bandwidth_roof, _, _ = plot_roofline(only_bytes).axes
    (x, y), = [line.get_xydata()[0] for line in bandwidth_roof.lines[1:]]
    assert x == 3.4e7 and y == pytest.approx(3.4e7 / 17e-6 / 1e9)   # bytes per call, achieved GB/s
    assert len(roof.lines) == 2 and "1 rows that report bytes" in bandwidth_roof.get_title()


def test_roofline_command_labels_each_run(tmp_path):
    pytest.importorskip("matplotlib")
    from cukern.roofline import plot_roofline
    a, b = tmp_path / "before.json", tmp_path / "after.json"
    a.write_text(json.dumps({"ceilings": {"copy_gbs": 2900.0, "device": "H100", "gemm_tflops": None},
                             "rows": A["rows"][:2]}))  # a bench_<family>.py --json file: no meta
    b.write_text(json.dumps(B))
    out = tmp_path / "r.png"
    r = _run("-m", "cukern", "roofline", str(a), str(b), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "6 rows, 2 runs: before (H100), after (NVIDIA H100 80GB HBM3)" in r.stdout
    assert out.read_bytes()[:4] == b"\x89PNG"
    runs = workbench.label_runs([(a, json.loads(a.read_text())), (b, B)])
    fig = plot_roofline(runs)
    roof, bandwidth_roof, bandwidth, _ = fig.axes
    legend = [t.get_text() for t in bandwidth_roof.get_legend().get_texts()]
    assert "before (H100)" in legend and "after (NVIDIA H100 80GB HBM3)" in legend
    assert {line.get_marker() for line in bandwidth_roof.lines[2:]} == {"o", "s"}   # one marker per run
    labels = [t.get_text() for t in bandwidth.get_yticklabels()]
    assert "rms_norm 1x4096 [before (H100)]" in labels and "rms_norm 1x4096 [after (NVIDIA H100 80GB HBM3)]" in labels
    assert workbench.label_runs([("x/run.json", A), ("y/run.json", A)])[0][0] == "x/run"
    merged = workbench.merge_results([json.loads(a.read_text()), B])
    assert merged["ceilings"]["gemm_tflops"] == 700.0 and len(merged["rows"]) == 6


# ----------------------------------------------------------------------------- bad input to the commands

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


def _bad_result(tmp_path, how) -> Path:
    """A file ``compare``/``roofline`` must refuse with one line: ``how`` names what is wrong."""
    p = tmp_path / f"{how.replace('/', '_')}.json"
    good = json.loads(json.dumps(A))
    if how == "missing":
        return p
    if how == "malformed":
        p.write_text('{"rows": [')
    elif how == "not utf-8":
        p.write_bytes(b'{"rows": [], "ceilings": {"device": "\xff"}}')
    elif how == "a list":
        p.write_text("[1, 2]")
    elif how == "row not an object":
        p.write_text(json.dumps({**good, "rows": [1]}))
    elif how == "row without a time":
        p.write_text(json.dumps({**good, "rows": [{"family": "f", "kernel": "k", "shape": "s"}]}))
    elif how == "time 0":
        good["rows"][2]["us"] = 0
        p.write_text(json.dumps(good))
    elif how == "NaN GB/s":
        good["rows"][0]["gbs"] = float("nan")
        p.write_text(json.dumps(good))
    else:   # a ceiling: "copy 0", "copy -1", "copy NaN", "gemm 0", "no ceilings"
        if how == "no ceilings":
            good["ceilings"] = {}
        else:
            key, value = how.split()
            good["ceilings"]["copy_gbs" if key == "copy" else "gemm_tflops"] = float(value)
        p.write_text(json.dumps(good))
    return p


BAD_RESULTS = ["missing", "malformed", "not utf-8", "a list", "row not an object", "row without a time",
               "time 0", "NaN GB/s", "no ceilings", "copy 0", "copy -1", "copy NaN", "gemm 0"]


@pytest.mark.parametrize("how", BAD_RESULTS)
def test_compare_and_roofline_refuse_a_bad_result_in_one_line(tmp_path, capsys, how):
    bad, good = _bad_result(tmp_path, how), tmp_path / "good.json"
    good.write_text(json.dumps(A))
    for argv in (["compare", bad, good], ["compare", good, bad], ["roofline", bad, "-o", tmp_path / "r.png"]):
        rc, _, err = _cli(capsys, *argv)
        _one_line_error(rc, err, 1)
        assert bad.name in err
    assert not (tmp_path / "r.png").exists()


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-0.1", "abc", ""])
def test_compare_threshold_must_be_a_finite_fraction(tmp_path, capsys, value):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(A))
    rc, _, err = _cli(capsys, "compare", good, good, "--threshold", value)
    _one_line_error(rc, err, 2)
    assert "--threshold" in err


def test_roofline_reports_the_path_it_wrote(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    good = tmp_path / "good.json"
    good.write_text(json.dumps(A))
    rc, out, _ = _cli(capsys, "roofline", good, "-o", tmp_path / "chart")
    assert rc == 0 and f"wrote {tmp_path / 'chart.png'} " in out
    assert (tmp_path / "chart.png").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "chart").exists()
    rc, out, _ = _cli(capsys, "roofline", good, "-o", tmp_path / "chart.svg")
    assert rc == 0 and f"wrote {tmp_path / 'chart.svg'} " in out and (tmp_path / "chart.svg").exists()


@pytest.mark.parametrize("argv", [
    ["roofline", "{good}", "-o", "{tmp}/no/such/folder/r.png"],
    ["roofline", "{good}", "-o", "{tmp}"],
    ["roofline", "{good}", "-o", "{tmp}/r.xyz"],
    ["bench", "--json", "{tmp}/no/such/folder/r.json"],
    ["bench", "--plot", "{tmp}/no/such/folder/r.png"],
    ["notebooks", "--run", "--figures", "{good}"],
    ["check", "--arch", "sm_xx"],
    ["check", "--arch", "sm_75"],
    ["generate", "--prompt", "x", "--max-tokens", "0"],
    ["generate", "--prompt", "x", "--max-tokens", "1.5"],
    ["generate", "--prompt", "x", "--model", "{tmp}/no_such.gguf"],
    ["generate"],
    ["no_such_command"],
])
def test_bad_flags_are_usage_errors_in_one_line(tmp_path, capsys, argv):
    """Checked before anything runs (so a long bench is not lost at the end, and no GPU is needed)."""
    good = tmp_path / "good.json"
    good.write_text(json.dumps(A))
    rc, _, err = _cli(capsys, *[a.format(good=good, tmp=tmp_path) for a in argv])
    _one_line_error(rc, err, 2)


@pytest.mark.parametrize("content", [b'{"nbformat": 4, "cells": [', b'{"nbformat": 4, "cells": []}\xff',
                                     b'{"nbformat": 4, "cells": [1]}',
                                     b'{"nbformat": 4, "cells": [{"cell_type": "code", "source": [1]}]}',
                                     b'{"nbformat": 4, "cells": [{"cell_type": "code", "source": 5}]}', None])
def test_notebooks_check_reports_a_bad_notebook_by_name(tmp_path, capsys, content):
    p = tmp_path / "bad.ipynb"
    if content is not None:
        p.write_bytes(content)
    rc, out, err = _cli(capsys, "notebooks", p)
    assert rc == 1 and "Traceback" not in out + err and "PROBLEMS" in out
    assert out.count("bad.ipynb") == 2, out   # the table's row and the problem line name the file


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


@pytest.mark.gpu
def test_kernel_timer_times_every_dispatch():
    import cupy

    from cukern import dispatch
    from cukern.elementwise import ElementwiseDispatch
    from cukern.streams import capture_graph
    d = ElementwiseDispatch()
    x = cupy.ones((8, 1024), cupy.float32)
    w, out = cupy.ones(1024, cupy.float32), cupy.empty((8, 1024), cupy.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
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
    # behind the runway the kernels run back to back: far less than a launch's host latency each
    assert sorted(us for _, us in kt.records())[len(names) // 2] < 8.0
    stats = kt.table()
    assert 0 < sum(s.pct_step for s in stats) <= 1.0


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


def test_notebook_check_catches_outputs_and_syntax(tmp_path):
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": "code", "metadata": {}, "source": ["x = 1\n"], "outputs": [{"output_type": "stream"}],
         "execution_count": 3},
        {"cell_type": "code", "metadata": {}, "source": "%matplotlib inline\n", "outputs": [],
         "execution_count": None}]}
    path = tmp_path / "bad.ipynb"
    path.write_text(json.dumps(nb))
    problems = notebooks.check_notebook(path)
    assert any("cell 0: committed with outputs" in p for p in problems)
    assert any("cell 1: does not compile" in p for p in problems)
    (tmp_path / "junk.ipynb").write_text("{")
    assert notebooks.check_notebook(tmp_path / "junk.ipynb")


def test_notebook_runner_executes_cells_in_one_namespace(tmp_path):
    pytest.importorskip("matplotlib")
    cells = ["from matplotlib import pyplot as plt\nvalue = 41\n",
             "value += 1\nfig, ax = plt.subplots()\nax.plot([1, 2], [value, value])\n",
             "assert value == 42\nraise RuntimeError('boom')\n", "never = True\n"]
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": "code", "metadata": {}, "source": c, "outputs": [], "execution_count": None} for c in cells]}
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps(nb))
    run = notebooks.run_notebook(path, figures_dir=tmp_path, show_progress=False)
    assert not run.ok and run.cells_run == 2 and run.cells == 4
    assert "cell 2:" in run.error and "RuntimeError: boom" in run.error
    assert [f.name for f in run.figures] == ["nb_cell1_1.png"] and (tmp_path / "nb_cell1_1.png").is_file()


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
    assert len(attention) == 9 and all(u.startswith("attention") for u in attention)
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

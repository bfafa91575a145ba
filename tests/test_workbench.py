"""The workbench: command help, bench tables and JSON compare, roofline plot, and bad input to the
commands.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cukern import workbench
from cukern.runtime import CukernError
from workbench_helpers import A, B, REPO, _cli, _one_line_error, _result, _run


# ----------------------------------------------------------------------------- --help

@pytest.mark.parametrize("command,words", [
    ("bench", ["--quick", "--json", "--plot", "--kernel", "family"]),
    ("compare", ["A.json", "B.json", "--threshold", "--fail-above", "--json"]),
    ("check", ["--gpu", "--arch", "-k", "--family", "--unit", "--jobs", "--cache-dir", "--no-cache", "--json"]),
    ("info", ["--json"]),
    ("notebooks", ["--run", "--figures", "--write", "--write-to", "--timeout"]),
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
    ["bench", "--kernel", "bwd("],
    ["notebooks", "--run", "--figures", "{good}"],
    ["notebooks", "--run", "--write-to", "{good}"],
    ["notebooks", "--write"],
    ["notebooks", "--write-to", "{tmp}"],
    ["notebooks", "--run", "--timeout", "0"],
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

"""Runtime: sources, archs, compile errors, the CPU compile check, the CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import cukern
from cukern import check, params, runtime

REPO = Path(__file__).resolve().parents[1]


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "cukern", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


def test_source_root_has_common_headers():
    root = runtime.source_root()
    assert (root / "common" / "types.cuh").is_file()
    for spec in cukern.families():
        assert (root / spec.source).is_file(), spec.source
        assert (root / spec.params_header).is_file(), spec.params_header


@pytest.mark.parametrize("text,value", [("sm_90", 90), ("90", 90), (80, 80), ("sm_90a", 90), ("compute_86", 86)])
def test_parse_arch(text, value):
    assert runtime.parse_arch(text) == value


@pytest.mark.parametrize("text", ["sm_75", "sm_70", "hopper", "sm_", ""])
def test_parse_arch_rejects(text):
    with pytest.raises(runtime.UnsupportedArchError):
        runtime.parse_arch(text)


def test_arch_unknown_to_nvrtc():
    with pytest.raises(runtime.UnsupportedArchError, match="unknown to this NVRTC"):
        runtime.compile_ptx("x", "__global__ void k() {}", (), 99)


def test_unknown_family_and_kernel():
    with pytest.raises(runtime.UnknownKernelError, match="unknown family 'nope'"):
        cukern.family("nope")
    with pytest.raises(runtime.UnknownKernelError, match="has no kernel 'nope'"):
        cukern.family("elementwise").kernel("nope")


def test_compile_error_names_file_and_line():
    code = '#include "common/types.cuh"\n__global__ void k(float* y) {\n  y[0] = not_declared;\n}\n'
    with pytest.raises(runtime.CompileError) as info:
        runtime.compile_ptx("broken", code, (), 90)
    msg = str(info.value)
    assert "unit 'broken'" in msg and "sm_90" in msg
    assert "broken.cu(3): error" in msg and "not_declared" in msg


def test_unit_source_hashes_every_header():
    spec = cukern.family("elementwise")
    text = spec.unit_source()
    assert runtime.sources_hash() in text
    assert f'#include "{spec.source}"' in text


def _scratch_sources(tmp_path: Path, kernel: str, header: str) -> Path:
    root = tmp_path / "cuda_src"
    shutil.copytree(runtime.source_root() / "common", root / "common")
    (root / "bad").mkdir()
    (root / "bad" / "params.cuh").write_text(header)
    (root / "bad" / "bad.cu").write_text('#include "bad/params.cuh"\n' + kernel)
    return root


@pytest.fixture
def scratch_root(tmp_path, monkeypatch):
    def make(kernel, header='#pragma once\n#include "common/types.cuh"\nstruct P {\n    uint32_t n;  // count\n};\n'):
        root = _scratch_sources(tmp_path, kernel, header)
        monkeypatch.setenv("CUKERN_SRC", str(root))
        runtime.source_root.cache_clear()
        params.load_header.cache_clear()
        return root
    yield make
    monkeypatch.delenv("CUKERN_SRC")
    runtime.source_root.cache_clear()
    params.load_header.cache_clear()


def test_check_flags_bare_scalar_argument(scratch_root):
    scratch_root('extern "C" __global__ void k(float* y, int n, const P p) { y[0] = n + p.n; }\n')
    spec = runtime.FamilySpec("bad", (runtime.KernelSpec("k", "P"),))
    rows = check.check_family(spec, 90)
    assert len(rows) == 1 and "only device pointers and tensor maps may precede the struct" in rows[0].error


def test_check_flags_wrong_struct_and_undeclared_kernel(scratch_root):
    scratch_root('struct Q { double a; double b; };\n'
                 'extern "C" __global__ void k(float* y, const Q q) { y[0] = q.a; }\n'
                 'extern "C" __global__ void stray(float* y, const P p) { y[0] = p.n; }\n')
    spec = runtime.FamilySpec("bad", (runtime.KernelSpec("k", "P"),))
    rows = {r.kernel: r for r in check.check_family(spec, 90)}
    assert "P is 4 bytes" in rows["k"].error and rows["k"].ptx_size == 16
    assert "not declared" in rows["stray"].error


def test_missing_source_is_a_clear_error(scratch_root):
    scratch_root("")
    spec = runtime.FamilySpec("ghost", (runtime.KernelSpec("k", "P"),))
    with pytest.raises(runtime.CukernError, match="ghost/ghost.cu not found"):
        spec.unit_source()


def test_cukern_src_must_hold_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("CUKERN_SRC", str(tmp_path))
    runtime.source_root.cache_clear()
    try:
        with pytest.raises(runtime.CukernError, match="does not hold cukern's sources"):
            runtime.source_root()
    finally:
        monkeypatch.delenv("CUKERN_SRC")
        runtime.source_root.cache_clear()


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_cli_check_lists_every_kernel(arch):
    r = _cli("check", "--arch", arch)
    assert r.returncode == 0, r.stdout + r.stderr
    for spec in cukern.families():
        for k in spec.kernels:
            assert k.name in r.stdout, k.name
    assert " 0 errors" in r.stdout
    hopper = [line for line in r.stdout.splitlines() if line.split()[1:2] and line.split()[1] in check.sm90a_units()]
    assert hopper and all(line.startswith("sm_90a " if arch == "sm_90" else "sm_80 ") for line in hopper)


def test_cli_check_reports_sm_90a():
    r = _cli("check", "--arch", "sm_90a", "--family", "tokens")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines()[1:] if line.startswith("sm_")]
    assert rows and all(line.startswith("sm_90a ") for line in rows)
    assert "(sm_90a;" in r.stdout


@pytest.mark.parametrize("unit,instructions", [("attention_prefill_wg_f16", ("wgmma.mma_async",)),
                                               ("matmul_f16_q4_0", ("wgmma.mma_async",))])
def test_hopper_units_compile_to_hopper_instructions(unit, instructions):
    """What an sm_90 GPU runs: the Hopper units built for compute_90a hold the wgmma instructions
    (for compute_90 they are stubs), and the check compiles them that way."""
    assert unit in check.sm90a_units()
    spec = cukern.family(unit)
    names = tuple(k.name for k in spec.kernels)
    ptx = runtime.compile_ptx(unit, spec.unit_source(), names, 90, spec.defines, arch_specific=True).ptx
    assert ".target sm_90a" in ptx
    for ins in instructions:
        assert ins in ptx, ins


def test_cli_check_rejects_old_arch():
    r = _cli("check", "--arch", "sm_75")
    assert r.returncode == 2 and "sm_80 or newer" in r.stderr and len(r.stderr.splitlines()) == 1   # a usage error


def test_cli_info_runs_anywhere():
    r = _cli("info")
    assert r.returncode == 0, r.stderr
    for key in ("cupy", "nvrtc", "cuda driver", "kernel cache", "gpu"):
        assert key in r.stdout


def test_cli_help():
    r = _cli("--help")
    assert r.returncode == 0 and "check" in r.stdout and "info" in r.stdout


def test_pdl_launch_structs_match_cuda_h():
    """cuLaunchKernelEx's CUlaunchConfig / CUlaunchAttribute as cuda.h lays them out on 64-bit hosts."""
    import ctypes

    from cukern import dispatch
    assert ctypes.sizeof(dispatch._LaunchAttribute) == 72  # id, pad to 8, a 64-byte value union
    assert dispatch._LaunchAttribute.value.offset == 8
    cfg = dispatch._LaunchConfig
    assert (cfg.shared_mem.offset, cfg.stream.offset, cfg.attrs.offset, cfg.num_attrs.offset) == (24, 32, 40, 48)
    assert ctypes.sizeof(cfg) == 56

"""GPU tests carry ``@pytest.mark.gpu``; without a CUDA device they are skipped with the reason."""

from __future__ import annotations

import functools
import os
import secrets
import zlib

import numpy as np
import pytest

from cukern.models.tiny import TinySpec, write_tiny_gguf
from models_helpers import ARCHS, MIXED, ROPE_VARIANTS


@functools.lru_cache(maxsize=1)
def no_gpu_reason() -> str | None:
    try:
        import cupy
    except ImportError:
        return "no CUDA device: CuPy is not installed"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        return f"no CUDA device ({type(e).__name__}: {first})"
    return None if n > 0 else "no CUDA device (the driver reports 0)"


def pytest_configure(config):
    # Under compute-sanitizer (profiling/device_check.sh) every array gets its own cudaMalloc,
    # so that memcheck catches an access just past an array instead of inside CuPy's pool.
    if os.environ.get("CUKERN_NO_POOL") == "1" and no_gpu_reason() is None:
        import cupy
        cupy.cuda.set_allocator(None)
        cupy.cuda.set_pinned_memory_allocator(None)


def pytest_collection_modifyitems(config, items):
    reason = no_gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# One seed per pytest run, printed in the header and, where a test failed, in the summary (the header is
# hidden under -q): every run draws fresh data and shapes, and `CUKERN_TEST_SEED=<seed> pytest ...`
# replays a run exactly.
RUN_SEED = int(os.environ.get("CUKERN_TEST_SEED") or secrets.randbits(32))


def pytest_report_header(config):
    return f"cukern test seed: CUKERN_TEST_SEED={RUN_SEED}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if terminalreporter.stats.get("failed") or terminalreporter.stats.get("error"):
        terminalreporter.write_line(f"replay with CUKERN_TEST_SEED={RUN_SEED}")


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded from the run's seed and the test's id (a stable hash, unlike ``hash()``)."""
    return np.random.default_rng([RUN_SEED, zlib.crc32(request.node.nodeid.encode())])


@pytest.fixture
def host_if_no_gpu(monkeypatch):
    """For tests of what a dispatch rejects before it launches: on a machine without a GPU, the real
    dispatch layer runs over host-backed arrays with launches recorded, not made
    (tests/host_dispatch.py), so the checks run on the CPU too. Returns the launch counter (None on
    a GPU, where everything is real)."""
    if no_gpu_reason() is None:
        return None
    import host_dispatch
    return host_dispatch.patch(monkeypatch, array_methods=True)


# ------------------------------------------------ tiny GGUF models of the cukern.models tests (test_models*.py)

@pytest.fixture(scope="module")
def attn():
    """One AttentionDispatch for a module's attention tests (cupy needed: the modules import-skip without it)."""
    from cukern.attention import AttentionDispatch
    return AttentionDispatch()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    """arch -> path of a 2-layer random model with mixed block types."""
    return {a: write_tiny_gguf(tiny_dir / f"{a}.gguf", TinySpec(a, types=MIXED), seed=i)
            for i, a in enumerate(ARCHS)}


@pytest.fixture(scope="module")
def tiny_rope(tiny_dir):
    return {k: write_tiny_gguf(tiny_dir / f"{k}.gguf", spec, seed=11) for k, spec in ROPE_VARIANTS.items()}

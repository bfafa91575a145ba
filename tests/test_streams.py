"""Streams, event timing and graph capture."""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern import streams  # noqa: E402


def test_resolve_stream_rejects_other_objects():
    for bad in (object(), 1.0, True, -1, "0"):
        with pytest.raises(TypeError, match="stream must be"):
            streams.resolve_stream(bad)


def test_resolve_stream_wraps_handles_and_torch_streams(monkeypatch):
    """A raw cudaStream_t (int) or a torch.cuda.Stream (its cuda_stream handle, on its device) becomes a
    CuPy stream over the same handle (Stream.from_external, through the CUDA stream protocol), made once
    per (handle, device)."""
    made = []

    class External:  # what cupy.cuda.Stream.from_external makes, without a driver
        def __init__(self, handle, device_id):
            self.ptr, self.device_id = handle, device_id
            made.append(self)

    class TorchLike:  # what torch.cuda.Stream offers
        cuda_stream = 0x5000
        device = type("device", (), {"index": 1})()

    assert streams._Handle(0x77).__cuda_stream__() == (0, 0x77)
    monkeypatch.setattr(streams, "_wrap_handle", External)
    monkeypatch.setattr(streams, "_EXTERNAL", {})
    a = streams.resolve_stream(0x1234)
    assert (a.ptr, a.device_id) == (0x1234, -1)
    assert streams.resolve_stream(np.int64(0x1234)) is a and len(made) == 1
    b = streams.resolve_stream(TorchLike())
    assert (b.ptr, b.device_id) == (0x5000, 1)
    assert streams.resolve_stream(0).ptr == 0
    with pytest.raises(TypeError, match="stream must be"):
        streams.resolve_stream(-1)


@pytest.mark.gpu
def test_event_timer_and_benchmark():
    from cukern.elementwise import ElementwiseDispatch
    d = ElementwiseDispatch()
    a = cupy.random.standard_normal(1 << 22, dtype=cupy.float32)
    out = cupy.empty_like(a)
    s = cupy.cuda.Stream(non_blocking=True)
    with streams.EventTimer(s) as t:
        for _ in range(5):
            d.scale(a, out, alpha=2.0, stream=s)
    assert t.ms > 0
    timing = streams.benchmark(lambda: d.scale(a, out, alpha=2.0), n_warmup=2, n_repeat=5)
    assert timing.median_ms > 0 and timing.min_ms <= timing.median_ms


@pytest.mark.gpu
def test_graph_replay_matches_eager(rng):
    """Capture rms_norm -> add_scaled -> scale into a graph; replaying it on fresh inputs written
    into the same buffers gives bit-identical results to running the dispatches eagerly."""
    from cukern.elementwise import ElementwiseDispatch
    d = ElementwiseDispatch()
    rows, cols = 7, 1030
    x = cupy.empty((rows, cols), cupy.float32)
    w = cupy.empty(cols, cupy.float32)
    h = cupy.empty((rows, cols), cupy.float32)
    y = cupy.empty((rows, cols), cupy.float32)
    z = cupy.empty((rows, cols), cupy.float32)

    def step(stream):
        d.rms_norm(x, w, y, eps=1e-5, stream=stream)
        d.add_scaled(h, y, z, alpha=0.5, stream=stream)
        d.scale(z, z, alpha=3.0, stream=stream)

    def fill():
        x.set(rng.standard_normal((rows, cols), dtype=np.float32))
        w.set(rng.standard_normal(cols, dtype=np.float32))
        h.set(rng.standard_normal((rows, cols), dtype=np.float32))

    s = cupy.cuda.Stream(non_blocking=True)
    d.load()  # compile outside the capture
    graph = streams.capture_graph(step, stream=s)
    for _ in range(3):
        with s:  # inputs and poison on s itself: a non-blocking stream does not wait for the default one
            fill()
            y.fill(np.nan)
            z.fill(np.nan)
            step(s)
            eager = z.get()
            y.fill(np.nan)
            z.fill(np.nan)
            graph.replay()
            replayed = z.get()
        assert not np.isnan(replayed).any()
        assert np.array_equal(eager, replayed)


@pytest.mark.gpu
def test_capture_rejects_default_stream():
    with pytest.raises(ValueError, match="non-default stream"):
        streams.capture_graph(lambda s: None, stream=cupy.cuda.Stream.null)


@pytest.mark.gpu
def test_dispatch_on_a_torch_stream_and_a_raw_handle():
    """stream= a torch.cuda.Stream or its raw handle: the launch is ordered on that stream."""
    torch = pytest.importorskip("torch", reason="the torch stream test needs torch")
    from cukern.elementwise import ElementwiseDispatch
    d = ElementwiseDispatch()
    a = cupy.random.standard_normal(1 << 20, dtype=cupy.float32)
    cupy.cuda.Device().synchronize()
    for make in (lambda s: s, lambda s: s.cuda_stream):
        s = torch.cuda.Stream()
        out = cupy.full_like(a, np.nan)
        d.scale(a, out, alpha=3.0, stream=make(s))
        s.synchronize()
        assert cupy.allclose(out, 3.0 * a)

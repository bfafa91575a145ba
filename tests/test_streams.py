"""Streams, event timing and graph capture."""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cukern import streams  # noqa: E402


def test_resolve_stream_rejects_other_objects():
    with pytest.raises(TypeError, match="stream must be"):
        streams.resolve_stream(object())
    with pytest.raises(TypeError, match="stream must be"):
        streams.resolve_stream(0)


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

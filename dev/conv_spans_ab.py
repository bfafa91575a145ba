"""Probe: conv1d_silu_in_place at 8192 x 8192 (K 4, ring) with at most 32, 16 or 8 spans a block, against
the out-of-place kernel. Delete once concluded."""
import cupy
from cupyx.profiler import benchmark
import cukern.elementwise.ssm as ssm
from cukern.elementwise import ElementwiseDispatch

d, rng = ElementwiseDispatch(), cupy.random.default_rng(0)
n, c = 8192, 8192
x = rng.standard_normal((n, c), dtype=cupy.float32)
xs = [x.copy() for _ in range(4)]
y = cupy.empty_like(x)
w = rng.standard_normal((c, 4), dtype=cupy.float32) * 0.25  # repeated in place: values stay bounded
st = rng.standard_normal((3, c), dtype=cupy.float32)
for rnd in range(2):
    t = benchmark(lambda: d.conv1d_silu(x, st, w, y, state_offset=1), n_repeat=50, n_warmup=5)
    print(f"out of place: {t.gpu_times.mean() * 1e6:.1f} us", flush=True)
    for cap in (32, 16, 8):
        ssm._CONV_IP_SPANS = cap
        i = [0]
        def f():
            i[0] = (i[0] + 1) % 4
            d.conv1d_silu(xs[i[0]], st, w, xs[i[0]], state_offset=1)
        t = benchmark(f, n_repeat=50, n_warmup=5)
        print(f"in place, <= {cap} spans: {t.gpu_times.mean() * 1e6:.1f} us", flush=True)

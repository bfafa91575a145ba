"""Probe: conv1d_silu_in_place at 8192 x 8192 (K 4, ring) with at most 32 or 16 spans a block, against the
out-of-place kernel, each in-place call on a fresh random buffer (repeated in place, the values decay to
denormals and the division's slow path). Delete once concluded."""
import cupy
import cukern.elementwise.ssm as ssm
from cukern.elementwise import ElementwiseDispatch

d, rng = ElementwiseDispatch(), cupy.random.default_rng(0)
n, c, reps = 8192, 8192, 24
xs = [rng.standard_normal((n, c), dtype=cupy.float32) for _ in range(reps)]
y = cupy.empty((n, c), cupy.float32)
w = rng.standard_normal((c, 4), dtype=cupy.float32) * 0.5
st = rng.standard_normal((3, c), dtype=cupy.float32)
ev = [cupy.cuda.Event() for _ in range(2)]


def timed(fn):
    ts = []
    for i in range(reps):
        ev[0].record()
        fn(i)
        ev[1].record()
        ev[1].synchronize()
        ts.append(cupy.cuda.get_elapsed_time(ev[0], ev[1]) * 1e3)
    return sorted(ts)[reps // 2]


for rnd in range(2):
    print(f"out of place: {timed(lambda i: d.conv1d_silu(xs[i], st, w, y, state_offset=1)):.1f} us", flush=True)
    for cap in (32, 16):
        for x in xs:
            rng.standard_normal(out=x, dtype=cupy.float32)
        ssm._CONV_IP_SPANS = cap
        print(f"in place, <= {cap} spans: {timed(lambda i: d.conv1d_silu(xs[i], st, w, xs[i], state_offset=1)):.1f} us",
              flush=True)

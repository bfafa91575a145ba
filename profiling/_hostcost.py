import time, cupy
from cukern.matmul import MatmulDispatch
from profiling.bench_matmul import random_weight_device
mm = MatmulDispatch(); rng = cupy.random.default_rng(0)
for name, m, k, n in [("Q8_0", 4096, 4096, 512), ("Q4_K", 14336, 4096, 512)]:
    w = random_weight_device(name, m, k, rng)
    b = rng.standard_normal((n, k), dtype=cupy.float32).astype(cupy.float16)
    d = cupy.empty((n, m), cupy.float32)
    for _ in range(3): mm.gemm(w, b, d)
    cupy.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(50): mm.gemm(w, b, d)
    host = (time.perf_counter() - t) / 50 * 1e6
    cupy.cuda.Device().synchronize()
    g = (time.perf_counter() - t) / 50 * 1e6
    print(f"{name} {m}x{k} N={n}: host {host:.1f} us/call, wall {g:.1f} us/call, plan {mm._wgr_plan(n, -(-m // 128), k, True)}")

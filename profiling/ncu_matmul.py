"""One quantized GEMM launch to profile with Nsight Compute, e.g.

    ncu --kernel-name regex:gemm --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        --section WarpStateStats python profiling/ncu_matmul.py Q4_K 14336 4096 2048 [f16|q8]
"""

from __future__ import annotations

import sys

import cupy

from cukern.matmul import MatmulDispatch
from profiling.bench_matmul import random_weight_device


def main(argv=None) -> int:
    args = (argv if argv is not None else sys.argv[1:]) + [None] * 5
    name, m, k, n, path = args[0] or "Q4_K", int(args[1] or 14336), int(args[2] or 4096), int(args[3] or 2048), args[4] or "f16"
    mm = MatmulDispatch()
    w = random_weight_device(name, m, k, cupy.random.default_rng(0))
    b = cupy.random.default_rng(1).standard_normal((n, k), dtype=cupy.float32)
    d = cupy.empty((n, m), cupy.float32)
    if path == "q8":
        qa = cupy.empty((n, k // 32 * 36), cupy.uint8)
        mm.quantize_q8_1(b, qa)
        run = lambda: mm.gemm_q8(w, qa, d)  # noqa: E731
    else:
        b16 = b.astype(cupy.float16)
        run = lambda: mm.gemm(w, b16, d)  # noqa: E731
    for _ in range(4):
        run()
    cupy.cuda.get_current_stream().synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())

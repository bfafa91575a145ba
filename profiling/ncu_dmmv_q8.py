"""One dmmv_q8 launch (Q4_K 14336x4096) for ncu: python profiling/ncu_dmmv_q8.py under
ncu --kernel-name regex:dmmv_q8 --launch-skip 3 --launch-count 1 ..."""
import cupy

from cukern.dmmv import DmmvDispatch
from profiling.bench_dmmv import _weights

d = DmmvDispatch()
(sets, nxt), _ = _weights(12, 14336, 4096)
x = cupy.random.standard_normal(4096, dtype=cupy.float32)
y = cupy.empty(14336, cupy.float32)
for _ in range(5):
    d.dmmv(nxt(), x, y)
cupy.cuda.Device().synchronize()

"""Probe: bwd_dkdv with 4 warps (64-key tiles) against 8 warps (128-key tiles), the bench_attention backward
rows in turns, twice each. Delete once concluded."""
import sys
sys.path.insert(0, "profiling")
import bench_attention
from cukern.attention import backward

for kw in (4, 8, 4, 8):
    backward._DKDV_WARPS = kw
    print(f"--- bwd_dkdv {kw} warps", flush=True)
    bench_attention.main(["--kernel", "^varlen bwd"])

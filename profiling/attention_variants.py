"""Prefill block shapes compared in one GPU run: each variant is a copy of cuda_src/ whose PrefillShape
constants for head_dim <= 128 are replaced (MT, BN, KC, WARPS, MIN_BLOCKS), compiled in its own process
(CUKERN_SRC), checked against torch SDPA on a ragged varlen batch, then timed on the bench's
prefill row (B4 L4096 32/32 D128 causal, paged) beside torch's flash backend. Scratch tool for tuning.

Run: PYTHONPATH=. python profiling/attention_variants.py [name ...]
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
VARIANTS = {
    "w4_mt2_bn64_kc32": {},
    "w4_mt2_bn64_kc64": {"KC": "BN"},
    "w4_mt1_bn32_b4": {"MT": "1", "BN": "32", "MIN_BLOCKS": "4"},
    "w4_mt1_bn32_b3": {"MT": "1", "BN": "32", "MIN_BLOCKS": "3"},
    "w8_mt1_bn64_kc64_b1": {"WARPS": "8", "MT": "1", "BN": "64", "KC": "BN"},
    "w8_mt1_bn64_kc32_b2": {"WARPS": "8", "MT": "1", "BN": "64", "MIN_BLOCKS": "2"},
}


def make_tree(name: str, subs: dict[str, str], base: pathlib.Path) -> pathlib.Path:
    tree = base / name
    shutil.copytree(ROOT / "cuda_src", tree)
    f = tree / "attention" / "prefill.cuh"
    s = f.read_text()
    for key, val in subs.items():
        s, n = re.subn(rf"(static constexpr int {key} = )([^;]*);",
                       lambda m: f"{m.group(1)}D <= 128 ? ({val}) : ({m.group(2)});", s, count=1)
        assert n == 1, key
    f.write_text(s)
    return tree


CHILD = r"""
import math, sys, cupy, numpy as np, torch, torch.nn.functional as F
import cukern.attention as A
subs = eval(sys.argv[1])
warps = int(subs.get("WARPS", 4)); mt = int(subs.get("MT", 2)); bn = int(subs.get("BN", 64))
old = A._prefill_shape
def shape(d):
    if d > 128:
        return old(d)
    bm = 16 * mt * warps
    return 32 * warps, bm, (bm + 4 * bn) * (d + 8) * 2
A._prefill_shape = shape
attn = A.AttentionDispatch()
# correctness: ragged causal varlen against torch SDPA (f32 math)
rng = np.random.default_rng(0)
lens = [1, 63, 64, 65, 300, 777]
cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
n, h, d = int(cu[-1]), 4, 128
q, k, v = (rng.standard_normal((n, h, d)).astype(np.float16) for _ in range(3))
out = cupy.full((n, h, d), np.nan, cupy.float16)
attn.flash_attn_varlen(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), cupy.asarray(cu), cupy.asarray(cu), out,
                       max_seqlen_q=max(lens), causal=True)
err = 0.0
for i, L in enumerate(lens):
    sl = slice(cu[i], cu[i + 1])
    t = [torch.tensor(x[sl], dtype=torch.float32).transpose(0, 1) for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*t, is_causal=True).transpose(0, 1).numpy()
    err = max(err, float(np.abs(cupy.asnumpy(out[sl]).astype(np.float32) - ref).max()))
import importlib.util, pathlib
spec = importlib.util.spec_from_file_location("b", "profiling/bench_attention.py")
b = importlib.util.module_from_spec(spec); spec.loader.exec_module(b)
crng = cupy.random.default_rng(0)
r = b._tc_rows("prefill paged f16", b._prefill_fn(attn, crng, 4, 4096, 32, 32, 128), 4, 4096, 32, 32, 128, True)
print(f"RESULT max|err| {err:.2e}  {r.us:8.1f} us {r.tflops:6.1f} TFLOP/s  flash {r.peer_us:8.1f} us "
      f"{r.peer_us / r.us:.3f}x", flush=True)
"""


def main(argv: list[str]) -> int:
    names = argv or list(VARIANTS)
    base = pathlib.Path(tempfile.mkdtemp(prefix="cukern-variants-"))
    for name in names:
        tree = make_tree(name, VARIANTS[name], base)
        env = dict(os.environ, CUKERN_SRC=str(tree))
        res = subprocess.run([sys.executable, "-c", CHILD, repr(VARIANTS[name])], env=env, cwd=ROOT,
                             capture_output=True, text=True)
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT")]
        print(f"{name:24s} " + (lines[-1][7:] if lines else "FAILED\n" + res.stderr[-2000:]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A/B of the varlen backward's bwd_dkdv variants (issue 37): the default kernel (32-row steps, scalar f32 dQ
atomics) against ``dkdv_rows=64`` and ``dq_vector_atomics=True`` (sm_90 only) and both, timed in turns over two
rounds at B 4 x L 4096, 32 heads, D 128, f16, causal and full; torch SDPA's flash backward beside them where
torch is importable. Each variant's dQ, dK, dV are checked against the default kernel's on the same inputs
(max |a - b| / max |b| per gradient: dQ differs in its last bits between any two runs, the atomics' order; a
wrong kernel shows up as errors far above 1e-3).

    PYTHONPATH=. python dev/bwd_ab.py                 # both masks, 2 rounds
    PYTHONPATH=. python dev/bwd_ab.py --causal-only --rounds 3

Times: CUDA events around ``--repeat`` calls after ``--warmup`` calls, the best of the round's repeats' mean
(inputs stay resident: the whole backward reads them several times anyway). FLOPs: traffic.attention_backward_flops
(2.5x the forward's; half of the full count when causal).
"""

from __future__ import annotations

import argparse

import cupy
import numpy as np

from cukern import traffic
from cukern.attention import AttentionDispatch

try:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # the A/B of our variants still runs
    torch = None


def _time_us(fn, warmup: int, repeat: int, batches: int = 3) -> float:
    """Best over `batches` of the mean time of `repeat` calls (CUDA events on the current stream)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(batches):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        for _ in range(repeat):
            fn()
        b.record()
        b.synchronize()
        best = min(best, cupy.cuda.get_elapsed_time(a, b) * 1e3 / repeat)
    return best


def _torch_time_us(fn, warmup: int, repeat: int, batches: int = 3) -> float:
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(batches):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(repeat):
            fn()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / repeat)
    return best


def _variants(attn: AttentionDispatch, d: int) -> dict:
    """name -> flash_attn_varlen_backward keywords of the variants this device runs."""
    out = {"default": {}}
    if attn._dkdv_fits(d, 8, 64):
        out["rows64"] = dict(dkdv_rows=64)
    if attn._units["attention_bwd_f16"].is_sm90():
        out["red4"] = dict(dq_vector_atomics=True)
        if "rows64" in out:
            out["rows64+red4"] = dict(dkdv_rows=64, dq_vector_atomics=True)
    return out


def _max_rel(a: cupy.ndarray, b: cupy.ndarray) -> float:
    a, b = a.astype(cupy.float32), b.astype(cupy.float32)
    return float(cupy.abs(a - b).max() / max(float(cupy.abs(b).max()), 1e-30))


def ab(attn, b, L, h, hk, d, causal, rounds, warmup, repeat, seed=0):
    rng = cupy.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((b * L, n, d), dtype=cupy.float32).astype(cupy.float16)
                   for n in (h, hk, hk, h))
    cu = cupy.asarray(np.arange(b + 1, dtype=np.int32) * L)
    out, lse = cupy.empty_like(q), cupy.empty((b * L, h), cupy.float32)
    attn.flash_attn_varlen(q, k, v, cu, cu, out, max_seqlen_q=L, causal=causal, lse=lse)
    variants = _variants(attn, d)
    grads = {name: dict(dq=cupy.empty_like(q), dk=cupy.empty_like(k), dv=cupy.empty_like(v),
                        delta=cupy.empty_like(lse), dq_accum=cupy.empty(q.shape, cupy.float32))
             for name in variants}

    def call(name):
        attn.flash_attn_varlen_backward(do, q, k, v, out, lse, cu, cu, L, L, causal=causal, **grads[name],
                                        **variants[name])

    flops = traffic.attention_backward_flops(b, h, L, d, causal)
    shape = f"B{b} L{L} H{h}/{hk} D{d} f16 {'causal' if causal else 'full'}"
    # correctness first: every variant's gradients against the default kernel's
    for name in variants:
        call(name)
    cupy.cuda.runtime.deviceSynchronize()
    base = grads["default"]
    for name in variants:
        if name != "default":
            errs = {g: _max_rel(grads[name][g], base[g]) for g in ("dq", "dk", "dv")}
            bad = any(not np.isfinite(e) or e > 1e-2 for e in errs.values())
            print(f"check {shape} {name:12s} vs default: " + ", ".join(f"{g} {e:.2e}" for g, e in errs.items())
                  + ("  <-- MISMATCH" if bad else ""), flush=True)

    peer = None
    if torch is not None:
        tq, tk, tv = (torch.randn(b, n, L, d, device="cuda", dtype=torch.float16).requires_grad_()
                      for n in (h, hk, hk))
        tdo = torch.randn(b, h, L, d, device="cuda", dtype=torch.float16)
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                tout = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, enable_gqa=hk != h)
            peer = lambda: torch.autograd.grad(tout, (tq, tk, tv), tdo, retain_graph=True)  # noqa: E731
        except RuntimeError as e:
            print(f"note: torch SDPA flash forward failed ({e}); no peer")

    for r in range(rounds):
        sdpa_us = _torch_time_us(peer, warmup, repeat) if peer else None
        if sdpa_us:
            print(f"round {r} {shape} {'SDPA flash bwd':14s} {sdpa_us:10,.1f} us {flops / sdpa_us / 1e6:7.1f} TFLOP/s",
                  flush=True)
        for name in variants:
            us = _time_us(lambda: call(name), warmup, repeat)
            ratio = f"  {sdpa_us / us:.2f}x SDPA flash" if sdpa_us else ""
            print(f"round {r} {shape} {name:14s} {us:10,.1f} us {flops / us / 1e6:7.1f} TFLOP/s{ratio}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--causal-only", action="store_true")
    ap.add_argument("--shape", default="4,4096,32,32,128", help="B,L,H,HK,D (default 4,4096,32,32,128)")
    args = ap.parse_args()
    b, L, h, hk, d = (int(x) for x in args.shape.split(","))
    attn = AttentionDispatch()
    dev = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    print(f"device: {dev['name'].decode()}; variants: {', '.join(_variants(attn, d))}; torch: "
          f"{torch.__version__ if torch is not None else 'absent'}", flush=True)
    for causal in (True,) if args.causal_only else (True, False):
        ab(attn, b, L, h, hk, d, causal, args.rounds, args.warmup, args.repeat)


if __name__ == "__main__":
    main()

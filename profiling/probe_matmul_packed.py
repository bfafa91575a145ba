"""Experiment: would gemm_wgr be faster on weights repacked once at load into the layout of its A
fragments (cuda_src/matmul/packed_wgr.cuh: each lane's quants of a stage contiguous, the scales
precomputed as f16; stored tile-major, so that one bulk copy moves a super-stage)? Packs random Q4_K, Q8_0, Q6_K and Q5_0 weights on the host, checks the kernel against the
float64 product of the packed values, then times gemm_wgr on the packed bytes against gemm_wgr on the GGUF
bytes (both 256-token tiles, one K slice) and dequantize + cuBLAS, in turns.

Run: PYTHONPATH=. python profiling/probe_matmul_packed.py   (PROBE_TYPES=Q4_K,Q8_0,Q6_K,Q5_0; PROBE_CASES=MxKxN,...;
PROBE_ROUNDS=4; PROBE_SPLIT=2: K slices of both gemm_wgr paths)
"""
from __future__ import annotations

import os
import sys

import cupy
import numpy as np

from cukern import matmul as M
from cukern.benchmark import rotating, time_graph_us, time_stream_us
from cukern.dispatch import tensor_map_2d
from cukern.matmul import MatmulDispatch
from cukern.runtime import FamilySpec, KernelSpec

sys.path.insert(0, "profiling")
from bench_matmul import random_weight_device

# type -> (packed type code, bytes per row and 256 elements), packed_wgr.cuh's QT_*_WGR
PACKED = {"Q4_K": (112, 160), "Q8_0": (108, 272), "Q6_K": (114, 288), "Q5_0": (106, 272)}


def _kernel(name: str) -> str:
    return f"gemm_wgr<{PACKED[name][0]}, 256, false>"


def _scales_mins(sc12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of Q4_K super-blocks from their 12 packed bytes [..., 12]."""
    q = sc12.astype(np.uint32)
    sc = np.empty(q.shape[:-1] + (8,), np.uint32)
    mn = np.empty_like(sc)
    sc[..., :4] = q[..., 0:4] & 63
    mn[..., :4] = q[..., 4:8] & 63
    sc[..., 4:] = (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return sc, mn


def pack_q4k(raw: np.ndarray, m: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q4_K bytes of an m x k matrix -> (the packed bytes [m, k / 256 * 160], the f16 values the kernel
    computes from them [m, k])."""
    nb = k // 256
    blk = raw.reshape(m, nb, 144)
    d = blk[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = blk[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    sc, mn = _scales_mins(blk[..., 4:16])
    s16 = (d[..., None] * sc).astype(np.float16)        # [m, nb, 8], d * sc exact in f32, rounded once
    nm16 = (-(dmin[..., None] * mn)).astype(np.float16)
    qs = blk[..., 16:144].reshape(m, nb, 4, 32)
    v = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.uint32)  # [m, nb, st, 64]: stage elements
    out = np.empty((m, nb, 160), np.uint8)
    words = np.zeros((m, nb, 4, 4, 2), np.uint32)  # [st, lane c, word h]
    for c in range(4):
        for j in range(8):
            e0 = 8 * j + 2 * c
            words[..., c, j // 4] |= (v[..., e0] << (4 * (j % 4))) | (v[..., e0 + 1] << (16 + 4 * (j % 4)))
    out[..., :128] = words.reshape(m, nb, 32).view(np.uint8).reshape(m, nb, 128)
    pairs = np.stack([s16, nm16], axis=-1)  # [m, nb, 8, 2] f16: (s, -m) per sub-block
    out[..., 128:] = pairs.view(np.uint8).reshape(m, nb, 32)
    # values: f16(q s - m), one rounding (the kernel's fma); sub-block of stage element e: 2 st + (e >= 32)
    q = v.reshape(m, nb, 4, 2, 32).astype(np.float64)
    vals = q * s16.reshape(m, nb, 4, 2, 1).astype(np.float64) + nm16.reshape(m, nb, 4, 2, 1).astype(np.float64)
    return out.reshape(m, -1), vals.astype(np.float16).reshape(m, k)


def _lane_bytes(v: np.ndarray) -> np.ndarray:
    """Stage elements [..., 4, 64] (one byte each) -> [..., 256] bytes: stage st, lane c, then pairs 8 j + 2 c
    (+1), j = 0..7, in order (FragDeqPacked8's words)."""
    order = np.array([[8 * j + 2 * c + e for j in range(8) for e in (0, 1)] for c in range(4)]).reshape(-1)
    return v[..., order].reshape(v.shape[:-2] + (256,))


def pack_q8_0(raw: np.ndarray, m: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q8_0 bytes -> (packed [m, k / 256 * 272], the f16 values q d)."""
    nb = k // 256
    blk = raw.reshape(m, nb, 8, 34)
    d = blk[..., 0:2].copy().view(np.float16)[..., 0]  # [m, nb, 8]
    q = blk[..., 2:34].copy().view(np.int8)            # [m, nb, 8, 32]
    out = np.empty((m, nb, 272), np.uint8)
    out[..., :256] = _lane_bytes((q.view(np.uint8) ^ 0x80).reshape(m, nb, 4, 64))
    out[..., 256:] = d.view(np.uint8).reshape(m, nb, 16)
    vals = (q.astype(np.float64) * d[..., None].astype(np.float64)).astype(np.float16)
    return out.reshape(m, -1), vals.reshape(m, k)


def pack_q5_0(raw: np.ndarray, m: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q5_0 bytes -> (packed [m, k / 256 * 272], the f16 values d (q - 16))."""
    nb = k // 256
    blk = raw.reshape(m, nb, 8, 22)
    d = blk[..., 0:2].copy().view(np.float16)[..., 0]
    qh = blk[..., 2:6].copy().view(np.uint32)  # [m, nb, 8, 1]: bit j is element j's fifth bit
    qs = blk[..., 6:22].astype(np.uint32)
    q = np.concatenate([qs & 15, qs >> 4], axis=-1) | (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4)
    out = np.empty((m, nb, 272), np.uint8)
    out[..., :256] = _lane_bytes(q.astype(np.uint8).reshape(m, nb, 4, 64))
    out[..., 256:] = d.view(np.uint8).reshape(m, nb, 16)
    vals = ((q.astype(np.float64) - 16) * d[..., None].astype(np.float64)).astype(np.float16)
    return out.reshape(m, -1), vals.reshape(m, k)


def pack_q6_k(raw: np.ndarray, m: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q6_K bytes -> (packed [m, k / 256 * 288], the f16 values f16(d sc) (q - 32))."""
    nb = k // 256
    blk = raw.reshape(m, nb, 210)
    ql, qh = blk[..., 0:128].astype(np.uint32), blk[..., 128:192].astype(np.uint32)
    sc = blk[..., 192:208].copy().view(np.int8).astype(np.float32)
    d = blk[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
    q = np.empty((m, nb, 256), np.uint32)
    for n in range(2):
        lo, hi, h = ql[..., 64 * n:64 * n + 32], ql[..., 64 * n + 32:64 * n + 64], qh[..., 32 * n:32 * n + 32]
        q[..., 128 * n:128 * n + 32] = (lo & 0xF) | ((h & 3) << 4)
        q[..., 128 * n + 32:128 * n + 64] = (hi & 0xF) | (((h >> 2) & 3) << 4)
        q[..., 128 * n + 64:128 * n + 96] = (lo >> 4) | (((h >> 4) & 3) << 4)
        q[..., 128 * n + 96:128 * n + 128] = (hi >> 4) | (((h >> 6) & 3) << 4)
    s16 = (d[..., None] * sc).astype(np.float16)  # [m, nb, 16]
    out = np.empty((m, nb, 288), np.uint8)
    out[..., :256] = _lane_bytes(q.astype(np.uint8).reshape(m, nb, 4, 64))
    out[..., 256:] = s16.view(np.uint8).reshape(m, nb, 32)
    vals = ((q.astype(np.float64) - 32).reshape(m, nb, 16, 16) * s16[..., None].astype(np.float64)).astype(np.float16)
    return out.reshape(m, -1), vals.reshape(m, k)


PACKERS = {"Q4_K": pack_q4k, "Q8_0": pack_q8_0, "Q6_K": pack_q6_k, "Q5_0": pack_q5_0}
STRIDE = {"Q4_K": 160, "Q8_0": 320, "Q6_K": 320, "Q5_0": 320}  # RawWgr<QT_*_WGR>::kStride


def tile_major(name: str, packed: np.ndarray, m: int, k: int) -> np.ndarray:
    """Row-major packed bytes [m, k / 256 * B] -> gemm_wgr's tile-major image: per (128-row tile, super-block)
    one chunk of 128 rows x STRIDE bytes (rows past m and the bytes past B zero)."""
    nb, bb, st, mt = k // 256, PACKED[name][1], STRIDE[name], -(-m // 128)
    out = np.zeros((mt * 128, nb, st), np.uint8)
    out[:m, :, :bb] = packed.reshape(m, nb, bb)
    return out.reshape(mt, 128, nb, st).transpose(0, 2, 1, 3).reshape(-1)


def _unit(defines: tuple[str, ...] = ()) -> M._Unit:
    spec = FamilySpec("matmul_packed" + "".join(x.replace("=", "") for x in defines),
                      tuple(KernelSpec(_kernel(t), "GemmParams") for t in PACKED), source="matmul/gemm.cu",
                      params_header="matmul/params.cuh", defines=defines)
    return M._Unit(spec, None, sm90a=True)


def packed_gemm(unit, name: str, w: cupy.ndarray, m: int, k: int, b: cupy.ndarray, d: cupy.ndarray, split: int = 1):
    """d [n, m] f32 = W b^T for the packed W of type name (m rows of k / 256 * PACKED bytes) and f16 b [n, k];
    split > 1: that many K slices (whole super-blocks) adding into d zeroed first."""
    n = b.shape[0]
    k_split = -(-(k // 256) // split) * 256
    if split > 1:
        d.fill(0)
    params = unit.struct("GemmParams").pack(
        w_offset=0, w2_offset=0, row_bytes=k // 256 * PACKED[name][1], b_stride=b.strides[0] // 2, d_stride=m, m=m,
        n=n, k=k, k_split=k_split, mode=0, atomic=int(split > 1), raw16=1)
    return unit._launch(_kernel(name), (-(-n // 256), -(-m // 128), -(-k // k_split)), 384,
                        (d, w, w, tensor_map_2d(b, (64, 256))), params, shared_mem=227 * 1024)


def check(unit, name: str, rng) -> None:
    for m, k, n, split in [(300, 512, 70, 1), (128, 4096, 256, 1), (1000, 1024, 513, 1), (200, 2048, 300, 3)]:
        wq = random_weight_device(name, m, k, rng)
        packed, vals = PACKERS[name](wq.buf.get(), m, k)
        packed = tile_major(name, packed, m, k)
        b = rng.standard_normal((n, k), dtype=cupy.float32).astype(cupy.float16)
        d = cupy.full((n, m), cupy.nan, cupy.float32)
        packed_gemm(unit, name, cupy.asarray(packed), m, k, b, d, split)
        want = b.get().astype(np.float64) @ vals.astype(np.float64).T
        err = float(np.abs(d.get() - want).max() / np.abs(want).max())
        # the GGUF values themselves: how far the packed f16 values are from the exact dequantization
        gguf = cupy.empty((m, k), cupy.float16)
        MatmulDispatch().dequantize(wq, gguf)
        werr = float(np.abs(vals.astype(np.float64) - gguf.get().astype(np.float64)).max()
                     / np.abs(gguf.get().astype(np.float64)).max())
        print(f"check {name} {m}x{k} N={n} split {split}: max |err| / max |ref| {err:.2e} (packed values vs dequantize_f16 {werr:.2e})",
              flush=True)
        assert err < 1e-4, "packed gemm_wgr disagrees with its reference"


def main() -> None:
    rng = cupy.random.default_rng(1)
    unit = _unit()
    names = os.environ.get("PROBE_TYPES", "Q4_K,Q8_0,Q6_K,Q5_0").split(",")
    for name in names:
        check(unit, name, rng)
    mm = MatmulDispatch()
    mm.WG_TILE = 256
    cases = [(4096, 4096, 512), (4096, 4096, 2048), (14336, 4096, 2048), (4096, 14336, 2048)]
    if os.environ.get("PROBE_CASES"):
        cases = [tuple(int(v) for v in c.split("x")) for c in os.environ["PROBE_CASES"].split(",")]
    rounds = int(os.environ.get("PROBE_ROUNDS", "4"))
    split = int(os.environ.get("PROBE_SPLIT", "1"))  # K slices of both gemm_wgr paths
    rows = _unit(("CUKERN_WGR_TILED=0",))  # the same layouts row-major, copied row by row (copy_raw)
    for name in names:
        for m, k, n in cases:
            time_case(mm, unit, rows, rng, name, m, k, n, rounds, split)
            cupy.get_default_memory_pool().free_all_blocks()


def time_case(mm, unit, rows, rng, name: str, m: int, k: int, n: int, rounds: int, split: int = 1) -> None:
    """One shape: the four paths over rotating weights (three of each, so that L2 does not serve them)."""
    ws = [random_weight_device(name, m, k, rng) for _ in range(3)]
    packed = [PACKERS[name](w.buf.get(), m, k)[0] for w in ws]
    packs = [cupy.asarray(tile_major(name, p, m, k)) for p in packed]
    packs_rows = [cupy.asarray(p) for p in packed]
    _, nxr = rotating(3, lambda i: packs_rows[i])
    _, nxt = rotating(3, lambda i: ws[i])
    _, nxp = rotating(3, lambda i: packs[i])
    b = rng.standard_normal((n, k), dtype=cupy.float32).astype(cupy.float16)
    d = cupy.empty((n, m), cupy.float32)
    dense, d16 = cupy.empty((m, k), cupy.float16), cupy.empty((n, m), cupy.float16)
    fns = {
        "gemm_wgr GGUF": lambda: time_graph_us(lambda: mm.gemm(nxt(), b, d, wgmma=True, split_k=split),
                                               n_inner=10, n_repeat=5),
        "packed rows": lambda: time_graph_us(lambda: packed_gemm(rows, name, nxr(), m, k, b, d, split), n_inner=10, n_repeat=5),
        "packed tiles": lambda: time_graph_us(lambda: packed_gemm(unit, name, nxp(), m, k, b, d, split), n_inner=10, n_repeat=5),
        "deq+cuBLAS": lambda: time_stream_us(lambda: (mm.dequantize(nxt(), dense), cupy.matmul(b, dense.T, out=d16))),
    }
    times = {key: [] for key in fns}
    for r in range(rounds):
        keys = list(fns)
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            times[key].append(fns[key]())
    med = {key: sorted(t)[len(t) // 2] for key, t in times.items()}
    peer = med["deq+cuBLAS"]
    print(f"{name} {m}x{k} N={n}{f' split {split}' if split > 1 else ''}: " + " | ".join(f"{key} {us:.1f} us ({peer / us:.2f}x peer)" for key, us in med.items()),
          flush=True)


if __name__ == "__main__":
    main()

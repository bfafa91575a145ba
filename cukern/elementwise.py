"""ElementwiseDispatch: norms, activations, RoPE, KV writes, MoE routing and SSM/DeltaNet kernels.

Kernels: ``cuda_src/elementwise/`` (one unit, one header per group); float64 references:
``cukern/reference/elementwise.py``; tests: ``tests/test_elementwise.py``; benchmark:
``profiling/bench_elementwise.py``.

Conventions: activations are f32, row-major, C-contiguous unless a method says otherwise; every
method validates its arguments and raises TypeError/ValueError before any launch; nothing here
synchronises, allocates device memory or reads device values, so every method can be captured in a
CUDA graph. Device-side index arrays (positions, sequence ids, page tables) are int32 and are not
range-checked on the host (that would need a device read): keeping them in range is the caller's
contract, as with FlashInfer's page indices.
"""

from __future__ import annotations

import cupy
import numpy as np

from cukern.dispatch import Dispatch, check_array
from cukern.runtime import FamilySpec, KernelSpec

__all__ = ["ElementwiseDispatch", "FAMILY", "ROPE_FAMILY", "FAMILIES", "Q8_1_BLOCK", "Q8_1_BLOCK_BYTES",
           "ROPE_VEC_HEAD_DIMS", "contiguous_page_table"]

_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)
_KV_TYPES = {np.dtype(np.float16): "__half", np.dtype(np.float32): "float"}
Q8_1_BLOCK = 32         # values per Q8_1 block (cuda_src/common/q8_1.cuh)
Q8_1_BLOCK_BYTES = 36   # bytes per block: half d, half s, int8 qs[32]

# Row-norm register kernels: (threads, float4s per thread); a row of n_cols fits when
# n_cols <= 4 * threads * items. The host takes the first that fits (fewest idle threads).
_REG_CONFIGS = ((64, 4), (128, 4), (256, 4), (512, 4), (1024, 4), (1024, 8))
# Few rows (decode): one float4 per thread and more threads, for a shorter dependent chain per thread.
_REG_CONFIGS_FEW_ROWS = ((64, 1), (128, 1), (256, 1), (512, 1), (1024, 1))
_FEW_ROWS = 132  # fewer rows than this: the GPU is far from full anyway
_LOOP_BLOCK = 256
_REG_KERNELS = ("rms_norm", "residual_rms_norm", "post_norm_residual_rms_norm", "rms_norm_accumulate",
                "residual_rms_norm_q8_1")
_LOOP_KERNELS = ("rms_norm", "residual_rms_norm", "post_norm_residual_rms_norm", "rms_norm_accumulate")

# binary_rows ops (cuda_src/elementwise/activations.cuh, EwOp)
_OP_AXPY, _OP_SCALE, _OP_SIGMOID_MUL, _OP_SWIGLU, _OP_SWIGLU_OAI, _OP_GEGLU = range(6)
_FLAT_BLOCK = 256
_FLAT_MAX_BLOCKS = 4096  # kernels grid-stride beyond
_BINARY_UNROLL = 4  # units per thread and step in binary_rows (BINARY_UNROLL in activations.cuh)
_BINARY_BIG = 1 << 20  # units: from here a thread takes _BINARY_UNROLL units per step
_MAX_GRID_Y = 65535
_MAX_U32 = 2**32 - 1
_MAX_FLAT = 2**31 - 1  # flat kernels index with uint32 plus a grid stride

_ROPE_BLOCK = 256
_ROPE_MAX_HEAD_DIM = 1024
# (pairs per lane, heads per warp task) of the rope kernels: head_dim <= 64 * PPL; more heads per task
# for small heads, so that a warp has several loads in flight
_ROPE_PPL = ((2, 4), (4, 2), (16, 1))
_ROPE_TASKS = 128  # heads per block step (tokens_per_block = ceil(128 / heads per token), <= 8)
_ROPE_MAX_TOKENS = 8
# Vectorised rope kernels (rope_vec.cuh): lanes per head row, head_dim = 8 * LPH; head rows per thread
_ROPE_VEC_LPH = (4, 8, 16, 32)
ROPE_VEC_HEAD_DIMS = tuple(8 * lph for lph in _ROPE_VEC_LPH)  # the vectorised RoPE kernels' head dims
_ROPE_VEC_ROWS = 2  # VEC_ROWS in rope_vec.cuh
# k_norm_rope_kv_vec: consecutive head rows per thread (its ROWS argument): 2, or 1 below _K_ROPE_FEW_ROWS rows,
# where fewer, smaller blocks lose more than the pairs gain (e.g. 16384x8x128 f16: 2 rows; decode 1x8x128: 1;
# docs/notes/elementwise.md)
_K_ROPE_ROWS = (1, 2)
_K_ROPE_FEW_ROWS = 4096
_RESIDENT_ROPE_BLOCKS = 8  # 256-thread blocks per SM (2048 threads)
_RESIDENT_GROUP_BLOCKS = 16  # 128-thread group_norm_reg blocks per SM
_POS_MODES = {"consecutive": 0, "per_token": 1, "mrope": 2, "imrope": 3}
_TOPK_WARPS = 4
_TOPK_MAX_K = 32
_TOPK_EPL = (2, 4, 8)  # experts per lane of softmax_topk_reg: n_experts <= 32 * EPL
_TOPK_MAX_EXPERTS = 2048  # 4 warps x 2048 x 4 B = 32 KiB of shared memory
# softmax_topk_lanes (a group of 8 lanes per token): (V, M) instances, n_experts <= 32 V, n_experts % 4 == 0,
# 16-byte aligned logits, k <= _TOPK_LANES_KMAX; M kept logits per lane: the first M with k <= 4 M. From
# _TOPK_LANES_MIN_TOKENS tokens, where the lanes' parallelism beats a warp per token (e.g. 128 experts, k = 8:
# the warp kernel ahead at 4096 tokens, the lanes 2x at 32768; docs/notes/elementwise.md); the warp kernels
# serve fewer tokens and the other shapes.
_TOPK_LANES_V = (1, 2, 4, 8)
_TOPK_LANES_M = (1, 2, 4)
_TOPK_LANES_KMAX = 16
_TOPK_LANES_TOKENS = 32  # tokens per block (TOPK_L_TOKENS in moe.cuh)
_TOPK_LANES_MIN_TOKENS = 8192
_CONV_CHUNK = 16
_KV_UNROLL = 4  # KV_UNROLL in kv.cuh
_QUANT_UNROLL = 4  # QUANT_UNROLL in norms.cuh
_GROUP_VPL = (1, 2, 8)  # float4s per lane of group_norm_reg: group_size <= 128 * VPL
_GROUPS_PER_BLOCK = 8  # 4 warps x GROUPS_PER_WARP (norms.cuh)
_CONV_K = (2, 3, 4)
_DELTANET_TILED_DK = (64, 128)
_ROUTER_SMALL = (1, 1, 256)  # (experts, tokens, threads) per block below _ROUTER_BATCH tokens
_ROUTER_LARGE = (8, 8, 64)  # fewer threads: each covers more of n_embd before the 64-value reduction
_ROUTER_BATCH = 16
# router_gemm (register-tiled f32 GEMM) from _ROUTER_GEMM_MIN_TOKENS tokens and _ROUTER_GEMM_MIN_EXPERTS experts,
# the tiled matvec below. Example: n_embd 2048, 128 experts, 8192 tokens: the GEMM 129 us against 321 (at 512
# tokens the matvec wins, 25 against 76; docs/notes/elementwise.md).
_ROUTER_GEMM_MIN_TOKENS = 4096
_ROUTER_GEMM_MIN_EXPERTS = 64
_ROUTER_GEMM_TILE = (32, 128, 128)  # (tokens, experts, threads) per block: RG_TOKENS, RG_EXPERTS, RG_THREADS
_ROUTER_GEMM_CONFIGS = ((32, 4),)
_ROUTER_GEMM_STAGES = _ROUTER_GEMM_CONFIGS[0]  # the instance dispatched


def _kernels() -> list[KernelSpec]:
    """Kernels of the first unit, elementwise.cu: norms, activations, MoE routing, SSM/DeltaNet."""
    ks = []
    for name in _REG_KERNELS:
        ks += [KernelSpec(f"{name}_reg<{b}, {i}>", "RmsNormParams") for b, i in _REG_CONFIGS + _REG_CONFIGS_FEW_ROWS]
    ks.append(KernelSpec("quantize_q8_1", "QuantizeParams"))
    ks += [KernelSpec(f"{name}_loop<{_LOOP_BLOCK}>", "RmsNormParams") for name in _LOOP_KERNELS]
    ks += [KernelSpec(f"group_norm<{g}>", "GroupNormParams") for g in ("false", "true")]
    ks += [KernelSpec(f"group_norm_reg<{g}, {v}>", "GroupNormParams") for g in ("false", "true") for v in _GROUP_VPL]
    ks += [KernelSpec(f"binary_rows<{op}, {v}>", "BinaryParams") for op in range(6) for v in ("true", "false")]
    ks.append(KernelSpec("softmax_topk", "TopkParams"))
    ks += [KernelSpec(f"softmax_topk_reg<{e}>", "TopkParams") for e in _TOPK_EPL]
    ks += [KernelSpec(f"softmax_topk_lanes<{v}, {m}>", "TopkParams") for v in _TOPK_LANES_V for m in _TOPK_LANES_M]
    ks += [KernelSpec(f"moe_weighted_sum<{v}>", "MoeSumParams") for v in ("true", "false")]
    ks += [KernelSpec(f"shared_expert_accumulate<{v}>", "SharedGateParams") for v in ("true", "false")]
    ks += [KernelSpec(f"router_matvec<{e}, {t}, {b}>", "RouterParams") for e, t, b in (_ROUTER_SMALL, _ROUTER_LARGE)]
    ks += [KernelSpec(f"router_gemm<{n}, {bk}, {st}>", "RouterParams") for n in ("false", "true")
           for bk, st in _ROUTER_GEMM_CONFIGS]
    ks += [KernelSpec(f"conv1d_silu<{k}>", "ConvParams") for k in _CONV_K]
    ks.append(KernelSpec("deltanet", "DeltaNetParams"))
    ks += [KernelSpec(f"deltanet_tiled<{dk}>", "DeltaNetParams") for dk in _DELTANET_TILED_DK]
    return ks


def _qkv_vec_kernel(kv: str, lph: int, q_out: str) -> str:
    """qk_norm_rope_kv_vec's instance for a cache of C type kv and q_out of C type q_out (float, or kv)."""
    return f"qk_norm_rope_kv_vec<{kv}, true, true, {lph}" + (">" if q_out == "float" else f", {q_out}>")


def _rope_kernels() -> list[KernelSpec]:
    """Kernels of the second unit, rope_kv.cu: RoPE and its fusions, KV writes, deinterleave."""
    ks = [KernelSpec(f"rope<{n}, {ppl}, {g}>", "RopeParams") for n in ("false", "true") for ppl, g in _ROPE_PPL]
    ks += [KernelSpec(f"rope_vec<{n}, {lph}>", "RopeParams") for n in ("false", "true") for lph in _ROPE_VEC_LPH]
    for kv in _KV_TYPES.values():
        ks += [KernelSpec(f"qk_norm_rope_kv<{kv}, {hq}, {ppl}, {g}>", "QkvRopeParams")
               for hq in ("true, true", "false, false") for ppl, g in _ROPE_PPL]
        ks += [KernelSpec(_qkv_vec_kernel(kv, lph, qo), "QkvRopeParams")
               for lph in _ROPE_VEC_LPH for qo in (("float",) if kv == "float" else ("float", kv))]
        ks += [KernelSpec(f"k_norm_rope_kv_vec<{kv}, {lph}, {r}>", "QkvRopeParams")
               for lph in _ROPE_VEC_LPH for r in _K_ROPE_ROWS]
        ks += [KernelSpec(f"kv_write<{kv}, {v}>", "KvWriteParams") for v in ("true", "false")]
    ks += [KernelSpec(f"deinterleave<{v}>", "DeinterleaveParams") for v in ("float", "float4")]
    return ks


FAMILY = FamilySpec(name="elementwise", kernels=tuple(_kernels()))
ROPE_FAMILY = FamilySpec(name="elementwise_rope", kernels=tuple(_rope_kernels()), source="elementwise/rope_kv.cu",
                         params_header="elementwise/params.cuh")
FAMILIES = {f.name: f for f in (FAMILY, ROPE_FAMILY)}  # cukern.families() lists each unit


class _Unit(Dispatch):
    """The second compilation unit, launched through the same checks."""

    def __init__(self, family: FamilySpec, device: int | None = None):
        self.family = family
        super().__init__(device)


def contiguous_page_table(n_seqs: int) -> cupy.ndarray:
    """The page table that makes a contiguous cache ``[n_seqs, capacity, n_kv_heads, head_dim]`` a
    paged one (page_size = capacity, page_table[s] = [s]). Allocates: build it once, at plan time."""
    return cupy.arange(n_seqs, dtype=cupy.int32).reshape(n_seqs, 1)


def _rope_launch(n_tokens: int, heads_per_token: int, head_dim: int, rope_dim: int, sms: int):
    """(tokens_per_block, grid, dynamic shared bytes, "PPL, G" template arguments) of the rope kernels: blocks
    loop over steps of tokens_per_block tokens, at most _RESIDENT_ROPE_BLOCKS per SM of them."""
    tpb = max(1, min(_ROPE_MAX_TOKENS, -(-_ROPE_TASKS // heads_per_token), n_tokens))
    half = rope_dim // 2
    ppl, g = next((p, g) for p, g in _ROPE_PPL if head_dim <= 64 * p)
    grid = min(-(-n_tokens // tpb), sms * _RESIDENT_ROPE_BLOCKS)
    return tpb, grid, 8 * half + 8 * tpb * half, f"{ppl}, {g}"


def _rope_vec_launch(n_rows: int, head_dim: int, rope_dim: int, arrays) -> tuple[int, int] | None:
    """(lanes per head row, grid) of the vectorised rope kernels, or None when they do not apply: they need
    head_dim = 8 * LPH (LPH in _ROPE_VEC_LPH), rope_dim % 8 == 0 and 16-byte aligned arrays."""
    lph = head_dim // 8
    if head_dim % 8 or lph not in _ROPE_VEC_LPH or rope_dim % 8 or not _aligned(*arrays):
        return None
    grid = -(-n_rows // (_ROPE_BLOCK // lph * _ROPE_VEC_ROWS))
    return (lph, grid) if grid <= 2**31 - 1 else None


def _inv_ratio(freq_base: float, rope_dim: int, freqs) -> float:
    """freq_base ** (-2 / rope_dim) in f64 (the kernels raise it to the pair index); unused with freqs."""
    return 1.0 if freqs is not None else float(freq_base) ** (-2.0 / rope_dim)


def _aligned(*arrays) -> bool:
    return all(a.data.ptr % 16 == 0 for a in arrays)


def _vec(ok: bool) -> str:
    return "true" if ok else "false"


def _flat_grid(units: int) -> int:
    return max(1, min(-(-units // _FLAT_BLOCK), _FLAT_MAX_BLOCKS))


def _check_eps(eps, what):
    if not eps >= 0:
        raise ValueError(f"{what}: eps must be >= 0, got {eps}")


def _check_disjoint(what, writes: dict, reads: dict) -> None:
    """Raise when an array the kernel writes overlaps another written or read one (reads may alias)."""
    w = [(n, a) for n, a in writes.items() if a is not None]
    r = [(n, a) for n, a in reads.items() if a is not None]
    for i, (n1, a1) in enumerate(w):
        for n2, a2 in w[i + 1:] + r:
            if a1.data.ptr < a2.data.ptr + a2.nbytes and a2.data.ptr < a1.data.ptr + a1.nbytes:
                raise ValueError(f"{what}: {n1} and {n2} must not overlap")


def _check_distinct(what, **arrays):
    """Raise when two named arrays share memory that the kernel reads and writes separately."""
    items = [(n, a) for n, a in arrays.items() if a is not None]
    for i, (n1, a1) in enumerate(items):
        lo1, hi1 = a1.data.ptr, a1.data.ptr + a1.nbytes
        for n2, a2 in items[i + 1:]:
            lo2, hi2 = a2.data.ptr, a2.data.ptr + a2.nbytes
            if lo1 < hi2 and lo2 < hi1:
                raise ValueError(f"{what}: {n1} and {n2} must not overlap")


class ElementwiseDispatch(Dispatch):
    """Records elementwise kernels into a stream. Every method takes ``stream=`` (None: CuPy's
    current stream), validates its arguments before launching, and returns its main output.

    ``pdl`` (default False; sm_90+) launches every kernel with programmatic dependent launch: each
    waits for the previous kernel in the stream first thing (``pdl_enter`` in common/pdl.cuh), so
    its launch and block start-up overlap that kernel's tail, as in a model's decode step."""

    family = FAMILY
    _ROPE_KERNELS = frozenset(k.name for k in ROPE_FAMILY.kernels)

    def __init__(self, device: int | None = None, *, pdl: bool = False):
        super().__init__(device)
        self.pdl = bool(pdl)
        self._rope_unit = _Unit(ROPE_FAMILY, device)

    def _launch(self, kernel, grid, block, pointers, params, *, stream=None, shared_mem=0):
        unit = self._rope_unit if kernel in self._ROPE_KERNELS else super()
        unit._launch(kernel, grid, block, pointers, params, stream=stream, shared_mem=shared_mem, pdl=self.pdl)

    # ------------------------------------------------------------------------------------------ norms

    def _rows(self, x, name="x"):
        check_array(name, x, dtype=_F32, ndim=2)
        n_rows, n_cols = x.shape
        if n_rows == 0 or n_cols == 0:
            raise ValueError(f"{name} must be non-empty, got shape {x.shape}")
        if n_rows > 2**31 - 1:
            raise ValueError(f"{name}: at most 2**31 - 1 rows, got {n_rows}")
        return n_rows, n_cols

    def _norm_params(self, n_rows, n_cols, eps, weight_offset, what):
        _check_eps(eps, what)
        return self.struct("RmsNormParams").pack(n_rows=n_rows, n_cols=n_cols, eps=eps, weight_offset=weight_offset)

    @staticmethod
    def _reg_config(n_rows: int, n_cols: int, arrays) -> tuple[int, int] | None:
        """(threads, items) of the register kernel for this row width, or None for the loop fallback."""
        if n_cols % 4 or not _aligned(*arrays):
            return None
        n4 = n_cols // 4
        configs = (_REG_CONFIGS_FEW_ROWS + _REG_CONFIGS) if n_rows < _FEW_ROWS else _REG_CONFIGS
        for block, items in configs:
            if n4 <= block * items:
                return block, items
        return None

    def _row_norm(self, name, n_rows, n_cols, arrays, params, stream, q8=False):
        cfg = self._reg_config(n_rows, n_cols, arrays)
        if cfg is None:
            if q8:
                raise ValueError(f"{name}: needs n_cols % 4 == 0, 16-byte aligned arrays and n_cols <= "
                                 f"{4 * _REG_CONFIGS[-1][0] * _REG_CONFIGS[-1][1]}, got n_cols={n_cols}")
            self._launch(f"{name}_loop<{_LOOP_BLOCK}>", n_rows, _LOOP_BLOCK, arrays, params, stream=stream)
        else:
            block, items = cfg
            self._launch(f"{name}_reg<{block}, {items}>", n_rows, block, arrays, params, stream=stream)

    def rms_norm(self, x: cupy.ndarray, w: cupy.ndarray, out: cupy.ndarray, *, eps: float = 1e-6,
                 weight_offset: float = 0.0, stream=None) -> cupy.ndarray:
        """``out = x * rsqrt(mean(x**2, axis=-1) + eps) * (w + weight_offset)``.

        x: [n_rows, n_cols] f32; w: [n_cols] f32; out: [n_rows, n_cols] f32 (may be x)."""
        n_rows, n_cols = self._rows(x)
        check_array("w", w, dtype=_F32, shape=(n_cols,))
        check_array("out", out, dtype=_F32, shape=(n_rows, n_cols))
        params = self._norm_params(n_rows, n_cols, eps, weight_offset, "rms_norm")
        self._row_norm("rms_norm", n_rows, n_cols, (out, x, w), params, stream)
        return out

    def residual_rms_norm(self, x: cupy.ndarray, residual: cupy.ndarray, w: cupy.ndarray, out: cupy.ndarray, *,
                          eps: float = 1e-6, weight_offset: float = 0.0, stream=None) -> cupy.ndarray:
        """``residual += x; out = rms_norm(residual) * (w + weight_offset)``.

        x, residual, out: [n_rows, n_cols] f32 (residual updated in place; out must not overlap it)."""
        n_rows, n_cols = self._rows(x)
        check_array("residual", residual, dtype=_F32, shape=(n_rows, n_cols))
        check_array("w", w, dtype=_F32, shape=(n_cols,))
        check_array("out", out, dtype=_F32, shape=(n_rows, n_cols))
        _check_distinct("residual_rms_norm", out=out, residual=residual)
        params = self._norm_params(n_rows, n_cols, eps, weight_offset, "residual_rms_norm")
        self._row_norm("residual_rms_norm", n_rows, n_cols, (out, residual, x, w), params, stream)
        return out

    def post_norm_residual_rms_norm(self, x: cupy.ndarray, residual: cupy.ndarray, w_post: cupy.ndarray,
                                    w: cupy.ndarray, out: cupy.ndarray, *, eps: float = 1e-6,
                                    weight_offset: float = 0.0, stream=None) -> cupy.ndarray:
        """Gemma's post-attention chain: ``residual += rms_norm(x) * (w_post + off)``, then
        ``out = rms_norm(residual) * (w + off)``.

        x, residual, out: [n_rows, n_cols] f32; w_post, w: [n_cols] f32; out must not overlap residual."""
        n_rows, n_cols = self._rows(x)
        check_array("residual", residual, dtype=_F32, shape=(n_rows, n_cols))
        check_array("w_post", w_post, dtype=_F32, shape=(n_cols,))
        check_array("w", w, dtype=_F32, shape=(n_cols,))
        check_array("out", out, dtype=_F32, shape=(n_rows, n_cols))
        _check_distinct("post_norm_residual_rms_norm", out=out, residual=residual)
        params = self._norm_params(n_rows, n_cols, eps, weight_offset, "post_norm_residual_rms_norm")
        self._row_norm("post_norm_residual_rms_norm", n_rows, n_cols, (out, residual, x, w_post, w), params, stream)
        return out

    def rms_norm_accumulate(self, src: cupy.ndarray, w: cupy.ndarray, hidden: cupy.ndarray, *, eps: float = 1e-6,
                            weight_offset: float = 0.0, stream=None) -> cupy.ndarray:
        """``hidden += rms_norm(src) * (w + weight_offset)`` (post-FFN norm fused with the residual add).

        src, hidden: [n_rows, n_cols] f32 (must not overlap); w: [n_cols] f32."""
        n_rows, n_cols = self._rows(src, "src")
        check_array("w", w, dtype=_F32, shape=(n_cols,))
        check_array("hidden", hidden, dtype=_F32, shape=(n_rows, n_cols))
        _check_distinct("rms_norm_accumulate", src=src, hidden=hidden)
        params = self._norm_params(n_rows, n_cols, eps, weight_offset, "rms_norm_accumulate")
        self._row_norm("rms_norm_accumulate", n_rows, n_cols, (hidden, src, w), params, stream)
        return hidden

    def residual_rms_norm_q8_1(self, x: cupy.ndarray, residual: cupy.ndarray, w: cupy.ndarray, q: cupy.ndarray, *,
                               eps: float = 1e-6, weight_offset: float = 0.0, stream=None) -> cupy.ndarray:
        """``residual += x`` and ``q = Q8_1(rms_norm(residual) * (w + weight_offset))``.

        x, residual: [n_rows, n_cols] f32, n_cols % 32 == 0; q: [n_rows, n_cols // 32 * 36] uint8, GGUF
        block_q8_1 rows (half d, half s = d * sum(qs), int8 qs[32]; cuda_src/common/q8_1.cuh)."""
        n_rows, n_cols = self._rows(x)
        if n_cols % Q8_1_BLOCK:
            raise ValueError(f"residual_rms_norm_q8_1: n_cols must be a multiple of {Q8_1_BLOCK}, got {n_cols}")
        check_array("residual", residual, dtype=_F32, shape=(n_rows, n_cols))
        check_array("w", w, dtype=_F32, shape=(n_cols,))
        check_array("q", q, dtype=np.uint8, shape=(n_rows, n_cols // Q8_1_BLOCK * Q8_1_BLOCK_BYTES), align=4)
        _check_distinct("residual_rms_norm_q8_1", q=q, residual=residual)
        params = self._norm_params(n_rows, n_cols, eps, weight_offset, "residual_rms_norm_q8_1")
        self._row_norm("residual_rms_norm_q8_1", n_rows, n_cols, (q, residual, x, w), params, stream, q8=True)
        return q

    def quantize_q8_1(self, x: cupy.ndarray, q: cupy.ndarray, *, stream=None) -> cupy.ndarray:
        """``q = Q8_1(x)`` row by row: x [n_rows, n_cols] f32 (n_cols % 32 == 0, 16-byte aligned);
        q [n_rows, n_cols // 32 * 36] uint8 as :meth:`residual_rms_norm_q8_1` writes it."""
        n_rows, n_cols = self._rows(x)
        if n_cols % Q8_1_BLOCK:
            raise ValueError(f"quantize_q8_1: n_cols must be a multiple of {Q8_1_BLOCK}, got {n_cols}")
        check_array("x", x, align=16)
        check_array("q", q, dtype=np.uint8, shape=(n_rows, n_cols // Q8_1_BLOCK * Q8_1_BLOCK_BYTES), align=4)
        _check_disjoint("quantize_q8_1", dict(q=q), dict(x=x))
        blocks = -(-(x.size // 4) // (256 * _QUANT_UNROLL))
        if blocks > 2**31 - 1:
            raise ValueError("quantize_q8_1: too many values")
        params = self.struct("QuantizeParams").pack(n_values=x.size)
        self._launch("quantize_q8_1", blocks, 256, (q, x), params, stream=stream)
        return q

    def _group_norm(self, what, x, out, w, z, group_size, l2, eps, weight_offset, stream):
        check_array("x", x, dtype=_F32)
        if x.size == 0:
            raise ValueError(f"{what}: x must be non-empty")
        if not isinstance(group_size, (int, np.integer)) or group_size < 1 or x.shape[-1] % group_size:
            raise ValueError(f"{what}: group_size must be a positive divisor of x.shape[-1] "
                             f"({x.shape[-1]}), got {group_size}")
        check_array("out", out, dtype=_F32, shape=x.shape)
        if w is not None:
            check_array("w", w, dtype=_F32, shape=(group_size,))
        if z is not None:
            check_array("z", z, dtype=_F32, shape=x.shape)
        _check_eps(eps, what)
        n_groups = x.size // group_size
        if n_groups > _MAX_U32:
            raise ValueError(f"{what}: too many groups ({n_groups})")
        params = self.struct("GroupNormParams").pack(n_groups=n_groups, group_size=int(group_size),
                                                     has_weight=int(w is not None), l2=int(l2), eps=eps,
                                                     weight_offset=weight_offset)
        ptrs = (out, x, w if w is not None else x, z if z is not None else x)
        vpl = next((v for v in _GROUP_VPL if group_size <= 128 * v), None)
        if vpl is not None and group_size % 4 == 0 and _aligned(*ptrs):
            grid = min(-(-n_groups // _GROUPS_PER_BLOCK), self.sm_count() * _RESIDENT_GROUP_BLOCKS)
            self._launch(f"group_norm_reg<{_vec(z is not None)}, {vpl}>", grid, 128, ptrs, params, stream=stream)
        else:
            self._launch(f"group_norm<{_vec(z is not None)}>", -(-n_groups // 4), 128, ptrs, params, stream=stream)
        return out

    def head_rms_norm(self, x: cupy.ndarray, w: cupy.ndarray, out: cupy.ndarray, *, eps: float = 1e-6,
                      weight_offset: float = 0.0, stream=None) -> cupy.ndarray:
        """Per-head Q/K RMS norm: every row of the last axis (head_dim) is normed and scaled by
        ``w + weight_offset``. x, out: [..., head_dim] f32 (out may be x); w: [head_dim] f32."""
        check_array("x", x, dtype=_F32)
        if x.ndim < 1:
            raise ValueError("head_rms_norm: x must have at least one dimension")
        return self._group_norm("head_rms_norm", x, out, w, None, x.shape[-1], False, eps, weight_offset, stream)

    def group_norm(self, x: cupy.ndarray, out: cupy.ndarray, *, group_size: int, w: cupy.ndarray | None = None,
                   l2: bool = False, eps: float = 1e-6, weight_offset: float = 0.0, stream=None) -> cupy.ndarray:
        """Norm of every contiguous group of ``group_size`` elements (DeltaNet's grouped Q/K norm):
        RMS (``rsqrt(mean(x**2) + eps)``) or, with ``l2``, L2 (``rsqrt(sum(x**2) + eps)``); times
        ``w + weight_offset`` when w ([group_size]) is given. x, out: same shape, f32 (out may be x)."""
        return self._group_norm("group_norm", x, out, w, None, group_size, l2, eps, weight_offset, stream)

    def gated_rms_norm(self, y: cupy.ndarray, z: cupy.ndarray, w: cupy.ndarray, out: cupy.ndarray, *,
                       group_size: int, eps: float = 1e-6, weight_offset: float = 0.0, stream=None) -> cupy.ndarray:
        """``out = rms_norm(y) * (w + weight_offset) * silu(z)`` per group of ``group_size`` (the gated
        RMS norm of DeltaNet's output). y, z, out: same shape f32; w: [group_size] f32."""
        check_array("y", y, dtype=_F32)
        return self._group_norm("gated_rms_norm", y, out, w, z, group_size, False, eps, weight_offset, stream)

    # ------------------------------------------------------------------------------------ activations

    def _binary(self, op, out, a, b, *, n_rows, n_cols, a_stride, b_stride, b_offset=0, alpha=1.0, limit=0.0,
                stream=None):
        """Launch binary_rows; the caller has validated shapes. b None: unread (scale)."""
        b = a if b is None else b
        vec = (n_cols % 4 == 0 and a_stride % 4 == 0 and b_stride % 4 == 0 and b_offset % 4 == 0
               and _aligned(out, a, b))
        units = n_cols // 4 if vec else n_cols
        params = self.struct("BinaryParams").pack(n_rows=n_rows, n_cols=n_cols, a_stride=a_stride,
                                                  b_stride=b_stride, out_stride=n_cols, b_offset=b_offset,
                                                  alpha=alpha, limit=limit)
        per_thread = _BINARY_UNROLL if n_rows * units >= _BINARY_BIG else 1
        grid = (_flat_grid(-(-units // per_thread)), min(n_rows, _MAX_GRID_Y))
        self._launch(f"binary_rows<{op}, {_vec(vec)}>", grid, _FLAT_BLOCK, (out, a, b), params, stream=stream)
        return out

    def _flat(self, out, *named):
        check_array("out", out, dtype=_F32)
        n = out.size
        if not 0 < n <= _MAX_FLAT:
            raise ValueError(f"out must have 1 to {_MAX_FLAT} elements, got {n}")
        for name, a in named:
            check_array(name, a, dtype=_F32, shape=out.shape)
        return n

    def add_scaled(self, a: cupy.ndarray, b: cupy.ndarray, out: cupy.ndarray, *, alpha: float = 1.0,
                   stream=None) -> cupy.ndarray:
        """``out = a + alpha * b`` elementwise, f32, any shape (out may be a: ``a += alpha * b``)."""
        n = self._flat(out, ("a", a), ("b", b))
        return self._binary(_OP_AXPY, out, a, b, n_rows=1, n_cols=n, a_stride=0, b_stride=0, alpha=alpha,
                            stream=stream)

    def add(self, a: cupy.ndarray, b: cupy.ndarray, out: cupy.ndarray, *, stream=None) -> cupy.ndarray:
        """``out = a + b`` elementwise, f32, any shape (out may be a or b)."""
        return self.add_scaled(a, b, out, alpha=1.0, stream=stream)

    def scale_accumulate(self, a: cupy.ndarray, b: cupy.ndarray, s: float, *, stream=None) -> cupy.ndarray:
        """``a += s * b`` in place (vectorised), f32, any shape."""
        return self.add_scaled(a, b, a, alpha=s, stream=stream)

    def scale(self, a: cupy.ndarray, out: cupy.ndarray, *, alpha: float, stream=None) -> cupy.ndarray:
        """``out = alpha * a`` elementwise, f32, any shape (out may be a)."""
        n = self._flat(out, ("a", a))
        return self._binary(_OP_SCALE, out, a, None, n_rows=1, n_cols=n, a_stride=0, b_stride=0, alpha=alpha,
                            stream=stream)

    def sigmoid_mul(self, x: cupy.ndarray, g: cupy.ndarray, out: cupy.ndarray, *, stream=None) -> cupy.ndarray:
        """``out = x * sigmoid(g)`` elementwise (gated attention output), f32, any shape (out may be x)."""
        n = self._flat(out, ("x", x), ("g", g))
        return self._binary(_OP_SIGMOID_MUL, out, x, g, n_rows=1, n_cols=n, a_stride=0, b_stride=0, stream=stream)

    def bias_add(self, x: cupy.ndarray, bias: cupy.ndarray, out: cupy.ndarray, *, offset: int = 0,
                 stream=None) -> cupy.ndarray:
        """``out[r] = x[r] + bias[offset : offset + n_cols]`` for every row r.

        x, out: [n_rows, n_cols] f32 (out may be x); bias: [n] f32 with offset + n_cols <= n (a slice
        of a fused bias, e.g. the K part of a QKV bias)."""
        n_rows, n_cols = self._rows(x)
        check_array("out", out, dtype=_F32, shape=(n_rows, n_cols))
        check_array("bias", bias, dtype=_F32, ndim=1)
        if not isinstance(offset, (int, np.integer)) or offset < 0 or offset + n_cols > bias.shape[0]:
            raise ValueError(f"bias_add: offset {offset} + n_cols {n_cols} exceeds bias length {bias.shape[0]}")
        return self._binary(_OP_AXPY, out, x, bias, n_rows=n_rows, n_cols=n_cols, a_stride=n_cols, b_stride=0,
                            b_offset=int(offset), alpha=1.0, stream=stream)

    def _glu(self, op, what, gate, up, out, alpha=1.0, limit=0.0, stream=None):
        if up is None:  # fused [n_rows, 2 * n_ff]: gate = first half, up = second half of each row
            check_array("gate_up", gate, dtype=_F32, ndim=2)
            n_rows, two_ff = gate.shape
            if two_ff % 2 or n_rows == 0 or two_ff == 0:
                raise ValueError(f"{what}: fused gate_up must be [n_rows, 2 * n_ff], got {gate.shape}")
            n_ff = two_ff // 2
            check_array("out", out, dtype=_F32, shape=(n_rows, n_ff))
            _check_distinct(what, out=out, gate_up=gate)
            a, b, stride = gate, gate[:, n_ff:], two_ff
        else:
            n_rows, n_ff = self._rows(gate, "gate")
            check_array("up", up, dtype=_F32, shape=(n_rows, n_ff))
            check_array("out", out, dtype=_F32, shape=(n_rows, n_ff))
            a, b, stride = gate, up, n_ff
        return self._binary(op, out, a, b, n_rows=n_rows, n_cols=n_ff, a_stride=stride, b_stride=stride,
                            alpha=alpha, limit=limit, stream=stream)

    def swiglu(self, gate: cupy.ndarray, up: cupy.ndarray | None, out: cupy.ndarray, *, stream=None) -> cupy.ndarray:
        """``out = silu(gate) * up``. gate, up, out: [n_rows, n_ff] f32 (out may be gate or up); or
        ``up=None`` and gate the fused [n_rows, 2 * n_ff] matmul output ([gate | up] per row)."""
        return self._glu(_OP_SWIGLU, "swiglu", gate, up, out, stream=stream)

    def swiglu_oai(self, gate: cupy.ndarray, up: cupy.ndarray | None, out: cupy.ndarray, *, alpha: float = 1.702,
                   limit: float = 7.0, stream=None) -> cupy.ndarray:
        """gpt-oss SwiGLU: ``g = min(gate, limit)``, ``u = clip(up, -limit, limit)``,
        ``out = g * sigmoid(alpha * g) * (u + 1)``. Shapes as :meth:`swiglu` (gpt-oss interleaves gate
        and up in its weights; de-interleave the weight rows once at load time to use this layout)."""
        if not limit > 0:
            raise ValueError(f"swiglu_oai: limit must be > 0, got {limit}")
        return self._glu(_OP_SWIGLU_OAI, "swiglu_oai", gate, up, out, alpha=alpha, limit=limit, stream=stream)

    def geglu(self, gate: cupy.ndarray, up: cupy.ndarray | None, out: cupy.ndarray, *, stream=None) -> cupy.ndarray:
        """``out = gelu_tanh(gate) * up`` (Gemma). Shapes as :meth:`swiglu`."""
        return self._glu(_OP_GEGLU, "geglu", gate, up, out, stream=stream)

    # ------------------------------------------------------------------------------------------- RoPE

    def _rope_common(self, what, head_dim, rope_dim, freqs, freq_base):
        if head_dim % 2 or head_dim > _ROPE_MAX_HEAD_DIM:
            raise ValueError(f"{what}: head_dim must be even and <= {_ROPE_MAX_HEAD_DIM}, got {head_dim}")
        rope_dim = head_dim if rope_dim is None else rope_dim  # head_dim <= 64 * max(_ROPE_PPL) holds here
        if not isinstance(rope_dim, (int, np.integer)) or rope_dim < 2 or rope_dim % 2 or rope_dim > head_dim:
            raise ValueError(f"{what}: rope_dim must be even, >= 2 and <= head_dim ({head_dim}), got {rope_dim}")
        if freqs is not None:
            check_array("freqs", freqs, dtype=_F32, shape=(rope_dim // 2,))
        elif not freq_base > 0:
            raise ValueError(f"{what}: freq_base must be > 0, got {freq_base}")
        return int(rope_dim)

    def _positions(self, what, positions, pos_mode, n_tokens, sections, multi_ok=True):
        if pos_mode not in _POS_MODES or (not multi_ok and _POS_MODES[pos_mode] > 1):
            modes = list(_POS_MODES) if multi_ok else ["consecutive", "per_token"]
            raise ValueError(f"{what}: pos_mode must be one of {modes}, got {pos_mode!r}")
        mode = _POS_MODES[pos_mode]
        shape = {0: (None,), 1: (n_tokens,), 2: (4, n_tokens), 3: (4, n_tokens)}[mode]
        check_array("positions", positions, dtype=_I32, shape=shape)
        if mode == 0 and positions.shape[0] < 1:
            raise ValueError(f"{what}: positions must hold the first token's position")
        if mode >= 2:
            if sections is None or len(sections) != 4 or any(int(s) < 0 for s in sections) or sum(sections) == 0:
                raise ValueError(f"{what}: pos_mode {pos_mode!r} needs 4 non-negative sections with a "
                                 f"positive sum, got {sections}")
            sections = [int(s) for s in sections]
        else:
            sections = [0, 0, 0, 0]
        return mode, sections

    def rope(self, x: cupy.ndarray, positions: cupy.ndarray, out: cupy.ndarray, *, rope_dim: int | None = None,
             neox: bool = True, freq_base: float = 10000.0, freqs: cupy.ndarray | None = None,
             pos_mode: str = "consecutive", sections=None, stream=None) -> cupy.ndarray:
        """Rotary embedding of x: [n_tokens, n_heads, head_dim] f32 into out (may be x).

        rope_dim: rotated leading elements (even, default head_dim); the rest are copied. neox: pairs
        (j, j + rope_dim/2), else interleaved (2j, 2j+1). Angle of pair j: pos * freq_base**(-2j/rope_dim),
        or pos * freqs[j] with freqs: [rope_dim // 2] f32. positions, int32: "consecutive" [>= 1]
        (token t at positions[0] + t: one decode position, or a prefill chunk), "per_token" [n_tokens],
        "mrope" / "imrope" [4, n_tokens] with ``sections`` = 4 pair counts (multi-section rotary;
        imrope interleaves the sections as Qwen3-VL does)."""
        return self._rope("rope", x, None, positions, out, rope_dim, neox, freq_base, freqs, pos_mode, sections,
                          0.0, 0.0, stream)

    def rms_norm_rope(self, x: cupy.ndarray, w: cupy.ndarray, positions: cupy.ndarray, out: cupy.ndarray, *,
                      eps: float = 1e-6, weight_offset: float = 0.0, rope_dim: int | None = None, neox: bool = True,
                      freq_base: float = 10000.0, freqs: cupy.ndarray | None = None, pos_mode: str = "consecutive",
                      sections=None, stream=None) -> cupy.ndarray:
        """Per-head RMS norm (weight w: [head_dim]) then :meth:`rope`, in one pass."""
        return self._rope("rms_norm_rope", x, w, positions, out, rope_dim, neox, freq_base, freqs, pos_mode,
                          sections, eps, weight_offset, stream)

    def _rope(self, what, x, w, positions, out, rope_dim, neox, freq_base, freqs, pos_mode, sections, eps,
              weight_offset, stream):
        check_array("x", x, dtype=_F32, ndim=3)
        n_tokens, n_heads, head_dim = x.shape
        if x.size == 0:
            raise ValueError(f"{what}: x must be non-empty, got shape {x.shape}")
        check_array("out", out, dtype=_F32, shape=x.shape)
        if w is not None:
            check_array("w", w, dtype=_F32, shape=(head_dim,))
            _check_eps(eps, what)
        rope_dim = self._rope_common(what, head_dim, rope_dim, freqs, freq_base)
        mode, sections = self._positions(what, positions, pos_mode, n_tokens, sections)
        tpb, grid, smem, ppl = _rope_launch(n_tokens, n_heads, head_dim, rope_dim, self.sm_count())
        params = self.struct("RopeParams").pack(
            n_tokens=n_tokens, n_heads=n_heads, head_dim=head_dim, rope_dim=rope_dim, neox=int(bool(neox)),
            pos_mode=mode, sections=sections, use_freqs=int(freqs is not None), freq_base=freq_base, eps=eps,
            weight_offset=weight_offset, tokens_per_block=tpb, inv_ratio=_inv_ratio(freq_base, rope_dim, freqs))
        ptrs = (out, x, w if w is not None else x, freqs if freqs is not None else x, positions)
        vec = _rope_vec_launch(n_tokens * n_heads, head_dim, rope_dim, ptrs[:3])
        if vec is not None:
            lph, vgrid = vec
            self._launch(f"rope_vec<{_vec(w is not None)}, {lph}>", vgrid, _ROPE_BLOCK, ptrs, params, stream=stream)
        else:
            self._launch(f"rope<{_vec(w is not None)}, {ppl}>", grid, _ROPE_BLOCK, ptrs, params, stream=stream,
                         shared_mem=smem)
        return out

    # ----------------------------------------------------------------------------------- KV writes

    def _kv_target(self, what, cache, page_table, n_kv_heads, head_dim, name="cache"):
        check_array(name, cache, ndim=4)
        if cache.dtype not in _KV_TYPES:
            raise TypeError(f"{what}: {name} dtype must be float16 or float32, got {cache.dtype}")
        n_pages, page_size, h, d = cache.shape
        if (h, d) != (n_kv_heads, head_dim):
            raise ValueError(f"{what}: {name} must be [n_pages, page_size, {n_kv_heads}, {head_dim}], got {cache.shape}")
        check_array("page_table", page_table, dtype=_I32, ndim=2)
        if page_table.shape[0] == 0 or page_table.shape[1] == 0 or n_pages == 0 or page_size == 0:
            raise ValueError(f"{what}: empty cache or page table")
        return page_size, page_table.shape[1]

    def _seq_positions(self, what, positions, seq_ids, pos_mode, n_tokens):
        if pos_mode not in ("consecutive", "per_token"):
            raise ValueError(f"{what}: pos_mode must be 'consecutive' or 'per_token', got {pos_mode!r}")
        n = n_tokens if pos_mode == "per_token" else None
        check_array("positions", positions, dtype=_I32, shape=(n,))
        check_array("seq_ids", seq_ids, dtype=_I32, shape=(n,))
        if positions.shape[0] == 0 or seq_ids.shape[0] == 0:
            raise ValueError(f"{what}: positions and seq_ids must not be empty")
        return _POS_MODES[pos_mode]

    def kv_write(self, src: cupy.ndarray, cache: cupy.ndarray, page_table: cupy.ndarray, positions: cupy.ndarray,
                 seq_ids: cupy.ndarray, *, pos_mode: str = "consecutive", stream=None) -> cupy.ndarray:
        """Write src: [n_tokens, n_kv_heads, head_dim] f32 into a paged K or V cache
        [n_pages, page_size, n_kv_heads, head_dim] (float16 or float32; common/kv_cache.cuh's layout)
        with page_table: [n_seqs, max_pages] int32. Token t goes to sequence seq_ids[0] at position
        positions[0] + t ("consecutive"), or to seq_ids[t] at positions[t] ("per_token": a decode batch).
        A contiguous cache [n_seqs, capacity, ...] is the case page_table = contiguous_page_table(n_seqs)."""
        check_array("src", src, dtype=_F32, ndim=3)
        n_tokens, n_kv, head_dim = src.shape
        if src.size == 0:
            raise ValueError("kv_write: src must be non-empty")
        page_size, max_pages = self._kv_target("kv_write", cache, page_table, n_kv, head_dim)
        mode = self._seq_positions("kv_write", positions, seq_ids, pos_mode, n_tokens)
        row_elems = n_kv * head_dim
        vec = row_elems % 4 == 0 and _aligned(cache, src)
        units = n_tokens * row_elems // (4 if vec else 1)
        if units + 256 * _KV_UNROLL > _MAX_U32:
            raise ValueError(f"kv_write: at most 2**32 - 1025 {'float4s' if vec else 'elements'} per call, got {units}")
        params = self.struct("KvWriteParams").pack(n_tokens=n_tokens, row_elems=row_elems, page_size=page_size,
                                                   max_pages=max_pages, pos_mode=mode)
        self._launch(f"kv_write<{_KV_TYPES[cache.dtype]}, {_vec(vec)}>", -(-units // (256 * _KV_UNROLL)), 256,
                     (cache, src, positions, seq_ids, page_table), params, stream=stream)
        return cache

    def kv_write_contiguous(self, src: cupy.ndarray, cache: cupy.ndarray, page_table: cupy.ndarray,
                            positions: cupy.ndarray, seq_ids: cupy.ndarray, *, pos_mode: str = "consecutive",
                            stream=None) -> cupy.ndarray:
        """:meth:`kv_write` into a contiguous cache [n_seqs, capacity, n_kv_heads, head_dim]; page_table is
        ``contiguous_page_table(n_seqs)`` (made once, at plan time)."""
        check_array("cache", cache, ndim=4)
        n_seqs = cache.shape[0]
        check_array("page_table", page_table, dtype=_I32, shape=(n_seqs, 1))
        self.kv_write(src, cache, page_table, positions, seq_ids, pos_mode=pos_mode, stream=stream)
        return cache

    def qk_norm_rope_kv_write(self, q: cupy.ndarray, k: cupy.ndarray, v: cupy.ndarray, wq: cupy.ndarray | None,
                              wk: cupy.ndarray | None, q_out: cupy.ndarray, k_cache: cupy.ndarray,
                              v_cache: cupy.ndarray, page_table: cupy.ndarray, positions: cupy.ndarray,
                              seq_ids: cupy.ndarray, *, eps: float = 1e-6, weight_offset: float = 0.0,
                              rope_dim: int | None = None, neox: bool = True, freq_base: float = 10000.0,
                              freqs: cupy.ndarray | None = None, pos_mode: str = "consecutive",
                              stream=None) -> cupy.ndarray:
        """The attention prologue in one launch: ``q_out = rope(rms_norm(q) * (wq + off))``, K cache row
        ``= rope(rms_norm(k) * (wk + off))``, V cache row ``= v``, per head.

        q: [n_tokens, n_q_heads, head_dim] f32; k, v: [n_tokens, n_kv_heads, head_dim] f32; wq, wk:
        [head_dim] f32, or both None for no norm (rotation only); q_out: f32 like q, or of the caches'
        dtype (Q rounded once for a tensor-core attention; the vectorised kernel's shapes only: head_dim
        8 * 4..32, 16-byte aligned arrays); caches, page_table, positions, seq_ids and pos_mode as
        :meth:`kv_write` ("per_token" is the batched decode of several sequences); rope arguments as
        :meth:`rope`. Returns q_out."""
        check_array("q", q, dtype=_F32, ndim=3)
        check_array("q_out", q_out, shape=q.shape)
        if q_out.dtype not in (_F32, k_cache.dtype):
            raise TypeError(f"qk_norm_rope_kv_write: q_out must be float32 or the caches' {k_cache.dtype}, "
                            f"got {q_out.dtype}")
        n_tokens, n_q, head_dim = q.shape
        check_array("k", k, dtype=_F32, ndim=3)
        check_array("v", v, dtype=_F32, shape=k.shape)
        if k.shape[0] != n_tokens or k.shape[2] != head_dim:
            raise ValueError(f"qk_norm_rope_kv_write: k must be [{n_tokens}, n_kv_heads, {head_dim}], got {k.shape}")
        if n_q == 0 or k.shape[1] == 0 or n_tokens == 0:
            raise ValueError("qk_norm_rope_kv_write: empty q or k")
        if n_q % k.shape[1]:
            raise ValueError(f"qk_norm_rope_kv_write: n_q_heads ({n_q}) must be a multiple of n_kv_heads ({k.shape[1]})")
        if v_cache.dtype != k_cache.dtype or v_cache.shape != k_cache.shape:
            raise ValueError("qk_norm_rope_kv_write: k_cache and v_cache must have the same shape and dtype")
        return self._qkv("qk_norm_rope_kv_write", q, k, v, wq, wk, q_out, k_cache, v_cache, page_table, positions,
                         seq_ids, eps, weight_offset, rope_dim, neox, freq_base, freqs, pos_mode, stream)

    def k_norm_rope_kv_write(self, k: cupy.ndarray, wk: cupy.ndarray | None, k_cache: cupy.ndarray,
                             page_table: cupy.ndarray, positions: cupy.ndarray, seq_ids: cupy.ndarray, *,
                             eps: float = 1e-6, weight_offset: float = 0.0, rope_dim: int | None = None,
                             neox: bool = True, freq_base: float = 10000.0, freqs: cupy.ndarray | None = None,
                             pos_mode: str = "consecutive", stream=None) -> cupy.ndarray:
        """The K-only sibling of :meth:`qk_norm_rope_kv_write`: K cache row ``= rope(rms_norm(k) * (wk + off))``
        (wk None: no norm). Returns k_cache."""
        check_array("k", k, dtype=_F32, ndim=3)
        if k.size == 0:
            raise ValueError("k_norm_rope_kv_write: k must be non-empty")
        self._qkv("k_norm_rope_kv_write", None, k, None, None, wk, None, k_cache, None, page_table, positions,
                  seq_ids, eps, weight_offset, rope_dim, neox, freq_base, freqs, pos_mode, stream)
        return k_cache

    def _qkv(self, what, q, k, v, wq, wk, q_out, k_cache, v_cache, page_table, positions, seq_ids, eps,
             weight_offset, rope_dim, neox, freq_base, freqs, pos_mode, stream):
        n_tokens, n_kv, head_dim = k.shape
        has_q = q is not None
        norm = wk is not None
        if has_q and (wq is None) != (wk is None):
            raise ValueError(f"{what}: give both wq and wk (norm) or neither (rotation only)")
        if norm:
            check_array("wk", wk, dtype=_F32, shape=(head_dim,))
            if has_q:
                check_array("wq", wq, dtype=_F32, shape=(head_dim,))
            _check_eps(eps, what)
        rope_dim = self._rope_common(what, head_dim, rope_dim, freqs, freq_base)
        page_size, max_pages = self._kv_target(what, k_cache, page_table, n_kv, head_dim, "k_cache")
        if has_q:
            self._kv_target(what, v_cache, page_table, n_kv, head_dim, "v_cache")
            _check_distinct(what, q_out=q_out, q=q)
        mode = self._seq_positions(what, positions, seq_ids, pos_mode, n_tokens)
        heads = (q.shape[1] + 2 * n_kv) if has_q else n_kv
        tpb, grid, smem, ppl = _rope_launch(n_tokens, heads, head_dim, rope_dim, self.sm_count())
        params = self.struct("QkvRopeParams").pack(
            n_tokens=n_tokens, n_q_heads=q.shape[1] if has_q else 0, n_kv_heads=n_kv, head_dim=head_dim,
            rope_dim=rope_dim, neox=int(bool(neox)), pos_mode=mode, use_freqs=int(freqs is not None),
            freq_base=freq_base, eps=eps, weight_offset=weight_offset, page_size=page_size, max_pages=max_pages,
            norm=int(norm), tokens_per_block=tpb, inv_ratio=_inv_ratio(freq_base, rope_dim, freqs))
        kv = _KV_TYPES[k_cache.dtype]
        flags = ("true, true" if has_q else "false, false") + f", {ppl}"
        unread = k  # any device pointer for arguments the instance never reads
        ptrs = (q_out if has_q else unread, k_cache, v_cache if has_q else k_cache, q if has_q else unread, k,
                v if has_q else unread, wq if (has_q and norm) else unread, wk if norm else unread,
                freqs if freqs is not None else unread, positions, seq_ids, page_table)
        vec = _rope_vec_launch(n_tokens * heads, head_dim, rope_dim, ptrs[:8])
        q_out_type = _KV_TYPES[q_out.dtype] if has_q else "float"
        if vec is None and q_out_type != "float":
            raise ValueError(f"{what}: a {q_out.dtype} q_out needs the vectorised kernel (head_dim in "
                             f"{ROPE_VEC_HEAD_DIMS}, rope_dim % 8 == 0, 16-byte aligned arrays), got head_dim "
                             f"{head_dim}, rope_dim {rope_dim}")
        if vec is not None and not has_q:
            lph = vec[0]
            rows = 1 if n_tokens * n_kv < _K_ROPE_FEW_ROWS else 2
            kgrid = -(-n_tokens * n_kv // (_ROPE_BLOCK // lph * rows))
            self._launch(f"k_norm_rope_kv_vec<{kv}, {lph}, {rows}>", kgrid, _ROPE_BLOCK,
                         (k_cache, k, ptrs[7], ptrs[8], positions, seq_ids, page_table), params, stream=stream)
        elif vec is not None:
            lph, vgrid = vec
            self._launch(_qkv_vec_kernel(kv, lph, q_out_type), vgrid, _ROPE_BLOCK, ptrs, params, stream=stream)
        else:
            self._launch(f"qk_norm_rope_kv<{kv}, {flags}>", grid, _ROPE_BLOCK, ptrs, params, stream=stream,
                         shared_mem=smem)
        return q_out

    def deinterleave(self, x: cupy.ndarray, q: cupy.ndarray, gate: cupy.ndarray, *, stream=None):
        """Split per-head interleaved [Q | gate]: x [n_tokens, n_heads, 2 * head_dim] f32 into
        q, gate [n_tokens, n_heads, head_dim] f32. Returns (q, gate)."""
        check_array("x", x, dtype=_F32, ndim=3)
        n_tokens, n_heads, two_d = x.shape
        if x.size == 0 or two_d % 2:
            raise ValueError(f"deinterleave: x must be non-empty [n_tokens, n_heads, 2 * head_dim], got {x.shape}")
        d = two_d // 2
        check_array("q", q, dtype=_F32, shape=(n_tokens, n_heads, d))
        check_array("gate", gate, dtype=_F32, shape=(n_tokens, n_heads, d))
        _check_disjoint("deinterleave", dict(q=q, gate=gate), dict(x=x))
        n_rows = n_tokens * n_heads
        if n_rows > _MAX_U32:
            raise ValueError("deinterleave: too many rows")
        vec = d % 4 == 0 and _aligned(x, q, gate)
        units = n_rows * d // (4 if vec else 1)
        params = self.struct("DeinterleaveParams").pack(n_rows=n_rows, head_dim=d)
        self._launch(f"deinterleave<{'float4' if vec else 'float'}>", _flat_grid(units), _FLAT_BLOCK, (q, gate, x),
                     params, stream=stream)
        return q, gate

    # ------------------------------------------------------------------------------------------- MoE

    def softmax_topk(self, logits: cupy.ndarray, ids: cupy.ndarray, weights: cupy.ndarray, *, k: int,
                     renorm: bool = True, scale: float = 1.0, stream=None):
        """Router top-k: per token, the k largest logits (ties: lower id first) in descending order into
        ids: [n_tokens, k] int32 and weights: [n_tokens, k] f32 = scale * softmax(logits)[id], rescaled to
        sum to scale when ``renorm`` (equal to a softmax over the k selected logits, as gpt-oss and
        Qwen3 route). logits: [n_tokens, n_experts] f32. Returns (ids, weights)."""
        n_tokens, n_experts = self._rows(logits, "logits")
        if not isinstance(k, (int, np.integer)) or not 1 <= k <= min(n_experts, _TOPK_MAX_K):
            raise ValueError(f"softmax_topk: k must be in [1, min(n_experts={n_experts}, {_TOPK_MAX_K})], got {k}")
        if n_experts > _TOPK_MAX_EXPERTS:
            raise ValueError(f"softmax_topk: at most {_TOPK_MAX_EXPERTS} experts, got {n_experts}")
        check_array("ids", ids, dtype=_I32, shape=(n_tokens, k))
        check_array("weights", weights, dtype=_F32, shape=(n_tokens, k))
        params = self.struct("TopkParams").pack(n_tokens=n_tokens, n_experts=n_experts, k=int(k),
                                                renorm=int(bool(renorm)), scale=scale)
        grid = -(-n_tokens // _TOPK_WARPS)
        epl = next((e for e in _TOPK_EPL if n_experts <= 32 * e), None)
        if (n_tokens >= _TOPK_LANES_MIN_TOKENS and n_experts % 4 == 0 and n_experts <= 32 * _TOPK_LANES_V[-1]
                and k <= _TOPK_LANES_KMAX and _aligned(logits)):
            v = next(v for v in _TOPK_LANES_V if n_experts <= 32 * v)
            m = next(m for m in _TOPK_LANES_M if k <= 4 * m)
            self._launch(f"softmax_topk_lanes<{v}, {m}>", -(-n_tokens // _TOPK_LANES_TOKENS), 8 * _TOPK_LANES_TOKENS,
                         (ids, weights, logits), params, stream=stream)
        elif epl is not None:
            self._launch(f"softmax_topk_reg<{epl}>", grid, 32 * _TOPK_WARPS, (ids, weights, logits), params,
                         stream=stream)
        else:
            self._launch("softmax_topk", grid, 32 * _TOPK_WARPS, (ids, weights, logits), params, stream=stream,
                         shared_mem=_TOPK_WARPS * n_experts * 4)
        return ids, weights

    def moe_weighted_sum(self, expert_out: cupy.ndarray, weights: cupy.ndarray, out: cupy.ndarray, *,
                         accumulate: bool = False, stream=None) -> cupy.ndarray:
        """``out[t] (+)= sum_j weights[t, j] * expert_out[t, j]``: expert_out [n_tokens, n_used, n_cols] f32,
        weights [n_tokens, n_used] f32, out [n_tokens, n_cols] f32 (``accumulate``: add to out)."""
        check_array("expert_out", expert_out, dtype=_F32, ndim=3)
        n_tokens, n_used, n_cols = expert_out.shape
        if expert_out.size == 0:
            raise ValueError("moe_weighted_sum: expert_out must be non-empty")
        check_array("weights", weights, dtype=_F32, shape=(n_tokens, n_used))
        check_array("out", out, dtype=_F32, shape=(n_tokens, n_cols))
        _check_disjoint("moe_weighted_sum", dict(out=out), dict(expert_out=expert_out, weights=weights))
        vec = n_cols % 4 == 0 and _aligned(out, expert_out)
        params = self.struct("MoeSumParams").pack(n_tokens=n_tokens, n_used=n_used, n_cols=n_cols,
                                                  accumulate=int(bool(accumulate)))
        grid = (_flat_grid(n_cols // 4 if vec else n_cols), min(n_tokens, _MAX_GRID_Y))
        self._launch(f"moe_weighted_sum<{_vec(vec)}>", grid, _FLAT_BLOCK, (out, expert_out, weights), params,
                     stream=stream)
        return out

    def shared_expert_accumulate(self, hidden: cupy.ndarray, shared_out: cupy.ndarray, gate_logit: cupy.ndarray, *,
                                 stream=None) -> cupy.ndarray:
        """``hidden[t] += sigmoid(gate_logit[t]) * shared_out[t]``: hidden, shared_out [n_tokens, n_cols]
        f32, gate_logit [n_tokens] f32 (the shared-expert gate's logit, e.g. one more router row)."""
        n_tokens, n_cols = self._rows(hidden, "hidden")
        check_array("shared_out", shared_out, dtype=_F32, shape=(n_tokens, n_cols))
        check_array("gate_logit", gate_logit, dtype=_F32, shape=(n_tokens,))
        _check_distinct("shared_expert_accumulate", hidden=hidden, shared_out=shared_out)
        vec = n_cols % 4 == 0 and _aligned(hidden, shared_out)
        params = self.struct("SharedGateParams").pack(n_tokens=n_tokens, n_cols=n_cols)
        grid = (_flat_grid(n_cols // 4 if vec else n_cols), min(n_tokens, _MAX_GRID_Y))
        self._launch(f"shared_expert_accumulate<{_vec(vec)}>", grid, _FLAT_BLOCK, (hidden, shared_out, gate_logit),
                     params, stream=stream)
        return hidden

    def router_matvec(self, x: cupy.ndarray, W: cupy.ndarray, logits: cupy.ndarray, *, scale: float = 1.0,
                      stream=None) -> cupy.ndarray:
        """``logits = scale * x @ W.T``: x [n_tokens, n_embd] f32, W [n_experts, n_embd] f32 (n_embd % 4 == 0,
        16-byte aligned), logits [n_tokens, n_experts] f32."""
        return self._router("router_matvec", x, None, W, logits, 0.0, 0.0, scale, stream)

    def router_rms_norm_matvec(self, x: cupy.ndarray, w_norm: cupy.ndarray, W: cupy.ndarray, logits: cupy.ndarray, *,
                               eps: float = 1e-6, weight_offset: float = 0.0, scale: float = 1.0,
                               stream=None) -> cupy.ndarray:
        """Fused router norm: ``logits = scale * (rms_norm(x) * (w_norm + weight_offset)) @ W.T`` without
        writing the normed x. Shapes as :meth:`router_matvec`; w_norm: [n_embd] f32."""
        _check_eps(eps, "router_rms_norm_matvec")
        return self._router("router_rms_norm_matvec", x, w_norm, W, logits, eps, weight_offset, scale, stream)

    def _router(self, what, x, w_norm, W, logits, eps, weight_offset, scale, stream):
        n_tokens, n_embd = self._rows(x)
        check_array("W", W, dtype=_F32, ndim=2)
        n_experts = W.shape[0]
        if W.shape[1] != n_embd or n_experts == 0:
            raise ValueError(f"{what}: W must be [n_experts, {n_embd}], got {W.shape}")
        check_array("logits", logits, dtype=_F32, shape=(n_tokens, n_experts))
        if w_norm is not None:
            check_array("w_norm", w_norm, dtype=_F32, shape=(n_embd,))
        if n_embd % 4 or not _aligned(x, W, *(() if w_norm is None else (w_norm,))):
            raise ValueError(f"{what}: needs n_embd % 4 == 0 and 16-byte aligned x, W, w_norm (n_embd={n_embd})")
        params = self.struct("RouterParams").pack(n_tokens=n_tokens, n_experts=n_experts, n_embd=n_embd,
                                                  norm=int(w_norm is not None), eps=eps, weight_offset=weight_offset,
                                                  scale=scale)
        args = (logits, x, W, w_norm if w_norm is not None else x)
        if n_tokens >= _ROUTER_GEMM_MIN_TOKENS and n_experts >= _ROUTER_GEMM_MIN_EXPERTS:
            t_tile, e_tile, threads = _ROUTER_GEMM_TILE
            bk, stages = _ROUTER_GEMM_STAGES
            grid = (-(-n_tokens // t_tile), -(-n_experts // e_tile))
            if grid[1] > _MAX_GRID_Y:
                raise ValueError(f"{what}: at most {_MAX_GRID_Y * e_tile} experts per call, got {n_experts}")
            smem = 4 * stages * ((t_tile + e_tile) * (bk + 4) + bk)  # rg_smem in moe.cuh
            self._launch(f"router_gemm<{'true' if w_norm is not None else 'false'}, {bk}, {stages}>", grid, threads,
                         args, params, stream=stream, shared_mem=smem)
            return logits
        e_tile, t_tile, threads = _ROUTER_SMALL if n_tokens < _ROUTER_BATCH else _ROUTER_LARGE
        grid = (-(-n_experts // e_tile), -(-n_tokens // t_tile))
        if grid[1] > _MAX_GRID_Y:
            raise ValueError(f"{what}: at most {_MAX_GRID_Y * t_tile} tokens per call with fewer than "
                             f"{_ROUTER_GEMM_MIN_EXPERTS} experts, got {n_tokens}")
        self._launch(f"router_matvec<{e_tile}, {t_tile}, {threads}>", grid, threads, args, params, stream=stream)
        return logits

    # --------------------------------------------------------------------------------- SSM / DeltaNet

    def conv1d_silu(self, x: cupy.ndarray, state: cupy.ndarray, w: cupy.ndarray, y: cupy.ndarray, *,
                    stream=None) -> cupy.ndarray:
        """Depthwise causal conv1d + SiLU over n_tokens tokens (1: decode; more: prefill) with a rolling
        state of the previous kernel_size - 1 inputs: x, y [n_tokens, n_channels] f32; state
        [kernel_size - 1, n_channels] f32, oldest first, updated in place; w [n_channels, kernel_size] f32
        (taps oldest first), kernel_size in (2, 3, 4)."""
        n_tokens, n_ch = self._rows(x)
        check_array("w", w, dtype=_F32, ndim=2)
        K = w.shape[1]
        if w.shape[0] != n_ch or K not in _CONV_K:
            raise ValueError(f"conv1d_silu: w must be [{n_ch}, kernel_size] with kernel_size in {_CONV_K}, got {w.shape}")
        check_array("state", state, dtype=_F32, shape=(K - 1, n_ch))
        check_array("y", y, dtype=_F32, shape=(n_tokens, n_ch))
        _check_disjoint("conv1d_silu", dict(y=y, state=state), dict(x=x, w=w))
        grid = (-(-n_ch // 128), -(-n_tokens // _CONV_CHUNK))
        if grid[1] > _MAX_GRID_Y:
            raise ValueError(f"conv1d_silu: at most {_MAX_GRID_Y * _CONV_CHUNK} tokens per call")
        params = self.struct("ConvParams").pack(n_tokens=n_tokens, n_channels=n_ch, kernel_size=K)
        self._launch(f"conv1d_silu<{K}>", grid, 128, (y, state, x, w), params, stream=stream)
        return y

    def deltanet(self, q: cupy.ndarray, k: cupy.ndarray, v: cupy.ndarray, g: cupy.ndarray, beta: cupy.ndarray,
                 state: cupy.ndarray, o: cupy.ndarray, *, q_scale: float | None = None, tiled: bool | None = None,
                 stream=None) -> cupy.ndarray:
        """Gated delta rule over n_tokens tokens of one sequence (1: decode), state updated in place.
        Per value head h (q/k head h // (n_v_heads // n_qk_heads)) and token t:
        ``S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T (q_scale q)``.

        q, k: [n_tokens, n_qk_heads, dk]; v, o: [n_tokens, n_v_heads, dv]; g (log decay), beta:
        [n_tokens, n_v_heads]; state: [n_v_heads, dk, dv]; all f32. q_scale defaults to dk**-0.5.
        tiled: the register-tiled kernel (dk in (64, 128)); None picks it when dk allows."""
        check_array("q", q, dtype=_F32, ndim=3)
        n_tokens, n_qk, dk = q.shape
        check_array("k", k, dtype=_F32, shape=q.shape)
        check_array("v", v, dtype=_F32, ndim=3)
        n_v, dv = v.shape[1], v.shape[2]
        if v.shape[0] != n_tokens or q.size == 0 or v.size == 0:
            raise ValueError(f"deltanet: v must be [{n_tokens}, n_v_heads, dv] and non-empty, got {v.shape}")
        if n_v % n_qk:
            raise ValueError(f"deltanet: n_v_heads ({n_v}) must be a multiple of n_qk_heads ({n_qk})")
        check_array("g", g, dtype=_F32, shape=(n_tokens, n_v))
        check_array("beta", beta, dtype=_F32, shape=(n_tokens, n_v))
        check_array("state", state, dtype=_F32, shape=(n_v, dk, dv))
        check_array("o", o, dtype=_F32, shape=(n_tokens, n_v, dv))
        _check_disjoint("deltanet", dict(o=o, state=state), dict(q=q, k=k, v=v, g=g, beta=beta))
        if n_v > _MAX_GRID_Y:
            raise ValueError(f"deltanet: at most {_MAX_GRID_Y} value heads")
        if tiled is None:
            tiled = dk in _DELTANET_TILED_DK
        elif tiled and dk not in _DELTANET_TILED_DK:
            raise ValueError(f"deltanet: the tiled kernel needs dk in {_DELTANET_TILED_DK}, got {dk}")
        params = self.struct("DeltaNetParams").pack(n_tokens=n_tokens, n_v_heads=n_v, n_qk_heads=n_qk, dk=dk, dv=dv,
                                                    q_scale=dk ** -0.5 if q_scale is None else q_scale)
        ptrs = (o, state, q, k, v, g, beta)
        if tiled:
            self._launch(f"deltanet_tiled<{dk}>", (-(-dv // 16), n_v), 128, ptrs, params, stream=stream)
        else:
            self._launch("deltanet", (-(-dv // 64), n_v), 64, ptrs, params, stream=stream)
        return o

"""RoPE and its fusions with the Q/K(/V) norms and the KV write: the kernels of
``cuda_src/elementwise/rope.cuh`` and ``rope_vec.cuh``; :func:`yarn_freqs`, the YaRN frequency table
and magnitude scale that every RoPE method takes as ``freqs=`` and ``attn_scale=``.
"""

from __future__ import annotations

import math

import cupy
import numpy as np

from cukern.dispatch import check_array
from cukern.elementwise.common import (_F32, _I32, _KV_TYPES, _POS_MODES, _act_type, _check_distinct, _check_eps,
                                      _targ, _vec)
from cukern.interop import like, tensors
from cukern.params import check_int, check_real

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


def _qkv_vec_kernel(kv: str, lph: int, q_out: str | None) -> str:
    """qk_norm_rope_kv_vec's instance for a cache of C type kv and q_out of C type q_out (float, or kv; None:
    no Q, the K + V instance)."""
    if q_out is None:
        return f"qk_norm_rope_kv_vec<{kv}, false, true, {lph}>"
    return f"qk_norm_rope_kv_vec<{kv}, true, true, {lph}" + (">" if q_out == "float" else f", {q_out}>")


def yarn_freqs(head_dim: int, *, base: float, factor: float, original_context: int, beta_fast: float = 32.0,
               beta_slow: float = 1.0, ext_factor: float = 1.0, attn_factor: float = 1.0
               ) -> tuple[np.ndarray, float]:
    """YaRN's inverse frequencies and magnitude scale, as llama.cpp's ``rope_yarn`` (ggml) applies them:
    ``(freqs, attn_scale)`` for the RoPE methods' keywords of those names.

    head_dim: rotated elements (the methods' rope_dim; even). Pair j < head_dim / 2 has the plain inverse
    frequency ``e = base ** (-2j / head_dim)`` and the interpolated one ``e / factor``; between the
    correction dims ``lo = max(0, floor(c(beta_fast)))`` and ``hi = min(head_dim - 1, ceil(c(beta_slow)))``,
    ``c(b) = head_dim * ln(original_context / (2 pi b)) / (2 ln base)``, the mix
    ``m = ext_factor * (1 - clip((j - lo) / max(0.001, hi - lo), 0, 1))`` gives ``freqs[j] = e / factor *
    (1 - m) + e * m`` (fast-rotating pairs keep their frequency, slow ones are interpolated). attn_scale =
    ``attn_factor * (1 + 0.1 ln(factor))`` when ext_factor != 0, else attn_factor: it multiplies cos and
    sin, so the rotated elements of Q and K both grow by it (the attention logits by its square).

    Returns freqs: [head_dim // 2] float32 (host; copy it to the device once, at load) and attn_scale.

    gpt-oss's GGUF keys: base = ``gpt-oss.rope.freq_base``, factor = ``gpt-oss.rope.scaling.factor``
    (llama.cpp's freq_scale is its inverse), original_context = ``gpt-oss.rope.scaling.original_context_length``;
    beta_fast, beta_slow and ext_factor keep these defaults (llama.cpp's for a YaRN model). llama.cpp's
    context passes ``rope_yarn`` an attn_factor that cancels its own ``get_mscale(factor)``, so the net
    scale is the ``1 + 0.1 ln(factor)`` above: leave attn_factor 1 (or ``gpt-oss.rope.scaling.attn_factor``
    where the file has it).
    """
    head_dim = check_int("head_dim", head_dim, 2)
    if head_dim % 2:
        raise ValueError(f"yarn_freqs: head_dim must be even, got {head_dim}")
    base, factor = check_real("base", base), check_real("factor", factor)
    original_context = check_int("original_context", original_context, 1)
    beta_fast, beta_slow = check_real("beta_fast", beta_fast), check_real("beta_slow", beta_slow)
    ext_factor, attn_factor = check_real("ext_factor", ext_factor), check_real("attn_factor", attn_factor)
    if not (base > 1 and factor > 0 and beta_fast > 0 and beta_slow > 0):
        raise ValueError(f"yarn_freqs: base must be > 1 and factor, beta_fast, beta_slow > 0, got base {base}, "
                         f"factor {factor}, beta_fast {beta_fast}, beta_slow {beta_slow}")

    def corr_dim(n_rot):  # the pair index whose wavelength fits n_rot times into original_context
        return head_dim * math.log(original_context / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    lo = max(0.0, math.floor(corr_dim(beta_fast)))
    hi = min(head_dim - 1.0, math.ceil(corr_dim(beta_slow)))
    j = np.arange(head_dim // 2, dtype=np.float64)
    extrap = base ** (-2.0 * j / head_dim)
    mix = ext_factor * (1.0 - np.clip((j - lo) / max(0.001, hi - lo), 0.0, 1.0))
    freqs = extrap / factor * (1.0 - mix) + extrap * mix
    scale = attn_factor * (1.0 + 0.1 * math.log(factor)) if ext_factor != 0 else attn_factor
    return freqs.astype(np.float32), float(scale)


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
    head_dim = 8 * LPH (LPH in _ROPE_VEC_LPH), rope_dim % 8 == 0 and every array aligned to 4 of its elements
    (they move 4 elements at a time: 16 bytes of f32, 8 of f16 / bf16)."""
    lph = head_dim // 8
    if (head_dim % 8 or lph not in _ROPE_VEC_LPH or rope_dim % 8
            or any(a.data.ptr % (4 * a.itemsize) for a in arrays)):
        return None
    grid = -(-n_rows // (_ROPE_BLOCK // lph * _ROPE_VEC_ROWS))
    return (lph, grid) if grid <= 2**31 - 1 else None


def _inv_ratio(freq_base: float, rope_dim: int, freqs) -> float:
    """freq_base ** (-2 / rope_dim) in f64 (the kernels raise it to the pair index); unused with freqs."""
    return 1.0 if freqs is not None else float(freq_base) ** (-2.0 / rope_dim)


class Rope:
    """ElementwiseDispatch's rope methods (a mixin: launches through the dispatch's ``_launch``)."""

    def _rope_common(self, what, head_dim, rope_dim, freqs, freq_base, attn_scale):
        if head_dim % 2 or head_dim > _ROPE_MAX_HEAD_DIM:
            raise ValueError(f"{what}: head_dim must be even and <= {_ROPE_MAX_HEAD_DIM}, got {head_dim}")
        rope_dim = head_dim if rope_dim is None else rope_dim  # head_dim <= 64 * max(_ROPE_PPL) holds here
        if not isinstance(rope_dim, (int, np.integer)) or rope_dim < 2 or rope_dim % 2 or rope_dim > head_dim:
            raise ValueError(f"{what}: rope_dim must be even, >= 2 and <= head_dim ({head_dim}), got {rope_dim}")
        if freqs is not None:
            check_array("freqs", freqs, dtype=_F32, shape=(rope_dim // 2,))
        elif not freq_base > 0:
            raise ValueError(f"{what}: freq_base must be > 0, got {freq_base}")
        if not check_real("attn_scale", attn_scale) > 0:
            raise ValueError(f"{what}: attn_scale must be > 0, got {attn_scale}")
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

    @tensors(out=like("x"))
    def rope(self, x: cupy.ndarray, positions: cupy.ndarray, out: cupy.ndarray | None = None, *,
             rope_dim: int | None = None, neox: bool = True, freq_base: float = 10000.0,
             freqs: cupy.ndarray | None = None, attn_scale: float = 1.0, pos_mode: str = "consecutive",
             sections=None, stream=None) -> cupy.ndarray:
        """Rotary embedding of x: [n_tokens, n_heads, head_dim] f32, f16 or bf16 (uint16 bits) into out of x's
        dtype (may be x); computed in f32 (the angles as below), out rounded once.

        rope_dim: rotated leading elements (even, default head_dim); the rest are copied. neox: pairs
        (j, j + rope_dim/2), else interleaved (2j, 2j+1). Angle of pair j: pos * freq_base**(-2j/rope_dim),
        or pos * freqs[j] with freqs: [rope_dim // 2] f32 (e.g. :func:`yarn_freqs`); cos and sin times
        attn_scale (> 0; YaRN's mscale), the copied tail unscaled. positions, int32: "consecutive" [>= 1]
        (token t at positions[0] + t: one decode position, or a prefill chunk), "per_token" [n_tokens],
        "mrope" / "imrope" [4, n_tokens] with ``sections`` = 4 pair counts (multi-section rotary;
        imrope interleaves the sections as Qwen3-VL does)."""
        return self._rope("rope", x, None, positions, out, rope_dim, neox, freq_base, freqs, attn_scale, pos_mode,
                          sections, 0.0, 0.0, stream)

    @tensors(out=like("x"))
    def rms_norm_rope(self, x: cupy.ndarray, w: cupy.ndarray, positions: cupy.ndarray, out: cupy.ndarray | None = None,
                      *, eps: float = 1e-6, weight_offset: float = 0.0, rope_dim: int | None = None, neox: bool = True,
                      freq_base: float = 10000.0, freqs: cupy.ndarray | None = None, attn_scale: float = 1.0,
                      pos_mode: str = "consecutive", sections=None, stream=None) -> cupy.ndarray:
        """Per-head RMS norm (weight w: [head_dim] f32) then :meth:`rope`, in one pass; x, out as :meth:`rope`."""
        return self._rope("rms_norm_rope", x, w, positions, out, rope_dim, neox, freq_base, freqs, attn_scale,
                          pos_mode, sections, eps, weight_offset, stream)

    def _rope(self, what, x, w, positions, out, rope_dim, neox, freq_base, freqs, attn_scale, pos_mode, sections,
              eps, weight_offset, stream):
        check_array("x", x, ndim=3)
        t = _targ(_act_type("x", x))
        n_tokens, n_heads, head_dim = x.shape
        if x.size == 0:
            raise ValueError(f"{what}: x must be non-empty, got shape {x.shape}")
        check_array("out", out, dtype=x.dtype, shape=x.shape)
        if w is not None:
            check_array("w", w, dtype=_F32, shape=(head_dim,))
            _check_eps(eps, what)
        rope_dim = self._rope_common(what, head_dim, rope_dim, freqs, freq_base, attn_scale)
        mode, sections = self._positions(what, positions, pos_mode, n_tokens, sections)
        tpb, grid, smem, ppl = _rope_launch(n_tokens, n_heads, head_dim, rope_dim, self.sm_count())
        params = self.struct("RopeParams").pack(
            n_tokens=n_tokens, n_heads=n_heads, head_dim=head_dim, rope_dim=rope_dim, neox=int(bool(neox)),
            pos_mode=mode, sections=sections, use_freqs=int(freqs is not None), freq_base=freq_base, eps=eps,
            weight_offset=weight_offset, tokens_per_block=tpb, attn_scale=attn_scale,
            inv_ratio=_inv_ratio(freq_base, rope_dim, freqs))
        ptrs = (out, x, w if w is not None else x, freqs if freqs is not None else x, positions)
        vec = _rope_vec_launch(n_tokens * n_heads, head_dim, rope_dim, ptrs[:3])
        if vec is not None:
            lph, vgrid = vec
            self._launch(f"rope_vec<{_vec(w is not None)}, {lph}{t}>", vgrid, _ROPE_BLOCK, ptrs, params,
                         stream=stream)
        else:
            self._launch(f"rope<{_vec(w is not None)}, {ppl}{t}>", grid, _ROPE_BLOCK, ptrs, params, stream=stream,
                         shared_mem=smem)
        return out

    @tensors
    def qk_norm_rope_kv_write(self, q: cupy.ndarray, k: cupy.ndarray, v: cupy.ndarray, wq: cupy.ndarray | None,
                              wk: cupy.ndarray | None, q_out: cupy.ndarray, k_cache: cupy.ndarray,
                              v_cache: cupy.ndarray, page_table: cupy.ndarray, positions: cupy.ndarray,
                              seq_ids: cupy.ndarray, *, eps: float = 1e-6, weight_offset: float = 0.0,
                              rope_dim: int | None = None, neox: bool = True, freq_base: float = 10000.0,
                              freqs: cupy.ndarray | None = None, attn_scale: float = 1.0, v_norm: bool = False,
                              wv: cupy.ndarray | None = None, pos_mode: str = "consecutive",
                              stream=None) -> cupy.ndarray:
        """The attention prologue in one launch: ``q_out = rope(rms_norm(q) * (wq + off))``, K cache row
        ``= rope(rms_norm(k) * (wk + off))``, V cache row ``= v``, per head.

        q: [n_tokens, n_q_heads, head_dim] f32; k, v: [n_tokens, n_kv_heads, head_dim] f32; wq, wk:
        [head_dim] f32, or both None for no norm (rotation only); q_out: f32 like q, or of the caches'
        dtype (Q rounded once for a tensor-core attention; the vectorised kernel's shapes only: head_dim
        8 * 4..32, arrays aligned to 4 elements); caches (f32, f16 or bf16 as uint16 bits), page_table,
        positions, seq_ids and pos_mode as :meth:`kv_write` ("per_token" is the batched decode of several
        sequences); rope arguments (freqs, attn_scale: Q and K alike) as :meth:`rope`; v_norm, wv as
        :meth:`k_norm_rope_kv_write`. Returns q_out."""
        check_array("q", q, dtype=_F32, ndim=3)
        check_array("q_out", q_out, shape=q.shape)
        if q_out.dtype not in (_F32, k_cache.dtype):
            raise TypeError(f"qk_norm_rope_kv_write: q_out must be float32 or the caches' {k_cache.dtype}, "
                            f"got {q_out.dtype}")
        n_tokens, n_q, head_dim = q.shape
        check_array("k", k, dtype=_F32, ndim=3)
        if k.shape[0] != n_tokens or k.shape[2] != head_dim:
            raise ValueError(f"qk_norm_rope_kv_write: k must be [{n_tokens}, n_kv_heads, {head_dim}], got {k.shape}")
        if n_q == 0 or k.shape[1] == 0 or n_tokens == 0:
            raise ValueError("qk_norm_rope_kv_write: empty q or k")
        if n_q % k.shape[1]:
            raise ValueError(f"qk_norm_rope_kv_write: n_q_heads ({n_q}) must be a multiple of n_kv_heads ({k.shape[1]})")
        check_array("v", v, dtype=_F32, shape=k.shape)  # required here (the V write of _qkv is optional)
        check_array("v_cache", v_cache, ndim=4)
        return self._qkv("qk_norm_rope_kv_write", q, k, v, wq, wk, wv, v_norm, q_out, k_cache, v_cache, page_table,
                         positions, seq_ids, eps, weight_offset, rope_dim, neox, freq_base, freqs, attn_scale,
                         pos_mode, stream)

    @tensors
    def k_norm_rope_kv_write(self, k: cupy.ndarray, wk: cupy.ndarray | None, k_cache: cupy.ndarray,
                             page_table: cupy.ndarray, positions: cupy.ndarray, seq_ids: cupy.ndarray, *,
                             v: cupy.ndarray | None = None, v_cache: cupy.ndarray | None = None,
                             v_norm: bool = False, wv: cupy.ndarray | None = None, eps: float = 1e-6,
                             weight_offset: float = 0.0, rope_dim: int | None = None, neox: bool = True,
                             freq_base: float = 10000.0, freqs: cupy.ndarray | None = None, attn_scale: float = 1.0,
                             pos_mode: str = "consecutive", stream=None) -> cupy.ndarray:
        """:meth:`qk_norm_rope_kv_write` without Q: K cache row ``= rope(rms_norm(k) * (wk + off))`` (wk None:
        no norm) and, given v and v_cache, V cache row ``= v`` in the same launch. v_norm: the V row is
        ``rms_norm(v)`` instead, times ``(wv + off)`` with wv: [head_dim] f32, of unit weight with wv None
        (eps and off shared with K). Returns k_cache."""
        check_array("k", k, dtype=_F32, ndim=3)
        if k.size == 0:
            raise ValueError("k_norm_rope_kv_write: k must be non-empty")
        if (v is None) != (v_cache is None):
            raise ValueError("k_norm_rope_kv_write: give v and v_cache together (the V write) or neither")
        self._qkv("k_norm_rope_kv_write", None, k, v, None, wk, wv, v_norm, None, k_cache, v_cache, page_table,
                  positions, seq_ids, eps, weight_offset, rope_dim, neox, freq_base, freqs, attn_scale, pos_mode,
                  stream)
        return k_cache

    def _qkv_v(self, what, k, v, wv, v_norm, k_cache, v_cache, page_table):
        """Checks of the V write (v None: none); returns QkvRopeParams.v_norm."""
        if v is None:
            if v_norm or wv is not None:
                raise ValueError(f"{what}: v_norm and wv need v and v_cache")
            return 0
        check_array("v", v, dtype=_F32, shape=k.shape)
        check_array("v_cache", v_cache, ndim=4)
        if v_cache.dtype != k_cache.dtype or v_cache.shape != k_cache.shape:
            raise ValueError(f"{what}: k_cache and v_cache must have the same shape and dtype")
        self._kv_target(what, v_cache, page_table, k.shape[1], k.shape[2], "v_cache")
        if wv is not None and not v_norm:
            raise ValueError(f"{what}: wv is the V norm's weight: pass v_norm=True with it")
        if wv is not None:
            check_array("wv", wv, dtype=_F32, shape=(k.shape[2],))
        return 0 if not v_norm else 2 if wv is not None else 1

    def _qkv(self, what, q, k, v, wq, wk, wv, v_norm, q_out, k_cache, v_cache, page_table, positions, seq_ids, eps,
             weight_offset, rope_dim, neox, freq_base, freqs, attn_scale, pos_mode, stream):
        n_tokens, n_kv, head_dim = k.shape
        has_q, has_v = q is not None, v is not None
        norm = wk is not None
        if has_q and (wq is None) != (wk is None):
            raise ValueError(f"{what}: give both wq and wk (norm) or neither (rotation only)")
        if norm:
            check_array("wk", wk, dtype=_F32, shape=(head_dim,))
            if has_q:
                check_array("wq", wq, dtype=_F32, shape=(head_dim,))
        rope_dim = self._rope_common(what, head_dim, rope_dim, freqs, freq_base, attn_scale)
        page_size, max_pages = self._kv_target(what, k_cache, page_table, n_kv, head_dim, "k_cache")
        v_mode = self._qkv_v(what, k, v, wv, v_norm, k_cache, v_cache, page_table)
        if norm or v_mode:
            _check_eps(eps, what)
        if has_q:
            _check_distinct(what, q_out=q_out, q=q)
        mode = self._seq_positions(what, positions, seq_ids, pos_mode, n_tokens)
        n_q = q.shape[1] if has_q else 0
        heads = n_q + n_kv * (2 if has_v else 1)
        tpb, grid, smem, ppl = _rope_launch(n_tokens, heads, head_dim, rope_dim, self.sm_count())
        params = self.struct("QkvRopeParams").pack(
            n_tokens=n_tokens, n_q_heads=n_q, n_kv_heads=n_kv, head_dim=head_dim, rope_dim=rope_dim,
            neox=int(bool(neox)), pos_mode=mode, use_freqs=int(freqs is not None), freq_base=freq_base, eps=eps,
            weight_offset=weight_offset, page_size=page_size, max_pages=max_pages, norm=int(norm),
            tokens_per_block=tpb, v_norm=v_mode, attn_scale=attn_scale,
            inv_ratio=_inv_ratio(freq_base, rope_dim, freqs))
        kv = _KV_TYPES[k_cache.dtype]
        unread = k  # any device pointer for arguments the instance never reads
        ptrs = (q_out if has_q else unread, k_cache, v_cache if has_v else k_cache, q if has_q else unread, k,
                v if has_v else unread, wq if (has_q and norm) else unread, wk if norm else unread,
                wv if wv is not None else unread, freqs if freqs is not None else unread, positions, seq_ids,
                page_table)
        vec = _rope_vec_launch(n_tokens * heads, head_dim, rope_dim, ptrs[:9])
        q_out_type = _KV_TYPES[q_out.dtype] if has_q else None
        if vec is None and q_out_type not in (None, "float"):
            raise ValueError(f"{what}: a {q_out.dtype} q_out needs the vectorised kernel (head_dim in "
                             f"{ROPE_VEC_HEAD_DIMS}, rope_dim % 8 == 0, arrays aligned to 4 elements), got head_dim "
                             f"{head_dim}, rope_dim {rope_dim}")
        if vec is not None and not (has_q or has_v):
            lph = vec[0]
            rows = 1 if n_tokens * n_kv < _K_ROPE_FEW_ROWS else 2
            kgrid = -(-n_tokens * n_kv // (_ROPE_BLOCK // lph * rows))
            self._launch(f"k_norm_rope_kv_vec<{kv}, {lph}, {rows}>", kgrid, _ROPE_BLOCK,
                         (k_cache, k, ptrs[7], ptrs[9], positions, seq_ids, page_table), params, stream=stream)
        elif vec is not None:
            lph, vgrid = vec
            self._launch(_qkv_vec_kernel(kv, lph, q_out_type), vgrid, _ROPE_BLOCK, ptrs, params, stream=stream)
        else:
            flags = f"{_vec(has_q)}, {_vec(has_v)}, {ppl}"
            self._launch(f"qk_norm_rope_kv<{kv}, {flags}>", grid, _ROPE_BLOCK, ptrs, params, stream=stream,
                         shared_mem=smem)
        return q_out

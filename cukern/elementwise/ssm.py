"""SSM / DeltaNet: causal conv1d + SiLU, the gated delta rule and its gates: the kernels of
``cuda_src/elementwise/ssm.cuh``.
"""

from __future__ import annotations

import cupy
import numpy as np

from cukern.dispatch import check_array
from cukern.elementwise.common import _F32, _MAX_GRID_Y, _check_disjoint, _check_distinct, _check_eps
from cukern.interop import like, tensors

_CONV_CHUNK = 16  # ssm.cuh CONV_CHUNK: tokens of an out-of-place thread; in place, tokens per span up to 512
_CONV_IP_CHANNELS = 32  # ssm.cuh CONV_IP_CHANNELS: channels of a conv1d_silu_in_place block
_CONV_IP_SPANS = 32  # ssm.cuh CONV_IP_SPANS: spans of a conv1d_silu_in_place block at most
_CONV_K = (2, 3, 4)
_TAP_TYPES = (_F32, np.dtype(np.float16))  # conv1d_silu's taps
_TAP_C = ("float", "__half")
_DELTANET_TILED_DK = (64, 128)


def _conv_in_place_spans(n_tokens: int) -> tuple[int, int]:
    """(spans, tokens per span) of conv1d_silu_in_place, whose block holds every token of 32 channels.

    One span per _CONV_CHUNK tokens, 32 at most: up to 32 * 16 = 512 tokens the launch has as many threads,
    each walking at most 16 tokens, as the out-of-place one (short prompts keep their parallelism); beyond,
    the 32 spans lengthen instead, since a block holds 1024 threads at most and in place forbids splitting
    a channel's tokens over blocks. Example: 8192 tokens x 8192 channels: 256 blocks of 1024 threads (one
    resident per SM above 32 registers a thread: two waves, 132 + 124 blocks, on a 132-SM H200), 256
    tokens per thread, the 16 loads of a chunk in flight; the K - 1 halo reads per span add 3 / 256 of the
    input (K = 4). The spans split the tokens evenly and none is empty (spans = ceil(n / span))."""
    spans = min(_CONV_IP_SPANS, -(-n_tokens // _CONV_CHUNK))
    span = -(-n_tokens // spans)
    return -(-n_tokens // span), span


class Ssm:
    """ElementwiseDispatch's ssm methods (a mixin: launches through the dispatch's ``_launch``)."""

    @tensors(y=like("x"))
    def conv1d_silu(self, x: cupy.ndarray, state: cupy.ndarray, w: cupy.ndarray, y: cupy.ndarray | None = None, *,
                    state_offset: int | None = None, stream=None) -> cupy.ndarray:
        """Depthwise causal conv1d + SiLU over n_tokens tokens (1: decode; more: prefill) with a state of
        the previous kernel_size - 1 inputs, updated in place: x, y [n_tokens, n_channels] f32 (y may be
        x: in place); state [kernel_size - 1, n_channels] f32; w [n_channels, kernel_size] f32 or f16
        (taps oldest first), kernel_size in (2, 3, 4). In place runs ``conv1d_silu_in_place``: a block
        holds every token of 32 channels, in spans that read the inputs before them before any span writes.

        state_offset None: the state's rows are oldest first and shift by n_tokens at each call.
        An int in [0, kernel_size - 1): the rows are a ring whose oldest entry is row state_offset; the
        call writes only the rows of the inputs it adds, and the caller's next state_offset is
        ``(state_offset + n_tokens) % (kernel_size - 1)``."""
        n_tokens, n_ch = self._rows(x)
        check_array("w", w, dtype=_TAP_TYPES, ndim=2)
        K = w.shape[1]
        if w.shape[0] != n_ch or K not in _CONV_K:
            raise ValueError(f"conv1d_silu: w must be [{n_ch}, kernel_size] with kernel_size in {_CONV_K}, got {w.shape}")
        check_array("state", state, dtype=_F32, shape=(K - 1, n_ch))
        check_array("y", y, dtype=_F32, shape=(n_tokens, n_ch))
        ring = state_offset is not None
        if ring and (isinstance(state_offset, bool) or not isinstance(state_offset, (int, np.integer))
                     or not 0 <= state_offset < K - 1):
            raise ValueError(f"conv1d_silu: state_offset must be None or an int in [0, {K - 1}), got {state_offset!r}")
        in_place = y.data.ptr == x.data.ptr
        _check_disjoint("conv1d_silu", dict(y=None if in_place else y, state=state), dict(x=x, w=w))
        tap = "float" if w.dtype == _F32 else "__half"
        if in_place:
            spans, span = _conv_in_place_spans(n_tokens)
            params = self.struct("ConvParams").pack(n_tokens=n_tokens, n_channels=n_ch, kernel_size=K,
                                                    tokens_per_thread=span, ring=int(ring),
                                                    state_offset=int(state_offset or 0))
            self._launch(f"conv1d_silu_in_place<{K}, {tap}>", (-(-n_ch // _CONV_IP_CHANNELS),),
                         (_CONV_IP_CHANNELS, spans), (y, state, w), params, stream=stream)
            return y
        grid = (-(-n_ch // 128), -(-n_tokens // _CONV_CHUNK))
        if grid[1] > _MAX_GRID_Y:
            raise ValueError(f"conv1d_silu: at most {_MAX_GRID_Y * _CONV_CHUNK} tokens per call")
        params = self.struct("ConvParams").pack(n_tokens=n_tokens, n_channels=n_ch, kernel_size=K,
                                                tokens_per_thread=_CONV_CHUNK, ring=int(ring),
                                                state_offset=int(state_offset or 0))
        self._launch(f"conv1d_silu<{K}, {tap}>", grid, 128, (y, state, x, w), params, stream=stream)
        return y

    @tensors(o=like("v"))
    def deltanet(self, q: cupy.ndarray, k: cupy.ndarray, v: cupy.ndarray, g: cupy.ndarray, beta: cupy.ndarray,
                 state: cupy.ndarray, o: cupy.ndarray | None = None, *, q_scale: float | None = None,
                 qk_l2norm: bool = False, norm_eps: float = 1e-6, tiled: bool | None = None,
                 stream=None) -> cupy.ndarray:
        """Gated delta rule over n_tokens tokens of one sequence (1: decode), state updated in place.
        Per value head h (q/k head h // (n_v_heads // n_qk_heads)) and token t:
        ``S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T (q_scale q)``.

        q, k: [n_tokens, n_qk_heads, dk]; v, o: [n_tokens, n_v_heads, dv]; g (log decay), beta:
        [n_tokens, n_v_heads]; state: [n_v_heads, dk, dv]; all f32. q_scale defaults to dk**-0.5.
        qk_l2norm: each head of q and k L2-normalised in the kernel first, ``x * rsqrt(sum(x^2) + norm_eps)``
        (as ``group_norm(l2=True)`` without a weight), so the projections' outputs go in as they are.
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
        _check_eps(norm_eps, "deltanet")
        if tiled is None:
            tiled = dk in _DELTANET_TILED_DK
        elif tiled and dk not in _DELTANET_TILED_DK:
            raise ValueError(f"deltanet: the tiled kernel needs dk in {_DELTANET_TILED_DK}, got {dk}")
        params = self.struct("DeltaNetParams").pack(n_tokens=n_tokens, n_v_heads=n_v, n_qk_heads=n_qk, dk=dk, dv=dv,
                                                    q_scale=dk ** -0.5 if q_scale is None else q_scale,
                                                    qk_l2norm=int(bool(qk_l2norm)), norm_eps=norm_eps)
        ptrs = (o, state, q, k, v, g, beta)
        if tiled:
            self._launch(f"deltanet_tiled<{dk}>", (-(-dv // 16), n_v), 128, ptrs, params, stream=stream)
        else:
            self._launch("deltanet", (-(-dv // 64), n_v), 64, ptrs, params, stream=stream)
        return o

    @tensors
    def deltanet_gates(self, ba: cupy.ndarray, a: cupy.ndarray, dt_bias: cupy.ndarray, g: cupy.ndarray,
                       beta: cupy.ndarray, *, group: int, stream=None):
        """DeltaNet's gates from the in-projection's beta/alpha logits: ``beta = sigmoid(b)``,
        ``g = a * softplus(alpha + dt_bias)`` per token and value head (g is the log decay :meth:`deltanet`
        takes). ba: [n_tokens, 2 * n_v_heads] f32, per key head ``group`` b logits then ``group`` alphas
        (value head h = kh * group + r; group = n_v_heads: one [b | alpha] row); a (= -exp(A_log)), dt_bias:
        [n_v_heads] f32; g, beta: [n_tokens, n_v_heads] f32. Returns (g, beta)."""
        n_tokens, two_v = self._rows(ba, "ba")
        n_v = two_v // 2
        if two_v % 2 or not isinstance(group, (int, np.integer)) or group < 1 or n_v % group:
            raise ValueError(f"deltanet_gates: ba must be [n_tokens, 2 * n_v_heads] and group a divisor of n_v_heads, "
                             f"got ba {ba.shape}, group {group!r}")
        check_array("a", a, dtype=_F32, shape=(n_v,))
        check_array("dt_bias", dt_bias, dtype=_F32, shape=(n_v,))
        check_array("g", g, dtype=_F32, shape=(n_tokens, n_v))
        check_array("beta", beta, dtype=_F32, shape=(n_tokens, n_v))
        _check_disjoint("deltanet_gates", dict(g=g, beta=beta), dict(ba=ba, a=a, dt_bias=dt_bias))
        _check_distinct("deltanet_gates", g=g, beta=beta)
        units = n_tokens * n_v
        if units > 2**31 - 1:
            raise ValueError("deltanet_gates: too many gates")
        params = self.struct("DeltaNetGateParams").pack(n_tokens=n_tokens, n_v_heads=n_v, group=int(group))
        self._launch("deltanet_gates", -(-units // 256), 256, (g, beta, ba, a, dt_bias), params, stream=stream)
        return g, beta

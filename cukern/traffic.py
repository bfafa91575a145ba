"""Bytes and FLOPs of each op as the benchmarks count them: one formula per op, written once.

``profiling/bench_<family>.py`` divide these by the measured time for a row's GB/s or TFLOP/s, and
``docs/ARCHITECTURE.md``'s tables quote the same counts. Bytes are what an op must move at least:
every activation read and written once, weights once per launch (L1/L2 reuse not counted). f32
activations are 4 bytes an element; ``w_bytes`` / ``e_bytes`` are a weight matrix's / one expert's
GGUF bytes (``QWeight.nbytes``). Pure arithmetic on ints and floats: importable without CuPy.

Example: ``dmmv(w_bytes=4096 * 14336 * 144 // 256, m=4096, k=14336)`` (Q4_K, one column) is the
weights' 33,030,144 bytes plus 4 * (14336 + 4096) of x and y: 33,103,872.
"""

from __future__ import annotations

F32 = 4  # bytes of an f32 activation
Q8_1_BLOCK_BYTES, Q8_1_BLOCK = 36, 32  # a Q8_1 block: half2 (d, d * sum) and 32 int8


# ------------------------------------------------------------------ dmmv
def dmmv(w_bytes: int, m: int, k: int, n: int = 1) -> int:
    """y = W x for n columns: W once, n columns of x read and of y written."""
    return w_bytes + F32 * n * (k + m)


def dmmv_prequantized(w_bytes: int, m: int, qx_bytes: int) -> int:
    """y = W x on a QuantizedX of ``qx_bytes``: W once, the quantized x read, y written."""
    return w_bytes + qx_bytes + F32 * m


def dmmv_glu(w_bytes: int, m: int, k: int) -> int:
    """y = act(W_g x) * (W_u x): both matrices of ``w_bytes`` once, x read, y written."""
    return 2 * w_bytes + F32 * (k + m)


def dmmv_glu_normed(w_bytes: int, m: int, k: int) -> int:
    """dmmv_glu behind a residual add + norm (two launches or one NormedX launch): both matrices, the
    residual and proj read, the new residual and the normed x (or the norms' weights) moved, y written."""
    return 2 * w_bytes + F32 * (4 * k + m)


def dmmv_merged(w_bytes: int, m: int, n_states: int, n_heads: int, head_dim: int) -> int:
    """dmmv on a MergedX (or merge_states then dmmv): W once, the split states (O and LSE of every state
    and head) read once, y written; the merged x moved in the unfused chain is not counted."""
    return w_bytes + F32 * (n_states * n_heads * (head_dim + 1) + m)


def quantized_x_bytes(k: int, n: int = 1) -> int:
    """Bytes of a QuantizedX of n columns of k: per column k int8 and 8 bytes per 32, rounded up to 16."""
    return n * ((k + k // 4 + 15) // 16 * 16)


def quantize_x(k: int, qx_bytes: int) -> int:
    """x quantized into a QuantizedX: x read, the QuantizedX written."""
    return F32 * k + qx_bytes


def ffn_down(w_bytes: int, m: int, k: int) -> int:
    """The FFN's down projection after gate and up (act(gate) * up, then W h): gate and up read, W once,
    y written (the intermediate h not counted)."""
    return w_bytes + 2 * F32 * k + F32 * m


def moe_dmmv(e_bytes: int, m: int, k: int, top_k: int, *, glu: bool = False) -> int:
    """One token's top_k experts (with ``glu`` two matrices each): every slot's expert once, x read, the
    top_k outputs written."""
    return (2 if glu else 1) * top_k * e_bytes + F32 * (k + top_k * m)


def moe_down(e_bytes: int, m: int, k: int, top_k: int) -> int:
    """One token's down projection and weighted sum: every slot's expert once, each slot's h and weight
    read, y written."""
    return top_k * e_bytes + F32 * top_k * (k + 1) + F32 * m


def moe_packed(e_bytes: int, m: int, k: int, top_k: int, n_tokens: int, n_active: float) -> float:
    """n_tokens tokens' experts token-batched: each of the ``n_active`` experts used once, x read and
    the n_tokens * top_k outputs written."""
    return n_active * e_bytes + F32 * n_tokens * (k + top_k * m)


def dmmv_pair(w_bytes: int, m: int, k: int, *, normed: bool = False) -> int:
    """y1 = W1 x, y2 = W2 x on one input (two m x k matrices of ``w_bytes``): both once, x read, y1 and y2
    written; ``normed``: x made from a NormedX (the residual and the norm's weight read)."""
    return 2 * w_bytes + F32 * ((2 if normed else 1) * k + 2 * m)


def moe_packed_sum(e_bytes: int, m: int, k: int, top_k: int, n_tokens: int, n_active: float) -> float:
    """The packed down projection summed into y (``moe_dmmv_packed(accumulate=True, weights=)``, or its
    outputs then ``moe_weighted_sum``): each of the ``n_active`` experts once, every slot's x and weight
    read, y [n_tokens, m] read and written (the per-slot outputs of the unfused chain not counted)."""
    return n_active * e_bytes + F32 * (n_tokens * top_k * (k + 1) + 2 * n_tokens * m)


def count_experts(n_tokens: int, top_k: int, n_experts: int) -> int:
    """moe_count_experts: the ids of every slot read (int32), the [n_experts] counts written."""
    return F32 * (n_tokens * top_k + n_experts)


# ------------------------------------------------------------------ elementwise
# Ops over n rows of ``width`` f32 values (a token's row, or all its heads: width = n_heads * head_dim):
# (arrays of the activations' size read, written; f32 vectors of ``width`` read once; 4-byte values
# read per row: positions, gates)
ROWS = {
    "rms_norm": (1, 1, 1, 0),
    "residual_rms_norm": (2, 2, 1, 0),
    "post_norm_residual_rms_norm": (2, 2, 2, 0),
    "rms_norm_accumulate": (2, 1, 1, 0),
    "head_rms_norm": (1, 1, 0, 0),
    "rope": (1, 1, 0, 0),
    "rms_norm_rope": (1, 1, 0, 0),
    "rope_per_token": (1, 1, 0, 1),
    "deinterleave": (2, 2, 0, 0),  # [n, heads, 2 * head_dim] in, two [n, heads, head_dim] out
    "gated_rms_norm": (2, 1, 0, 0),
    "group_norm": (1, 1, 0, 0),
    "binary": (2, 1, 0, 0),  # add, mul, swiglu, geglu, sigmoid_mul, scale_accumulate
    "scale": (1, 1, 0, 0),
    "bias_add": (1, 1, 1, 0),
    "shared_expert_accumulate": (2, 1, 0, 1),
}


def rows(op: str, n: int, width: int) -> int:
    """Bytes of a row op of :data:`ROWS` over n rows of ``width`` f32 values."""
    reads, writes, vectors, per_row = ROWS[op]
    return F32 * (n * width * (reads + writes) + width * vectors + n * per_row)


def q8_1_bytes(values: int) -> int:
    """Bytes of ``values`` f32 values quantized to Q8_1 blocks."""
    return values * Q8_1_BLOCK_BYTES // Q8_1_BLOCK


def residual_rms_norm_q8_1(n: int, width: int) -> int:
    """proj and the residual read, the residual written, the normed rows written as Q8_1, the weight once."""
    return 3 * F32 * n * width + q8_1_bytes(n * width) + F32 * width


def quantize_q8_1(n: int, width: int) -> int:
    """f32 rows read, Q8_1 blocks written."""
    return F32 * n * width + q8_1_bytes(n * width)


def qk_norm_rope_kv_write(n: int, n_heads: int, n_kv_heads: int, head_dim: int, kv_itemsize: int = 2) -> int:
    """Q read and written (q_rot), K and V read as f32 and written into the cache."""
    kv = n * n_kv_heads * head_dim
    return 2 * F32 * n * n_heads * head_dim + 2 * kv * F32 + 2 * kv * kv_itemsize


def kv_write(n: int, n_kv_heads: int, head_dim: int, kv_itemsize: int = 2) -> int:
    """Rows of n tokens read as f32 and written into the cache (kv_write, k_norm_rope_kv_write)."""
    return n * n_kv_heads * head_dim * (F32 + kv_itemsize)


def kv_pair_write(n: int, n_kv_heads: int, head_dim: int, kv_itemsize: int = 2) -> int:
    """K and V rows of n tokens read as f32 and written into their caches (k_norm_rope_kv_write with v=)."""
    return 2 * kv_write(n, n_kv_heads, head_dim, kv_itemsize)


def deltanet_gates(n_tokens: int, n_v_heads: int) -> int:
    """The [n_tokens, 2 n_v_heads] logits read, g and beta written, a and dt_bias read once."""
    return F32 * (4 * n_tokens * n_v_heads + 2 * n_v_heads)


def softmax_topk(n_tokens: int, n_experts: int, k: int) -> int:
    """Router logits read, k ids and k weights written per token."""
    return F32 * n_tokens * (n_experts + 2 * k)


def moe_weighted_sum(n_tokens: int, k: int, width: int) -> int:
    """k expert outputs (and the weights, counted as one more row) read, one row written per token."""
    return F32 * n_tokens * (k + 1) * width


def router_matvec(n_tokens: int, n_embd: int, n_experts: int, *, norm: bool = False) -> int:
    """x and the router matrix read once, the logits written (with ``norm`` the norm's weight too)."""
    return F32 * (n_tokens * n_embd + n_experts * n_embd + n_tokens * n_experts + (n_embd if norm else 0))


def router_flops(n_tokens: int, n_embd: int, n_experts: int) -> int:
    return 2 * n_tokens * n_experts * n_embd


def conv1d_silu(n_tokens: int, n_channels: int, k: int, *, ring: bool = False) -> int:
    """x read and y written; the state (the last k - 1 tokens of every channel) read and written (``ring``: a
    ring state of which only the rows of the added inputs, min(n_tokens, k - 1), are written); the
    [n_channels, k] filter once."""
    written = min(n_tokens, k - 1) if ring else k - 1
    return F32 * (2 * n_tokens * n_channels + (k - 1 + written) * n_channels + n_channels * k)


def deltanet(n_tokens: int, n_qk_heads: int, n_v_heads: int, dk: int, dv: int) -> int:
    """The state ([n_v_heads, dk, dv]) read and written, q and k ([n_tokens, n_qk_heads, dk]) and v
    read, o ([n_tokens, n_v_heads, dv]) written (the gates not counted)."""
    return F32 * (2 * n_v_heads * dk * dv + 2 * n_tokens * n_qk_heads * dk + 2 * n_tokens * n_v_heads * dv)


# ------------------------------------------------------------------ attention
def kv_cache(b: int, kv_len: int, hk: int, d: int, kv_itemsize: int = 2) -> int:
    """The keys and values of b sequences of kv_len tokens, hk KV heads of head_dim d."""
    return b * kv_len * hk * d * 2 * kv_itemsize


def attention_decode(b: int, kv_len: int, h: int, hk: int, d: int, kv_itemsize: int = 2) -> int:
    """One query token of b sequences: every cached key and value of every KV head once, q read, o
    written."""
    return kv_cache(b, kv_len, hk, d, kv_itemsize) + 2 * b * h * d * F32


def attention_prefill_flops(b: int, h: int, L: int, d: int, causal: bool) -> float:
    """Q K^T and P V over b sequences of L tokens: 4 b h L^2 d, half of it under a causal mask."""
    return (2.0 if causal else 4.0) * b * h * L * L * d


def attention_backward_flops(b: int, h: int, L: int, d: int, causal: bool) -> float:
    """The backward's S, dP, dV, dK and dQ products: 2.5 x the forward's (10 b h L^2 d, half of it causal);
    the deterministic dQ pass's recomputed S and dP are not counted."""
    return 2.5 * attention_prefill_flops(b, h, L, d, causal)


# ------------------------------------------------------------------ matmul
def gemm_flops(m: int, n: int, k: int, *, glu: bool = False) -> float:
    """D = W B for n columns (``glu``: the gate and up matrices, twice the products)."""
    return (4.0 if glu else 2.0) * m * n * k


# ------------------------------------------------------------------ tokens
def embed(n_tokens: int, row_bytes: int, d_model: int) -> int:
    """n_tokens rows of the table read (``row_bytes`` each), f32 rows written."""
    return n_tokens * (row_bytes + F32 * d_model)


def sample(n_rows: int, vocab: int) -> int:
    """The logits read once (the candidates of stage 2 not counted)."""
    return F32 * n_rows * vocab


# ------------------------------------------------------------------ models
def decode_step(matrix_bytes) -> int:
    """One decode step of a whole batch: every weight matrix (its GGUF bytes, an iterable) read once;
    activations, norms and the KV cache not counted."""
    return sum(int(b) for b in matrix_bytes)

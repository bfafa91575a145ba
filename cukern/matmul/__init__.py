"""MatmulDispatch: quantized GEMMs for prefill (N token columns against raw GGUF weights), the fused
gate+up+activation GEMMs, one-pass activation quantizers and the whole-matrix dequantizer.

Kernels: ``cuda_src/matmul/`` (block formats in ``cuda_src/common/quants.cuh``, Q8_1 in
``cuda_src/common/q8_1.cuh``); float64 references: ``cukern/reference/matmul.py``; tests:
``tests/test_matmul*.py``; benchmark: ``profiling/bench_matmul.py``; measurements and the designs
not kept: ``docs/notes/matmul.md``.

Layouts (the dmmv family's): a weight is a :class:`cukern.dmmv.QWeight` (raw GGUF bytes, type,
``m`` rows of ``k`` elements, byte offset). Activations ``b`` are ``[n, k]`` (one row per token),
outputs ``d`` are ``[n, m]``; both may be row-strided views (unit stride along the row). ``b`` is
f32 or f16; ``d`` is f32.

Paths (:meth:`MatmulDispatch.plan_path` is the rule, :meth:`MatmulDispatch.matmul` applies it,
``path=`` overrides it): ``"matvec"`` for N <= 8 (the dmmv family's batched matvec reads the
weights once per launch), ``"int8"`` only when the activations already are Q8_1 (it never beat the
f16 path), ``"f16"`` otherwise. The f16 path (:meth:`gemm`, :meth:`gemm_glu`) has two kernels:

* ``gemm_wgr`` (gemm_wgr.cuh; sm_90a, from ``WG_MIN_N`` = 256 columns, ``wgmma=`` overrides):
  ``wgmma`` with the weights dequantized straight into the A-operand registers, activations
  (an f32 b first rounded to f16 into a staging buffer) by the tensor copy engine. Token tile
  (128 or 256) and K split come from a stage-cost model over the waves of CTAs (``_wgr_plan``).
  On a :class:`PackedWeight` (:meth:`pack`, :meth:`pack_glu`: weights repacked tile-major once at
  load) the same kernel moves each super-stage by one bulk copy and runs at any N.
* ``gemm_f16`` (gemm.cuh; any arch): W dequantized to f16 tiles in shared memory,
  ``mma.sync.m16n8k16``; token tiles 16..128, K split across CTAs (atomics into a zeroed ``d``)
  when the tile grid cannot fill the GPU.

The int8 path (:meth:`gemm_q8`, :meth:`gemm_q8_glu`) runs Q8_1 activations against int8 quants on
``mma.sync`` s8 tensor cores with exact integer dot products per 32-block.

Every method validates its arguments before any launch; nothing here synchronises or reads device
values (graph-capturable), and nothing allocates device memory but :meth:`pack` / :meth:`pack_glu`
and the f16 staging buffer of f32 activations (one per (k, stream), regrown by a call with more rows:
run one call of each shape before capturing a graph). :meth:`gemm` and :meth:`gemm_glu` replay a
repeated call's checked launch (the last 256 distinct calls), so an eager prefill loop pays the
checks once per call site.
"""

from cukern.matmul.common import (FAMILIES, FAMILY, GEMM_QTYPES, MOE_QTYPES, PACKED_LAYOUTS, PackedWeight, q8_0_row_bytes,
                                  q8_1_row_bytes)
from cukern.matmul.dispatch import MatmulDispatch

__all__ = ["MatmulDispatch", "PackedWeight", "FAMILY", "FAMILIES", "GEMM_QTYPES", "MOE_QTYPES", "PACKED_LAYOUTS", "q8_1_row_bytes",
           "q8_0_row_bytes"]

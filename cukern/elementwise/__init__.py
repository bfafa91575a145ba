"""ElementwiseDispatch: norms, activations, RoPE, KV writes, MoE routing and SSM/DeltaNet kernels.

Kernels: ``cuda_src/elementwise/`` (f32 units ``elementwise`` and ``elementwise_rope``, 16-bit units
``elementwise_f16`` and ``elementwise_bf16``, the bf16 caches' KV writers ``elementwise_kv_bf16``; one header
per group); float64 references: ``cukern/reference/elementwise.py``; tests:
``tests/test_elementwise{,_rope,_rope_kv,_moe,_ssm,_shapes}.py`` (f32; f32/f16/bf16 caches) and
``tests/test_elementwise_f16.py`` (f16 / bf16); benchmark:
``profiling/bench_elementwise.py``; measurements: ``docs/notes/elementwise.md``. One module per
kernel header (``norms``, ``activations``, ``rope``, ``kv``, ``moe``, ``ssm``: a mixin of
:class:`ElementwiseDispatch`'s methods each), the units and the class in ``dispatch``.

Conventions: arrays are row-major and C-contiguous unless a method says otherwise. Activations are f32,
except in the row and group norms, the binary ops / gated activations and ``rope`` / ``rms_norm_rope``,
which take float32, float16 or bfloat16 (as uint16 bit patterns, the package's convention, or an
ml_dtypes bfloat16 array), compute in f32 and write their outputs in the input's dtype: every activation
array of a call (input, output, residual, gate, bias) has the one dtype; norm weights and RoPE frequencies
are f32 always (small, read through L2, kept at full precision). Every
method validates its arguments and raises TypeError/ValueError before any launch; nothing here
synchronises, allocates device memory or reads device values, so every method can be captured in a
CUDA graph. Device-side index arrays (positions, sequence ids, page tables) are int32 and are not
range-checked on the host (that would need a device read): keeping them in range is the caller's
contract, as with FlashInfer's page indices.
"""

from cukern.elementwise.dispatch import FAMILIES, FAMILY, ROPE_FAMILY, ElementwiseDispatch
from cukern.elementwise.kv import contiguous_page_table
from cukern.elementwise.norms import Q8_1_BLOCK, Q8_1_BLOCK_BYTES
from cukern.elementwise.rope import ROPE_VEC_HEAD_DIMS, yarn_freqs
from cukern.routing import RouteSlot

__all__ = ["ElementwiseDispatch", "FAMILY", "ROPE_FAMILY", "FAMILIES", "Q8_1_BLOCK", "Q8_1_BLOCK_BYTES",
           "ROPE_VEC_HEAD_DIMS", "RouteSlot", "contiguous_page_table", "yarn_freqs"]

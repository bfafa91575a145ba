"""ElementwiseDispatch: norms, activations, RoPE, KV writes, MoE routing and SSM/DeltaNet kernels.

Kernels: ``cuda_src/elementwise/`` (two units, one header per group); float64 references:
``cukern/reference/elementwise.py``; tests: ``tests/test_elementwise.py``; benchmark:
``profiling/bench_elementwise.py``; measurements: ``docs/notes/elementwise.md``. One module per
kernel header (``norms``, ``activations``, ``rope``, ``kv``, ``moe``, ``ssm``: a mixin of
:class:`ElementwiseDispatch`'s methods each), the units and the class in ``dispatch``.

Conventions: activations are f32, row-major, C-contiguous unless a method says otherwise; every
method validates its arguments and raises TypeError/ValueError before any launch; nothing here
synchronises, allocates device memory or reads device values, so every method can be captured in a
CUDA graph. Device-side index arrays (positions, sequence ids, page tables) are int32 and are not
range-checked on the host (that would need a device read): keeping them in range is the caller's
contract, as with FlashInfer's page indices.
"""

from cukern.elementwise.dispatch import FAMILIES, FAMILY, ROPE_FAMILY, ElementwiseDispatch
from cukern.elementwise.kv import contiguous_page_table
from cukern.elementwise.norms import Q8_1_BLOCK, Q8_1_BLOCK_BYTES
from cukern.elementwise.rope import ROPE_VEC_HEAD_DIMS

__all__ = ["ElementwiseDispatch", "FAMILY", "ROPE_FAMILY", "FAMILIES", "Q8_1_BLOCK", "Q8_1_BLOCK_BYTES",
           "ROPE_VEC_HEAD_DIMS", "contiguous_page_table"]

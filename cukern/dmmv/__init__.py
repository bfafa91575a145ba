"""DmmvDispatch: matrix-vector products over raw GGUF-quantized weights, their fusions, and the
mixture-of-experts matvecs driven by a device-side routing buffer.

Kernels: ``cuda_src/dmmv/`` (block formats in ``cuda_src/common/quants.cuh``); float64
references: ``cukern/reference/dmmv.py``; tests: ``tests/test_dmmv*.py``; benchmark:
``profiling/bench_dmmv.py``; measurements: ``docs/notes/dmmv.md``. One module per kernel source
(``dense``: dmmv.cu's f32 path, ``q8``: the int8 path of q8.cuh, ``moe``: moe.cu and
moe_packed.cu: a mixin of :class:`DmmvDispatch`'s methods each), the operands in ``weights``,
the units and the class in ``dispatch``.

A weight is described once by a :class:`QWeight` (buffer of raw GGUF bytes, type, rows, columns,
byte offset, and for MoE the expert count and stride); everything about it is validated there,
so the per-call checks are on the activations only. Activations are f32, C-contiguous, 16-byte
aligned. Ten compilation units (each stays under ~10 s of NVRTC): ``dmmv`` (plain, batched,
pair, the epilogues, dequantize), ``dmmv_glu`` (gate + up + activation), ``dmmv_moe`` (expert
matvecs, down + weighted sum, routing), ``dmmv_moe_packed`` (token-batched experts),
``dmmv_q8x`` (x, or the FFN's act(gate) * up, quantized once into a :class:`QuantizedX`, and the
int8 matvecs that read it), ``dmmv_two`` (pair and gate + up + activation on the int8 path),
``dmmv_nx`` (dmmv, pair and GLU on a :class:`NormedX`), ``dmmv_three`` (q, k and v on one
NormedX), ``dmmv_mx`` (dmmv on a :class:`MergedX`: split attention states merged in) and
``dmmv_split_tc`` (dmmv on a :class:`SplitQ8` at 2, 4 and 8 columns, on tensor cores).
"""

from cukern.dmmv.dense import THREE_TYPES
from cukern.dmmv.dispatch import (FAMILIES, FAMILY, GLU_FAMILY, MOE_FAMILY, MX_FAMILY, NX_FAMILY, PACKED_FAMILY,
                                  Q8X_FAMILY, SPLIT_TC_FAMILY, THREE_FAMILY, TWO_FAMILY, DmmvDispatch)
from cukern.dmmv.moe import DeviceError
from cukern.routing import RouteSlot
from cukern.dmmv.weights import (Q8_TYPES, QTYPES, MergedX, MoeRoute, NormedX, QuantizedX, QWeight, SplitQ8, qtype_id,
                                 row_bytes)

__all__ = ["DmmvDispatch", "QWeight", "SplitQ8", "NormedX", "MergedX", "QuantizedX", "MoeRoute", "RouteSlot",
           "QTYPES", "Q8_TYPES",
           "FAMILY", "GLU_FAMILY", "MOE_FAMILY", "PACKED_FAMILY", "Q8X_FAMILY", "TWO_FAMILY", "NX_FAMILY", "THREE_FAMILY",
           "MX_FAMILY", "SPLIT_TC_FAMILY", "THREE_TYPES", "DeviceError", "FAMILIES", "qtype_id",
           "row_bytes"]

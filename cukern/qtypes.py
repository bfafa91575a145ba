"""GGML tensor type ids by name: ``ggml.h``'s ``enum ggml_type``, the ids GGUF files store.

An :class:`enum.IntEnum`, so a member is the id itself: it keys and indexes the tables that bare ids
do (``QTYPES[GGMLType.Q4_K] is QTYPES[12]``) and formats as the id in kernel template arguments
(``f"gemm_f16<{GGMLType.Q4_K}, ...>"`` is ``"gemm_f16<12, ...>"``). Only the types cukern reads.
"""

from __future__ import annotations

import enum

__all__ = ["GGMLType"]


class GGMLType(enum.IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q5_0 = 6
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30
    MXFP4 = 39

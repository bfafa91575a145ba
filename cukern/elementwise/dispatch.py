"""ElementwiseDispatch: the family's compilation units and the dispatch class, assembled from one mixin per
kernel header. Units: ``elementwise`` (``elementwise.cu``) and ``elementwise_rope`` (``rope_kv.cu``) hold the
f32 kernels (with the KV writers of f32 and f16 caches); ``elementwise_f16`` and ``elementwise_bf16``
(``act16.cu``) the 16-bit instances of the kernels templated on the activation type; ``elementwise_kv_bf16``
(``rope_kv.cu``) the KV writers of bf16 caches; so that each unit compiles in seconds and only when first used.
"""

from __future__ import annotations

from cukern.dispatch import Dispatch, Unit, repeatable
from cukern.elementwise.activations import Activations
from cukern.elementwise.common import _targ
from cukern.elementwise.kv import KvWrites
from cukern.elementwise.moe import (_ROUTER_GEMM_CONFIGS, _ROUTER_LARGE, _ROUTER_SMALL, _TOPK_EPL, _TOPK_LANES_M,
                                    _TOPK_LANES_V, Moe)
from cukern.elementwise.norms import (_GROUP_VPL, _LOOP_BLOCK, _LOOP_KERNELS, _REG_CONFIGS, _REG_CONFIGS_FEW_ROWS,
                                      _REG_KERNELS, Norms)
from cukern.elementwise.rope import _K_ROPE_ROWS, _ROPE_PPL, _ROPE_VEC_LPH, Rope, _qkv_vec_kernel
from cukern.elementwise.ssm import _CONV_K, _DELTANET_TILED_DK, _TAP_C, Ssm
from cukern.runtime import FamilySpec, KernelSpec


def _kernels() -> list[KernelSpec]:
    """Kernels of the first unit, elementwise.cu: norms, activations, MoE routing, SSM/DeltaNet (f32)."""
    ks = _act_kernels("float", norms=_REG_KERNELS)
    ks.append(KernelSpec("quantize_q8_1", "QuantizeParams"))
    ks.append(KernelSpec("softmax_topk", "TopkParams"))
    ks += [KernelSpec(f"softmax_topk_reg<{e}>", "TopkParams") for e in _TOPK_EPL]
    ks += [KernelSpec(f"softmax_topk_lanes<{v}, {m}>", "TopkParams") for v in _TOPK_LANES_V for m in _TOPK_LANES_M]
    ks += [KernelSpec(f"moe_weighted_sum<{v}>", "MoeSumParams") for v in ("true", "false")]
    ks += [KernelSpec(f"shared_expert_accumulate<{v}>", "SharedGateParams") for v in ("true", "false")]
    ks += [KernelSpec(f"router_matvec<{e}, {t}, {b}>", "RouterParams") for e, t, b in (_ROUTER_SMALL, _ROUTER_LARGE)]
    ks += [KernelSpec(f"router_gemm<{n}, {bk}, {st}>", "RouterParams") for n in ("false", "true")
           for bk, st in _ROUTER_GEMM_CONFIGS]
    ks += [KernelSpec(f"conv1d_silu{v}<{k}, {t}>", "ConvParams") for v in ("", "_in_place") for k in _CONV_K
           for t in _TAP_C]
    ks.append(KernelSpec("deltanet", "DeltaNetParams"))
    ks += [KernelSpec(f"deltanet_tiled<{dk}>", "DeltaNetParams") for dk in _DELTANET_TILED_DK]
    ks.append(KernelSpec("deltanet_gates", "DeltaNetGateParams"))
    return ks


def _act_kernels(t: str, norms=_LOOP_KERNELS) -> list[KernelSpec]:
    """The kernels templated on the activation type t (C type): row norms (register versions of ``norms``,
    loop versions), group norms and binary_rows."""
    ks = [KernelSpec(f"{name}_reg<{b}, {i}{_targ(t)}>", "RmsNormParams") for name in norms
          for b, i in _REG_CONFIGS + _REG_CONFIGS_FEW_ROWS]
    ks += [KernelSpec(f"{name}_loop<{_LOOP_BLOCK}{_targ(t)}>", "RmsNormParams") for name in _LOOP_KERNELS]
    ks += [KernelSpec(f"group_norm<{g}{_targ(t)}>", "GroupNormParams") for g in ("false", "true")]
    ks += [KernelSpec(f"group_norm_reg<{g}, {v}{_targ(t)}>", "GroupNormParams") for g in ("false", "true")
           for v in _GROUP_VPL[4 if t == "float" else 2]]
    ks += [KernelSpec(f"binary_rows<{op}, {v}{_targ(t)}>", "BinaryParams") for op in range(6) for v in ("true", "false")]
    return ks


def _rope_act_kernels(t: str) -> list[KernelSpec]:
    """rope / rms_norm_rope (scalar and vectorised) for the activation type t."""
    ks = [KernelSpec(f"rope<{n}, {ppl}, {g}{_targ(t)}>", "RopeParams") for n in ("false", "true") for ppl, g in _ROPE_PPL]
    ks += [KernelSpec(f"rope_vec<{n}, {lph}{_targ(t)}>", "RopeParams") for n in ("false", "true")
           for lph in _ROPE_VEC_LPH]
    return ks


def _kv_kernels(kv: str) -> list[KernelSpec]:
    """The KV writers (fused with the norms and RoPE, and plain) for a cache of C type kv."""
    ks = [KernelSpec(f"qk_norm_rope_kv<{kv}, {hq}, {ppl}, {g}>", "QkvRopeParams")
          for hq in ("true, true", "false, true", "false, false") for ppl, g in _ROPE_PPL]
    ks += [KernelSpec(_qkv_vec_kernel(kv, lph, qo), "QkvRopeParams")
           for lph in _ROPE_VEC_LPH for qo in (("float",) if kv == "float" else ("float", kv))]
    ks += [KernelSpec(_qkv_vec_kernel(kv, lph, None), "QkvRopeParams") for lph in _ROPE_VEC_LPH]
    ks += [KernelSpec(f"k_norm_rope_kv_vec<{kv}, {lph}, {r}>", "QkvRopeParams")
           for lph in _ROPE_VEC_LPH for r in _K_ROPE_ROWS]
    ks += [KernelSpec(f"kv_write<{kv}, {v}>", "KvWriteParams") for v in ("true", "false")]
    return ks


def _rope_kernels() -> list[KernelSpec]:
    """Kernels of the second unit, rope_kv.cu: RoPE and its fusions, the KV writers of f32 and f16 caches,
    deinterleave."""
    ks = _rope_act_kernels("float") + _kv_kernels("float") + _kv_kernels("__half")
    ks += [KernelSpec(f"deinterleave<{v}>", "DeinterleaveParams") for v in ("float", "float4")]
    return ks


FAMILY = FamilySpec(name="elementwise", kernels=tuple(_kernels()))
ROPE_FAMILY = FamilySpec(name="elementwise_rope", kernels=tuple(_rope_kernels()), source="elementwise/rope_kv.cu",
                         params_header="elementwise/params.cuh")
# bf16 caches' KV writers: a unit of their own (rope_kv.cu again), compiled only when a bf16 cache first needs it
KV_BF16_FAMILY = FamilySpec(name="elementwise_kv_bf16", kernels=tuple(_kv_kernels("__nv_bfloat16")),
                            source="elementwise/rope_kv.cu", params_header="elementwise/params.cuh")
ACT16_FAMILIES = tuple(FamilySpec(name=f"elementwise_{short}", kernels=tuple(_act_kernels(t) + _rope_act_kernels(t)),
                                  source="elementwise/act16.cu", params_header="elementwise/params.cuh")
                       for short, t in (("f16", "__half"), ("bf16", "__nv_bfloat16")))
_UNITS = (ROPE_FAMILY, KV_BF16_FAMILY) + ACT16_FAMILIES  # every unit but FAMILY
FAMILIES = {f.name: f for f in (FAMILY,) + _UNITS}  # cukern.families() lists each unit


class ElementwiseDispatch(Norms, Activations, Rope, KvWrites, Moe, Ssm, Dispatch):
    """Records elementwise kernels into a stream. Every method takes ``stream=`` (None: CuPy's
    current stream, torch's for torch tensors: cukern.interop), validates its arguments before
    launching, and returns its main output.

    Dtypes: the row norms (``rms_norm``, ``residual_rms_norm``, ``post_norm_residual_rms_norm``,
    ``rms_norm_accumulate``), the group norms (``head_rms_norm``, ``group_norm``, ``gated_rms_norm``), the
    binary ops and gated activations (``add``, ``add_scaled``, ``scale``, ``scale_accumulate``,
    ``sigmoid_mul``, ``bias_add``, ``swiglu``, ``swiglu_oai``, ``geglu``) and ``rope`` /
    ``rms_norm_rope`` take activations in float32, float16 or bfloat16 (uint16 bits), picked by the
    input's dtype; every activation array of a call has that dtype and so has the output, which is
    rounded once from f32 arithmetic. Norm weights and RoPE frequencies stay f32. The 16-byte vector paths
    hold 16 / itemsize elements (4 floats, 8 halves), so a 16-bit row takes them when its length is a
    multiple of 8 and its arrays are 16-byte aligned (RoPE: 4 elements, 8 bytes); other shapes take the
    scalar kernels. The KV writers (``kv_write``, ``qk_norm_rope_kv_write``, ``k_norm_rope_kv_write``) read f32
    rows into f32, f16 or bf16 (uint16 bits) caches. Every other method is f32 only.

    ``pdl`` (default False; sm_90+) launches every kernel with programmatic dependent launch: each
    waits for the previous kernel in the stream first thing (``pdl_enter`` in common/pdl.cuh), so
    its launch and block start-up overlap that kernel's tail, as in a model's decode step.

    Every method is ``repeatable`` (cukern.dispatch): a call repeated with the same arrays (pointer,
    shape, strides, dtype), values and keywords replays the first one's launches, checks skipped."""

    family = FAMILY
    _UNIT_OF = {k.name: f.name for f in _UNITS for k in f.kernels}  # else FAMILY's

    def __init__(self, device: int | None = None, *, pdl: bool = False):
        super().__init__(device)
        self.pdl = bool(pdl)
        self._units = {f.name: Unit(f, device) for f in _UNITS}  # compiled when first used

    def _launch(self, kernel, grid, block, pointers, params, *, stream=None, shared_mem=0):
        name = self._UNIT_OF.get(kernel)
        unit = super() if name is None else self._units[name]
        unit._launch(kernel, grid, block, pointers, params, stream=stream, shared_mem=shared_mem, pdl=self.pdl)


# Every public method of the family is a function of its arguments alone (arrays, numbers, the
# dispatch's pdl): a call repeated with the same arrays and values replays the first one's launches.
for _mixin in (Norms, Activations, Rope, KvWrites, Moe, Ssm):
    for _name, _fn in vars(_mixin).items():
        if not _name.startswith("_") and callable(_fn):
            setattr(ElementwiseDispatch, _name, repeatable(_fn))

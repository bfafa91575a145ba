"""The CPU-only compile check behind ``python -m cukern check --arch sm_XX``.

For each arch: compile every family unit with NVRTC (no GPU, no driver), then
for each declared kernel read its ``.entry`` from the PTX and check the
calling convention: every parameter but the last is a device pointer
(``.u64``) or a tensor map (``cukern::TensorMap``: 128 bytes, 64-byte
aligned, from ``dispatch.tensor_map_2d``), the last is the declared struct,
of the dtype's size and alignment. Entries in the PTX that no FamilySpec declares are errors too
(an undeclared kernel could never be launched through a Dispatch). Each
params header is also compiled as a layout probe (``cukern.params``), whose
``static_assert``\\ s pin every offset to the NumPy dtype.

A unit is compiled for the target the GPU runs it as: on sm_90 the Hopper units
(:func:`sm90a_units`: wgmma prefill and GEMM) are built for ``compute_90a``, as
``runtime.load_module_sm90a`` builds them (for ``compute_90`` they are empty stubs);
``--arch sm_90a`` builds every unit for ``compute_90a``.
"""

from __future__ import annotations

from dataclasses import dataclass

from cukern import families as _families
from cukern import params, runtime


def sm90a_units() -> set[str]:
    """The units an sm_90 device runs built for sm_90a."""
    from cukern import matmul
    from cukern.attention.dispatch import _SM90A_UNITS
    return set(_SM90A_UNITS) | {matmul.FAMILIES[f"matmul_f16_{s}"].name for s in matmul.GEMM_QTYPES.values()}


@dataclass
class Row:
    arch: int
    unit: str
    kernel: str
    struct: str
    struct_size: int  # bytes, from the NumPy dtype
    ptx_size: int  # bytes, from the PTX (-1 when unknown)
    error: str = ""
    arch_specific: bool = False  # compiled for compute_<arch>a

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def target(self) -> str:
        return f"sm_{self.arch}{'a' if self.arch_specific else ''}"


def _tensor_map(p) -> bool:
    """A by-value cukern::TensorMap (common/mbarrier.cuh): 128 bytes, 64-byte aligned."""
    return p.kind == ".b8" and p.size == 128 and p.align >= 64


def check_family(spec: runtime.FamilySpec, arch: int, arch_specific: bool = False) -> list[Row]:
    """Rows for every kernel of ``spec`` compiled for ``arch`` (the ``a`` target when asked, or
    where an sm_90 device runs the unit as sm_90a)."""
    structs = params.load_header(spec.params_header)
    names = tuple(k.name for k in spec.kernels)
    specific = arch_specific or (arch == 90 and spec.name in sm90a_units())
    rows = _check_unit(spec, structs, names, arch, specific)
    for r in rows:
        r.arch_specific = specific
    return rows


def _check_unit(spec, structs, names, arch: int, specific: bool) -> list[Row]:
    try:
        compiled = runtime.compile_ptx(spec.name, spec.unit_source(), names, arch, spec.defines,
                                       arch_specific=specific)
    except runtime.CukernError as e:
        return [Row(arch, spec.name, "(unit)", "", 0, -1, str(e))]
    rows = []
    for k in spec.kernels:
        struct = structs.get(k.params)
        if struct is None:
            rows.append(Row(arch, spec.name, k.name, k.params, 0, -1,
                            f"{spec.params_header} declares no struct {k.params}"))
            continue
        size, align = struct.dtype.itemsize, struct.dtype.alignment
        ps = compiled.params(k.name)
        row = Row(arch, spec.name, k.name, k.params, size, ps[-1].size if ps else -1)
        if not ps:
            row.error = "takes no parameters (expected pointers, then the struct)"
        elif ps[-1].kind != ".b8" or ps[-1].size != size or ps[-1].align != align:
            row.error = (f"last parameter is {ps[-1].kind}[{ps[-1].size}] align {ps[-1].align}; "
                         f"{k.params} is {size} bytes, align {align}")
        else:
            bad = [p for p in ps[:-1] if p.kind not in (".u64", ".b64") and not _tensor_map(p)]
            if bad:
                row.error = (f"parameter {bad[0].index} is {bad[0].kind}: only device pointers and tensor maps "
                             f"may precede the struct (no bare scalars in a launch)")
        rows.append(row)
    declared = set(compiled.lowered.values())
    for entry in runtime.ptx_entries(compiled.ptx):
        if entry not in declared:
            rows.append(Row(arch, spec.name, entry, "", 0, -1, "kernel in the unit but not declared in its FamilySpec"))
    return rows


def check_header(header: str, arch: int, arch_specific: bool = False) -> Row:
    n = len(params.load_header(header))
    try:
        runtime.compile_ptx(f"probe:{header}", params.layout_probe_source(header), (), arch,
                            arch_specific=arch_specific)
    except runtime.CukernError as e:
        return Row(arch, f"probe:{header}", f"layout of {n} structs", "", 0, -1, str(e), arch_specific)
    return Row(arch, f"probe:{header}", f"layout of {n} structs", "", 0, 0, "", arch_specific)


def run(targets, family_names=None) -> list[Row]:
    """Check every family (or those named) for each target: an arch (``90``) or an
    ``(arch, arch_specific)`` pair from ``runtime.parse_target``."""
    import cukern
    specs = _families() if not family_names else [cukern.family(n) for n in family_names]
    rows = []
    for target in targets:
        arch, specific = target if isinstance(target, tuple) else (target, False)
        for spec in specs:
            rows.extend(check_family(spec, arch, specific))
        headers = sorted({s.params_header for s in specs})
        rows.extend(check_header(h, arch, specific) for h in headers)
    return rows

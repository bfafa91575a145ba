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

:func:`run` compiles the units in a process pool (NVRTC compiles a unit on one core) and
keeps each unit's PTX in an on-disk cache (:func:`cache_dir`), keyed by the unit's text
(which carries a SHA-256 of every file under ``cuda_src/``), the options, the target, the
kernel names, the NVRTC version and the CUDA headers: an unchanged tree is checked again
from the PTX, and any edit to a source or header compiles the units anew.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import cukern
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


def check_family(spec: runtime.FamilySpec, arch: int, arch_specific: bool = False,
                 cache: Path | None = None) -> list[Row]:
    """Rows for every kernel of ``spec`` compiled for ``arch`` (the ``a`` target when asked, or
    where an sm_90 device runs the unit as sm_90a); PTX from ``cache`` when given and present."""
    structs = params.load_header(spec.params_header)
    names = tuple(k.name for k in spec.kernels)
    specific = arch_specific or (arch == 90 and spec.name in sm90a_units())
    rows = _check_unit(spec, structs, names, arch, specific, cache)
    for r in rows:
        r.arch_specific = specific
    return rows


def _check_unit(spec, structs, names, arch: int, specific: bool, cache: Path | None = None) -> list[Row]:
    try:
        compiled = _compile(spec.name, spec.unit_source(), names, arch, spec.defines, specific, cache)
    except runtime.CukernError as e:
        return [Row(arch, spec.name, "(unit)", "", 0, -1, str(e))]
    entries = runtime.ptx_entries(compiled.ptx)   # parsed once (CompiledPtx.params parses it per call)
    rows = []
    for k in spec.kernels:
        struct = structs.get(k.params)
        if struct is None:
            rows.append(Row(arch, spec.name, k.name, k.params, 0, -1,
                            f"{spec.params_header} declares no struct {k.params}"))
            continue
        size, align = struct.dtype.itemsize, struct.dtype.alignment
        ps = entries.get(compiled.lowered.get(k.name, k.name))
        row = Row(arch, spec.name, k.name, k.params, size, ps[-1].size if ps else -1)
        if ps is None:
            row.error = "no entry for it in the PTX"
        elif not ps:
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
    for entry in entries:
        if entry not in declared:
            rows.append(Row(arch, spec.name, entry, "", 0, -1, "kernel in the unit but not declared in its FamilySpec"))
    return rows


def check_header(header: str, arch: int, arch_specific: bool = False, cache: Path | None = None) -> Row:
    n = len(params.load_header(header))
    try:
        _compile(f"probe:{header}", params.layout_probe_source(header), (), arch, (), arch_specific, cache)
    except runtime.CukernError as e:
        return Row(arch, f"probe:{header}", f"layout of {n} structs", "", 0, -1, str(e), arch_specific)
    return Row(arch, f"probe:{header}", f"layout of {n} structs", "", 0, 0, "", arch_specific)


# ----------------------------------------------------------------------------- the PTX cache

def cache_dir() -> Path:
    """Where the check keeps PTX: ``$CUKERN_CACHE_DIR``, else ``$XDG_CACHE_HOME/cukern``, else
    ``~/.cache/cukern``."""
    if os.environ.get("CUKERN_CACHE_DIR"):
        return Path(os.environ["CUKERN_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cukern"


@lru_cache(maxsize=1)
def _toolchain() -> str:
    """The NVRTC version and a hash of the CUDA headers the kernels include (a CUDA wheel
    upgraded in place keeps its path)."""
    h = hashlib.sha256(".".join(map(str, runtime._nvrtc().getVersion())).encode())
    inc = runtime.cuda_include_dir()
    for name in ("cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h", "cuda_bf16.hpp"):
        try:
            h.update((Path(inc) / name).read_bytes() if inc else b"")
        except OSError:
            h.update(b"-")
    return h.hexdigest()


def _cache_path(cache: Path, unit: str, code: str, names, arch: int, defines, specific: bool) -> Path:
    """The file holding this compile's PTX: a SHA-256 of everything the PTX depends on. ``code``
    names the family file by path only, so the hash of every source (:func:`runtime.sources_hash`)
    is part of the key even where ``code`` does not carry it (the layout probes)."""
    key = hashlib.sha256("\0".join(["cukern-check-ptx/1", unit, code, runtime.sources_hash(), *names, str(arch),
                                    str(specific), *runtime.compile_options(arch, defines), _toolchain()]).encode())
    return cache / "ptx" / f"{unit.replace(':', '_').replace('/', '_')}-{key.hexdigest()[:32]}.json"


def _compile(unit: str, code: str, names, arch: int, defines, specific: bool,
             cache: Path | None) -> runtime.CompiledPtx:
    """:func:`runtime.compile_ptx`, through the PTX cache when ``cache`` is a folder. Only a
    successful compile is stored: a unit that fails is compiled (and reported) every time."""
    if cache is None:
        return runtime.compile_ptx(unit, code, names, arch, defines, arch_specific=specific)
    path = _cache_path(cache, unit, code, names, arch, defines, specific)
    try:
        data = json.loads(path.read_text())
        return runtime.CompiledPtx(unit, arch, data["ptx"], data["lowered"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    compiled = runtime.compile_ptx(unit, code, names, arch, defines, arch_specific=specific)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")   # atomic for concurrent checks
        tmp.write_text(json.dumps({"ptx": compiled.ptx, "lowered": compiled.lowered}))
        os.replace(tmp, path)
    except OSError:   # a read-only cache slows the next run; it does not fail this one
        pass
    return compiled


def _cached(cache: Path | None, task) -> bool:
    """Whether ``task``'s PTX is in the cache (it is then checked in this process, no worker)."""
    if cache is None:
        return False
    unit, arch, specific = task
    try:
        if unit.startswith("probe:"):
            header = unit[len("probe:"):]
            key = (unit, params.layout_probe_source(header), (), arch, (), specific)
        else:
            spec = cukern.family(unit)
            specific = specific or (arch == 90 and unit in sm90a_units())
            key = (unit, spec.unit_source(), tuple(k.name for k in spec.kernels), arch, spec.defines, specific)
        return _cache_path(cache, *key).is_file()
    except (runtime.CukernError, ValueError, OSError):
        return False


# ----------------------------------------------------------------------------- units and the run

def family_units(name: str) -> list[str]:
    """The units of family ``name``: every unit its module declares (``attention``: the 13
    attention units; ``dmmv``: every ``dmmv*`` unit)."""
    units = [u for u, mod in cukern.FAMILY_MODULES.items() if mod.rsplit(".", 1)[1] == name]
    if not units:
        known = sorted({mod.rsplit(".", 1)[1] for mod in cukern.FAMILY_MODULES.values()})
        hint = f"; {name!r} is a unit: use --unit {name}" if name in cukern.FAMILY_MODULES else ""
        raise runtime.UnknownKernelError(f"unknown family {name!r} (known: {', '.join(known)}){hint}")
    return units


def select_units(family_names=None, unit_names=None) -> list[str]:
    """The units to check: those of the families named, then the units named (each once, in
    declaration order); every unit when neither is given."""
    if not family_names and not unit_names:
        return list(cukern.FAMILY_MODULES)
    chosen = [u for name in family_names or () for u in family_units(name)]
    for name in unit_names or ():
        cukern.family(name)   # UnknownKernelError naming the known units
        chosen.append(name)
    return [u for u in cukern.FAMILY_MODULES if u in set(chosen)]


def _run_task(task, cache: Path | None) -> list[Row]:
    """The rows of one compile: a unit (``name``) or a header's layout probe (``probe:header``)."""
    unit, arch, specific = task
    if unit.startswith("probe:"):
        return [check_header(unit[len("probe:"):], arch, specific, cache)]
    return check_family(cukern.family(unit), arch, specific, cache)


def run(targets, family_names=None, unit_names=None, *, jobs: int = 1, cache: Path | None = None,
        progress=None) -> list[Row]:
    """Check the units of the families named and the units named (every unit when neither is
    given) for each target: an arch (``90``) or an ``(arch, arch_specific)`` pair from
    ``runtime.parse_target``. Compiles not in ``cache`` run in a pool of ``jobs`` processes;
    ``progress(task, done, total)`` is called as each finishes. The rows come in a fixed order: per
    target, the units, then the layout probes of their headers."""
    units = select_units(family_names, unit_names)
    headers = sorted({cukern.family(u).params_header for u in units})
    tasks = []
    for target in targets:
        arch, specific = target if isinstance(target, tuple) else (target, False)
        tasks += [(u, arch, specific) for u in units] + [(f"probe:{h}", arch, specific) for h in headers]
    results: dict[int, list[Row]] = {}

    def finished(i: int, rows: list[Row]) -> None:
        results[i] = rows
        if progress:
            progress(tasks[i], len(results), len(tasks))
    todo = []
    for i, task in enumerate(tasks):
        if _cached(cache, task):
            finished(i, _run_task(task, cache))
        else:
            todo.append(i)
    if len(todo) > 1 and jobs > 1:
        # spawn: a worker never inherits the parent's threads (a progress bar's) or its NVRTC state
        with ProcessPoolExecutor(max_workers=min(jobs, len(todo)),
                                 mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(_run_task, tasks[i], cache): i for i in todo}
            for f in as_completed(futures):
                finished(futures[f], f.result())
    else:
        for i in todo:
            finished(i, _run_task(tasks[i], cache))
    return [r for i in range(len(tasks)) for r in results[i]]

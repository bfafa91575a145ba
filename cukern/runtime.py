"""Finding, compiling and caching cukern's CUDA modules.

A *family* (attention, elementwise, dmmv, ...) is one compilation unit:
``cuda_src/<family>/<family>.cu``, which includes headers from
``cuda_src/common/`` and its own folder. :class:`FamilySpec` names the unit,
its parameter header and every kernel it exports (with the struct each kernel
takes by value).

Two ways to compile, one set of options (:func:`compile_options`):

* on a GPU, :func:`load_module` builds a ``cupy.RawModule`` for the device's
  arch, once per (source hash, options, arch) in this process and in CuPy's
  on-disk kernel cache (``CUPY_CACHE_DIR``);
* without a GPU, :func:`compile_ptx` runs NVRTC alone for a named arch and
  returns the PTX, which ``python -m cukern check`` inspects.

CuPy keys its disk cache on the source text only, not on included headers, so
the unit's text starts with a SHA-256 of every file it can include: editing a
header invalidates the cache. The unit then ``#include``\\ s the family file by
path, so NVRTC reports errors as ``/path/to/cuda_src/<family>/x.cuh(LINE)``.

This module imports CuPy lazily: ``import cukern`` works without it.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

__all__ = [
    "CukernError", "CompileError", "UnsupportedArchError", "UnknownKernelError",
    "KernelSpec", "FamilySpec", "source_root", "parse_arch", "device_arch", "compile_options",
    "load_module", "load_module_sm90a", "parse_target", "Sm90aModule", "compile_ptx", "PtxParam", "ptx_entries", "MIN_ARCH",
]

MIN_ARCH = 80  # cp.async, bf16 mma.sync and ldmatrix are used freely from sm_80 on


class CukernError(Exception):
    """Base class of cukern's own errors."""


class CompileError(CukernError):
    """NVRTC rejected a unit; the message carries its log (file(line): error ...)."""


class UnsupportedArchError(CukernError, ValueError):
    """An arch older than MIN_ARCH, unknown to this NVRTC, or not of the form sm_XX."""


class UnknownKernelError(CukernError, KeyError):
    """A kernel or family name that no FamilySpec declares."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


# --------------------------------------------------------------------------- sources

def _candidate_roots() -> list[Path]:
    pkg = Path(__file__).resolve().parent
    return [pkg / "cuda_src",        # installed: shipped as package data
            pkg.parent / "cuda_src"]  # source tree: cukern/ beside cuda_src/


@lru_cache(maxsize=1)
def source_root() -> Path:
    """The cuda_src/ folder: $CUKERN_SRC if set (a working copy of the sources), else the one
    inside the installed package, else the one beside cukern/ in a checkout."""
    override = os.environ.get("CUKERN_SRC")
    if override:
        root = Path(override).resolve()
        if not (root / "common" / "types.cuh").is_file():
            raise CukernError(f"CUKERN_SRC={override} does not hold cukern's sources (no common/types.cuh)")
        return root
    for root in _candidate_roots():
        if (root / "common" / "types.cuh").is_file():
            return root
    raise CukernError("cukern's CUDA sources were not found; looked in "
                      + ", ".join(str(r) for r in _candidate_roots()))


@dataclass(frozen=True)
class KernelSpec:
    name: str  # extern "C" name, or a template name expression such as "rms_norm<256, true>"
    params: str  # the parameter struct it takes by value, last


@dataclass(frozen=True)
class FamilySpec:
    """One compilation unit and the kernels it exports."""

    name: str  # also the folder under cuda_src/
    kernels: tuple[KernelSpec, ...]
    source: str = ""  # defaults to "<name>/<name>.cu"
    params_header: str = ""  # defaults to "<name>/params.cuh"
    defines: tuple[str, ...] = ()  # extra -D options
    _by_name: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not self.source:
            object.__setattr__(self, "source", f"{self.name}/{self.name}.cu")
        if not self.params_header:
            object.__setattr__(self, "params_header", f"{self.name}/params.cuh")
        for k in self.kernels:
            if k.name in self._by_name:
                raise ValueError(f"family {self.name}: kernel {k.name} declared twice")
            self._by_name[k.name] = k

    def kernel(self, name: str) -> KernelSpec:
        try:
            return self._by_name[name]
        except KeyError:
            raise UnknownKernelError(f"family {self.name} has no kernel {name!r}") from None

    def unit_source(self) -> str:
        """The text handed to NVRTC: a hash of every includable file, then the family file."""
        path = source_root() / self.source
        if not path.is_file():
            raise CukernError(f"family {self.name}: source {self.source} not found under {source_root()}")
        return f'// cukern unit {self.name} sources-sha256 {sources_hash()}\n#include "{self.source}"\n'


def sources_hash() -> str:
    """SHA-256 over every .cu/.cuh file (path and contents) under cuda_src/."""
    h = hashlib.sha256()
    root = source_root()
    for p in sorted(root.rglob("*")):
        if p.suffix in (".cu", ".cuh") and p.is_file():
            h.update(str(p.relative_to(root)).encode())
            h.update(b"\0")
            h.update(p.read_bytes())
    return h.hexdigest()


# --------------------------------------------------------------------------- arch and options

def parse_arch(arch: str | int) -> int:
    """"sm_90", "90", 90 -> 90. Raises UnsupportedArchError below MIN_ARCH or when malformed."""
    text = str(arch).strip().lower()
    m = re.fullmatch(r"(?:sm_|compute_)?(\d{2,3})a?", text)
    if not m:
        raise UnsupportedArchError(f"arch {arch!r} is not of the form sm_XX (e.g. sm_90)")
    value = int(m.group(1))
    if value < MIN_ARCH:
        raise UnsupportedArchError(f"arch sm_{value} is not supported: cukern needs sm_{MIN_ARCH} or newer")
    return value


def parse_target(arch: str | int) -> tuple[int, bool]:
    """"sm_90a" -> (90, True), "sm_90" / "90" / 90 -> (90, False): the arch and whether it is the
    arch-specific target (``a``: wgmma, setmaxnreg; code built for it runs on that arch only)."""
    return parse_arch(arch), str(arch).strip().lower().endswith("a")


def _nvrtc():
    from cupy.cuda import nvrtc
    return nvrtc


def nvrtc_supported_archs() -> tuple[int, ...]:
    return tuple(_nvrtc().getSupportedArchs())


def _check_nvrtc_knows(arch: int) -> None:
    supported = nvrtc_supported_archs()
    if arch not in supported:
        raise UnsupportedArchError(f"arch sm_{arch} is unknown to this NVRTC "
                                   f"{'.'.join(map(str, _nvrtc().getVersion()))} "
                                   f"(it knows {', '.join(f'sm_{a}' for a in supported)})")


def device_arch(device: int | None = None) -> int:
    """Compute capability of a CUDA device (the current one by default) as an int, e.g. 90."""
    import cupy
    dev = cupy.cuda.Device(device) if device is not None else cupy.cuda.Device()
    return parse_arch(dev.compute_capability)


@lru_cache(maxsize=1)
def cuda_include_dir() -> str | None:
    """Where cuda_fp16.h lives: a CUDA toolkit, or the nvidia-cuda-runtime wheel.

    Found through ``cuda.pathfinder`` (a CuPy dependency), which looks at
    CUDA_HOME/CUDA_PATH, conda and the NVIDIA pip wheels. None when nothing is
    found: NVRTC then fails on the first ``#include <cuda_fp16.h>`` and the
    CompileError says to install the ``cuda12``/``cuda13`` extra."""
    try:
        from cuda.pathfinder import find_nvidia_header_directory
        found = find_nvidia_header_directory("cudart")
    except Exception:  # pathfinder absent or too old: fall back to CuPy's own search
        found = None
    if found is None:
        try:
            from cupy import _environment
            path = _environment.get_cuda_path()
            if path and (Path(path) / "include" / "cuda_fp16.h").is_file():
                found = str(Path(path) / "include")
        except Exception:
            found = None
    return found


def compile_options(arch: int, defines: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Every NVRTC option cukern uses, in one place (the arch itself is added by the caller:
    CuPy picks -arch=sm_XX for the device; the CPU check passes -arch=compute_XX)."""
    opts = ["--std=c++17", f"-I{source_root()}", f"-DCUKERN_ARCH={arch}", "-lineinfo"]
    inc = cuda_include_dir()
    if inc:
        opts.append(f"-I{inc}")
    opts.extend(f"-D{d}" for d in defines)
    return tuple(opts)


_MISSING_HEADERS_HINT = (
    "\nhint: NVRTC could not find the CUDA headers. Install cukern with its cuda12 or cuda13 extra "
    "(it brings the nvidia-cuda-runtime wheel), or set CUDA_HOME to a CUDA toolkit.")


def _compile_error(unit: str, arch: int, log: str) -> CompileError:
    hint = _MISSING_HEADERS_HINT if "cannot open source file \"cuda_" in log else ""
    return CompileError(f"NVRTC failed to compile unit {unit!r} for sm_{arch}:\n{log.strip()}{hint}")


# --------------------------------------------------------------------------- GPU: cupy.RawModule

_modules: dict[tuple, object] = {}
_modules_lock = threading.Lock()


def load_module(unit: str, code: str, name_expressions: tuple[str, ...], arch: int,
                defines: tuple[str, ...] = ()):
    """Compile (or fetch from cache) a ``cupy.RawModule`` for ``arch`` and load every kernel.

    All kernels are fetched here so that a compile error surfaces at load, as a
    CompileError naming the unit, never in the middle of a dispatch."""
    import cupy
    options = compile_options(arch, defines)
    key = (unit, hashlib.sha256(code.encode()).hexdigest(), options, arch, name_expressions)
    with _modules_lock:
        mod = _modules.get(key)
        if mod is not None:
            return mod
        _check_nvrtc_knows(arch)
        mod = cupy.RawModule(code=code, options=options, name_expressions=list(name_expressions),
                             backend="nvrtc")
        try:
            for name in name_expressions:
                mod.get_function(name)
        except cupy.cuda.compiler.CompileException as e:
            raise _compile_error(unit, arch, e.get_message() if hasattr(e, "get_message") else str(e)) from None
        _modules[key] = mod
        return mod


def load_module_sm90a(unit: str, code: str, name_expressions: tuple[str, ...],
                      defines: tuple[str, ...] = ()) -> "Sm90aModule":
    """Like :func:`load_module`, for an sm_90 device, but built for sm_90a (wgmma, setmaxnreg).

    CuPy's RawModule always appends ``-arch=sm_<device>``, so the unit goes through NVRTC here
    and is loaded as a cubin with ``RawModule(path=)``. The cubin and the lowered kernel names
    are cached under CUPY_CACHE_DIR, keyed on the unit text (which hashes every header), the
    options and the NVRTC version."""
    options = ("-arch=sm_90a", "-ftz=true", *compile_options(90, defines))
    key = (unit, hashlib.sha256(code.encode()).hexdigest(), options, name_expressions)
    with _modules_lock:
        mod = _modules.get(key)
        if mod is None:
            mod = _modules[key] = Sm90aModule(unit, code, name_expressions, options)
        return mod


class Sm90aModule:
    """A cubin built by NVRTC for sm_90a; ``get_function`` takes the name expressions."""

    def __init__(self, unit: str, code: str, names: tuple[str, ...], options: tuple[str, ...]):
        import cupy
        nvrtc = _nvrtc()
        key = hashlib.sha256("\0".join([code, *options, *names, str(nvrtc.getVersion())]).encode()).hexdigest()
        cache = Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))
        base = cache / f"cukern_sm90a_{key}"
        cubin_path, names_path = base.with_suffix(".cubin"), base.with_suffix(".names")
        try:
            lowered = names_path.read_text().split("\n")
            cached = cubin_path.is_file() and len(lowered) == len(names)
        except OSError:
            cached = False
        if not cached:
            cubin, lowered = self._compile(nvrtc, unit, code, names, options)
            base.parent.mkdir(parents=True, exist_ok=True)
            for path, data in ((cubin_path, cubin), (names_path, "\n".join(lowered).encode())):
                tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}")   # atomic for concurrent processes
                tmp.write_bytes(data)
                os.replace(tmp, path)
        self._module = cupy.RawModule(path=str(cubin_path))
        self._lowered = dict(zip(names, lowered))

    @staticmethod
    def _compile(nvrtc, unit, code, names, options):
        prog = nvrtc.createProgram(code, f"{unit}.cu", [], [])
        try:
            for name in names:
                nvrtc.addNameExpression(prog, name)
            try:
                nvrtc.compileProgram(prog, list(options))
            except nvrtc.NVRTCError:
                raise CompileError(f"NVRTC failed to compile unit {unit!r} for sm_90a:\n"
                                   f"{nvrtc.getProgramLog(prog).strip()}") from None
            cubin = nvrtc.getCUBIN(prog)
            lowered = [nvrtc.getLoweredName(prog, n) for n in names]
        finally:
            nvrtc.destroyProgram(prog)
        return bytes(cubin), [x.decode() if isinstance(x, bytes) else x for x in lowered]

    def get_function(self, name: str):
        return self._module.get_function(self._lowered[name])


# --------------------------------------------------------------------------- CPU: NVRTC alone

@dataclass(frozen=True)
class PtxParam:
    index: int
    kind: str  # ".u64", ".u32", ".f32", ... for scalars and pointers; ".b8" for a by-value aggregate
    size: int  # bytes
    align: int


@dataclass(frozen=True)
class CompiledPtx:
    unit: str
    arch: int
    ptx: str
    lowered: dict[str, str]  # name expression -> entry name in the PTX

    def params(self, name: str) -> list[PtxParam]:
        entries = ptx_entries(self.ptx)
        entry = self.lowered.get(name, name)
        if entry not in entries:
            raise UnknownKernelError(f"unit {self.unit}: no entry for kernel {name!r} in the PTX")
        return entries[entry]


def compile_ptx(unit: str, code: str, name_expressions: tuple[str, ...], arch: int,
                defines: tuple[str, ...] = (), *, arch_specific: bool = False) -> CompiledPtx:
    """Compile with NVRTC for ``compute_<arch>`` (``compute_<arch>a`` with ``arch_specific``, as
    :func:`load_module_sm90a` builds) and return the PTX; needs no GPU or driver."""
    nvrtc = _nvrtc()
    _check_nvrtc_knows(arch)
    # CuPy adds -ftz=true to every RawModule compile: match it, so the PTX is what the GPU runs.
    options = [f"-arch=compute_{arch}{'a' if arch_specific else ''}", "-ftz=true", *compile_options(arch, defines)]
    prog = nvrtc.createProgram(code, f"{unit}.cu", [], [])
    try:
        for name in name_expressions:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError:
            raise _compile_error(unit, arch, nvrtc.getProgramLog(prog)) from None
        ptx = nvrtc.getPTX(prog)
        ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
        lowered = {name: nvrtc.getLoweredName(prog, name) for name in name_expressions}
        for name, low in lowered.items():
            lowered[name] = low.decode() if isinstance(low, bytes) else low
    finally:
        nvrtc.destroyProgram(prog)
    return CompiledPtx(unit, arch, ptx, lowered)


_ENTRY = re.compile(r"\.entry\s+([\w$]+)\s*\(([^)]*)\)", re.S)
_PARAM = re.compile(r"\.param\s+(?:\.align\s+(\d+)\s+)?(\.\w+)\s+[\w$]+_param_(\d+)(?:\[(\d+)\])?")
_SCALAR_BYTES = {"8": 1, "16": 2, "32": 4, "64": 8}


def ptx_entries(ptx: str) -> dict[str, list[PtxParam]]:
    """Kernel entry name -> its parameters, read from the ``.entry`` declarations."""
    entries = {}
    for m in _ENTRY.finditer(ptx):
        params = []
        for p in _PARAM.finditer(m.group(2)):
            align, kind, index, count = p.group(1), p.group(2), int(p.group(3)), p.group(4)
            width = _SCALAR_BYTES.get(kind[2:], 1)
            size = width * (int(count) if count else 1)
            params.append(PtxParam(index, kind, size, int(align) if align else width))
        entries[m.group(1)] = params
    return entries

"""Registers, stack frame and spills of attention kernels, without a GPU: NVRTC's PTX for sm_90 through
the local ptxas -v (a CUDA toolkit's ptxas; its version may differ from the NVRTC that compiles on the
GPU machine, so the numbers are leads).

Run: PYTHONPATH=. python profiling/attention_regs.py [substring ...]   (default: decode_tc and prefill, f16)
"""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile

from cukern.attention import FAMILIES
from cukern.runtime import compile_ptx


def main(argv: list[str]) -> int:
    wanted = argv or ["decode_tc<__half", "prefill<__half, 128"]
    for spec in FAMILIES.values():
        names = tuple(k.name for k in spec.kernels if any(w in k.name for w in wanted))
        if not names:
            continue
        ptx = compile_ptx(spec.name, spec.unit_source(), names, 90, spec.defines)
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(ptx.ptx)
            f.flush()
            res = subprocess.run(["ptxas", "-arch=sm_90", "-v", f.name, "-o", "/dev/null"], capture_output=True,
                                 text=True)
        back = {low: name for name, low in ptx.lowered.items()}
        current = None
        for line in res.stderr.splitlines():
            m = re.search(r"Compiling entry function '([^']+)'", line)
            if m:
                current = back.get(m.group(1), m.group(1))
            elif current and ("registers" in line or "stack frame" in line):
                print(f"{current:40s} {line.split(':', 1)[-1].strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

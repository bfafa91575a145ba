"""Probe: prefill NMSE of the tiny MoE models at chunk 16 (grouped path) over seeds, with the grouped
GEMMs on and off, to size test_gpu_moe_forward_matches_reference's bound. Delete once concluded."""
import sys, tempfile
from pathlib import Path
import numpy as np
import cupy
sys.path.insert(0, "tests")
from cukern.models.tiny_moe import MOE_PRESETS
from cukern.models.tiny import write_tiny_gguf
from cukern.models.moe import MoeBlock
from cukern.reference.models import ReferenceModel
from cukern.testing import nmse
from test_models import _transformer

d = Path(tempfile.mkdtemp())
for name in ("gpt-oss",):
    i = list(MOE_PRESETS).index(name)
    path = write_tiny_gguf(d / f"{name}.gguf", MOE_PRESETS[name](), seed=20 + i)
    for rule in (16, None):
        MoeBlock.gemm_min_slots_per_expert = rule
        for chunk, kv in ((16, "float32"),):
            m, model = _transformer(path, max_seqs=8, kv_dtype=kv, prefill_chunk=chunk)
            ref = ReferenceModel(m.config, m.tensors)
            vals = []
            for seed in range(16):
                prompt = np.random.default_rng(seed).integers(0, m.config.vocab_size, size=29).tolist()
                ref.reset()
                slot = model.cache.add(0)
                logits = cupy.full(m.config.vocab_size, np.nan, cupy.float32)
                model.prefill(prompt, slot, logits)
                model.check_errors()
                vals.append(nmse(logits, ref.forward(prompt)[-1]))
                model.cache.free(slot)
            print(f"{name:9s} gemm_rule={rule!s:4s} chunk={chunk:2d} {kv}: NMSE max {max(vals):.2e} median "
                  f"{np.median(vals):.2e}  {' '.join(f'{v:.1e}' for v in vals)}", flush=True)

"""A/B of the decode step's NormedX path and the split LM head on the real model (one process, turns)."""
import sys
import cupy
import numpy as np
from cukern.models import default_model_path
from cukern.models.gguf_loader import load_gguf
from cukern.models.transformer import Transformer

m = load_gguf(default_model_path())
m.upload(progress=False)
lm = Transformer(m, max_seqs=8, max_tokens=1024 + 200)
split, gguf = lm.head_mv, lm.head
orig = Transformer._normed_path
prompt = list(range(2, 130))
res = {}
for rnd in range(2):
    for normed in (False, True):
        for head in ("gguf", "split"):
            lm._normed_path = (lambda n, f=normed: f and orig(lm, n))
            lm.head_mv = split if head == "split" else gguf
            for b in (1, 8):
                lm.generate([prompt] * b, 8)
                _, st = lm.generate([prompt] * b, 128)
                us = st.decode_s / (st.decode_tokens / b) * 1e6
                res.setdefault((normed, head, b), []).append(us)
for k, v in sorted(res.items()):
    print(f"normed={k[0]!s:5} head={k[1]:5} b{k[2]}: " + " ".join(f"{u:7.1f}" for u in v) + " us/step")

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
import cukern.models.transformer as T
three = T.THREE_TYPES
res = {}
for rnd in range(2):
    for normed, head, use3 in ((False, "gguf", False), (True, "split", False), (True, "split", True)):
        if True:
            lm._normed_path = (lambda n, f=normed: f and orig(lm, n))
            lm.head_mv = split if head == "split" else gguf
            T.THREE_TYPES = three if use3 else ()
            for b in (1, 8):
                lm.generate([prompt] * b, 8)
                _, st = lm.generate([prompt] * b, 128)
                us = st.decode_s / (st.decode_tokens / b) * 1e6
                res.setdefault((normed, head, use3, b), []).append(us)
for k, v in sorted(res.items()):
    print(f"normed={k[0]!s:5} head={k[1]:5} three={k[2]!s:5} b{k[3]}: " + " ".join(f"{u:7.1f}" for u in v) + " us/step")

"""Tokens family benchmark: embedding gather and sampling at decode and prefill sizes, CUDA-graph timed
(as a decode step runs them), GB/s from the counted bytes, % of the copy ceiling measured in this run,
and the ratio to the torch ops a user would write instead, timed the same way in the same run.

Bytes counted (cukern.traffic): embed reads n table rows (raw blocks) and writes n f32 rows; sample reads
the logits once (the candidates it writes are a few KB). Inputs rotate through enough sets to span 4x the
L2. The rows are the table of ``specs(quick)``; ``s`` is one input set (``s.t``: the torch peer's inputs).
Run: PYTHONPATH=. python profiling/bench_tokens.py [--quick] [--json out.json]
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import cupy
import numpy as np

from cukern import traffic
from cukern.benchmark import Peer, RowSpec, measure_ceilings, run_specs, script_main
from cukern.tokens import SamplePlan, TokensDispatch

try:
    import torch
except ImportError:  # the torch peer is optional; its rows then show no ratio
    torch = None

_L2_ROTATE_BYTES = 200 << 20
_Q8_0 = 8
VOCAB, D_MODEL = 262144, 640  # a Gemma-3-sized Q8_0 table (178 MB: larger than L2 by itself)
ROW_BYTES = D_MODEL // 32 * 34
NUCLEUS = dict(temperature=0.8, top_k=64, top_p=0.95)


def specs(quick: bool) -> list[RowSpec]:
    """Every row, in the order it runs."""
    out = [RowSpec("embed Q8_0 (graph)", f"{n} x {D_MODEL}", (_embed_sets, n),
                   lambda s: s.d.embed(s.table, _Q8_0, D_MODEL, s.ids, s.out, scale=25.3),
                   (traffic.embed, n, ROW_BYTES, D_MODEL),
                   peers=(_torch("F.embedding f32 * scale",
                                 lambda t: torch.nn.functional.embedding(t.ids, t.table) * 25.3),))
           for n in (1, 1024)]
    for batch in ((1,) if quick else (1, 8)):
        g, shape, nbytes = (_sample_sets, batch), f"{batch} x {VOCAB}", (traffic.sample, batch, VOCAB)
        out += [
            RowSpec("sample greedy (graph)", shape, g, lambda s: s.d.sample(s.greedy, s.logits), nbytes,
                    peers=(_torch("torch.argmax", lambda t: torch.argmax(t.logits, dim=-1)),)),
            RowSpec("sample T0.8 k64 p0.95 (graph)", shape, g, lambda s: s.d.sample(s.nucleus, s.logits, **NUCLEUS), nbytes,
                    peers=(_torch("topk+softmax+multinomial", lambda t: _torch_sample(t.logits)),)),
        ]
    return out


def _torch(name, call):
    """A torch peer, called on the set's torch inputs, timed through torch's graph API."""
    return Peer(name, lambda s: call(s.t), how="torch_graph")


def _torch_sample(logits):
    v, i = torch.topk(logits / NUCLEUS["temperature"], NUCLEUS["top_k"], dim=-1)
    p = torch.softmax(v, dim=-1)
    c = torch.cumsum(p, dim=-1)
    p = torch.where(c - p < NUCLEUS["top_p"], p, torch.zeros_like(p))
    return i.gather(-1, torch.multinomial(p, 1))


# ------------------------------------------------------------------ input sets
def _table(ctx):
    """The Q8_0 table (random quants, small scales) and the f32 table a torch user keeps, made once."""
    if "table" not in vars(ctx):
        ctx.table = cupy.random.randint(0, 256, size=(VOCAB, ROW_BYTES), dtype=cupy.uint8)
        ctx.table.reshape(VOCAB, -1, 34)[:, :, 0:2] = cupy.asarray(np.array([0.01], np.float16).view(np.uint8))
        ctx.t_table = torch.randn(VOCAB, D_MODEL, device="cuda") if torch is not None else None
    return ctx.table, ctx.t_table


def _embed_sets(ctx, n):
    table, t_table = _table(ctx)
    ids = cupy.asarray(np.random.default_rng(n).integers(0, VOCAB, n).astype(np.int32))
    t = SimpleNamespace(ids=torch.from_dlpack(ids).long(), table=t_table) if torch is not None else None
    return [SimpleNamespace(d=ctx.d, table=table, ids=ids, out=cupy.empty((n, D_MODEL), cupy.float32), t=t)]


def _sample_sets(ctx, batch):
    n_sets = max(1, min(16, _L2_ROTATE_BYTES // max(traffic.sample(batch, VOCAB), 1)))
    plans = dict(greedy=SamplePlan(batch, VOCAB, sampling=False), nucleus=SamplePlan(batch, VOCAB, sampling=True))
    sets = []
    for _ in range(n_sets):
        logits = ctx.rng.standard_normal((batch, VOCAB), dtype=cupy.float32) * 3
        t = SimpleNamespace(logits=torch.from_dlpack(logits)) if torch is not None else None
        sets.append(SimpleNamespace(d=ctx.d, logits=logits, t=t, **plans))
    return sets


def bench(quick: bool = False) -> tuple[list, object]:
    ctx = SimpleNamespace(d=TokensDispatch(), rng=cupy.random.default_rng(0))
    ceil = measure_ceilings()
    return run_specs("tokens", specs(quick), ceil, ctx), ceil


def main(argv=None) -> int:
    return script_main(bench, __doc__, title='tokens',
                       quick_help='batch 1 only', argv=argv)


if __name__ == "__main__":
    sys.exit(main())

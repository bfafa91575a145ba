"""Tokens family benchmark: embedding gather and sampling at decode and prefill sizes, CUDA-graph timed
(as a decode step runs them), GB/s from the counted bytes, % of the copy ceiling measured in this run,
and the ratio to the torch ops a user would write instead, timed the same way in the same run.

Bytes counted: embed reads n table rows (raw blocks) and writes n f32 rows; sample reads the logits
once (the candidates it writes are a few KB). Inputs rotate through enough sets to span 4x the L2.
Run: PYTHONPATH=. python profiling/bench_tokens.py [--quick] [--json out.json]
"""

from __future__ import annotations

import sys

import cupy
import numpy as np

from cukern import traffic
from cukern.benchmark import Row, measure_ceilings, rotating, script_main, time_graph_us, time_torch_graph_us
from cukern.tokens import SamplePlan, TokensDispatch

try:
    import torch
except ImportError:  # the torch peer is optional; its rows then show no ratio
    torch = None

_L2_ROTATE_BYTES = 200 << 20
_Q8_0 = 8


def _sets(nbytes, make):
    return rotating(max(1, min(16, _L2_ROTATE_BYTES // max(nbytes, 1))), make)


def bench(quick: bool = False) -> tuple[list, object]:
    d = TokensDispatch()
    ceil = measure_ceilings()
    rows: list[Row] = []
    rng = cupy.random.default_rng(0)

    def row(kernel, shape, fn, nbytes, peer="", peer_fn=None):
        try:
            us = time_graph_us(fn)
        except Exception as e:  # one broken row must not hide the others
            print(f"row {kernel} {shape} failed: {type(e).__name__}: {e}", file=sys.stderr)
            return
        peer_us = None
        if peer_fn is not None and torch is not None:
            try:
                peer_us = time_torch_graph_us(peer_fn)
            except Exception as e:
                print(f"peer of {kernel} {shape} failed: {type(e).__name__}: {e}", file=sys.stderr)
        gbs = nbytes / us / 1e3
        rows.append(Row("tokens", kernel + " (graph)", shape, us, gbs=gbs, pct_ceiling=gbs / ceil.copy_gbs,
                        peer=peer if peer_us else "", peer_us=peer_us))

    # ---- embedding: a Gemma-3-sized Q8_0 table (262144 x 640, 178 MB; larger than L2 by itself)
    vocab, d_model = 262144, 640
    row_bytes = d_model // 32 * 34
    table = cupy.random.randint(0, 256, size=(vocab, row_bytes), dtype=cupy.uint8)
    table.reshape(vocab, -1, 34)[:, :, 0:2] = cupy.asarray(np.array([0.01], np.float16).view(np.uint8))  # scales
    t_table = torch.randn(vocab, d_model, device="cuda") if torch is not None else None  # the f32 table a
    for n in (1, 1024):                                                                    # torch user keeps
        ids = cupy.asarray(np.random.default_rng(n).integers(0, vocab, n).astype(np.int32))
        out = cupy.empty((n, d_model), cupy.float32)
        t_ids = torch.from_dlpack(ids).long() if torch is not None else None
        row("embed Q8_0", f"{n} x {d_model}", lambda: d.embed(table, _Q8_0, d_model, ids, out, scale=25.3),
            traffic.embed(n, row_bytes, d_model), "F.embedding f32 * scale",
            (lambda: torch.nn.functional.embedding(t_ids, t_table) * 25.3) if torch is not None else None)

    # ---- sampling over a 262144-token vocabulary
    for batch in ((1,) if quick else (1, 8)):
        nbytes = traffic.sample(batch, vocab)
        sets, nxt = _sets(nbytes, lambda i: rng.standard_normal((batch, vocab), dtype=cupy.float32) * 3)
        greedy, nucleus = SamplePlan(batch, vocab, sampling=False), SamplePlan(batch, vocab, sampling=True)
        t_sets = [torch.from_dlpack(s) for s in sets] if torch is not None else None
        cursor = {"i": 0}

        def t_next():
            cursor["i"] += 1
            return t_sets[cursor["i"] % len(t_sets)]

        def t_sample():
            v, i = torch.topk(t_next() / 0.8, 64, dim=-1)
            p = torch.softmax(v, dim=-1)
            c = torch.cumsum(p, dim=-1)
            p = torch.where(c - p < 0.95, p, torch.zeros_like(p))
            return i.gather(-1, torch.multinomial(p, 1))

        row("sample greedy", f"{batch} x {vocab}", lambda: d.sample(greedy, nxt()), nbytes, "torch.argmax",
            (lambda: torch.argmax(t_next(), dim=-1)) if torch is not None else None)
        row("sample T0.8 k64 p0.95", f"{batch} x {vocab}",
            lambda: d.sample(nucleus, nxt(), temperature=0.8, top_k=64, top_p=0.95), nbytes,
            "topk+softmax+multinomial", t_sample if torch is not None else None)
    return rows, ceil


def main(argv=None) -> int:
    return script_main(bench, __doc__, title='tokens',
                       quick_help='batch 1 only', argv=argv)


if __name__ == "__main__":
    sys.exit(main())

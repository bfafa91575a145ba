"""When does each block of a split decode start, get past pdl_wait, finish its tiles and leave? A variant
of the attention unit built with CUKERN_DECODE_CLOCKS=1 (decode_tc.cuh) records %globaltimer per block;
this replays B1 32/8 D128 decode steps (pdl, CUDA graph, K/V rotating over layers as the benchmark does)
and prints, for the last step of a replayed graph, the spread of the blocks' times relative to the launch's first block.
Scratch tool for the question: is a long decode bound by every SM streaming at the same rate, or do some
SMs finish their equal shares early (uneven bandwidth per SM) while the launch waits for the slowest?

Run: PYTHONPATH=. python profiling/attention_blocks.py   (BLOCKS_KV=8192,131072; BLOCKS_CFG=8:16,4:33;
BLOCKS_BAL=0,1: the fixed split and the balanced one, DecodePlan.balance;
BLOCKS_DEFINES=A=1;B=2,A=0: variants of the unit, one per comma-separated set)
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import sys

import cupy
import numpy as np

from cukern import attention as A
from cukern.benchmark import time_graph_us
from cukern.streams import capture_graph

sys.path.insert(0, "profiling")
from attention_probe import _b1_decode_case, _layer_steps


def _clocked(pdl: bool, defines: tuple[str, ...] = ()) -> A.AttentionDispatch:
    attn = A.AttentionDispatch(pdl=pdl)
    tag = "_".join(x.replace("=", "") for x in defines)
    spec = dataclasses.replace(A.FAMILIES["attention"], name=f"attention_clocks{tag}",
                               defines=("CUKERN_DECODE_CLOCKS=1", *defines))
    attn._units["attention"] = A._Unit(spec)
    return attn


def _q(x, qs):
    return " ".join(f"{v:7.2f}" for v in np.quantile(x, qs))


def main():
    for defines in os.environ.get("BLOCKS_DEFINES", "").split(","):
        ds = tuple(x for x in defines.split(";") if x)
        print(f"-- defines {ds}")
        run(_clocked(pdl=True, defines=ds))


def run(attn):
    kvs = [int(x) for x in os.environ.get("BLOCKS_KV", "8192,131072").split(",")]
    cfgs = [tuple(int(v) for v in c.split(":")) for c in os.environ.get("BLOCKS_CFG", "8:16,4:33").split(",")]
    rng = cupy.random.default_rng(0)
    qs = (0.0, 0.1, 0.5, 0.9, 1.0)
    for kv in kvs:
        n_layers = max(2, min(16, -(-4 * (50 << 20) // (kv * 8 * 128 * 4))))
        cache, s, q, out = _b1_decode_case(rng, kv, n_layers)
        for (nw, ns), bal in itertools.product(cfgs, [bool(int(x)) for x in os.environ.get("BLOCKS_BAL", "0,1").split(",")]):
            attn._tc_warps, attn._balance = nw, bal
            plan = attn.plan_decode(cache, [s], 32, n_splits=ns)
            step = _layer_steps(attn, plan, q, out, n_layers)
            n_inner = max(8, 2 * n_layers)
            us = time_graph_us(step, n_inner=n_inner)
            graph = capture_graph(lambda st, step=step, n=n_inner: [step() for _ in range(n)])
            graph.replay(cupy.cuda.get_current_stream())  # the clocks of the graph's last step
            cupy.cuda.get_current_stream().synchronize()
            mod = attn._units["attention"].load()
            buf = mod.get_global("cukern_decode_clocks")
            n_blocks = 8 * ns
            c = cupy.ndarray((5 * 8192,), cupy.uint64, buf)[: 5 * n_blocks].get().reshape(n_blocks, 5)
            t = (c[:, :4].astype(np.int64) - int(c[:, 0].min())) / 1e3  # us from the first block's entry
            sm = c[:, 4]
            stream = t[:, 2] - t[:, 1]
            print(f"KV{kv} w{nw} s{ns}{' balanced' if plan.balance else ''}: graph {us:.2f} us/step, {n_blocks} blocks on {len(set(sm.tolist()))} SMs")
            print(f"  quantiles {qs}: entry {_q(t[:, 0], qs)}")
            print(f"                          wait  {_q(t[:, 1], qs)}")
            print(f"                          tiles {_q(t[:, 2], qs)}")
            print(f"                          leave {_q(t[:, 3], qs)}")
            print(f"                 tiles - wait  {_q(stream, qs)}  (spread {100 * (stream.max() / stream.min() - 1):.1f}%)")
            for h in range(8):
                th = t[h * ns:(h + 1) * ns, 2]
                print(f"  KV head {h}: tiles done {_q(th, qs)}")
            last = np.argsort(t[:, 2])[-4:]
            print("  slowest blocks (split, head, sm, tiles done): "
                  + ", ".join(f"({b % ns}, {b // ns}, {sm[b]}, {t[b, 2]:.2f})" for b in last))
            fast = np.argsort(t[:, 2])[:4]
            print("  fastest blocks: " + ", ".join(f"({b % ns}, {b // ns}, {sm[b]}, {t[b, 2]:.2f})" for b in fast))
        del cache
        attn._tc_warps = attn._balance = None


if __name__ == "__main__":
    main()

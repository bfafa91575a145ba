"""When does each block of a split decode start, get past pdl_wait, finish its tiles and leave? A variant
of the attention unit built with CUKERN_DECODE_CLOCKS=1 (decode_tc.cuh) records %globaltimer per block;
this replays B1 32/8 D128 decode steps (pdl, CUDA graph, K/V rotating over layers as the benchmark does)
and prints, for the last step of a replayed graph, the spread of the blocks' times from the step's first
block's entry.
Scratch tool for the question: is a long decode bound by every SM streaming at the same rate, or do some
SMs finish their equal shares early (uneven bandwidth per SM) while the launch waits for the slowest?

2026-11-26, ninth session (H100, B1 32/8 D128 w8 s16, pdl, graph; us are per step, clocks from one step):
  * The blocks of a launch stream unevenly. From pdl_wait to their last tile they take 6.2-10.5 us at
    KV8k (median 8.1), 119-186 us at KV128k (median 167); the spread is within each KV head (one head's
    16 splits: 318-366 us done), not between heads. The launch ends with its slowest block.
  * At KV8k every block waits in pdl_wait until 1.4-4.7 us after the previous launch's last block left
    (that gap moves from step to step). Prologue tiles issued before the wait (CUKERN_DECODE_EARLY, three
    runs in turns): 2 (the kernel's NS - 1) 16.53 / 16.38 / 16.45 us, 1 16.31 / 16.23 / 16.38, 0 18.00;
    KV32k 49.4 / 49.2 / 49.1 against 50.7 / 50.5 / 50.6 with 1; KV128k 192.0 / 192.1 / 192.8 against
    193.3 / 192.9 / 193.2. Not changed.
  * A balanced split (prototyped in commits 72dbd5a, b994ee5 and 0b3749b, then reverted): the 16
    blocks of a head share its keys; each warp's first tiles are fixed and the rest drawn from a
    per-head atomic ticket counter (one draw per 16-key tile, drawn one or two tiles ahead; ticket order
    round robin over 16 regions, each streamed in order as in the fixed split). Correct (the decode GPU
    tests passed, except the pdl-versus-plain test, which asks for bit-identical output: the sums
    follow the draw order). The blocks then finished within 9-20% of each other, but every step was
    slower:
      KV8k 16.41-16.62 us fixed, 17.24-17.40 balanced (one tile ahead), 18.76-18.85 (two ahead);
      KV32k 49.1-49.3, 51.1-51.2, 51.9-52.2;
      KV128k 192.3-193.8, 196.1-197.3, 196.7-196.9.
    The same code with tickets from a per-warp sequence (CUKERN_DECODE_LOCAL_TICKETS, no atomics, so no
    balancing) ran KV8k 16.80 against 16.36, KV32k 49.8 against 49.0, KV128k 191.1 against 191.5. So
    the loss is the draws: about 65 k same-address atomics per KV128k step, eight addresses. Not kept.
    Per-region counters (a warp steals from another region only when its own is empty) would spread
    them. The ceiling of any balancing is the gap between the median and the slowest block, about
    1.4 us at KV8k and about 7% at KV128k, which is still short of 80% of copy and of SDPA.

2026-11-26, twelfth session (H100, the default plan w8 s16, in-loop L2 prefetch as the rule sets it;
BLOCKS_PAIR=1: two clocked launches in the middle of a graph, so that both have neighbours; us from the first
one's wait return):
  * KV8k, three replays: tiles done 5.9-9.4 us, blocks leave 8.9-19.7; the next launch's blocks enter from -1.5
    (the SMs the grid leaves free) to 19.2 (median 10.2-11.3: as this launch's blocks leave) and return from
    the wait 0.38-0.48 us after this launch's last block leaves. So the step is the slowest block's tiles
    (~9 us) plus ~10 us from there to the last block leaving: the partial write, the acq_rel fence and
    atomic, the merging block's loads, all under the next launch's prologue traffic. Without that traffic
    (CUKERN_DECODE_EARLY=0, BLOCKS_PF=0) the same stretch is 4.6-5.3 us, but the tiles then end at 12-18 us.
  * KV32k: tiles 30.2-43.0, last leave 49.8-51.4, next wait +0.38-0.42; KV128k: tiles 124-177 (the spread
    of the fixed split), last leave 181.9-184.8, next wait +0.42-0.90.
  * pdl_release.py: the release itself costs 0.42-0.58 us in a chain of small kernels, with or without
    stores, an acq_rel atomic, 200 KB a block prefetched before the wait, or one block ending 3 us late.
  * The next launch allowed only once a launch is past its wait (griddepcontrol.launch_dependents after
    pdl_wait, a macro-guarded variant), so that at most one prologue overlaps a launch and blocks of w4 s16
    (two per SM) start beside the previous launch's: KV8k w8 s16 15.70 -> 16.10 us, w4 s16 17.8 -> 18.9, w4
    s33 17.05 -> 17.73; KV32k and KV128k w8 equal; KV128k w4 s16 192.9 -> 186.0 (still behind w8 s16's 182).
    Not kept.

Run: PYTHONPATH=. python profiling/attention_blocks.py   (BLOCKS_KV=8192,131072; BLOCKS_CFG=8:16,4:33;
BLOCKS_DEFINES=A=1;B=2,A=0: variants of the unit, one per comma-separated set; BLOCKS_PAIR=1 the pair of
clocked launches mid-graph, BLOCKS_DEFINES=A=1;B=2 then one variant for every launch, BLOCKS_PF its pre-wait
L2 prefetch, BLOCKS_WAIT=1 the plan's merge_wait)
"""
from __future__ import annotations

import dataclasses
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


def _clocks(attn, n_blocks):
    """The [n_blocks, 5] clocks of a clocked unit's last launch (entry, wait, tiles, leave in ns; SM)."""
    buf = attn._units["attention"].load().get_global("cukern_decode_clocks")
    return cupy.ndarray((5 * 8192,), cupy.uint64, buf)[: 5 * n_blocks].get().reshape(n_blocks, 5).astype(np.int64)


def pair():
    """Two consecutive launches in the middle of a graph of decode steps, each from its own clocked unit (its own
    clock buffer), the others unclocked: when does the second's wait return after the first's last block leaves?"""
    kvs = [int(x) for x in os.environ.get("BLOCKS_KV", "8192,131072").split(",")]
    rng = cupy.random.default_rng(0)
    extra = tuple(x for x in os.environ.get("BLOCKS_DEFINES", "").split(";") if x)  # a variant of all three units
    a, c = _clocked(True, ("CUKERN_PAIR=1", *extra)), _clocked(True, ("CUKERN_PAIR=2", *extra))
    plain = _clocked(True, extra) if extra else A.AttentionDispatch(pdl=True)
    plain._merge_wait = bool(int(os.environ.get("BLOCKS_WAIT", "0")))  # the plan's merge by the first split's block
    if os.environ.get("BLOCKS_PF"):  # force the L2 prefetch before the wait (tiles)
        a._l2_prefetch = c._l2_prefetch = plain._l2_prefetch = int(os.environ["BLOCKS_PF"])
    for kv in kvs:
        n_layers = max(2, min(16, -(-4 * (50 << 20) // (kv * 8 * 128 * 4))))
        cache, s, q, out = _b1_decode_case(rng, kv, n_layers)
        plan = plain.plan_decode(cache, [s], 32)
        n_inner = max(8, 2 * n_layers)
        order = [plain] * (n_inner // 2) + [a, c] + [plain] * (n_inner // 2)
        for x in (a, c):
            x.flash_attn_decode(plan, 0, q, out)  # compile outside the capture

        def steps(stream, order=order, plan=plan, n_layers=n_layers, q=q, out=out):
            for i, x in enumerate(order):
                x.flash_attn_decode(plan, i % n_layers, q, out)
        graph = capture_graph(steps)
        for rep in range(3):
            graph.replay(cupy.cuda.get_current_stream())
            cupy.cuda.get_current_stream().synchronize()
            _pair_report(f"KV{kv} w{plan.warps} s{plan.n_splits} run {rep}", _clocks(a, plan.n_splits * 8),
                         _clocks(c, plan.n_splits * 8))
        del cache


def _pair_report(label, ta, tc):
    t0 = ta[:, 1].min()  # the first launch's wait return

    def us(x):
        return (x - t0) / 1e3
    print(f"{label}: launch 1 wait {us(ta[:, 1].min()):.2f}, tiles done {us(ta[:, 2].min()):.2f}-"
          f"{us(ta[:, 2].max()):.2f}, leave {us(ta[:, 3].min()):.2f}-{us(ta[:, 3].max()):.2f}; launch 2 entry "
          f"{us(tc[:, 0].min()):.2f}-{us(tc[:, 0].max()):.2f} (median {np.median(us(tc[:, 0])):.2f}), wait "
          f"{us(tc[:, 1].min()):.2f}-{us(tc[:, 1].max()):.2f}, tiles done {us(tc[:, 2].max()):.2f}, leave "
          f"{us(tc[:, 3].max()):.2f}; last leave -> next wait {(tc[:, 1].min() - ta[:, 3].max()) / 1e3:.2f} us",
          flush=True)
    qs = (0.0, 0.1, 0.5, 0.9, 1.0)
    for name, t in (("launch 1", ta), ("launch 2", tc)):
        print(f"  {name} quantiles {qs}: entry {_q(us(t[:, 0]), qs)} | tiles {_q(us(t[:, 2]), qs)} | leave "
              f"{_q(us(t[:, 3]), qs)}", flush=True)


def main():
    if os.environ.get("BLOCKS_PAIR"):
        return pair()
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
        for nw, ns in cfgs:
            attn._tc_warps = nw
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
            print(f"KV{kv} w{nw} s{ns}: graph {us:.2f} us/step, {n_blocks} blocks on {len(set(sm.tolist()))} SMs")
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
        attn._tc_warps = None


if __name__ == "__main__":
    main()

"""Profile prefill + N decode steps: an NVTX range per step and per layer (for nsys), and a
per-kernel table of CUDA-event times summed by kernel name (for machines without nsys).

With ``--model PATH`` (a GGUF file) or ``--tiny ARCH`` (a small random-weight model of that
architecture, written to a temporary file by ``cukern.models.tiny``), what runs is the models
package's :class:`~cukern.models.transformer.Transformer`: its prefill, then its ``generate``
loop eagerly (each step timed and NVTX-ranged between the ``on_token`` callbacks) and replayed
from a CUDA graph. Its layers carry no NVTX ranges of their own: nsys shows the step ranges and
the per-kernel ranges.

Without either, a synthetic decoder built only from cukern dispatches runs, shaped like a
Llama-style layer: RMS norm -> Q, K, V matvecs over GGUF-quantized weights -> KV-cache write -> paged
attention -> output matvec -> residual + RMS norm -> gate/up GLU matvec -> down matvec; after the
last layer a final norm and the LM-head matvec. Weights are random valid GGUF blocks; default
sizes are Llama 3.2 1B's (16 layers, width 2048, 32/8 heads of 64, FFN 8192, vocab 128256),
Q4_K layers and a Q6_K head. ``--elementwise-only`` keeps the norms and residual arithmetic
alone (no attention or matvec). It is not the models package's forward: it times the kernels
a decode step is made of, with a model's shapes, and needs no model file.

    PYTHONPATH=. python profiling/profile_decode.py --steps 32
    CUKERN_NVTX=1 nsys profile -t cuda,nvtx -o decode python profiling/profile_decode.py   # see README.md

The table's times are device times of each kernel (two events around each launch, the step's
launches queued behind a GEMM "runway" so that the GPU runs them back to back: see
cukern/profiler.py); "% step" is the share of the step's device time. The host's wall time to
launch a step eagerly is printed beside it, and the last line times the same step replayed
from a CUDA graph, which removes the launch cost.
"""

from __future__ import annotations

import argparse
import contextlib
import sys


class SyntheticDecoder:
    """Preallocated weights, KV cache and activations, and the layer loop over them.

    Every buffer is allocated here, so :meth:`forward` with ``rows=1`` only launches kernels
    and can be captured into a CUDA graph. With ``full=False`` a layer is the elementwise part
    alone: ``residual += x; h = norm(residual); mix = 0.5 h; residual += mix; h = norm(residual);
    x += 0.1 h`` (what ``notebooks/decode_step.ipynb`` checks against a float64 reference)."""

    def __init__(self, n_layers: int = 16, hidden: int = 2048, max_rows: int = 512, *, full: bool = True,
                 n_heads: int = 32, n_kv_heads: int = 8, head_dim: int = 64, ffn: int = 8192, vocab: int = 128256,
                 qtype: str = "Q4_K", head_qtype: str = "Q6_K", page_size: int = 16, seed: int = 0):
        import cupy

        from cukern.elementwise import ElementwiseDispatch
        self.ew = ElementwiseDispatch()
        self.n_layers, self.hidden, self.max_rows, self.full = n_layers, hidden, max_rows, full
        rng = cupy.random.default_rng(seed)
        f32 = cupy.float32
        self.norm_w = [(rng.standard_normal(hidden, dtype=f32), rng.standard_normal(hidden, dtype=f32))
                       for _ in range(n_layers)]
        self.x = rng.standard_normal((max_rows, hidden), dtype=f32)  # layer input / FFN output
        self.residual = cupy.zeros((max_rows, hidden), f32)
        self.h = cupy.empty((max_rows, hidden), f32)  # normed activations
        self.mix = rng.standard_normal((max_rows, hidden), dtype=f32)  # attention block output
        if full:
            self._build_full(n_heads, n_kv_heads, head_dim, ffn, vocab, qtype, head_qtype, page_size, seed)

    def _build_full(self, n_heads, n_kv_heads, head_dim, ffn, vocab, qtype, head_qtype, page_size, seed):
        import cupy
        import numpy as np

        from cukern.attention import AttentionDispatch, PagedKVCache
        from cukern.dmmv import QTYPES, DmmvDispatch, QWeight
        from cukern.reference.dmmv import random_weight
        self.dm, self.at = DmmvDispatch(), AttentionDispatch()
        self.n_heads, self.n_kv_heads, self.head_dim, self.ffn, self.vocab = n_heads, n_kv_heads, head_dim, ffn, vocab
        ids = {name: t for t, (name, *_) in QTYPES.items()}
        host_rng = np.random.default_rng(seed)
        templates: dict = {}

        def weight(qname, m, k):
            """A distinct device copy per layer of one random valid m x k weight (generated once)."""
            key = (qname, m, k)
            if key not in templates:
                templates[key] = cupy.asarray(random_weight(ids[qname], m, k, host_rng).ravel())
            return QWeight(templates[key].copy(), ids[qname], m, k)
        h, q, kv = self.hidden, n_heads * head_dim, n_kv_heads * head_dim
        self.w = [dict(q=weight(qtype, q, h), k=weight(qtype, kv, h), v=weight(qtype, kv, h), o=weight(qtype, h, q),
                       gate=weight(qtype, ffn, h), up=weight(qtype, ffn, h), down=weight(qtype, h, ffn))
                  for _ in range(self.n_layers)]
        self.w_head = weight(head_qtype, vocab, h)
        self.w_final_norm = cupy.ones(h, cupy.float32)
        templates.clear()
        r, f32 = self.max_rows, cupy.float32
        self.q = cupy.empty((r, n_heads, head_dim), f32)
        self.k = cupy.empty((r, n_kv_heads, head_dim), f32)
        self.v = cupy.empty((r, n_kv_heads, head_dim), f32)
        self.attn = cupy.empty((r, n_heads, head_dim), f32)
        self.g = cupy.empty((r, ffn), f32)
        self.logits = cupy.empty((1, vocab), f32)
        n_pages = -(-(r + 1) // page_size)
        self.cache = PagedKVCache(self.n_layers, n_pages, page_size, n_kv_heads, head_dim, max_seqs=1)
        self.slot = self.cache.add(0)
        self.prefill_plan = self.decode_plan = None
        self.slot_ids = cupy.asarray([self.slot], dtype=cupy.int32)
        self.positions = cupy.zeros(1, cupy.int32)
        self.bytes_per_step = (sum(w.nbytes for layer in self.w for w in layer.values()) + self.w_head.nbytes
                               + 2 * self.n_layers * (r + 1) * kv * 2)

    # ------------------------------------------------------------------ schedule (host work)
    def plan_prefill(self, rows: int) -> None:
        """Make room for ``rows`` tokens in the cache and plan their attention (host work)."""
        if self.full:
            self.cache.extend(self.slot, rows - self.cache.length(self.slot))
            self.prefill_plan = self.at.plan_batched(self.cache, [self.slot], [rows])

    def plan_decode(self) -> None:
        """One more cache position for the decode token (rewritten by every step) and its plan."""
        if self.full:
            n = self.cache.length(self.slot)
            self.cache.extend(self.slot, 1)
            self.positions.fill(n)
            self.decode_plan = self.at.plan_decode(self.cache, [self.slot], self.n_heads)

    # ------------------------------------------------------------------ kernels only
    def layer(self, i: int, rows: int, stream=None) -> None:
        x, r, h, m = self.x[:rows], self.residual[:rows], self.h[:rows], self.mix[:rows]
        w_attn, w_ffn = self.norm_w[i]
        ew = self.ew
        ew.residual_rms_norm(x, r, w_attn, h, eps=1e-6, stream=stream)   # residual += x; h = norm
        if not self.full:
            ew.scale(h, m, alpha=0.5, stream=stream)                        # (attention would go here)
            ew.residual_rms_norm(m, r, w_ffn, h, eps=1e-6, stream=stream)
            ew.add_scaled(x, h, x, alpha=0.1, stream=stream)                # (the FFN output)
            return
        w, dm, at = self.w[i], self.dm, self.at
        cols = (lambda a: a.reshape(rows, -1)) if rows > 1 else (lambda a: a.reshape(-1))  # matvec x/y views
        q, k, v, attn = self.q[:rows], self.k[:rows], self.v[:rows], self.attn[:rows]
        dm.dmmv(w["q"], cols(h), cols(q), stream=stream)
        dm.dmmv(w["k"], cols(h), cols(k), stream=stream)
        dm.dmmv(w["v"], cols(h), cols(v), stream=stream)
        if rows == 1:
            at.write_kv(self.cache, i, k, v, self.slot_ids, self.positions, stream=stream)
            at.flash_attn_decode(self.decode_plan, i, q, attn, stream=stream)
        else:
            at.write_kv_run(self.cache, i, k, v, self.slot, 0, stream=stream)
            at.flash_attn_batched(self.prefill_plan, i, q, attn, stream=stream)
        dm.dmmv(w["o"], cols(attn), cols(m), stream=stream)
        ew.residual_rms_norm(m, r, w_ffn, h, eps=1e-6, stream=stream)    # residual += attn; h = norm
        g = self.g[:rows]
        dm.dmmv_glu(w["gate"], w["up"], cols(h), cols(g), stream=stream)
        dm.dmmv(w["down"], cols(g), cols(x), stream=stream)               # x = FFN output

    def forward(self, rows: int, stream=None) -> None:
        """Every layer over ``rows`` rows (1: a decode step, then the LM head on its token)."""
        from cukern.profiler import nvtx_range
        for i in range(self.n_layers):
            with nvtx_range(f"layer {i}"):
                self.layer(i, rows, stream)
        if self.full and rows == 1:
            with nvtx_range("lm head"):
                self.ew.residual_rms_norm(self.x[:1], self.residual[:1], self.w_final_norm, self.h[:1], stream=stream)
                self.dm.dmmv(self.w_head, self.h[0], self.logits[0], stream=stream)


def profile_model(path: str, args) -> int:
    """The models package's Transformer on ``path``: per-kernel tables of a prefill and of eager
    decode steps, then the graph-replayed decode rate."""
    import cupy
    import numpy as np

    from cukern.models.transformer import Transformer
    from cukern.profiler import KernelTimer, nvtx_range
    model = Transformer.load(path, max_tokens=args.prefill + 2 * args.steps + 8, dmmv_int8=args.dmmv_int8)
    c = model.cfg
    print(f"model {path}: {c.n_layers} layers, d_model {c.d_model}, {c.n_heads}/{c.n_kv_heads} heads of "
          f"{c.head_dim}, vocab {c.vocab_size}; prefill {args.prefill} tokens, then {args.steps} decode steps")
    prompt = np.random.default_rng(0).integers(0, c.vocab_size, args.prefill).tolist()
    stream = cupy.cuda.Stream(non_blocking=True)
    logits = cupy.empty(c.vocab_size, cupy.float32)
    table = dict(strip_templates=args.group_templates)
    for rep in range(2):  # the first run compiles every kernel it meets
        model.clear_prefill_graphs()  # each run eager, its launches timed one by one (not a graph replay)
        slot = model.cache.add(0, stream=stream)
        with KernelTimer() as kt:
            with nvtx_range("prefill"), kt.step(stream):
                model.prefill(prompt, slot, logits, stream=stream)
        model.cache.free(slot, stream=stream)
    print(f"\nprefill ({args.prefill} tokens)")
    print(kt.report(**table))

    model.generate(prompt, 2, use_graph=False, stream=stream)  # compile the decode kernels
    ranges = contextlib.ExitStack()
    with KernelTimer() as kt:
        def on_token(step, ids):  # called after the prefill (step 0), then after every decode step
            ranges.close()
            if step == 0:
                kt.reset()  # drop the prefill's launches
            else:
                kt.end_step()
            ranges.enter_context(nvtx_range(f"decode step {step}"))
            kt.begin_step(stream)
        model.generate(prompt, args.steps + 1, use_graph=False, on_token=on_token, stream=stream)
        ranges.close()
        kt.end_step()  # the open step after the last token holds no launch
    print(f"\ndecode ({args.steps} steps, eager launches; each step ends with a host read of its token)")
    print(kt.report(**table))
    n = max(len(kt.step_us), 1)
    device_us, host_us = sum(kt.step_us) / n, sum(kt.host_step_us) / n
    _, stats = model.generate(prompt, args.steps + 2, use_graph=True, stream=stream)
    rate = stats.decode_tok_s
    graph = f"{rate:,.0f} tokens/s, {1e6 / rate:.1f} us per step" if rate else "not timed"
    print(f"\ndecode step: device {device_us:.1f} us, eager host {host_us:.1f} us (with its token read); "
          f"CUDA graph replay: {graph}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--layers", type=int, default=16, help="layers (default 16)")
    ap.add_argument("--hidden", type=int, default=2048, help="model width (default 2048)")
    ap.add_argument("--heads", type=int, default=32, help="query heads (default 32)")
    ap.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    ap.add_argument("--head-dim", type=int, default=64, help="head dimension (default 64)")
    ap.add_argument("--ffn", type=int, default=8192, help="FFN width (default 8192)")
    ap.add_argument("--vocab", type=int, default=128256, help="LM-head rows (default 128256)")
    ap.add_argument("--qtype", default="Q4_K", help="GGUF type of the layer weights (default Q4_K)")
    ap.add_argument("--head-qtype", default="Q6_K", help="GGUF type of the LM head (default Q6_K)")
    ap.add_argument("--prefill", type=int, default=512, help="prefill rows (tokens), default 512")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps (default 32)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed decode steps first (default 3)")
    ap.add_argument("--elementwise-only", action="store_true", help="norms and residual arithmetic only")
    ap.add_argument("--model", metavar="PATH", help="profile this GGUF model with cukern.models instead")
    ap.add_argument("--tiny", metavar="ARCH", help="profile a tiny random-weight ARCH model (gemma3, llama, "
                                                   "qwen2, qwen3), or one with a real model's shapes "
                                                   "(gemma3-270m), with cukern.models instead")
    ap.add_argument("--dmmv-int8", action="store_true", help="--model/--tiny: the matvecs' int8 path where a "
                                                             "type has one (default: the f32 path)")
    ap.add_argument("--nvtx", action="store_true", help="NVTX ranges on (same as CUKERN_NVTX=1)")
    ap.add_argument("--group-templates", action="store_true",
                    help="sum the variants of a kernel together (dmmv<12, 1> and dmmv<14, 1>)")
    args = ap.parse_args(argv)

    import cupy

    from cukern.dispatch import enable_nvtx
    from cukern.profiler import KernelTimer, nvtx_range
    from cukern.streams import capture_graph
    from cukern.workbench import progress
    if args.nvtx:
        enable_nvtx(True)
    if args.model:
        return profile_model(args.model, args)
    if args.tiny:
        import tempfile

        from cukern.models.tiny import PRESETS, TinySpec, write_tiny_gguf
        spec = PRESETS[args.tiny]() if args.tiny in PRESETS else TinySpec(args.tiny)
        with tempfile.TemporaryDirectory() as tmp:
            return profile_model(write_tiny_gguf(f"{tmp}/tiny-{args.tiny}.gguf", spec), args)

    full = not args.elementwise_only
    model = SyntheticDecoder(args.layers, args.hidden, max(args.prefill, 1), full=full, n_heads=args.heads,
                             n_kv_heads=args.kv_heads, head_dim=args.head_dim, ffn=args.ffn, vocab=args.vocab,
                             qtype=args.qtype, head_qtype=args.head_qtype)
    what = (f"{args.qtype} weights, {args.heads}/{args.kv_heads} heads of {args.head_dim}, FFN {args.ffn}, "
            f"{args.head_qtype} LM head of {args.vocab}" if full else "elementwise kernels only")
    print(f"synthetic decoder: {args.layers} layers of width {args.hidden}, {what}; "
          f"prefill {args.prefill} tokens, then {args.steps} decode steps")
    stream = cupy.cuda.Stream(non_blocking=True)
    table = dict(strip_templates=args.group_templates)
    with stream:
        model.plan_prefill(args.prefill)
        with KernelTimer() as kt:
            with nvtx_range("prefill"), kt.step(stream):
                model.forward(args.prefill, stream)  # first run: compiles every kernel it meets
        with KernelTimer() as kt:
            with nvtx_range("prefill"), kt.step(stream):
                model.forward(args.prefill, stream)
        print(f"\nprefill ({args.prefill} tokens)")
        print(kt.report(**table))

        model.plan_decode()
        for _ in range(args.warmup):
            model.forward(1, stream)
        with KernelTimer() as kt:
            for s in progress(range(args.steps), desc="decode", unit="step"):
                with nvtx_range(f"decode step {s}"), kt.step(stream):
                    model.forward(1, stream)
        print(f"\ndecode ({args.steps} steps, eager launches)")
        print(kt.report(**table))
        device_us = sum(kt.step_us) / len(kt.step_us)
        eager_us = sum(kt.host_step_us) / len(kt.step_us)  # host wall time: the eager loop's cost
        kernel_us = sum(us for _, us in kt.records()) / len(kt.step_us)
        n_launches = len(kt.records()) // len(kt.step_us)

        try:
            graph = capture_graph(lambda st: model.forward(1, st), stream)
        except Exception as e:  # a dispatch that cannot be captured is a finding, not a crash
            print(f"\ndecode step: eager {eager_us:.1f} us; CUDA graph capture FAILED: {type(e).__name__}: {e}")
            return 1
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        graph.replay(stream)
        start.record(stream)
        for _ in range(args.steps):
            graph.replay(stream)
        end.record(stream)
        end.synchronize()
        graph_us = cupy.cuda.get_elapsed_time(start, end) * 1e3 / args.steps
    gbs = f"; {model.bytes_per_step / (graph_us * 1e-6) / 1e9:,.0f} GB/s of weights + KV" if full else ""
    print(f"\ndecode step: {n_launches} launches, kernels {kernel_us:.1f} us of {device_us:.1f} us queued; "
          f"eager (host) {eager_us:.1f} us, CUDA graph replay {graph_us:.1f} us ({eager_us / graph_us:.1f}x){gbs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

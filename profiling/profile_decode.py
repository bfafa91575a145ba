"""Profile prefill + N decode steps: an NVTX range per step and per layer (for nsys), and a
per-kernel table of CUDA-event times summed by kernel name (for machines without nsys).

What runs: a synthetic decoder built only from cukern dispatches, shaped like a
transformer layer's non-matmul work (pre-attention norm, residual add, pre-FFN
norm, scaled residual) over ``--layers`` layers of width ``--hidden``; prefill
runs the same layers over ``--prefill`` rows. Families that exist in
``cukern.FAMILY_MODULES`` are used; the model forward (``cukern/models``) is not
wired in yet.

    PYTHONPATH=. python profiling/profile_decode.py --steps 32
    CUKERN_NVTX=1 nsys profile -t cuda,nvtx -o decode python profiling/profile_decode.py   # see README.md

The table's times are device times of each kernel (two events around each
launch); "% step" is the share of the event-timed step, and the "between
kernels" row is the rest of the step: launch gaps, which a CUDA graph removes
(the last lines time the same step replayed from a graph).
"""

from __future__ import annotations

import argparse
import sys


class SyntheticDecoder:
    """Preallocated buffers and a layer loop built from the elementwise dispatches.

    hidden: model width; n_layers: layers; max_rows: the largest row count (prefill tokens)."""

    def __init__(self, n_layers: int, hidden: int, max_rows: int, seed: int = 0):
        import cupy

        from cukern.elementwise import ElementwiseDispatch
        self.ew = ElementwiseDispatch()
        self.n_layers, self.hidden = n_layers, hidden
        rng = cupy.random.default_rng(seed)
        f32 = cupy.float32
        self.norm_w = [(rng.standard_normal(hidden, dtype=f32), rng.standard_normal(hidden, dtype=f32))
                       for _ in range(n_layers)]
        self.x = rng.standard_normal((max_rows, hidden), dtype=f32)  # embeddings / layer input
        self.residual = cupy.zeros((max_rows, hidden), f32)
        self.h = cupy.empty((max_rows, hidden), f32)  # normed activations
        self.mix = rng.standard_normal((max_rows, hidden), dtype=f32)  # stands in for the attention/FFN output

    def layer(self, i: int, rows: int, stream=None) -> None:
        """[rows, hidden]: residual += x; h = norm(residual); residual += 0.5 mix; h = norm(residual)."""
        x, r, h, m = self.x[:rows], self.residual[:rows], self.h[:rows], self.mix[:rows]
        w_attn, w_ffn = self.norm_w[i]
        self.ew.residual_rms_norm(x, r, w_attn, h, eps=1e-6, stream=stream)   # attention input
        self.ew.scale(h, m, alpha=0.5, stream=stream)                           # (attention would go here)
        self.ew.residual_rms_norm(m, r, w_ffn, h, eps=1e-6, stream=stream)    # FFN input
        self.ew.add_scaled(x, h, x, alpha=0.1, stream=stream)                   # (FFN output into the stream)

    def forward(self, rows: int, stream=None) -> None:
        from cukern.profiler import nvtx_range
        for i in range(self.n_layers):
            with nvtx_range(f"layer {i}"):
                self.layer(i, rows, stream)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--layers", type=int, default=26, help="layers (default 26, as Gemma 3 270M)")
    ap.add_argument("--hidden", type=int, default=640, help="model width (default 640, as Gemma 3 270M)")
    ap.add_argument("--prefill", type=int, default=512, help="prefill rows (tokens), default 512")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps (default 32)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed decode steps first (default 3)")
    ap.add_argument("--nvtx", action="store_true", help="NVTX ranges on (same as CUKERN_NVTX=1)")
    ap.add_argument("--group-templates", action="store_true",
                    help="sum kernel variants together (rms_norm<256, true> and <256, false>)")
    args = ap.parse_args(argv)

    import cupy

    from cukern.dispatch import enable_nvtx
    from cukern.profiler import KernelTimer, nvtx_range
    from cukern.streams import capture_graph
    from cukern.workbench import progress
    if args.nvtx:
        enable_nvtx(True)

    model = SyntheticDecoder(args.layers, args.hidden, max(args.prefill, 1))
    stream = cupy.cuda.Stream(non_blocking=True)
    print(f"synthetic decoder: {args.layers} layers x 4 elementwise kernels, hidden {args.hidden}, "
          f"prefill {args.prefill} rows, {args.steps} decode steps of 1 row")
    with stream:
        model.forward(args.prefill, stream)  # compile every kernel outside the timings
        for _ in range(args.warmup):
            model.forward(1, stream)
        stream.synchronize()

        with KernelTimer() as kt:
            with nvtx_range("prefill"), kt.step(stream):
                model.forward(args.prefill, stream)
        print(f"\nprefill ({args.prefill} rows)")
        print(kt.report(strip_templates=args.group_templates))

        with KernelTimer() as kt:
            for s in progress(range(args.steps), desc="decode", unit="step"):
                with nvtx_range(f"decode step {s}"), kt.step(stream):
                    model.forward(1, stream)
        print(f"\ndecode ({args.steps} steps, eager launches)")
        print(kt.report(strip_templates=args.group_templates))

        graph = capture_graph(lambda st: model.forward(1, st), stream)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        graph.replay(stream)
        start.record(stream)
        for _ in range(args.steps):
            graph.replay(stream)
        end.record(stream)
        end.synchronize()
        graph_us = cupy.cuda.get_elapsed_time(start, end) * 1e3 / args.steps
    eager_us = sum(kt.step_us) / len(kt.step_us)
    n_kernels = 4 * args.layers
    print(f"\ndecode step: eager {eager_us:.1f} us, CUDA graph replay {graph_us:.1f} us "
          f"({n_kernels} kernels; {eager_us / graph_us:.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

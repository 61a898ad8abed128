"""Export a checkpoint as one GGUF file for llama.cpp, ollama and candle (llama architecture,
SentencePiece vocabulary with scores and token types, BOS/EOS ids, normalisation notes).

    python scripts/export_gguf.py --checkpoint CKPT --out model.gguf [--type f32|f16|bf16|q8_0] [--overwrite]
                                  [--raw-spellings nukta|nukta,vowel_signs|none] [--alias-logit-offset NATS]

Norms stay float32 in every type. Tokenize for it as bnlit does: ``bnlit.export.gguf_text(text)``
(``bnlit.tokenizer.normalize`` and SentencePiece's whitespace rule) before llama.cpp's tokenizer;
docs/export.md has the llama.cpp, ollama and candle recipes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bnlit.errors import BnlitError

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")  # bnlit.export.GGUF_TYPES (tests/test_scripts_help.py checks they agree)
RAW_SPELLING_KINDS = ("nukta", "vowel_signs")  # bnlit.raw_spellings.RAW_SPELLINGS (tests/test_scripts_help.py)
DEFAULT_RAW_SPELLINGS = ("nukta",)  # bnlit.raw_spellings.DEFAULT_KINDS
DEFAULT_ALIAS_LOGIT_OFFSET = -0.5  # bnlit.alias_logits.DEFAULT_OFFSET (tests/test_scripts_help.py)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", required=True, type=Path, help="a bnlit training checkpoint (last.ckpt or step*.ckpt)")
    p.add_argument("--out", required=True, type=Path, help="the .gguf file to write")
    p.add_argument("--type", choices=GGUF_TYPES, default="f32", help="type of the weight matrices")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument("--raw-spellings", default=",".join(DEFAULT_RAW_SPELLINGS),
                   help="tokens for the other spellings of pieces (bnlit/raw_spellings.py), so that llama.cpp "
                        "reads raw text: comma-separated kinds of " + ",".join(RAW_SPELLING_KINDS) + ", or none")
    p.add_argument("--alias-logit-offset", type=float, default=DEFAULT_ALIAS_LOGIT_OFFSET, metavar="NATS",
                   help="a raw-spelling token's logit relative to its piece's (bnlit/alias_logits.py): lower costs "
                        "less on text in bnlit's spelling, more on text typed in the other; 0 shares the piece's row")
    args = p.parse_args(argv)
    kinds = () if args.raw_spellings == "none" else tuple(k for k in args.raw_spellings.split(",") if k)
    if unknown := sorted(set(kinds) - set(RAW_SPELLING_KINDS)):
        print(f"error: --raw-spellings {args.raw_spellings}: {','.join(unknown)} is not a kind; use any of "
              f"{','.join(RAW_SPELLING_KINDS)} (comma-separated) or none", file=sys.stderr)
        return 2
    from bnlit.checkpointing import load_model  # after the arguments: --help answers without torch
    from bnlit.export import export_gguf

    try:
        model, tok, ckpt = load_model(args.checkpoint)
        out = export_gguf(model, tok, args.out, type=args.type, overwrite=args.overwrite, raw_spellings=kinds,
                          alias_logit_offset=args.alias_logit_offset)
    except BnlitError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"exported {model.config.name} (step {ckpt.get('global_step')}, {model.num_params():,} parameters) "
          f"to {out} ({args.type}, {out.stat().st_size / 2**20:.2f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

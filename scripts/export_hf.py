"""Export a checkpoint in the Hugging Face Llama layout (config.json, model.safetensors,
generation_config.json, tokenizer.json + tokenizer_config.json, and the SentencePiece tokenizer.model).

    python scripts/export_hf.py --checkpoint CKPT --out DIR [--dtype float32|bfloat16|float16] [--overwrite]

Load it with ``transformers.LlamaForCausalLM.from_pretrained(DIR)`` and
``AutoTokenizer.from_pretrained(DIR)``: the tokenizer.json normalises raw text as bnlit does
(``bnlit/hf_tokenizer.py``), so ``tok.encode(text)`` gives bnlit's ids with no bnlit call first.
The export refuses, in one line and before writing anything, a tokenizer it cannot reproduce.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bnlit.errors import BnlitError

DTYPES = ("bfloat16", "float16", "float32")  # torch dtypes by name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", required=True, type=Path, help="a bnlit training checkpoint (last.ckpt or step*.ckpt)")
    p.add_argument("--out", required=True, type=Path, help="directory to write the Hugging Face model into")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the saved weights")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    args = p.parse_args(argv)
    import torch  # after the arguments: --help answers without it

    from bnlit.checkpointing import load_model
    from bnlit.export import export_hf

    try:
        model, tok, ckpt = load_model(args.checkpoint)
        out = export_hf(model, tok, args.out, dtype=getattr(torch, args.dtype), overwrite=args.overwrite)
    except BnlitError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    files = sorted(f.name for f in out.iterdir())
    print(f"exported {model.config.name} (step {ckpt.get('global_step')}, {model.num_params():,} parameters) "
          f"to {out}: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Do other tools tokenize raw text as bnlit does? Per text file (one document per line, raw), the
share of lines on which Hugging Face's ``AutoTokenizer`` on an export directory and llama.cpp on a
GGUF file give exactly :meth:`bnlit.tokenizer.Tokenizer.encode`'s ids, with no bnlit call first,
and on which their ``decode`` of bnlit's ids gives SentencePiece's text. For llama.cpp it also counts
the lines whose ids equal bnlit's once each raw-spelling token (a precomposed nukta letter, a
two-part vowel sign: ``bnlit/raw_spellings.py``) is mapped to the piece it spells, and per file
the lines with each kind of difference between the raw text and what bnlit's tokenizer reads
(``bnlit.raw_spellings.raw_differences``).

    python scripts/tokenizer_parity.py --tokenizer RUN/tokenizer.model [--hf EXPORT_DIR] [--gguf FILE]
                                       --text ben_Beng.dev --text eng_Latn.dev [--show 3] [--json]

``--show N`` prints the first N differing lines of each file with the first differing pieces.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from collections import Counter

from bnlit.errors import BnlitError, ConfigError
from bnlit.raw_spellings import raw_differences
from bnlit.tokenizer import Tokenizer


def read_lines(path: Path) -> list[str]:
    if not path.is_file():
        raise ConfigError(f"--text {path}: no such file")
    return [line for line in path.read_text(encoding="utf-8").split("\n") if line]


def compare(name: str, encode, decode, lines: list[str], want: list[list[int]], tok: Tokenizer, show: int,
            canonical=None) -> dict:
    same = same_text = same_pieces = 0
    shown = []
    canonical = canonical or (lambda ids: ids)
    for line, ids in zip(lines, want):
        got = encode(line)
        same += got == ids
        got = canonical(got)
        if got == ids:
            same_pieces += 1
        elif len(shown) < show:
            k = next((i for i, (a, b) in enumerate(zip(ids, got)) if a != b), min(len(ids), len(got)))
            shown.append(f"  {name}: {json.dumps(line[:60], ensure_ascii=False)} at token {k}: bnlit "
                         f"{[tok.sp.id_to_piece(i) for i in ids[k:k + 3]]} vs {got[k:k + 3]}")
        same_text += decode(ids) == tok.decode(ids)
    return {"lines": len(lines), "same_ids": same, "same_pieces": same_pieces, "same_decode": same_text,
            "examples": shown}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", required=True, type=Path, help="the run's tokenizer.model (or an export's)")
    p.add_argument("--hf", type=Path, help="a Hugging Face export directory (scripts/export_hf.py)")
    p.add_argument("--gguf", type=Path, help="a GGUF file (scripts/export_gguf.py; needs the serve extra)")
    p.add_argument("--text", action="append", type=Path, required=True, help="raw text, one document per line")
    p.add_argument("--show", type=int, default=3, help="differing lines to print per file and tool")
    p.add_argument("--json", action="store_true", help="print one JSON object per text file and tool")
    args = p.parse_args(argv)
    try:
        tok = Tokenizer(args.tokenizer)
        tools = {}
        if args.hf:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(args.hf)
            tools["hf"] = (hf.encode, hf.decode, None)
        if args.gguf:
            from bnlit.serving import LlamaCppLM

            lm = LlamaCppLM(args.gguf, vocab_only=True)
            tools["llama.cpp"] = (lm.encode_raw, lm.decode, lm.canonical)
        if not tools:
            raise ConfigError("nothing to compare: pass --hf EXPORT_DIR and/or --gguf FILE")
        out = {}
        for path in args.text:
            lines = read_lines(path)
            want = tok.encode_batch(lines)
            out[str(path)] = {name: compare(name, enc, dec, lines, want, tok, args.show, canon)
                              for name, (enc, dec, canon) in tools.items()}
            out[str(path)]["raw_differences"] = dict(Counter(k for line in lines for k in raw_differences(line))
                                                     .most_common())
    except BnlitError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if args.json:
        print(json.dumps(out, indent=2, ensure_ascii=False))
        return 0
    for path, rows in out.items():
        kinds = rows.pop("raw_differences")
        print(f"{path}: lines by kind of raw-text difference from what bnlit reads: "
              + (", ".join(f"{k} {n}" for k, n in kinds.items()) or "none"))
        for name, r in rows.items():
            pieces = (f" ({r['same_pieces']}/{r['lines']} once its raw-spelling tokens are mapped to the pieces "
                      "they spell)" if r["same_pieces"] != r["same_ids"] else "")
            print(f"{path}: {name} gives bnlit's ids on {r['same_ids']}/{r['lines']} raw lines{pieces}, "
                  f"decodes bnlit's ids to SentencePiece's text on {r['same_decode']}/{r['lines']}")
            print("\n".join(r["examples"]) if r["examples"] else "", end="\n" if r["examples"] else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())

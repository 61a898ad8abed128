"""Compare tokenizer recipes on the embedded corpus: BPE vs unigram, character coverage, NFC vs
NFKC, and per-language sampling of the training text. Each variant is trained by
``scripts/train_tokenizer.py`` on the same lines and scored on the same held-out slice (and, with
``--eval LANG=FILE``, on extra text such as FLORES-200). Prints a Markdown table.

    python scripts/compare_tokenizers.py --out /tmp/tokcmp [--vocab-size 8192] [--eval bn=FILE --eval en=FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_tokenizer  # noqa: E402  (the sibling CLI)

from bnlit import fertility  # noqa: E402
from bnlit.data import embedded  # noqa: E402
from bnlit.tokenizer import Tokenizer  # noqa: E402

BASE = {"model_type": "bpe", "character_coverage": 0.9999, "normalization": "nfc", "lang_weights": None}
VARIANTS = {
    "bpe, cov 0.9999, NFC, natural mix": {},
    "unigram": {"model_type": "unigram"},
    "bpe, cov 0.9995": {"character_coverage": 0.9995},
    "bpe, cov 1.0": {"character_coverage": 1.0},
    "bpe, NFKC": {"normalization": "nfkc"},
    "bpe, bn=0.8,en=0.2": {"lang_weights": "bn=0.8,en=0.2"},
    "bpe, bn=0.7,en=0.3": {"lang_weights": "bn=0.7,en=0.3"},
    "bpe, bn=0.5,en=0.5": {"lang_weights": "bn=0.5,en=0.5"},
    "unigram, bn=0.7,en=0.3": {"model_type": "unigram", "lang_weights": "bn=0.7,en=0.3"},
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the training lines and one tokenizer per variant")
    p.add_argument("--vocab-size", type=int, default=8192, help="vocabulary of every variant")
    p.add_argument("--num-threads", type=int, default=2, help="SentencePiece training and encoding threads")
    p.add_argument("--eval", action="append", default=[], metavar="LANG=FILE", help="extra held-out text of one language to score every variant on, one sentence a line (repeatable)")
    p.add_argument("--only", action="append", default=None, help="variant names to run")
    args = p.parse_args(argv)
    out = Path(args.out)
    files = embedded.materialize(out / "embedded")
    extra = {}
    for spec in args.eval:
        lang, _, file = spec.partition("=")
        extra[lang] = fertility.read_lines(file)
    extra_cols = [f"{lang} cpt (eval)" for lang in extra]
    print("| recipe | bn chars/token | en chars/token | bn byte-fallback | en byte-fallback | "
          + "".join(f"{c} | " for c in extra_cols) + "train s |")
    print("|---" * (6 + len(extra_cols)) + "|")
    for name, change in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        v = {**BASE, **change}
        d = out / name.replace(" ", "").replace(",", "_").replace("=", "")
        ns = argparse.Namespace(input=[f"bn={files['bn']}", f"en={files['en']}"], vocab_size=args.vocab_size,
                                out=str(d), heldout_fraction=0.05, seed=0, num_threads=args.num_threads, **v)
        card = train_tokenizer.build(ns)
        h = card["heldout_fertility"]
        cells = [f"{h['bn']['chars_per_token']:.3f}", f"{h['en']['chars_per_token']:.3f}",
                 f"{100 * h['bn']['byte_fallback_rate']:.2f}%", f"{100 * h['en']['byte_fallback_rate']:.2f}%"]
        if extra:
            tok = Tokenizer(card["tokenizer"])
            cells += [f"{fertility.measure(t, tok, lang).chars_per_token:.3f}" for lang, t in extra.items()]
        print(f"| {name} | " + " | ".join(cells) + f" | {card['training_seconds']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

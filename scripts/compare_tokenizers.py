"""Compare tokenizer recipes on the embedded corpus at several vocabulary sizes: the default recipe
(``conf/tokenizer/default.yaml``) and variants of it, next to a byte-level baseline. Each variant
is trained by ``scripts/train_tokenizer.py`` on the same lines and scored on the same held-out
slice and, with ``--eval LANG=FILE``, on extra text such as FLORES-200 dev (line-aligned
translations give the token premium of Petrov et al. 2023). Prints a Markdown table.

    python scripts/compare_tokenizers.py --out /tmp/tokcmp [--vocab-size 8192 32000] \
        [--eval bn=ben_Beng.dev --eval en=eng_Latn.dev] [--only default ...]

Columns: chars/token per language on the held-out slice and on the eval text; the premium (bn
tokens / en tokens for the same content; on the held-out slices, which are not translations,
en chars/token / bn chars/token); the byte-fallback rate (tokens that are raw bytes); the share
of Bangla tokens that start with a combining mark (a vowel sign, hasanta or nukta starting a
token: a split inside a grapheme cluster).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_tokenizer  # noqa: E402  (the sibling CLI)

from bnlit import progress  # noqa: E402
from bnlit.checks import fertility
from bnlit.data import embedded  # noqa: E402
from bnlit.tokenizer import Tokenizer  # noqa: E402

RECIPE_KEYS = ("model_type", "character_coverage", "normalization", "lang_weights", "split_digits",
               "word_frequencies")
VARIANTS = {
    "default": {},
    "no word list": {"word_frequencies": None},
    "digits merge": {"split_digits": False},
    "natural mix": {"lang_weights": None},
    "bn=0.7,en=0.3": {"lang_weights": {"bn": 0.7, "en": 0.3}},
    "bn=0.5,en=0.5": {"lang_weights": {"bn": 0.5, "en": 0.5}},
    "unigram": {"model_type": "unigram"},
    "coverage 1.0": {"character_coverage": 1.0},
}


def weights_spec(weights: dict | None) -> str:
    return ",".join(f"{k}={v}" for k, v in weights.items()) if weights else "none"


def scores(tok, heldout: dict[str, list[str]], evals: dict[str, list[str]]) -> dict:
    h = {lang: fertility.measure(lines, tok, lang) for lang, lines in heldout.items()}
    e = {lang: fertility.measure(lines, tok, lang) for lang, lines in evals.items()}
    out = {"held": h, "eval": e}
    if "bn" in h and "en" in h:
        out["held_premium"] = h["en"].chars_per_token / h["bn"].chars_per_token
    if "bn" in e and "en" in e and len(evals["bn"]) == len(evals["en"]):
        out["eval_premium"] = e["bn"].tokens / e["en"].tokens
    return out


def row(name: str, vocab: int | str, s: dict, seconds: float | None) -> str:
    def cpt(d, lang):
        return f"{d[lang].chars_per_token:.3f}" if lang in d else ""

    def pct(d, lang, attr):
        return f"{100 * getattr(d[lang], attr):.2f}%" if lang in d else ""

    h, e = s["held"], s["eval"]
    ev = e or h
    cells = [name, str(vocab), cpt(h, "bn"), cpt(h, "en"), f"{s.get('held_premium', float('nan')):.2f}",
             cpt(e, "bn"), cpt(e, "en"), f"{s['eval_premium']:.2f}" if "eval_premium" in s else "",
             pct(ev, "bn", "byte_fallback_rate"), pct(ev, "en", "byte_fallback_rate"),
             pct(ev, "bn", "mark_start_rate"), "" if seconds is None else f"{seconds:.1f}"]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for the training lines and one tokenizer per variant")
    p.add_argument("--vocab-size", type=int, nargs="+", default=[8192, 32000],
                   help="vocabulary sizes, each variant trained at each (default: %(default)s)")
    p.add_argument("--num-threads", type=int, default=2, help="SentencePiece training and encoding threads (default: %(default)s)")
    p.add_argument("--eval", action="append", default=[], metavar="LANG=FILE",
                   help="extra held-out text of one language to score every variant on, one sentence a line (repeatable)")
    p.add_argument("--only", nargs="+", default=None, help=f"variant names ({', '.join(VARIANTS)})")
    p.add_argument("--heldout-fraction", type=float, default=0.05,
                   help="content-hash share of the corpus held out for scoring (default: %(default)s)")
    args = p.parse_args(argv)
    progress.ENABLED = False  # the bars would interleave with the table on stdout
    unknown = sorted(set(args.only or ()) - set(VARIANTS))
    if unknown:
        p.error(f"--only {unknown}: the variants are {list(VARIANTS)}")
    out = Path(args.out)
    files = embedded.materialize(out / "embedded")
    evals = {}
    for spec in args.eval:
        lang, _, file = spec.partition("=")
        evals[lang] = fertility.read_lines(file)
    from bnlit.data.shards import is_validation

    heldout = {lang: [x for x in fertility.iter_lines([Path(f).read_text(encoding="utf-8")])
                      if is_validation(x, args.heldout_fraction)] for lang, f in files.items()}
    base = {k: train_tokenizer.default_recipe()[k] for k in RECIPE_KEYS}
    ev = "eval" if evals else "held-out"
    print(f"default recipe: {base}; eval text: {', '.join(args.eval) or 'none (held-out columns repeated)'}")
    print("| recipe | vocab | bn held-out | en held-out | premium held-out | bn eval | en eval | premium eval "
          f"| bn byte-fallback ({ev}) | en byte-fallback ({ev}) | bn tokens starting with a mark ({ev}) | train s |")
    print("|---" * 12 + "|")
    print(row("bytes (UTF-8)", "256", scores(fertility.BYTES, heldout, evals), None), flush=True)
    for vocab in args.vocab_size:
        for name, change in VARIANTS.items():
            if args.only and name not in args.only:
                continue
            v = {**base, **change}
            d = out / f"{vocab}-{name.replace(' ', '_').replace(',', '_').replace('=', '')}"
            ns = argparse.Namespace(input=[f"bn={files['bn']}", f"en={files['en']}"], vocab_size=vocab, out=str(d),
                                    heldout_fraction=args.heldout_fraction, seed=0, num_threads=args.num_threads,
                                    model_type=v["model_type"], character_coverage=v["character_coverage"],
                                    normalization=v["normalization"], lang_weights=weights_spec(v["lang_weights"]),
                                    split_digits=v["split_digits"],
                                    word_frequencies=weights_spec(v["word_frequencies"]))
            card = train_tokenizer.build(ns)
            tok = Tokenizer(card["tokenizer"])
            print(row(name, vocab, scores(tok, heldout, evals), card["training_seconds"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

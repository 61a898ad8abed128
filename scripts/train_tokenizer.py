"""Train a SentencePiece tokenizer on text files and write ``DIR/tokenizer.model`` plus a JSON card
(``DIR/tokenizer_card.json``: vocabulary, model type, normalisation, training-text statistics and
fertility on a held-out slice).

    python scripts/train_tokenizer.py --input bn=bn.txt en=en.txt --vocab-size 8192 --out tok/ \
        [--model-type bpe|unigram] [--lang-weights bn=0.8,en=0.2]

Each ``--input`` is ``LANG=FILE`` or a bare ``FILE``, whose language is then detected from its
script: ``bn`` when most letters of its first 200,000 characters are in the Bengali block, ``en``
when most are Latin (any Latin-script text counts as English), else the file is refused. Every
non-empty line is a training sentence; a content-hash slice of the lines (``--heldout-fraction``,
the same split rule as the data module's) is held out and only used for the card's fertility.
``--lang-weights`` resamples the training lines so each language has that share of the
characters. The defaults are the recipe measured in the README ("Tokenizer fertility").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bnlit import fertility
from bnlit.errors import BnlitError, ConfigError
from bnlit.tokenizer import NORMALIZATION_RULES, Tokenizer, sample_by_language, train_tokenizer

DETECT_CHARS = 200_000


class RawDescriptionDefaultsFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's layout and shows each option's default."""


def parse_weights(spec: str | None) -> dict[str, float] | None:
    """``"bn=0.8,en=0.2"`` -> ``{"bn": 0.8, "en": 0.2}``."""
    if not spec:
        return None
    out = {}
    for part in spec.split(","):
        lang, sep, value = part.partition("=")
        try:
            out[lang.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not lang.strip() or out[lang.strip()] < 0:
            raise ConfigError(f"--lang-weights {spec!r}: write LANG=WEIGHT[,LANG=WEIGHT...] with weights >= 0")
    if sum(out.values()) <= 0:
        raise ConfigError(f"--lang-weights {spec!r}: at least one weight must be positive")
    return out


def parse_inputs(specs: list[str]) -> list[tuple[str, Path]]:
    """``LANG=FILE`` or ``FILE`` (language detected from the script) -> ``[(lang, path)]``."""
    out = []
    for spec in specs:
        lang, sep, file = spec.partition("=")
        if not sep or "/" in lang or not lang:
            lang, file = "", spec
        path = Path(file)
        if not path.is_file():
            raise ConfigError(f"--input {spec}: {path} does not exist")
        if not lang:
            with path.open(encoding="utf-8", errors="replace") as f:
                lang = fertility.detect_language(f.read(DETECT_CHARS))
            if lang == "und":
                raise ConfigError(f"--input {spec}: cannot tell its language from its script; write LANG={file}")
        out.append((lang, path))
    return out


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--input {path}: not UTF-8 (byte offset {e.start}); convert it with iconv") from None


def build(args: argparse.Namespace) -> dict:
    inputs = parse_inputs(args.input)
    weights = parse_weights(args.lang_weights)
    from bnlit.data.shards import is_validation  # after the argument checks: it imports Lightning
    train_lines: dict[str, list[str]] = {}
    heldout: dict[str, list[str]] = {}
    stats: dict[str, dict] = {}
    for lang, path in inputs:
        lines = list(fertility.iter_lines([read_text(path)]))
        s = stats.setdefault(lang, {"files": [], "lines": 0, "chars": 0, "bytes": 0})
        s["files"].append(str(path))
        s["lines"] += len(lines)
        s["chars"] += sum(map(len, lines))
        s["bytes"] += sum(len(x.encode("utf-8")) for x in lines)
        for line in lines:
            (heldout if is_validation(line, args.heldout_fraction) else train_lines).setdefault(lang, []).append(line)
    if weights and set(weights) - set(train_lines):
        raise ConfigError(f"--lang-weights names {sorted(set(weights) - set(train_lines))}, "
                          f"but the inputs are {sorted(train_lines)}")
    pairs = sample_by_language(train_lines, weights, seed=args.seed, with_language=True)
    sampled_chars: dict[str, int] = {}
    for lang, line in pairs:
        sampled_chars[lang] = sampled_chars.get(lang, 0) + len(line)
    sample = [line for _, line in pairs]
    out = Path(args.out)
    t0 = time.perf_counter()
    model = train_tokenizer(sample, out / "tokenizer.model", vocab_size=args.vocab_size,
                            model_type=args.model_type, character_coverage=args.character_coverage,
                            normalization=args.normalization, num_threads=args.num_threads)
    seconds = time.perf_counter() - t0
    tok = Tokenizer(model)
    total_sampled = sum(sampled_chars.values())
    card = {
        "tokenizer": str(model),
        "sha256": tok.sha256,
        "vocab_size": tok.vocab_size,
        "model_type": args.model_type,
        "normalization": {"bnlit": "NFC", "sentencepiece_rule": NORMALIZATION_RULES[args.normalization],
                          "name": args.normalization},
        "character_coverage": args.character_coverage,
        "byte_fallback": True,
        "lang_weights": weights,
        "heldout_fraction": args.heldout_fraction,
        "training_text": {lang: {**s, "train_lines": len(train_lines.get(lang, [])),
                                 "heldout_lines": len(heldout.get(lang, [])),
                                 "sampled_chars": sampled_chars.get(lang, 0),
                                 "sampled_char_share": sampled_chars.get(lang, 0) / total_sampled if total_sampled else 0.0}
                          for lang, s in stats.items()},
        "training_seconds": round(seconds, 3),
        "training_mb_per_s": round(sum(len(x.encode("utf-8")) for x in sample) / 1e6 / seconds, 4),
        "heldout_fertility": fertility.report(heldout, tok, parallel=False) if heldout else {},
    }
    (out / "tokenizer_card.json").write_text(json.dumps(card, indent=2, ensure_ascii=False))
    return card


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=RawDescriptionDefaultsFormatter)
    p.add_argument("--input", nargs="+", required=True, metavar="[LANG=]FILE", help="training text, one sentence a line; LANG= names its language, else it is detected from the script")
    p.add_argument("--vocab-size", type=int, required=True, help="pieces in the vocabulary (the model's model.config.vocab_size), e.g. 8192")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for tokenizer.model and tokenizer_card.json")
    p.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe", help="SentencePiece algorithm")
    p.add_argument("--lang-weights", default=None, metavar="bn=0.8,en=0.2", help="resample the lines so each language has this share of the characters (default: as given)")
    p.add_argument("--character-coverage", type=float, default=0.9999, help="share of characters the vocabulary must cover; rarer ones fall back to bytes")
    p.add_argument("--normalization", choices=sorted(NORMALIZATION_RULES), default="nfc", help="nfc (bnlit's) or nfkc (also folds compatibility forms)")
    p.add_argument("--heldout-fraction", type=float, default=0.05, help="content-hash share of lines held out for the card's fertility")
    p.add_argument("--seed", type=int, default=0, help="seed of the --lang-weights resampling")
    p.add_argument("--num-threads", type=int, default=None, help="SentencePiece training threads (default: all cores)")
    args = p.parse_args(argv)
    try:
        card = build(args)
    except BnlitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = {lang: round(f["chars_per_token"], 3) for lang, f in card["heldout_fertility"].items()}
    print(f"wrote {card['tokenizer']} ({card['vocab_size']} {card['model_type']}, {card['training_seconds']} s); "
          f"held-out chars/token {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

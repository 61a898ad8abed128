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
characters. The defaults are ``conf/tokenizer/default.yaml``, the recipe measured in docs/tokenizer.md
("Tokenizer fertility").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from bnlit import CONF_DIR
from bnlit.checks import fertility
from bnlit.errors import BnlitError, ConfigError
from bnlit.tokenizer import NORMALIZATION_RULES, Tokenizer, sample_by_language, train_tokenizer

DETECT_CHARS = 200_000


def default_recipe() -> dict:
    """The tokenizer keys of ``conf/tokenizer/default.yaml``: the CLI's defaults."""
    return OmegaConf.to_container(OmegaConf.load(Path(CONF_DIR) / "tokenizer" / "default.yaml"))


def parse_weights(spec: str | None, flag: str = "--lang-weights") -> dict[str, float] | None:
    """``"bn=0.8,en=0.2"`` -> ``{"bn": 0.8, "en": 0.2}``; ``"none"`` -> None."""
    if not spec or spec.strip().lower() == "none":
        return None
    out = {}
    for part in spec.split(","):
        lang, sep, value = part.partition("=")
        try:
            out[lang.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not lang.strip() or out[lang.strip()] < 0:
            raise ConfigError(f"{flag} {spec!r}: write LANG=WEIGHT[,LANG=WEIGHT...] with weights >= 0")
    if sum(out.values()) <= 0:
        raise ConfigError(f"{flag} {spec!r}: at least one weight must be positive")
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
    if args.lang_weights is None:  # the recipe's weights, for the languages given
        given = {lang for lang, _ in inputs}
        weights = {k: v for k, v in (default_recipe()["lang_weights"] or {}).items() if k in given}
        weights = weights if len(weights) > 1 else None
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
    word_freq = parse_weights(args.word_frequencies, "--word-frequencies")
    if args.word_frequencies is None:  # the recipe's, for the languages given
        word_freq = {k: v for k, v in (default_recipe().get("word_frequencies") or {}).items() if k in train_lines}
    real_lines = {lang: len(lines) for lang, lines in train_lines.items()}
    word_chars = {}
    for lang, ratio in (word_freq or {}).items():
        if lang not in train_lines:
            raise ConfigError(f"--word-frequencies names {lang}, but the inputs are {sorted(train_lines)}")
        from bnlit.data.embedded import word_lines

        extra = word_lines(lang, int(ratio * sum(map(len, train_lines[lang]))), seed=args.seed)
        word_chars[lang] = sum(map(len, extra))
        train_lines[lang] = train_lines[lang] + extra
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
                            normalization=args.normalization, num_threads=args.num_threads,
                            split_digits=args.split_digits)
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
        "split_digits": args.split_digits,
        "byte_fallback": True,
        "lang_weights": weights,
        "word_frequencies": word_freq or None,
        "word_text_chars": word_chars,
        "heldout_fraction": args.heldout_fraction,
        "training_text": {lang: {**s, "train_lines": real_lines.get(lang, 0),
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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, metavar="[LANG=]FILE",
                   help="training text, one sentence a line; LANG= names its language, else it is detected from the script")
    p.add_argument("--vocab-size", type=int, required=True,
                   help="pieces in the vocabulary (the model's model.config.vocab_size), e.g. 8192")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for tokenizer.model and tokenizer_card.json")
    recipe = default_recipe()
    p.add_argument("--model-type", choices=("bpe", "unigram"), default=recipe["model_type"],
                   help="SentencePiece algorithm (default: %(default)s, conf/tokenizer/default.yaml)")
    p.add_argument("--lang-weights", default=None, metavar="bn=0.8,en=0.2",
                   help="default: conf/tokenizer/default.yaml's lang_weights for the languages given; "
                        "'none' keeps the text's own mix")
    p.add_argument("--word-frequencies", default=None, metavar="bn=1.0",
                   help="add wordfreq word text to a language's training lines, as a multiple of its characters "
                        "(default: conf/tokenizer/default.yaml's word_frequencies; 'none' for none)")
    p.add_argument("--character-coverage", type=float, default=recipe["character_coverage"],
                   help="share of characters the vocabulary must cover; rarer ones fall back to bytes (default: %(default)s)")
    p.add_argument("--normalization", choices=sorted(NORMALIZATION_RULES), default=recipe["normalization"],
                   help="nfc (bnlit's) or nfkc (also folds compatibility forms) (default: %(default)s)")
    p.add_argument("--split-digits", action=argparse.BooleanOptionalAction, default=recipe["split_digits"],
                   help="every ASCII and Bangla digit its own token")
    p.add_argument("--heldout-fraction", type=float, default=0.05,
                   help="content-hash share of lines held out for the card's fertility (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the --lang-weights resampling (default: %(default)s)")
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

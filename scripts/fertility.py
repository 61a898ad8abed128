"""Per-language tokenizer fertility, and the token premium on line-aligned parallel text.

    python scripts/fertility.py --tokenizer PATH|bytes --lang bn=FILE --lang en=FILE [--json] [--plot FILE]

Every non-empty line of a file is a sentence. When all files have the same number of lines they
are taken as line-aligned translations and each language gets its token premium (Petrov et al.
2023: its tokens divided by English's, or the first language's, for the same content).
``--tokenizer bytes`` is the raw UTF-8 baseline (one token per byte). ``--json`` prints one JSON
object keyed by language; otherwise a table, and ``--plot`` writes a bar chart of chars/token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bnlit.checks import fertility
from bnlit.errors import BnlitError, ConfigError

COLUMNS = ("chars_per_token", "bytes_per_token", "tokens_per_word", "tokens", "chars",
           "byte_fallback_rate", "unk_rate", "mark_start_rate", "premium")


def parse_lang(specs: list[str]) -> dict[str, Path]:
    out = {}
    for spec in specs:
        lang, sep, file = spec.partition("=")
        if not sep or not lang or not file:
            raise ConfigError(f"--lang {spec!r}: write LANG=FILE")
        if lang in out:
            raise ConfigError(f"--lang {lang} given twice")
        if not Path(file).is_file():
            raise ConfigError(f"--lang {spec}: {file} does not exist")
        out[lang] = Path(file)
    return out


def load_tokenizer(spec: str):
    if spec == fertility.BYTES:
        return fertility.BYTES
    from bnlit.tokenizer import Tokenizer

    return Tokenizer(spec)


def table(result: dict[str, dict]) -> str:
    cols = [c for c in COLUMNS if any(c in r for r in result.values())]
    rows = [["lang", *cols]]
    for lang, r in result.items():
        rows.append([lang, *(_fmt(r[c]) if c in r else "" for c in cols)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def _fmt(v) -> str:
    if isinstance(v, int):
        return str(v)
    return f"{v:.4f}" if abs(v) < 1 else f"{v:.3f}"


def plot(result: dict[str, dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4 + len(result), 3))
    langs = list(result)
    ax.bar(langs, [result[k]["chars_per_token"] for k in langs])
    ax.set_ylabel("characters per token")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokenizer", required=True, metavar="PATH|bytes", help="a SentencePiece tokenizer.model, or bytes for the raw UTF-8 baseline")
    p.add_argument("--lang", action="append", required=True, metavar="LANG=FILE", help="text of one language, one sentence a line (repeatable; line-aligned files give the token premium)")
    p.add_argument("--json", action="store_true", help="print one JSON object keyed by language")
    p.add_argument("--plot", metavar="FILE.png", help="also write a bar chart of characters per token per language")
    p.add_argument("--num-threads", type=int, default=1, help="SentencePiece encoding threads")
    p.add_argument("--timing", action="store_true", help="add encode_seconds and encode_mb_per_s")
    args = p.parse_args(argv)
    try:
        files = parse_lang(args.lang)
        tok = load_tokenizer(args.tokenizer)
        texts = {lang: fertility.read_lines(path) for lang, path in files.items()}
    except (BnlitError, UnicodeDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    result = fertility.report(texts, tok, num_threads=args.num_threads)
    seconds = time.perf_counter() - t0
    if args.timing:
        mb = sum(r["bytes"] for r in result.values()) / 1e6
        for r in result.values():
            r["encode_seconds"] = seconds
            r["encode_mb_per_s"] = mb / seconds
    if args.plot:
        plot(result, args.plot, f"{Path(args.tokenizer).name}: fertility")
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"tokenizer {args.tokenizer}")
        print(table(result))
        if args.timing:
            print(f"encoded {mb:.2f} MB in {seconds:.3f} s ({mb / seconds:.2f} MB/s, {args.num_threads} threads)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

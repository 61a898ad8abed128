"""OCR debris in Bangla text: ``python scripts/ocr_debris.py [--file F] [--samples N]``.

Measures what ``data.clean.ocr_debris`` (bnlit/data/ocr_debris.py) acts on, on the embedded Bangla
books (normalised as the data build does) or on your own file (``.txt``: one document per blank-line
separated paragraph; ``.jsonl``: a ``text`` field per line): the share of number tokens and
digit characters; the pages (lines) above each number-token share, and their characters; the
pages that start or end with a number token; then what the configured step drops and strips, and
``--samples`` of the pages it drops. docs/data.md "OCR debris: page numbers and tables" quotes its output.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SHARES = (0.05, 0.1, 0.2, 0.3, 0.5)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--file", type=Path, default=None, help="a .txt or .jsonl file instead of the embedded Bangla books")
    p.add_argument("--max-number-share", type=float, default=0.2, help="data.clean.ocr_debris.max_number_share")
    p.add_argument("--min-numbers", type=int, default=3, help="data.clean.ocr_debris.min_numbers")
    p.add_argument("--edge-number-digits", type=int, default=3, help="data.clean.ocr_debris.edge_number_digits (0: off)")
    p.add_argument("--samples", type=int, default=3, help="dropped pages to print (first 200 characters each)")
    p.add_argument("--seed", type=int, default=0, help="which dropped pages are sampled")
    return p.parse_args(argv)


def documents(path: Path | None) -> list[str]:
    from bnlit.data.normalize import normalize_text

    if path is None:
        from bnlit.data.embedded import bangla_documents

        docs = bangla_documents()
    elif path.suffix == ".jsonl":
        docs = [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    else:
        docs = [d for d in path.read_text(encoding="utf-8").split("\n\n") if d.strip()]
    return [normalize_text(d) for d in docs]


def main(argv=None) -> None:
    args = parse_args(argv)
    from bnlit.data.ocr_debris import DIGIT, OcrDebrisConfig, clean_ocr_debris, is_number, number_share

    docs = documents(args.file)
    pages = [p for d in docs for p in d.split("\n") if p.strip()]
    chars = sum(map(len, pages))
    tokens = [t for p in pages for t in p.split()]
    digits = sum(len(DIGIT.findall(p)) for p in pages)
    print(f"{args.file or 'embedded Bangla books'}: {len(docs)} documents, {len(pages)} pages (lines), "
          f"{chars:,} characters, {len(tokens):,} tokens")
    print(f"  digit characters {digits / chars:.2%}; number tokens {sum(map(is_number, tokens)) / len(tokens):.2%}")
    shares = [number_share(p) for p in pages]
    for s in SHARES:
        hit = [len(p) for p, (share, n) in zip(pages, shares) if share > s and n >= args.min_numbers]
        print(f"  pages with > {s:.0%} number tokens (and >= {args.min_numbers}): {len(hit) / len(pages):.2%} "
              f"of pages, {sum(hit) / chars:.2%} of characters")
    first = sum(1 for p in pages if is_number(p.split()[0]))
    last = sum(1 for p in pages if is_number(p.split()[-1]))
    print(f"  pages starting with a number token {first / len(pages):.2%}, ending with one {last / len(pages):.2%}")
    cfg = OcrDebrisConfig(max_number_share=args.max_number_share, min_numbers=args.min_numbers,
                          edge_number_digits=args.edge_number_digits or None)
    total: dict[str, int] = {}
    dropped = []
    for d in docs:
        for k, v in clean_ocr_debris(d, cfg)[1].items():
            total[k] = total.get(k, 0) + v
        dropped += [p for p in d.split("\n") if p.strip() and clean_ocr_debris(p, cfg)[1]["dropped_pages"]]
    print(f"  the step ({cfg}): drops {total['dropped_pages']} pages ({total['dropped_pages'] / len(pages):.2%}), "
          f"{total['dropped_chars']:,} characters ({total['dropped_chars'] / chars:.2%}); strips "
          f"{total['stripped_tokens']:,} page-edge number tokens ({total['stripped_chars']:,} characters)")
    for p in random.Random(args.seed).sample(dropped, min(args.samples, len(dropped))):
        print(f"  dropped: {p[:200]}")


if __name__ == "__main__":
    main()

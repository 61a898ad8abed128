"""bnlit's Bangla quality filters against FineWeb-2's ``ben_Beng`` filters on the same documents:
``python scripts/compare_filters.py [--text FILE --lines-per-doc N] [--examples 2] [--json]``.

Both see the same normalised text (:func:`bnlit.data.normalize.normalize_text`). bnlit's are
:func:`bnlit.data.filters.filter_reason` with ``data.clean.filters`` of conf/data/embedded.yaml;
FineWeb-2's are the three datatrove filters of its pipeline (``fineweb-2-pipeline.py``) with the
thresholds and stop words of its ``configs/ben_Beng.yml``: ``GopherRepetitionFilter`` (duplicate
line fraction 0.165, top 2/3/4-gram fractions, duplicated 5..10-gram fractions),
``FineWebQualityFilter`` (lines ending in punctuation >= 0.25, newline ratio 0.268, duplicated
characters 0.1) and ``GopherQualityFilter`` (average word length 4-24, non-alphabetic words
<= 0.8, at least 2 stop words). Its language-ID threshold (GlotLID score 0.872) is not applied:
every document here is Bangla. FineWeb-2 splits Bangla words with indic-nlp-library's trivial
tokenizer (``pip install indic-nlp-library``); without it, bnlit's canonical words stand in and
the table says so.

Corpora: the embedded Bangla books (one document per book), the same books cut into their OCR
pages (a web page's size), and ``--text FILE`` cut into documents of ``--lines-per-doc`` lines
(e.g. a clean reference text such as a benchmark's sentences). For each: documents kept by
each, by both, and the reasons and examples of what one drops and the other keeps.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from bnlit.data import embedded
from bnlit.data.filters import FilterConfig, filter_reason
from bnlit.data.normalize import normalize_text

# FineWeb-2 configs/ben_Beng.yml
FW2_BEN = {
    "dup_line_frac": 0.165,
    "dup_n_grams": [(5, 0.099), (6, 0.083), (7, 0.069), (8, 0.058), (9, 0.048), (10, 0.04)],
    "top_n_grams": [(2, 0.084), (3, 0.103), (4, 0.134)],
    "line_punct_thr": 0.25,
    "new_line_ratio": 0.268,
    "max_avg_word_length": 24,
    "min_avg_word_length": 4,
    "max_non_alpha_words_ratio": 0.8,
    "stopwords": ["এবং", "ও", "হয়", "করে", "একটি", "তিনি", "করা", "থেকে"],
}


def bnlit_filters() -> FilterConfig:
    """``data.clean.filters`` of the default config (conf/data/embedded.yaml)."""
    import yaml

    from bnlit import CONF_DIR

    return FilterConfig.from_dict(yaml.safe_load((CONF_DIR / "data" / "embedded.yaml").read_text())["clean"]["filters"])


def fineweb2_filters() -> tuple[list, str]:
    """FineWeb-2's three filters with the ben_Beng settings, and the word tokenizer they use."""
    from datatrove.pipeline.filters import FineWebQualityFilter, GopherQualityFilter, GopherRepetitionFilter

    try:
        import indicnlp  # noqa: F401

        language, words = "ben_Beng", "indic-nlp-library trivial tokenizer (FineWeb-2's)"
    except ImportError:
        from bnlit.data.steps import CanonicalWords

        language, words = CanonicalWords(), "bnlit canonical words (indic-nlp-library not installed)"
    c = FW2_BEN
    return [
        GopherRepetitionFilter(language=language, dup_para_frac=0, dup_line_char_frac=0, dup_para_char_frac=0,
                               dup_line_frac=c["dup_line_frac"], top_n_grams=c["top_n_grams"],
                               dup_n_grams=c["dup_n_grams"]),
        FineWebQualityFilter(language=language, short_line_thr=999, char_duplicates_ratio=0.1,
                             line_punct_thr=c["line_punct_thr"], new_line_ratio=c["new_line_ratio"]),
        GopherQualityFilter(language=language, max_avg_word_length=c["max_avg_word_length"],
                            min_avg_word_length=c["min_avg_word_length"], stop_words=c["stopwords"],
                            max_non_alpha_words_ratio=c["max_non_alpha_words_ratio"], min_stop_words=2),
    ], words


def fineweb2_reason(filters: list, text: str) -> str | None:
    from datatrove.data import Document

    doc = Document(text=text, id="x")
    for f in filters:
        result = f.filter(doc)
        ok, reason = result if isinstance(result, tuple) else (result, None)
        if not ok:
            return f"{f.name.split(' ', 1)[-1]}:{reason}"
    return None


def fineweb2_each(filters: list, text: str) -> dict[str, str | None]:
    """Each FineWeb-2 filter's verdict on its own (None: kept), so a filter that drops everything
    (FineWebQuality's line punctuation on OCR without punctuation) does not hide the others'."""
    from datatrove.data import Document

    out = {}
    for f in filters:
        result = f.filter(Document(text=text, id="x"))
        ok, reason = result if isinstance(result, tuple) else (result, None)
        out[f.name.split(" ", 1)[-1]] = None if ok else reason
    return out


def corpora(args) -> dict[str, list[str]]:
    books = embedded.bangla_documents()
    out = {"embedded books": books, "embedded book pages": [p for b in books for p in b.split("\n") if p.strip()]}
    if args.text:
        lines = [ln for ln in Path(args.text).read_text(encoding="utf-8").splitlines() if ln.strip()]
        n = args.lines_per_doc
        out[f"{Path(args.text).name} ({n} lines/doc)"] = ["\n".join(lines[i:i + n]) for i in range(0, len(lines), n)]
    return out


def compare(docs: list[str], cfg: FilterConfig, fw2: list, examples: int) -> dict:
    docs = [t for t in (normalize_text(d) for d in docs) if t]
    ours = [filter_reason(t, "bn", cfg) for t in docs]
    theirs = [fineweb2_reason(fw2, t) for t in docs]
    each = [fineweb2_each(fw2, t) for t in docs]
    only_ours = [(t, r) for t, r, f in zip(docs, ours, theirs) if r and not f]
    only_theirs = [(t, f) for t, r, f in zip(docs, ours, theirs) if f and not r]
    clip = lambda t: t[:240].replace("\n", " / ") + ("..." if len(t) > 240 else "")  # noqa: E731

    def per_reason(pairs):  # up to ``examples`` of each reason
        out: dict[str, list] = {}
        for t, r in pairs:
            if len(out.setdefault(r, [])) < examples:
                out[r].append(clip(t))
        return [[r, t] for r, ts in out.items() for t in ts]

    return {
        "docs": len(docs),
        "kept_bnlit": sum(r is None for r in ours),
        "kept_fineweb2": sum(f is None for f in theirs),
        "kept_both": sum(r is None and f is None for r, f in zip(ours, theirs)),
        "kept_by_each_fineweb2_filter": {name: sum(e[name] is None for e in each) for name in each[0]} if each else {},
        "chars": sum(len(t) for t in docs),
        "chars_kept_bnlit": sum(len(t) for t, r in zip(docs, ours) if r is None),
        "chars_kept_fineweb2": sum(len(t) for t, f in zip(docs, theirs) if f is None),
        "fineweb2_each_drops": dict(Counter(f"{n}:{r}" for e in each for n, r in e.items() if r)),
        "bnlit_drops": dict(Counter(r.split(":")[0] + ":" + r.split(":")[1] for r in ours if r)),
        "fineweb2_drops": dict(Counter(f for f in theirs if f)),
        "dropped_by_bnlit_kept_by_fineweb2": {"count": len(only_ours), "reasons": dict(Counter(r for _, r in only_ours)),
                                              "examples": per_reason(only_ours)},
        "dropped_by_fineweb2_kept_by_bnlit": {"count": len(only_theirs), "reasons": dict(Counter(f for _, f in only_theirs)),
                                              "examples": per_reason(only_theirs)},
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--text", help="a Bangla text file to compare on as well (documents of --lines-per-doc lines)")
    p.add_argument("--lines-per-doc", type=int, default=10, help="lines of --text per document")
    p.add_argument("--examples", type=int, default=2, help="examples shown of each reason for a disagreement")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = p.parse_args(argv)
    cfg = bnlit_filters()
    fw2, words = fineweb2_filters()
    result = {"fineweb2_words": words, "bnlit_filters": cfg.to_dict(), "fineweb2_ben_Beng": FW2_BEN,
              "corpora": {name: compare(docs, cfg, fw2, args.examples) for name, docs in corpora(args).items()}}
    if args.json:
        print(json.dumps(result, indent=2, ensure_ascii=False))
        return result
    print(f"FineWeb-2 word splitting: {words}\n")
    names = list(next(iter(result["corpora"].values()))["kept_by_each_fineweb2_filter"])
    pct = lambda a, b: f"{100 * a / b:.0f}%" if b else "-"  # noqa: E731
    print("| corpus | documents | kept by bnlit (chars) | kept by FineWeb-2 ben_Beng (chars) | kept by both | "
          + " | ".join(f"kept by {n} alone" for n in names) + " |")
    print("|---|---|---|---|---|" + "---|" * len(names))
    for name, r in result["corpora"].items():
        each = r["kept_by_each_fineweb2_filter"]
        print(f"| {name} | {r['docs']} | {r['kept_bnlit']} ({pct(r['chars_kept_bnlit'], r['chars'])}) | "
              f"{r['kept_fineweb2']} ({pct(r['chars_kept_fineweb2'], r['chars'])}) | {r['kept_both']} | "
              + " | ".join(str(each.get(n, "-")) for n in names) + " |")
    for name, r in result["corpora"].items():
        print(f"\n## {name}\nbnlit drops: {r['bnlit_drops']}\nFineWeb-2 drops: {r['fineweb2_drops']}\n"
              f"FineWeb-2's filters each on its own drop: {r['fineweb2_each_drops']}")
        for key, label in (("dropped_by_bnlit_kept_by_fineweb2", "bnlit drops, FineWeb-2 keeps"),
                           ("dropped_by_fineweb2_kept_by_bnlit", "FineWeb-2 drops, bnlit keeps")):
            d = r[key]
            print(f"{label}: {d['count']} {d['reasons']}")
            for reason, text in d["examples"]:
                print(f"  [{reason}] {text}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

"""Synthetic documents for the data-pipeline tests: random sentences over small vocabularies, so
no copied text is committed and distinct documents share no long n-grams."""

from __future__ import annotations

import random

BN_WORDS = ("আমি তুমি সে আমরা তোমরা তারা বাড়ি নদী আকাশ গাছ ফুল পাখি বই স্কুল শহর গ্রাম মানুষ জল "
            "মাটি আলো রাত দিন সকাল বিকেল সন্ধ্যা খাবার ভাত মাছ দুধ চা পথ মাঠ খেলা গান কথা চিঠি মেঘ "
            "বৃষ্টি রোদ হাওয়া সমুদ্র পাহাড় বন্ধু মা বাবা ভাই বোন শিক্ষক ছাত্র কাজ সময় বছর মাস সপ্তাহ "
            "নতুন পুরনো বড় ছোট সুন্দর ভালো লাল নীল সবুজ হলুদ যায় আসে দেখে বলে লেখে পড়ে খায় ঘুমায় হাসে").split()
EN_WORDS = ("the a river sky tree flower bird book school city village people water earth light night "
            "day morning evening food rice fish milk tea road field game song word letter cloud rain sun "
            "wind sea mountain friend mother father brother sister teacher student work time year month "
            "week new old big small beautiful good red blue green yellow goes comes sees says writes reads "
            "eats sleeps laughs under over near far quickly slowly often never always").split()


def sentence(rng: random.Random, words, n: int = 12) -> str:
    return " ".join(rng.choice(words) for _ in range(n))


def document(seed: int, language: str = "bn", sentences: int = 12) -> str:
    rng = random.Random(seed)
    words = BN_WORDS if language == "bn" else EN_WORDS
    end = "।" if language == "bn" else "."
    lines = [sentence(rng, words, rng.randint(9, 15)) + end for _ in range(sentences)]
    return "\n".join(" ".join(lines[i:i + 3]) for i in range(0, len(lines), 3))


def near_copy(text: str, k: int = 0) -> str:
    """The same document with one word (the ``k``-th after the middle, in steps of 7) changed and
    different punctuation and spacing (its word 5-gram shingles keep a Jaccard similarity far
    above 0.8 with the original)."""
    words = text.split()
    words[len(words) // 2 + 7 * k] = "পরিবর্তন"
    return "  ".join(words).replace("।", "!")


def planted_corpus() -> list[tuple[str, str, list[str]]]:
    """Three sources with duplicates planted within a source, across sources and across the
    contiguous pieces (tasks) a source is split into: (name, language, documents).

    ``web`` (bn, 45 documents): 36 originals, then an exact copy of ``web[0]`` (a later piece copies
    the first), a canonical copy of ``web[1]`` (upper case, spaced danda), a near copy of
    ``web[2]``, a near copy of that near copy, a short
    document, an English one (script), a repetitive one, an exact copy of the repetitive one (the
    filters drop both before dedup sees them) and a document quoting a validation passage.
    ``wiki`` (bn, 17): 12 originals, an exact copy of ``web[3]``, a near copy of ``web[4]``, an
    exact copy of ``wiki[0]``, a near copy of ``wiki[1]`` and a document quoting the evaluation
    text :func:`planted_eval`. ``news`` (en, 14): 12 originals, a
    Bangla copy of ``web[5]`` (dropped by the English script check) and an exact copy of
    ``news[0]``.
    """
    web = [document(i) for i in range(36)]
    wiki = [document(200 + i) for i in range(12)]
    news = [document(400 + i, "en") for i in range(12)]
    repetitive = "\n".join([sentence(random.Random(7), BN_WORDS, 12) + "।"] * 30)
    val = next(d for d in web if _is_val(d))
    quote = next(t for i in range(900, 999)
                 if not _is_val(t := document(i) + "\n" + " ".join(val.split()[:40])))
    web += [web[0], "  " + web[1].upper().replace("।", " । "), near_copy(web[2]), near_copy(near_copy(web[2]), 1),
            "ছোট।", document(990, "en"), repetitive, repetitive, quote]
    quote_eval = document(991) + "\n" + " ".join(planted_eval()[0].split()[:30])
    wiki += [web[3], near_copy(web[4]), wiki[0], near_copy(wiki[1]), quote_eval]
    news += [web[5], news[0]]
    return [("web", "bn", web), ("wiki", "bn", wiki), ("news", "en", news)]


PLANTED_VAL_FRACTION = 0.2


def planted_eval() -> list[str]:
    """An evaluation set for :func:`planted_corpus` (one ``wiki`` document quotes its first)."""
    return [document(960), document(961)]


def _is_val(text: str) -> bool:
    from bnlit.data.shards import is_validation

    return is_validation(text, PLANTED_VAL_FRACTION)


def write_sources(directory, corpus) -> list:
    """``corpus`` ((name, language, documents)) as JSONL files; returns the :class:`Source` list."""
    import json
    from pathlib import Path

    from bnlit.data.sources import Source

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for name, language, docs in corpus:
        path = directory / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
        out.append(Source(name=name, language=language, path=str(path)))
    return out


def plan_build(tmp_path, corpus, tokenizer_path, val_fraction: float = 0.2, clean=None, tasks: int = 1,
               eval_texts=None, cache=None):
    """The data build's plan for ``corpus`` written to files under ``tmp_path`` with the given
    tokenizer (``clean``: a :class:`CleanConfig`, None: no cleaning)."""
    import json
    from pathlib import Path

    from bnlit.data.pipeline import CleanConfig, plan_data
    from bnlit.data.sources import Source, fingerprint
    from bnlit.tokenizer import Tokenizer

    tmp_path = Path(tmp_path)
    sources = write_sources(tmp_path / "sources", corpus)
    paths = [Path(s.path) for s in sources]
    evals = []
    if eval_texts:
        ev = tmp_path / "sources" / "bench.jsonl"
        ev.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in eval_texts))
        evals = [(Source(name="bench", language="eval", path=str(ev), sample_by="line"), ev)]
    vocab = Tokenizer(tokenizer_path).vocab_size
    return plan_data(sources, paths, [fingerprint(s, p) for s, p in zip(sources, paths)],
                     clean if clean is not None else CleanConfig(enabled=False), val_fraction,
                     Path(cache or tmp_path / "cache"), {"path": str(tokenizer_path), "vocab_size": vocab},
                     tasks=tasks, eval_sources=evals)

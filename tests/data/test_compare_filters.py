"""scripts/compare_filters.py: bnlit's filters and FineWeb-2's ben_Beng filters (datatrove's, with
the thresholds of FineWeb-2's configs/ben_Beng.yml) on planted documents."""

from __future__ import annotations

import sys
from pathlib import Path

import random

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import compare_filters as cf  # noqa: E402

# words of at least 4 code points (FineWeb-2's ben_Beng wants an average of 4 to 24), with stop words
WORDS = ("বিশ্ববিদ্যালয় শিক্ষার্থী গবেষণা পরিবেশ সরকারের নির্বাচন সংস্কৃতি ইতিহাস আন্দোলন সাহিত্য "
         "প্রকাশিত বাংলাদেশ কলকাতা নদীর বৃষ্টিপাত কৃষকদের উৎপাদন বাজারে পরিবার শিশুদের").split()
STOPS = ["এবং", "একটি", "থেকে", "করে"]


def prose(seed: int, lines: int = 8) -> str:
    """Random lines of 14 words in which no word pair occurs twice: Gopher's top-2-gram check has nothing to
    find, so only what a test plants (missing punctuation, a repeated line) can fail a filter."""
    rng, pairs, words = random.Random(seed), set(), []
    while len(words) < 14 * lines:
        w = rng.choice(WORDS + STOPS)
        if words and (words[-1] == w or (words[-1], w) in pairs):
            continue
        if words:
            pairs.add((words[-1], w))
        words.append(w)
    return "\n".join(" ".join(words[i:i + 14]) + "।" for i in range(0, len(words), 14))


def test_a_page_without_punctuation_fails_fineweb2_line_punctuation_only_and_a_repeated_one_fails_both():
    good = prose(1)
    bare = prose(2).replace("।", "")  # like the embedded OCR: punctuation stripped
    repeated = "\n".join([good.split("\n")[0]] * 8)  # one line eight times
    fw2, _ = cf.fineweb2_filters()
    r = cf.compare([good, bare, repeated], cf.bnlit_filters(), fw2, examples=1)
    assert r["docs"] == 3 and r["kept_both"] == 1
    assert r["kept_bnlit"] == 2 and r["kept_fineweb2"] == 1
    only_fw2 = r["dropped_by_fineweb2_kept_by_bnlit"]
    assert only_fw2["count"] == 1 and list(only_fw2["reasons"]) == ["FineWeb Quality:line_punct_ratio"]
    assert r["kept_by_each_fineweb2_filter"]["FineWeb Quality"] == 1  # only the punctuated prose
    assert r["kept_by_each_fineweb2_filter"]["Gopher Repetition"] == 2
    assert any(k.startswith("repetition:") for k in r["bnlit_drops"]), r["bnlit_drops"]
    assert r["chars_kept_bnlit"] < r["chars"]

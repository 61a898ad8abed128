import random

from bnlit.data.filters import FilterConfig, FilterStats, apply_filters, filter_reason, script_ratio, symbol_ratio
from helpers_data import EN_WORDS, document, sentence


def planted_bn():
    good = [document(i, "bn") for i in range(20)]
    rng = random.Random(99)
    planted = {
        "length": "ছোট একটা লেখা।",
        "script": document(1000, "en"),  # English text inside a Bangla source
        "repetition:lines": "\n".join([document(1001, "bn")] + ["একই লাইন আবার আবার ফিরে আসে বারবার এখানে।"] * 12),
        "repetition:ngrams": " ".join(["আমরা সবাই মিলে নদীর ধারে বসে গান গাই"] * 30),
        "symbols": " ".join(w + rng.choice("#¤§©®¶†‡°±×÷~^") * 2 for w in document(1002, "bn").split()),
    }
    return good, planted


def test_each_filter_drops_exactly_its_planted_document():
    good, planted = planted_bn()
    cfg = FilterConfig()
    for text in good:
        assert filter_reason(text, "bn", cfg) is None, text[:40]
    for kind, text in planted.items():
        reason = filter_reason(text, "bn", cfg)
        assert reason is not None and reason.startswith(kind.split(":")[0]), (kind, reason)
    stats = FilterStats()
    kept = list(apply_filters(good + list(planted.values()), "bn", cfg, stats))
    assert kept == good
    assert stats.docs == {"length": 1, "script": 1, "repetition": 2, "symbols": 1}
    assert stats.chars["length"] == len(planted["length"])
    assert sum(stats.details.values()) == 5


def test_english_documents_pass_the_english_script_check_and_fail_the_bangla_one():
    en = document(7, "en")
    assert filter_reason(en, "en", FilterConfig()) is None
    assert script_ratio(en, "en") == 1.0 and script_ratio(en, "bn") == 0.0
    assert filter_reason(en, "bn", FilterConfig()) == "script:ratio"
    mixed = document(8, "bn") + "\n" + sentence(random.Random(1), EN_WORDS, 20)  # some code-switching is fine
    assert 0.5 < script_ratio(mixed, "bn") < 1.0 and filter_reason(mixed, "bn", FilterConfig()) is None


def test_switched_off_checks_keep_everything():
    _, planted = planted_bn()
    off = FilterConfig(min_chars=None, min_words=None, min_script_ratio=None, max_dup_line_frac=None,
                       max_dup_line_char_frac=None, repetition_ngrams=False, max_symbol_ratio=None)
    assert all(filter_reason(t, "bn", off) is None for t in planted.values())


def test_symbol_ratio_counts_noise_not_punctuation_or_digits():
    assert symbol_ratio("আমি ভাত খাই। ১২৩, 45 (ok) - “হ্যাঁ”") == 0.0
    assert symbol_ratio("ab§§") == 0.5


def test_gopher_ngram_statistics_match_a_plain_reference():
    from collections import Counter

    from bnlit.data.filters import dup_ngram_char_frac, top_ngram_char_frac

    def ref_dup(ws, n):
        grams = [tuple(ws[i:i + n]) for i in range(len(ws) - n + 1)]
        c = Counter(grams)
        cov = [False] * len(ws)
        for i, g in enumerate(grams):
            if c[g] > 1:
                cov[i:i + n] = [True] * n
        return sum(len(w) for w, k in zip(ws, cov) if k) / sum(map(len, ws))

    def ref_top(ws, n):  # None when several n-grams share the top count (either may be picked)
        common = Counter(tuple(ws[i:i + n]) for i in range(len(ws) - n + 1)).most_common(2)
        (g, k), tie = common[0], len(common) > 1 and common[1][1] == common[0][1]
        return 0.0 if k < 2 else None if tie else sum(map(len, g)) * k / sum(map(len, ws))

    rng = random.Random(3)
    checked = 0
    for trial in range(40):
        ws = [rng.choice("ক খ গ ঘ ঙ চ ছ".split()) * rng.randint(1, 3) for _ in range(rng.randint(12, 80))]
        for n in (2, 3, 5, 7):
            assert abs(dup_ngram_char_frac(ws, n) - ref_dup(ws, n)) < 1e-12
        for n in (2, 3):
            want = ref_top(ws, n)
            if want is not None:
                checked += 1
                assert abs(top_ngram_char_frac(ws, n) - want) < 1e-12
    assert checked >= 10

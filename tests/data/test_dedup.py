from bnlit.data.dedup import DedupConfig, canonical_words, deduplicate, exact_key
from helpers_data import document


def near_copy(text: str) -> str:
    """The same document with one word changed and different punctuation and spacing."""
    words = text.split()
    words[len(words) // 2] = "পরিবর্তন"
    return "  ".join(words).replace("।", "!")


def test_exact_and_near_duplicates_are_removed_within_and_across_sources():
    a = [document(i) for i in range(12)]
    b = [document(100 + i) for i in range(6)]
    docs = [("a", t) for t in a]
    docs += [("a", a[0]), ("a", "  " + a[1].upper().replace("।", " । "))]  # exact (canonically) within a
    docs += [("a", near_copy(a[2]))]  # near within a
    docs += [("b", t) for t in b]
    docs += [("b", a[3]), ("b", near_copy(a[4]))]  # exact and near across sources
    kept, stats = deduplicate(docs, DedupConfig())
    assert kept == [("a", t) for t in a] + [("b", t) for t in b]  # every distinct document stays, first copy wins
    assert dict(stats.exact) == {"a": 2, "b": 1} and dict(stats.near) == {"a": 1, "b": 1}
    assert dict(stats.exact_cross) == {"b": 1} and dict(stats.near_cross) == {"b": 1}
    assert stats.chars["b"] == len(a[3]) + len(near_copy(a[4]))


def test_switching_near_off_keeps_near_copies():
    a = document(1)
    kept, stats = deduplicate([("a", a), ("a", near_copy(a)), ("a", a)], DedupConfig(near=False))
    assert [t for _, t in kept] == [a, near_copy(a)] and dict(stats.exact) == {"a": 1}


def test_canonical_words_ignore_case_punctuation_and_spacing():
    assert canonical_words("Hello,  World! আমি। ভাত") == ["hello", "world", "আমি", "ভাত"]
    assert exact_key(canonical_words("A b.")) == exact_key(canonical_words("a  B"))

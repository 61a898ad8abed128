from datasketch import MinHashLSH

from bnlit.data.dedup import DedupConfig, canonical_words, lsh_bands, signature
from helpers_data import document, near_copy


def test_canonical_words_ignore_case_punctuation_and_spacing():
    assert canonical_words("Hello,  World! আমি। ভাত") == ["hello", "world", "আমি", "ভাত"]
    assert canonical_words("A b.") == canonical_words("a  B")


def test_minhash_values_equal_datasketch_affine32():
    import xxhash
    from datasketch import MinHash

    from bnlit.data.dedup import shingles

    for text in (document(1), "এক দুই", "one"):
        ws = canonical_words(text)
        m = MinHash(num_perm=128, seed=1, hashfunc=xxhash.xxh32_intdigest, scheme="affine32")
        m.update_batch(shingles(ws, 5))
        assert (signature(ws, DedupConfig()) == m.hashvalues).all()


def test_bands_are_those_datasketch_picks_and_collide_like_its_lsh():
    cfg = DedupConfig()
    assert lsh_bands(cfg) == (9, 13)
    docs = [document(i) for i in range(20)] + [near_copy(document(3)), near_copy(document(4), 1)]
    lsh = MinHashLSH(threshold=cfg.threshold, num_perm=cfg.num_perm)
    from datasketch import MinHash

    sigs = [signature(canonical_words(d), cfg) for d in docs]
    hits = []
    for i, s in enumerate(sigs):
        m = MinHash(num_perm=cfg.num_perm, hashvalues=s, scheme="affine32")
        found = lsh.query(m)
        ours = [j for j in range(i) if any((sigs[j][b * 13:(b + 1) * 13] == s[b * 13:(b + 1) * 13]).all() for b in range(9))]
        assert sorted(found) == ours
        hits += found
        lsh.insert(i, m)
    assert sorted(hits) == [3, 4]  # the two near copies find their originals, nothing else collides

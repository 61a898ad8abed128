"""bnlit's tokenizer as a Hugging Face ``tokenizers`` pipeline (``tokenizer.json``), so that
``AutoTokenizer.from_pretrained(export_dir)`` gives :meth:`bnlit.tokenizer.Tokenizer.encode`'s ids
on raw text, with no bnlit call first and without protobuf, sentencepiece or tiktoken at load time.

:meth:`Tokenizer.encode` is ``SentencePiece(normalize(text))``. Both halves become ``tokenizers``
components:

- **The normalizer** is a ``Sequence`` of ``Replace`` (Oniguruma regexes) and ``NFC`` steps that
  spell out :func:`bnlit.data.normalize.normalize_chars` rule by rule: CR/CRLF to LF; the control,
  invisible-format, space-separator and line-separator classes of its table (enumerated from the
  same table, so the Unicode version is the exporting Python's); NFC (which also decomposes the
  nukta letters, composition exclusions); legacy khanda-ta; runs of joiners; the joiners that change
  no rendering (look-behind and look-ahead at the neighbours the Python rule looks at); NFC again.
  Then SentencePiece's own normaliser: its precompiled character map when the model has one
  (``tokenizer.normalization=nfkc``), its ``remove_extra_whitespaces`` (spaces stripped at the ends,
  runs collapsed) and its dummy prefix with spaces escaped as ``▁``.
- **The model** is a ``BPE`` with byte fallback whose merges reproduce SentencePiece's BPE
  encoding: SentencePiece merges, at each step, the adjacent pair whose concatenation is the
  vocabulary piece of highest score; ``tokenizers`` merges the pair of lowest rank. Every split of
  every piece into two vocabulary pieces is a merge, ranked by the piece's score. (Two different
  splits of one piece can overlap only in text like ``ab|a|ba``; there SentencePiece takes the
  leftmost pair, ``tokenizers`` the lower-ranked split.) User-defined pieces (the Bangla digits)
  are plain vocabulary entries that no merge produces or consumes, as SentencePiece never merges
  them; :func:`check_user_defined` refuses a model where another piece contains one.

:func:`verify` compares the pipeline with :meth:`Tokenizer.encode` on :func:`probe_texts` (every
Bangla letter, sign, digit and joiner in context, both nukta forms, khanda-ta, controls, spaces,
English, emoji) and the export refuses, in one line, a tokenizer whose ids differ.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Iterable, Sequence

from bnlit.data import normalize as N
from bnlit.errors import CheckpointError
from bnlit.tokenizer import BANGLA_CHARS, BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer

SPACE = "\u2581"  # SentencePiece's escaped space, "▁"


def _class(codepoints: Iterable[int]) -> str:
    """An Oniguruma character class of ``codepoints`` as ranges of ``\\x{...}`` escapes."""
    ranges: list[list[int]] = []
    for c in sorted(set(codepoints)):
        if ranges and ranges[-1][1] == c - 1:
            ranges[-1][1] = c
        else:
            ranges.append([c, c])
    return "[" + "".join(f"\\x{{{a:X}}}" if a == b else f"\\x{{{a:X}}}-\\x{{{b:X}}}" for a, b in ranges) + "]"


def _all_codepoints() -> range:
    return range(0x110000)


def normalizer_rules() -> list[tuple[str, str] | str]:
    """The steps of :func:`bnlit.data.normalize.normalize_chars` as ``(regex, replacement)`` pairs
    and ``"NFC"`` markers, in order."""
    table = N._TABLE
    removed = [c for c, v in table.items() if v is None and c not in (0x0A, 0x0D)]
    to_space = [c for c, v in table.items() if v == " "]
    to_newline = [c for c, v in table.items() if v == "\n" and c != 0x0D]
    consonants = [c for c in range(0x0980, 0x0A00) if N.is_bengali_consonant(chr(c))]
    symbols = [c for c in _all_codepoints() if N._is_symbol(chr(c))]
    hasanta, zwj, zwnj, joiner = r"\x{9CD}", r"\x{200D}", r"\x{200C}", r"[\x{200C}\x{200D}]"
    cons, sym = _class(consonants), _class(symbols)
    not_after = _class([0x09CD, *consonants])
    not_after_zwj = _class([0x09CD, *consonants, *symbols])
    stray_joiners = "|".join([
        # ZWNJ is kept after a hasanta, or between a consonant and a hasanta
        f"(?<!{not_after}){zwnj}",
        f"(?<={cons}){zwnj}(?!{hasanta})",
        # ZWJ also between two symbols (emoji sequences)
        f"(?<!{not_after_zwj}){zwj}",
        f"(?<={sym}){zwj}(?!{sym})",
        f"(?<={cons}){zwj}(?!{hasanta})",
    ])
    return [
        (r"\r\n?", "\n"),
        (_class(removed), ""),
        (_class(to_space), " "),
        (_class(to_newline), "\n"),
        "NFC",  # NFC decomposes য় ড় ঢ়: normalize.unify_nukta has nothing left to do
        (r"\x{9A4}\x{9CD}\x{200D}(?![\x{980}-\x{9FF}])", "\u09ce"),  # legacy khanda-ta
        (f"(?<={joiner}){joiner}", ""),  # a run of joiners keeps its first
        (stray_joiners, ""),
        "NFC",  # removing a joiner can bring reorderable marks together
    ]


def check_user_defined(proto) -> None:
    """Refuse a SentencePiece model whose user-defined piece (never merged by SentencePiece) is
    inside another piece: a merge-based tokenizer (``tokenizers``, llama.cpp) would form it."""
    pieces = [p.piece for p in proto.pieces]
    for p in proto.pieces:
        if p.type != p.USER_DEFINED:
            continue
        inside = next((q for q in pieces if q != p.piece and p.piece in q), None)
        if inside is not None:
            raise CheckpointError(f"tokenizer: user-defined piece {p.piece!r} is also inside piece {inside!r}; "
                                  "a merge-based tokenizer (Hugging Face, llama.cpp) would merge it where "
                                  "SentencePiece does not. Retrain the tokenizer (scripts/train_tokenizer.py)")


def bpe_vocab_and_merges(proto) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Every piece's id, and the merges (module docstring), best first."""
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    mergeable = {p.piece: (p.score, i) for i, p in enumerate(proto.pieces) if p.type in (p.NORMAL, p.USER_DEFINED)}
    merges = []
    for i, p in enumerate(proto.pieces):
        if p.type != p.NORMAL or len(p.piece) < 2:
            continue
        for k in range(1, len(p.piece)):
            left, right = p.piece[:k], p.piece[k:]
            if left in mergeable and right in mergeable:
                merges.append(((-p.score, i, mergeable[left][1]), (left, right)))
    merges.sort(key=lambda m: m[0])
    return vocab, [pair for _, pair in merges]


def build(tokenizer: Tokenizer):
    """The ``tokenizers.Tokenizer`` that encodes raw text as ``tokenizer.encode`` does."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer

    proto = tokenizer.proto()
    kind = proto.trainer_spec.model_type
    if kind != proto.trainer_spec.BPE:
        raise CheckpointError(f"tokenizer: a SentencePiece {proto.trainer_spec.ModelType.Name(kind)} model has no "
                              "Hugging Face tokenizer.json export in bnlit (BPE only); export without it or retrain "
                              "with tokenizer.model_type=bpe")
    check_user_defined(proto)
    spec = proto.normalizer_spec
    steps = [normalizers.NFC() if r == "NFC" else normalizers.Replace(Regex(r[0]), r[1]) for r in normalizer_rules()]
    if spec.precompiled_charsmap:
        steps.append(normalizers.Precompiled(spec.precompiled_charsmap))
    if spec.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Replace(Regex(r"\A +| +\z"), "")]
    if spec.add_dummy_prefix:
        steps.append(normalizers.Prepend(SPACE))
    if spec.escape_whitespaces:
        steps.append(normalizers.Replace(" ", SPACE))
    vocab, merges = bpe_vocab_and_merges(proto)
    hf = HFTokenizer(models.BPE(vocab, merges, unk_token=proto.pieces[UNK_ID].piece, fuse_unk=True,
                                byte_fallback=proto.trainer_spec.byte_fallback))
    hf.normalizer = normalizers.Sequence(steps)
    hf.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                    *([decoders.Strip(" ", 1, 0)] if spec.add_dummy_prefix else [])])
    hf.add_special_tokens([AddedToken(proto.pieces[i].piece, special=True, normalized=False)
                           for i in (PAD_ID, UNK_ID, BOS_ID, EOS_ID)])
    return hf


def probe_texts() -> list[str]:
    """Raw texts that exercise every rule of the normalisation and of SentencePiece's encoding."""
    hasanta, zwj, zwnj, nukta = N.HASANTA, N.ZWJ, N.ZWNJ, N.NUKTA
    consonants = [chr(c) for c in range(0x0995, 0x09BA) if unicodedata.category(chr(c)) == "Lo"]
    out = [
        "".join(BANGLA_CHARS),
        " ".join(BANGLA_CHARS),
        " ".join(f"ক{c}" for c in BANGLA_CHARS),
        "বাংলা ভাষা ও সাহিত্য। ২০২৪ সালে ১২৩ জন, 2024 সালে 123 জন॥",
        # the nukta letters, precomposed and as letter + nukta, alone and inside words
        "\u09df \u09dc \u09dd য\u09bc ড\u09bc ঢ\u09bc",
        "নয়া আষাঢ় পড়া বাড়ি নয়া আষাঢ় পড়া বাড়ি",
        "\u09df\u09c7 \u09af\u09bc\u09c7 \u09dc\u09bf\u09bc",
        # khanda-ta: U+09CE, and the legacy ত + hasanta + ZWJ at a word end and inside a word
        "উৎসব হঠাৎ হঠাত\u09cd\u200d হঠাত\u09cd\u200d। উত\u09cd\u200dসব",
        # joiners that change rendering, and stray ones
        f"ক{hasanta}{zwnj}ষ ক{hasanta}{zwj}ষ র{zwj}{hasanta}য {zwj}ক খ{zwnj} a{zwj}b {zwnj}{zwj}x",
        f"ক{zwnj}{hasanta} ক{zwj}{hasanta} ক{zwj}{zwnj}{zwj}{hasanta}ষ ি{zwj} {zwj}{zwj}",
        "👩\u200d💻 👨\u200d👩\u200d👧 ❤\ufe0f\u200d🔥 a\u200d🔥 🔥\u200da ©\u200d®",
        # controls, invisible format characters, odd spaces and line breaks
        "a\u0000b\u0007c\u001bd\u007fe\u0085f\u00adg\u200bh\u200ei\u202aj\u2066k\ufefflm",
        "tab\there\u00a0nbsp\u2003em\u3000ideographic\u2028line\u2029para\r\nwin\rmac\n\nend",
        "\U000e0001\U000e0041tags \U0001d173musical\U000110bdkaithi",
        # spaces: leading, trailing, runs, only spaces; empty and newline-only text
        "   leading and trailing   ",
        "runs   of     spaces  inside", "     ", "", "\n", " \n ", "a \n  b",
        "Plain English, with punctuation: 'quotes', \"double\", (parens) & symbols #1 — “curly” … 3.14",
        "Mixed বাংলা and English: ১টি apple, ২টি কলা।",
        # text that looks like byte pieces, and the escaped space typed as text (special tokens
        # typed as text are matched by Hugging Face and not by SentencePiece: README)
        "<0x41> <0xE0><0xA6> ▁ x▁▁y <s",
        # decomposed vowel signs that NFC composes (ো = ে + া, ৌ = ে + ৗ), and Latin accents
        "কে\u09be কে\u09d7 café cafe\u0301 Å",
        "".join(chr(0x0980 + i) for i in range(128)),
        "".join(c + nukta for c in consonants),
    ]
    return out


def mismatches(hf, tokenizer: Tokenizer, texts: Sequence[str]) -> list[tuple[str, list[int], list[int]]]:
    """``(text, bnlit ids, tokenizers ids)`` of every text where the two differ."""
    out = []
    for text, want in zip(texts, tokenizer.encode_batch(list(texts))):
        got = hf.encode(text, add_special_tokens=False).ids
        if got != want:
            out.append((text, want, got))
    return out


def verify(hf, tokenizer: Tokenizer, texts: Sequence[str] | None = None) -> None:
    """Refuse (one line) a ``tokenizer.json`` that tokenizes a probe text unlike bnlit."""
    texts = probe_texts() if texts is None else texts
    bad = mismatches(hf, tokenizer, texts)
    if bad:
        text, want, got = bad[0]
        k = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        raise CheckpointError(f"tokenizer.json would tokenize {len(bad)} of {len(texts)} probe texts unlike bnlit, "
                              f"e.g. {json.dumps(text[:40], ensure_ascii=False)}: ids differ at {k} "
                              f"({want[k:k + 3]} vs {got[k:k + 3]}); report this (bnlit/hf_tokenizer.py)")

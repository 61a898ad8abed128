"""SentencePiece tokenizer: training, loading and Bangla-safe normalisation.

**Normalisation** is :func:`normalize`, which is :func:`bnlit.data.normalize.normalize_chars`, the
character rules data cleaning applies (controls removed, NFC with য় ড় ঢ় as letter + nukta,
legacy khanda-ta as ৎ, ZWJ/ZWNJ kept only where they change rendering). bnlit applies it before
SentencePiece sees any text, in training and in :meth:`Tokenizer.encode`; SentencePiece's own
rule is ``identity``. NFKC (SentencePiece's default) also folds compatibility characters, which
rewrites some text and so changes what a model sees from what a user typed. The Hugging Face
export carries :func:`normalize` in its ``tokenizer.json`` (``bnlit/hf_tokenizer.py``); the
SentencePiece model alone does not: call :func:`normalize` first.

**Coverage.** Every letter, vowel sign, mark and digit of the Bengali block that Bangla uses
(:data:`BANGLA_CHARS`), the danda and double danda, and ZWJ/ZWNJ are required characters: each is
a piece at any vocabulary size, whether or not the training text has it, so none falls back to
bytes. **Digits** are one token each in both scripts: SentencePiece's ``split_digits`` splits
ASCII digits only, so the Bangla digits are ``user_defined_symbols``, which SentencePiece never
merges with their neighbours (``২০২৪`` -> ``▁ ২ ০ ২ ৪`` like ``2024`` -> ``▁ 2 0 2 4``).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import string
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from bnlit import progress
from bnlit import storage
from bnlit.data.normalize import HASANTA, NUKTA, ZWJ, ZWNJ, normalize_chars
from bnlit.errors import TokenizerError

log = logging.getLogger(__name__)

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


def _chars(*ranges: tuple[int, int]) -> str:
    return "".join(chr(c) for lo, hi in ranges for c in range(lo, hi + 1))


# The Bengali block as Bangla writes it (Unicode chart U+0980-U+09FF): candrabindu, anusvara,
# visarga; the vowels (with vocalic R/L and RR/LL); the consonants; nukta, avagraha; the vowel signs;
# hasanta, khanda-ta, the au length mark; the digits; the rupee mark and the taka sign. Left out:
# the precomposed nukta letters য় ড় ঢ় (normalisation decomposes them), the Assamese ra/wa
# (U+09F0/U+09F1), the historic fraction and currency numerators (U+09F4-U+09FA) and the Vedic signs.
BANGLA_DIGITS = _chars((0x09E6, 0x09EF))
BANGLA_CHARS = _chars(
    (0x0981, 0x0983), (0x0985, 0x098C), (0x098F, 0x0990), (0x0993, 0x09A8), (0x09AA, 0x09B0), (0x09B2, 0x09B2),
    (0x09B6, 0x09B9), (0x09BC, 0x09C4), (0x09C7, 0x09C8), (0x09CB, 0x09CE), (0x09D7, 0x09D7), (0x09E0, 0x09E3),
) + BANGLA_DIGITS + "\u09f2\u09f3"
DANDA, DOUBLE_DANDA = "\u0964", "\u0965"
BANGLA_REQUIRED = BANGLA_CHARS + DANDA + DOUBLE_DANDA + ZWJ + ZWNJ
REQUIRED_CHARS = BANGLA_REQUIRED + string.digits + string.punctuation + "‘’“”–—…"
# a mark that cannot start a well-formed Bangla syllable: a token that starts with one was cut
# inside a grapheme cluster (docs/tokenizer.md)
COMBINING_MARKS = _chars((0x0981, 0x0983), (0x09BE, 0x09C4), (0x09C7, 0x09C8), (0x09CB, 0x09CC), (0x09D7, 0x09D7),
                         (0x09E2, 0x09E3)) + NUKTA + HASANTA
# 4 special tokens, 256 byte-fallback pieces and the required characters: a smaller vocabulary
# cannot be trained whatever the text
MIN_VOCAB_SIZE = 4 + 256 + len(set(REQUIRED_CHARS))
NORMALIZATION_RULES = {"nfc": "identity", "nfkc": "nfkc"}  # bnlit name -> SentencePiece rule
MAX_LINE_BYTES = 4000  # SentencePiece drops training sentences longer than max_sentence_length (4192 bytes)
# bump when what train_tokenizer does with the same arguments changes (cached tokenizers retrain)
RECIPE_VERSION = 2

normalize = normalize_chars  # the one character normalisation (bnlit/data/normalize.py)


def training_lines(texts: Iterable[str], max_bytes: int = MAX_LINE_BYTES) -> Iterator[str]:
    """Split documents into lines SentencePiece accepts, cutting over-long lines at spaces."""
    for text in texts:
        for line in normalize(text).splitlines():
            line = line.strip()
            while line:
                if len(line.encode("utf-8")) <= max_bytes:
                    yield line
                    break
                cut = line.rfind(" ", 0, max_bytes // 3)  # a Bangla character is 3 UTF-8 bytes
                cut = cut if cut > 0 else max_bytes // 3
                yield line[:cut]
                line = line[cut:].strip()


def sample_by_language(
    lines_by_language: Mapping[str, Sequence[str]], weights: Mapping[str, float] | None, seed: int = 0,
    with_language: bool = False,
) -> list[str] | list[tuple[str, str]]:
    """Tokenizer training lines in which each language has ``weights`` of the characters.

    The total stays the characters available; a language asked for more than it has is repeated
    (whole passes plus a random subset, which is how SentencePiece sees a higher frequency), one
    asked for less is subsampled. ``weights=None`` keeps the text as it is. ``with_language``
    returns ``(language, line)`` pairs.
    """
    if not weights:
        return [(lang, line) if with_language else line
                for lang, lines in lines_by_language.items() for line in lines]
    unknown = sorted(set(weights) - set(lines_by_language))
    missing = sorted(k for k in lines_by_language if weights.get(k, 0) <= 0 and lines_by_language[k])
    if unknown or any(w < 0 for w in weights.values()):
        raise TokenizerError(f"tokenizer.lang_weights={dict(weights)}: languages {unknown} have no text "
                             f"(have {sorted(lines_by_language)}) or a weight is negative")
    if missing:
        log.warning("tokenizer.lang_weights gives no weight to %s; their text is left out", missing)
    rng = np.random.default_rng(seed)
    total_w = sum(weights.values())
    total_chars = sum(len(line) for lines in lines_by_language.values() for line in lines)
    out: list = []
    for lang, lines in lines_by_language.items():
        lengths = np.array([len(line) for line in lines], dtype=np.int64)
        if weights.get(lang, 0) <= 0 or lengths.sum() == 0:
            continue
        budget = total_chars * weights[lang] / total_w
        passes, rest = divmod(budget, float(lengths.sum()))
        picked = list(lines) * int(passes)
        order = rng.permutation(len(lines))
        take = int(np.searchsorted(np.cumsum(lengths[order]), rest))
        picked += [lines[i] for i in order[:take]]
        out += [(lang, line) for line in picked] if with_language else picked
    return [out[i] for i in rng.permutation(len(out))]


def train_tokenizer(
    texts: Iterable[str],
    out_path: str | os.PathLike,
    vocab_size: int,
    model_type: str = "bpe",
    character_coverage: float = 0.9999,
    max_sentences: int = 2_000_000,
    num_threads: int | None = None,
    normalization: str = "nfc",
    split_digits: bool = True,
) -> Path:
    """Train a SentencePiece model on ``texts`` and write it atomically to ``out_path``.

    ``normalization``: ``nfc`` (:func:`normalize`, SentencePiece rule ``identity``) or ``nfkc``
    (:func:`normalize`, then SentencePiece's ``nfkc`` rule, stored in the model and applied at
    encode time). ``split_digits``: every ASCII and Bangla digit is its own token.
    """
    import sentencepiece as spm

    if model_type not in ("bpe", "unigram"):
        raise TokenizerError(f"tokenizer.model_type={model_type!r}: use 'bpe' or 'unigram'")
    if normalization not in NORMALIZATION_RULES:
        raise TokenizerError(f"tokenizer.normalization={normalization!r}: use one of {sorted(NORMALIZATION_RULES)}")
    user_defined = list(BANGLA_DIGITS) if split_digits else []  # never merged, like split_digits' ASCII
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    bar = progress.bar("tokenizer: reading", unit="line")

    def lines() -> Iterator[str]:  # tqdm's update() returns True when it redraws: never yield that
        for line in training_lines(texts):
            bar.update()
            yield line

    def on_log(line: str) -> bool:
        """SentencePiece's INFO lines drive the bar and are not shown; warnings and errors are."""
        if alphabet := re.search(r"Alphabet size=(\d+)", line):  # reading is done: merges follow
            # special, byte-fallback and user-defined pieces
            merges = vocab_size - 4 - 256 - len(user_defined) - int(alphabet.group(1))
            progress.set_total(bar, max(1, merges) if model_type == "bpe" else None,
                               desc=f"tokenizer: {model_type} merges", unit="merge")
        elif merged := re.search(r"merges=(\d+)", line):
            bar.update(int(merged.group(1)) - bar.n)
        return not re.match(r"([WEF]\d{4} |.*LOG\((WARNING|ERROR|FATAL)\))", line)

    try:
        with progress.native_log_lines(on_log):
            spm.SentencePieceTrainer.train(
                sentence_iterator=lines(),
                model_writer=model,
                vocab_size=vocab_size,
                model_type=model_type,
                character_coverage=character_coverage,
                normalization_rule_name=NORMALIZATION_RULES[normalization],
                byte_fallback=True,
                split_digits=split_digits,
                user_defined_symbols=user_defined,
                allow_whitespace_only_pieces=True,
                required_chars="".join(sorted(set(REQUIRED_CHARS) - set(user_defined))),
                pad_id=PAD_ID,
                unk_id=UNK_ID,
                bos_id=BOS_ID,
                eos_id=EOS_ID,
                input_sentence_size=max_sentences,
                shuffle_input_sentence=True,
                seed_sentencepiece_size=1_000_000,
                num_threads=num_threads or os.cpu_count() or 1,
                minloglevel=0 if not bar.disable else 2,
            )
        bar.update(bar.total - bar.n if bar.total else 0)  # merges are reported every 100
        bar.refresh()
    except RuntimeError as e:
        reason = str(e).splitlines()[0]
        if "too high" in reason:  # more pieces asked for than the text can supply
            fix = f"lower tokenizer.vocab_size={vocab_size} (it follows model.config.vocab_size) or give more text"
        else:  # "smaller than required_chars. 10 vs 339": the text's characters alone need 339 pieces
            need = re.search(r"(\d+) vs (\d+)", reason)
            fix = (f"raise tokenizer.vocab_size={vocab_size} (it follows model.config.vocab_size) to at least "
                   f"{need.group(2) if need else MIN_VOCAB_SIZE} (e.g. 8192)")
        raise TokenizerError(f"tokenizer training failed ({reason}); {fix}") from None
    finally:
        bar.close()
    return storage.write_bytes(out_path, model.getvalue())  # never a half-written model at out_path


class Tokenizer:
    """A loaded SentencePiece model with bnlit's normalisation and special tokens."""

    def __init__(self, model: str | os.PathLike | bytes):
        import sentencepiece as spm

        if isinstance(model, (bytes, bytearray)):
            self.model_bytes = bytes(model)
            self.path = None
        else:
            self.path = Path(model)
            if not self.path.is_file():
                raise TokenizerError(f"tokenizer.path: {self.path} does not exist; train one with "
                                     "scripts/train_tokenizer.py or leave tokenizer.path unset")
            self.model_bytes = self.path.read_bytes()
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(self.model_bytes)
        except Exception:
            raise TokenizerError(f"tokenizer.path: {self.path} is not a SentencePiece model") from None
        self.sha256 = hashlib.sha256(self.model_bytes).hexdigest()

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    bos_id, eos_id, pad_id, unk_id = BOS_ID, EOS_ID, PAD_ID, UNK_ID

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(normalize(text))

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        return self.sp.encode([normalize(t) for t in texts], num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode(list(ids))

    def proto(self):
        """The SentencePiece ``ModelProto`` (pieces, types, normaliser flags), for the exports."""
        from sentencepiece import sentencepiece_model_pb2

        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(self.model_bytes)
        return proto

    def is_byte(self, token_id: int) -> bool:
        return self.sp.is_byte(token_id)

    def save(self, path: str | os.PathLike) -> Path:
        return storage.write_bytes(path, self.model_bytes)

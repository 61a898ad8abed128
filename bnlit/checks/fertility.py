"""Tokenizer fertility: how much text one token carries, per language, and what that does to a
mixture.

A mixture weight is only meaningful in some unit. The sampler draws fixed-length token windows, so
a weight is natively a *token* share; what a person means by "80% Bangla" is usually an
*information* (character) share. The two differ by each language's characters per token: with a
byte-level tokenizer Bangla (2.66 UTF-8 bytes per character) gets ~0.37 characters per token and
English ~1.0, so a token split of 80/20 is a character split of about 60/40, and an even token
split hands English almost three quarters of the text. The functions here measure fertility
(:func:`measure`, :func:`chars_per_token`, :func:`heldout_fertility`), the token premium of Petrov et al. (2023), convert
between the two units (:func:`token_weights_for_char_shares`, :func:`effective_shares`) and judge
the result (:func:`floor_verdicts`, :func:`share_verdicts`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bnlit.errors import ConfigError

BYTES = "bytes"
DEFAULT_FLOORS = {"bn": 2.5}
DEFAULT_MAX_FACTOR = 1.5
# the token premium a bilingual tokenizer should stay within on parallel text (Petrov et al. 2023
# report 1.01 for MuRIL, 1.17 for BLOOM and 1.38 for XLM-R on Bangla; bytes give 2.63)
DEFAULT_PREMIUM_BAND = (0.8, 1.25)

_BENGALI = (0x0980, 0x09FF)


@dataclass
class Fertility:
    """Counts and ratios for one language's text under one tokenizer."""

    language: str
    lines: int
    chars: int
    bytes: int
    words: int
    tokens: int
    byte_tokens: int
    unk_tokens: int
    mark_start_tokens: int = 0  # tokens whose text starts with a Bangla combining mark (a bad split)

    @property
    def chars_per_token(self) -> float:
        return chars_per_token(self.chars, self.tokens)

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / self.tokens if self.tokens else float("nan")

    @property
    def tokens_per_word(self) -> float:
        return self.tokens / self.words if self.words else float("nan")

    @property
    def byte_fallback_rate(self) -> float:
        return self.byte_tokens / self.tokens if self.tokens else float("nan")

    @property
    def unk_rate(self) -> float:
        return self.unk_tokens / self.tokens if self.tokens else float("nan")

    @property
    def mark_start_rate(self) -> float:
        """Share of tokens that start with a vowel sign, hasanta, nukta or other Bangla combining
        mark: a token boundary inside a grapheme cluster (0 for a script without such marks)."""
        return self.mark_start_tokens / self.tokens if self.tokens else float("nan")

    def to_dict(self) -> dict:
        return {**asdict(self), "chars_per_token": self.chars_per_token,
                "bytes_per_token": self.bytes_per_token, "tokens_per_word": self.tokens_per_word,
                "byte_fallback_rate": self.byte_fallback_rate, "unk_rate": self.unk_rate,
                "mark_start_rate": self.mark_start_rate}


def byte_piece_table(tokenizer) -> tuple[np.ndarray, int]:
    """A boolean array over the vocabulary marking byte-fallback pieces, and the unknown id."""
    sp = tokenizer.sp
    return np.array([sp.is_byte(i) for i in range(sp.get_piece_size())], dtype=bool), sp.unk_id()


def mark_start_table(tokenizer) -> np.ndarray:
    """A boolean array over the vocabulary marking pieces whose text (after any ``▁``) starts
    with a Bangla combining mark (``bnlit.tokenizer.COMBINING_MARKS``)."""
    from bnlit.tokenizer import COMBINING_MARKS

    sp, marks = tokenizer.sp, set(COMBINING_MARKS)
    return np.array([not sp.is_byte(i) and sp.id_to_piece(i).lstrip("\u2581")[:1] in marks
                     for i in range(sp.get_piece_size())], dtype=bool)


def piece_chars(tokenizer) -> np.ndarray:
    """Characters each vocabulary id stands for in decoded (normalised) text: a piece's length
    with ``▁`` as a space, 1 for a byte that starts a UTF-8 character and 0 for a continuation
    byte or a control id. ``piece_chars(tok)[ids].sum()`` counts the text of any token window
    exactly, even one cut in the middle of a character."""
    sp = tokenizer.sp
    out = np.zeros(sp.get_piece_size(), dtype=np.int64)
    for i in range(sp.get_piece_size()):
        if sp.is_byte(i):
            out[i] = int((int(sp.id_to_piece(i)[3:5], 16) & 0xC0) != 0x80)
        elif not (sp.is_control(i) or sp.is_unknown(i)):
            out[i] = len(sp.id_to_piece(i))
    return out


def measure(texts: Sequence[str], tokenizer, language: str = "", num_threads: int = 1) -> Fertility:
    """Fertility of ``tokenizer`` (a :class:`bnlit.tokenizer.Tokenizer`, or ``"bytes"`` for the raw
    UTF-8 baseline: one token per byte) on ``texts``. Characters are counted on the text as
    given, so tokenizers with different normalisations are compared on the same denominator."""
    texts = [t for t in texts if t]
    chars = sum(len(t) for t in texts)
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    words = sum(len(t.split()) for t in texts)
    if tokenizer == BYTES:  # a mark's first byte starts a token
        from bnlit.tokenizer import COMBINING_MARKS

        marks = sum(t.count(m) for t in texts for m in COMBINING_MARKS)
        return Fertility(language, len(texts), chars, nbytes, words, nbytes, nbytes, 0, marks)
    is_byte, unk = byte_piece_table(tokenizer)
    mark = mark_start_table(tokenizer)
    ids = tokenizer.encode_batch(list(texts), num_threads=num_threads)
    flat = np.fromiter((i for doc in ids for i in doc), dtype=np.int64)
    return Fertility(language, len(texts), chars, nbytes, words, int(flat.size),
                     int(is_byte[flat].sum()) if flat.size else 0, int((flat == unk).sum()),
                     int(mark[flat].sum()) if flat.size else 0)


def chars_per_token(chars: int, tokens: int, docs: int = 0) -> float:
    """Characters per token: the one fertility formula of bnlit. ``docs`` end-of-document ids are
    taken off ``tokens`` first (they carry no text; shard indexes count one per document). With
    no content token the ratio is undefined and the result is ``nan``, never ``0.0``, which would
    read as a starved language and fail a floor."""
    content = tokens - docs
    return chars / content if content > 0 else float("nan")


def language_counts(stats: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """Per-language ``chars``, content ``tokens`` (end-of-document ids excluded) and ``docs``,
    summed over shard-index entries (each with ``language``, ``chars``, ``tokens``, ``docs``)."""
    out: dict[str, dict[str, int]] = {}
    for st in stats:
        e = out.setdefault(st["language"], {"chars": 0, "tokens": 0, "docs": 0})
        e["chars"] += st["chars"]
        e["tokens"] += st["tokens"] - st["docs"]
        e["docs"] += st["docs"]
    return out


def heldout_fertility(stats: Iterable[Mapping[str, Any]], tokens: Mapping[str, np.ndarray], tokenizer) -> dict[str, dict]:
    """Per-language counts and ratios of a held-out slice: characters and tokens from its shard
    statistics, byte-fallback and unknown rates from its ``tokens`` (per language, end-of-document
    ids included or not), and ``premium``: the reference language's characters per token over this
    language's, the tokens it pays per unit of text. The reference is English if present. The
    slices are not translations of each other, so this is not the content-matched premium of
    Petrov et al. 2023 (:func:`token_premium`, ``scripts/fertility.py``)."""
    is_byte, unk = byte_piece_table(tokenizer)
    out: dict[str, dict] = language_counts(stats)
    for lang, e in out.items():
        ids = np.asarray(tokens[lang], dtype=np.int64)
        ids = ids[ids != tokenizer.eos_id]
        e["chars_per_token"] = chars_per_token(e["chars"], e["tokens"])
        e["byte_fallback_rate"] = float(is_byte[ids].mean()) if ids.size else float("nan")
        e["unk_rate"] = float((ids == unk).mean()) if ids.size else float("nan")
    ref = "en" if "en" in out else next(iter(out), None)
    for e in out.values():
        e["premium"] = out[ref]["chars_per_token"] / e["chars_per_token"]  # nan when either is nan
    return out


def token_premium(token_counts: Mapping[str, int], reference: str | None = None) -> dict[str, float]:
    """Tokenization premium (Petrov et al. 2023, "Language Model Tokenizers Introduce Unfairness
    Between Languages"): on parallel text, the tokens a language needs divided by the tokens the
    reference language needs for the same content. The reference is English if present, else the
    first language."""
    if not token_counts:
        return {}
    ref = reference or ("en" if "en" in token_counts else next(iter(token_counts)))
    if ref not in token_counts:
        raise ValueError(f"reference language {ref!r} not among {sorted(token_counts)}")
    base = token_counts[ref]
    return {lang: (n / base if base else float("nan")) for lang, n in token_counts.items()}


def _normalise(weights: Mapping[str, float]) -> dict[str, float]:
    total = float(sum(weights.values()))
    if total <= 0:
        raise ValueError(f"weights {dict(weights)} must have a positive sum")
    return {k: float(v) / total for k, v in weights.items()}


def token_weights_for_char_shares(char_shares: Mapping[str, float],
                                  chars_per_token: Mapping[str, float]) -> dict[str, float]:
    """Token sampling weights that deliver ``char_shares`` of characters: a source whose tokens
    carry ``c`` characters each must be sampled in proportion to ``share / c``."""
    bad = [k for k in char_shares if not chars_per_token.get(k, 0) > 0]
    if bad:
        raise ValueError(f"sources {bad} have no measured characters per token")
    return _normalise({k: w / chars_per_token[k] for k, w in char_shares.items()})


def effective_shares(token_shares: Mapping[str, float],
                     chars_per_token: Mapping[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """(token shares, character shares) that sampling tokens by ``token_shares`` delivers."""
    tokens = _normalise(token_shares)
    return tokens, _normalise({k: t * chars_per_token[k] for k, t in tokens.items()})


def by_language(values: Mapping[str, float], languages: Mapping[str, str]) -> dict[str, float]:
    """Sum per-source ``values`` into per-language totals (``languages``: source -> language)."""
    out: dict[str, float] = {}
    for name, v in values.items():
        out[languages[name]] = out.get(languages[name], 0.0) + v
    return out


def floor_verdicts(chars_per_token: Mapping[str, float],
                   floors: Mapping[str, float] = DEFAULT_FLOORS) -> list[str]:
    """One message per language whose characters per token is below its floor."""
    out = []
    for lang, floor in floors.items():
        cpt = chars_per_token.get(lang)
        if cpt is not None and not cpt >= floor:
            out.append(
                f"tokenizer fertility: {lang} gets {cpt:.2f} characters per token, below the floor of "
                f"{floor:.2f} (UTF-8 bytes alone give {lang} {_byte_cpt_hint(lang)}); the tokenizer barely "
                f"covers {lang}: retrain it on text that includes {lang} (scripts/train_tokenizer.py "
                f"--lang-weights, or tokenizer.path=null to train one on data.sources), or lower "
                f"callbacks.fertility.floors.{lang}")
    return out


def _byte_cpt_hint(lang: str) -> str:
    return "~0.37 chars/token" if lang == "bn" else "~1 char/token for Latin script"


def share_verdicts(intended: Mapping[str, float], token_share: Mapping[str, float],
                   char_share: Mapping[str, float], chars_per_token: Mapping[str, float] | None = None,
                   max_factor: float = DEFAULT_MAX_FACTOR, unit: str = "tokens") -> list[str]:
    """Messages for mixtures whose delivered shares betray the intended ones.

    ``intended`` is the per-language share the config asks for (in ``unit``); the delivered
    shares are checked in both units. A language is *inverted* when it was meant to get more than
    another but receives less (in tokens or in characters); it is *over-represented* when it
    receives more than ``max_factor`` times its intended share.
    """
    intended = _normalise(intended)
    cpt = chars_per_token or {}
    numbers = lambda lang: (f"intended {100 * intended[lang]:.1f}% ({unit}), delivered "  # noqa: E731
                            f"{100 * token_share.get(lang, 0):.1f}% of tokens and {100 * char_share.get(lang, 0):.1f}% "
                            f"of characters" + (f" at {cpt[lang]:.2f} chars/token" if lang in cpt else ""))
    fix = ("set data.weight_unit=chars so the data module converts character shares into token weights, "
           "retrain the tokenizer so the languages' fertility is closer, or change data.sources.*.weight")
    out = []
    langs = list(intended)
    for a in langs:
        for b in langs:
            if intended[a] > intended[b] + 1e-9:
                for what, got in (("tokens", token_share), ("characters", char_share)):
                    if got.get(a, 0.0) < got.get(b, 0.0):
                        out.append(f"mixture inverted in {what}: {a} was meant to outweigh {b} but gets less "
                                   f"({a}: {numbers(a)}; {b}: {numbers(b)}); {fix}")
    for lang in langs:
        for what, got in (("tokens", token_share), ("characters", char_share)):
            if intended[lang] > 0 and got.get(lang, 0.0) > max_factor * intended[lang]:
                out.append(f"mixture over-represents {lang} in {what} by "
                           f"{got[lang] / intended[lang]:.2f}x (> {max_factor}x): {numbers(lang)}; {fix}")
    return out


def script_ratio(text: str) -> dict[str, float]:
    """Share of alphabetic characters in the Bengali block and in Latin script."""
    bengali = latin = letters = 0
    for ch in text:
        if ch.isalpha() or _BENGALI[0] <= ord(ch) <= _BENGALI[1]:
            letters += 1
            o = ord(ch)
            if _BENGALI[0] <= o <= _BENGALI[1]:
                bengali += 1
            elif o < 0x250:
                latin += 1
    return {"bn": bengali / letters if letters else 0.0, "latin": latin / letters if letters else 0.0}


def detect_language(text: str, threshold: float = 0.5) -> str:
    """``bn`` when most letters are Bengali script, ``en`` when most are Latin, else ``und``.
    A script detector, not a language identifier: Latin-script text is assumed to be English."""
    r = script_ratio(text)
    if r["bn"] > threshold:
        return "bn"
    if r["latin"] > threshold:
        return "en"
    return "und"


def iter_lines(texts: Iterable[str]) -> Iterable[str]:
    """The non-empty lines of ``texts``, stripped."""
    for t in texts:
        for line in t.splitlines():
            if line.strip():
                yield line.strip()


def read_lines(path, limit: int | None = None) -> list[str]:
    """Non-empty, stripped lines of a UTF-8 text file (the unit of a line-aligned parallel file)."""
    lines = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()]
    lines = [line for line in lines if line]
    return lines[:limit] if limit else lines


def report(texts_by_language: Mapping[str, Sequence[str]], tokenizer, parallel: bool | None = None,
           num_threads: int = 1) -> dict[str, dict]:
    """Per-language fertility dicts; with line-aligned parallel text (same line count everywhere,
    or ``parallel=True``) each gets ``premium`` relative to English or the first language."""
    results = {lang: measure(texts, tokenizer, lang, num_threads) for lang, texts in texts_by_language.items()}
    out = {lang: f.to_dict() for lang, f in results.items()}
    counts = {len(t) for t in texts_by_language.values()}
    if parallel is None:
        parallel = len(texts_by_language) > 1 and len(counts) == 1
    if parallel:
        if len(counts) != 1:
            raise ValueError(f"parallel text needs the same number of lines per language, got "
                             f"{ {k: len(v) for k, v in texts_by_language.items()} }")
        for lang, p in token_premium({k: f.tokens for k, f in results.items()}).items():
            out[lang]["premium"] = p
    return out


def read_parallel(files: Mapping[str, str | Path], field: str = "parallel") -> dict[str, list[str]]:
    """Line-aligned translations ``{lang: file}`` -> ``{lang: lines}``; every file must exist and
    have the same number of non-empty lines (the check a content-matched premium needs)."""

    texts = {}
    for lang, file in files.items():
        path = Path(file).expanduser()
        if not path.is_file():
            raise ConfigError(f"{field}.{lang}: {path} does not exist; point it at a line-aligned translation "
                              f"file or set {field}=null")
        texts[lang] = read_lines(path)
    counts = {lang: len(lines) for lang, lines in texts.items()}
    if len(texts) < 2 or len(set(counts.values())) != 1 or not next(iter(counts.values())):
        raise ConfigError(f"{field}: {counts} lines per language; parallel text needs two or more languages "
                          f"with the same number of non-empty lines, line i of each a translation of the others")
    return texts


def premium_verdicts(premium: Mapping[str, float], band: Sequence[float] = DEFAULT_PREMIUM_BAND,
                     source: str = "parallel text") -> list[str]:
    """One message per language whose token premium on parallel text (its tokens divided by the
    reference language's for the same content, :func:`token_premium`) is outside ``band``, in
    either direction: above it the language is under-served, below it the reference is."""
    lo, hi = band
    ref = "en" if "en" in premium else next(iter(premium), None)
    out = []
    for lang, p in premium.items():
        if lang == ref or lo <= p <= hi:
            continue
        starved, fed = (lang, ref) if p > hi else (ref, lang)
        out.append(f"tokenizer premium: {lang} needs {p:.2f}x the tokens {ref} needs for the same content on "
                   f"{source}, outside {lo:.2f}-{hi:.2f}; the vocabulary under-serves {starved}: retrain the "
                   f"tokenizer with more {starved} text (tokenizer.lang_weights {{{starved}: more, {fed}: less}}) "
                   f"or widen callbacks.fertility.premium_band")
    return out


def fertility_metrics(val: Mapping[str, dict], mixture: Mapping | None, parallel: Mapping[str, dict] | None) -> dict[str, float]:
    """The ``tok/`` metrics of a held-out measurement (:func:`heldout_fertility`), the data
    module's ``mixture`` shares and a parallel-text :func:`report`."""
    metrics = {}
    for lang, v in (parallel or {}).items():
        metrics[f"tok/{lang}_parallel_chars_per_token"] = v["chars_per_token"]
        metrics[f"tok/{lang}_parallel_premium"] = v["premium"]
    for lang, v in val.items():
        metrics[f"tok/{lang}_chars_per_token"] = v["chars_per_token"]
        metrics[f"tok/{lang}_premium"] = v["premium"]
        metrics[f"tok/{lang}_byte_fallback_rate"] = v["byte_fallback_rate"]
        if mixture:
            metrics[f"tok/{lang}_intended_share"] = mixture["intended"].get(lang, 0.0)
            metrics[f"tok/{lang}_token_share"] = mixture["tokens"].get(lang, 0.0)
            metrics[f"tok/{lang}_char_share"] = mixture["chars"].get(lang, 0.0)
    return metrics


def fertility_table(val: Mapping[str, dict], mixture: Mapping | None,
                    parallel: Mapping[str, dict] | None) -> tuple[list[str], list[list]]:
    """Columns and rows of ``tok/fertility``: one row per held-out language."""
    columns = ["language", "chars_per_token", "premium", "byte_fallback_rate", "unk_rate", "intended_share",
               "token_share", "char_share", "weight_unit", "parallel_chars_per_token", "parallel_premium"]
    par = parallel or {}
    rows = [[lang, v["chars_per_token"], v["premium"], v["byte_fallback_rate"], v["unk_rate"],
             *((mixture["intended"].get(lang), mixture["tokens"].get(lang), mixture["chars"].get(lang),
                mixture["unit"]) if mixture else (None, None, None, None)),
             par.get(lang, {}).get("chars_per_token"), par.get(lang, {}).get("premium")]
            for lang, v in val.items()]
    return columns, rows


@dataclass
class FertilitySettings:
    """What the start-of-run check (:func:`run_check`) checks, validated when made.

    Args:
        floors: minimum characters per token per language (default ``{"bn": 2.5}``; UTF-8 bytes give
            Bangla ~0.37, a Bangla-aware 8k tokenizer ~3.4).
        max_factor: a language delivered more than this multiple of its intended share (in tokens or
            characters) fails the share check.
        check_shares: run the inverted/over-represented mixture checks.
        on_fail: ``raise`` (stop the run with a :class:`~bnlit.errors.TokenizerError`) or ``warn``.
        parallel: ``{lang: file}`` of line-aligned translations (for example FLORES-200 dev
            ``{bn: ben_Beng.dev, en: eng_Latn.dev}``); when given, the content-matched token premium
            (Petrov et al. 2023) is measured on it, logged and checked against ``premium_band``.
            ``None`` (the default): not measured. Read when the settings are made: a missing or
            misaligned file stops the run before any data is built.
        premium_band: ``[low, high]``; a premium outside it, in either direction, is warned about.
    """

    floors: Mapping[str, float] | None = None
    max_factor: float = DEFAULT_MAX_FACTOR
    check_shares: bool = True
    on_fail: str = "raise"
    parallel: Mapping[str, str] | None = None
    premium_band: Sequence[float] = DEFAULT_PREMIUM_BAND

    def __post_init__(self):
        if self.on_fail not in ("raise", "warn"):
            raise ConfigError(f"callbacks.fertility.on_fail={self.on_fail!r}: use one of ['raise', 'warn']")
        if self.max_factor <= 1.0:
            raise ConfigError(f"callbacks.fertility.max_factor={self.max_factor}: must be > 1")
        band = list(self.premium_band)
        if len(band) != 2 or not 0 < band[0] <= 1 <= band[1]:
            raise ConfigError(f"callbacks.fertility.premium_band={band}: write [low, high] with 0 < low <= 1 <= high")
        self.premium_band = (float(band[0]), float(band[1]))
        self.parallel = dict(self.parallel) if self.parallel else None
        self.parallel_texts = read_parallel(self.parallel, "callbacks.fertility.parallel") if self.parallel else None
        self.floors = dict(DEFAULT_FLOORS if self.floors is None else self.floors)


def run_check(dm, settings: FertilitySettings) -> tuple[dict, list[str], list[str]]:
    """The start-of-run check on a bnlit data module ``dm``: held-out characters per token against
    the floors, the mixture's delivered shares against its intent (``check_shares``), and the
    content-matched premium on the parallel texts against ``premium_band``. Returns the result
    (``validation``, ``mixture``, ``parallel``), the problems (stop or warn) and the premium
    warnings (never a stop)."""
    s = settings
    stats = dm.split_stats("val").values()
    val = heldout_fertility(stats, {st["language"]: dm.val_tokens(st["language"]) for st in stats}, dm.tokenizer)
    mixture = getattr(dm, "mixture", None)
    problems = floor_verdicts({k: v["chars_per_token"] for k, v in val.items()}, s.floors)
    if mixture and s.check_shares:
        cpt = {lang: chars_per_token(e["chars"], e["tokens"])
               for lang, e in language_counts(dm.split_stats("train").values()).items()}
        problems += share_verdicts(mixture["intended"], mixture["tokens"], mixture["chars"], cpt,
                                   max_factor=s.max_factor, unit=mixture["unit"])
    parallel, warnings = None, []
    if s.parallel_texts:
        parallel = report(s.parallel_texts, dm.tokenizer, parallel=True)
        source = "parallel text " + ", ".join(f"{k}={v}" for k, v in s.parallel.items())
        warnings = premium_verdicts({k: v["premium"] for k, v in parallel.items()}, s.premium_band, source)
    return {"validation": val, "mixture": mixture, "parallel": parallel}, problems, warnings

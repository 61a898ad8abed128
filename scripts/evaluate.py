"""Held-out NLL/token, bits/char and bits/byte of a checkpoint per language, against its random
twin and the run's unigram and bigram baselines, each with the contamination of that text by the
training data; optionally multiple-choice accuracy (lm-eval-harness ``acc_norm`` scoring).

    python scripts/evaluate.py --checkpoint CKPT --text bn=FILE --text en=FILE [--json]
                               [--twin/--no-twin] [--multiple-choice FILE] [--run-dir DIR] [--no-contamination]
                               [--held-out bn] [--gguf FILE ...] [--gguf-raw]

A ``.txt`` file is one document per blank-line separated paragraph, a ``.jsonl`` file one
``{"text": ...}`` per line. Every document token and one end-of-document token per document are
scored once, in windows of at most the training ``seq_len`` that cut a document only when it is
longer (``bnlit.evaluation.windows``), with the attention the checkpoint was trained
with (the document mask unless it ran with ``module.document_masking=false``; ``--document-masking``
overrides): a document scores as it would alone. The n-gram baselines score the same stream.
The run directory (default: the checkpoint's ``<run dir>/checkpoints/..``) supplies the baselines
(``baselines/ngram_<lang>.npz``, or counted from the run's training shards) and the cleaned
training text the contamination is measured against: the share of the file's distinct 13-word
n-grams found in training (``ngram_rate``) and of its documents contaminated by the run's
decontamination rule (``contamination_rate``). ``--json`` prints one JSON object keyed by
language, with top-level ``vocab_size`` (and ``multiple_choice`` when asked).

``--held-out LANG`` scores the run's own validation documents of LANG (from its cleaning cache).
``--gguf FILE`` (repeatable; needs the ``serve`` extra) also scores a GGUF export of the checkpoint
through llama.cpp: llama.cpp tokenizes the text (after ``bnlit.export.gguf_text``; with
``--gguf-raw`` the raw text, as llama.cpp's CLI, server and ollama get it) and computes the
logits, in the same windows; each language's row gains ``gguf`` with, per file, the same
fields, ``same_tokens`` (llama.cpp's token stream equals bnlit's), ``same_pieces`` (it does once
each raw-spelling token is mapped to the piece it spells, ``bnlit/raw_spellings.py``) and
``bits_per_char_vs_trained``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bnlit.errors import BnlitError, ConfigError

if TYPE_CHECKING:  # imported where used: --help answers without torch
    from bnlit.evaluation.heldout import EvalResult

BASELINES = ("unigram", "bigram")  # bnlit.evaluation.ngram.BASELINES (tests/test_scripts_help.py checks they agree)

RESERVED = ("vocab_size", "ln_vocab", "checkpoint", "step", "seq_len", "document_masking", "multiple_choice", "run_dir",
            "baselines")
FIELDS = ("nll_per_token", "perplexity", "bits_per_char", "bits_per_byte")
BASELINE_FIELDS = ("nll_per_token", "bits_per_char", "bits_per_byte")


def parse_text(specs: list[str]) -> dict[str, Path]:
    out = {}
    for spec in specs:
        lang, sep, file = spec.partition("=")
        if not sep or not lang or not file:
            raise ConfigError(f"--text {spec!r}: write LANG=FILE")
        if lang in out or lang in RESERVED:
            raise ConfigError(f"--text {lang}: given twice or a reserved name ({', '.join(RESERVED)})")
        out[lang] = Path(file)
    return out


def find_run_dir(checkpoint: Path, run_dir: Path | None) -> Path | None:
    """The training run a checkpoint came from: ``--run-dir``, else ``<run dir>/checkpoints/x.ckpt``'s
    grandparent when it looks like a bnlit run (a data report, baselines or a Hydra config)."""
    if run_dir is not None:
        if not run_dir.is_dir():
            raise ConfigError(f"--run-dir {run_dir}: no such directory; pass the training run's output directory")
        return run_dir
    cand = checkpoint.resolve().parent.parent
    marks = ("data_report.json", "baselines", ".hydra")
    return cand if any((cand / m).exists() for m in marks) else None


def run_baselines(run_dir: Path | None, languages: list[str], eos_id: int, vocab_size: int) -> tuple[dict, str]:
    """The run's n-gram counts for ``languages``, and where they came from."""
    from bnlit.evaluation.ngram import count_shards, load_baselines

    if run_dir is None:
        return {}, "unknown training data (no run directory; pass --run-dir)"
    counts = load_baselines(run_dir, languages)
    if len(counts) == len(languages):
        return counts, f"{run_dir}/baselines"
    from bnlit.data.report import read_report
    from bnlit.data.shards import load_index

    report = read_report(run_dir) or {}
    shard_dir = report.get("shard_dir")
    if not shard_dir or not Path(shard_dir).is_dir():
        return counts, f"{run_dir}/baselines" if counts else f"{run_dir}: no baselines/ and no training shards"
    index = load_index(shard_dir)
    if index["vocab_size"] != vocab_size:
        return counts, f"training shards {shard_dir} are of another tokenizer"
    counted = count_shards(shard_dir, index, eos_id, vocab_size)
    counts |= {lang: counted[lang] for lang in languages if lang in counted and lang not in counts}
    return counts, f"counted from {shard_dir}"


def contamination(texts: list[str], run_dir: Path | None, name: str) -> dict:
    """``check_against_training`` of ``texts`` (``ngram_rate``, ``contamination_rate``, ...), or
    ``{"unknown": reason}`` when the run's training text is not available."""
    if run_dir is None:
        return {"unknown": "no run directory (pass --run-dir)"}
    from bnlit.data.report import check_against_training
    from bnlit.errors import DataError

    try:
        return check_against_training(texts, run_dir, name=name)
    except DataError as e:
        return {"unknown": str(e)}


def score(model, stream, seq_len: int, batch_size: int, device, chars: int, nbytes: int, eos_id: int,
          masked: bool) -> EvalResult:
    from bnlit.evaluation.heldout import EvalResult, evaluate_stream

    nll, tokens = evaluate_stream(model, stream, seq_len, batch_size, device, eos_id=eos_id, document_masking=masked)
    return EvalResult(nll, tokens, chars, nbytes)


GGUF_FILE_TYPES = {0: "f32", 1: "f16", 7: "q8_0", 32: "bf16"}  # general.file_type (gguf.LlamaFileType)


def score_gguf(lm, docs: list[str], seq_len: int, batch_size: int, bnlit_stream, trained: EvalResult,
               masked: bool, raw: bool = False) -> dict:
    """One language's row for a GGUF file: llama.cpp's tokens (of the raw text, or after the
    ``gguf_text`` pre-call) and logits, bnlit's windows."""
    from bnlit.evaluation.heldout import EvalResult, evaluate_stream, token_stream

    stream = token_stream([lm.encode_raw(d) if raw else lm.encode(d) for d in docs], lm.eos_id)
    nll, tokens = evaluate_stream(lm, stream, seq_len, batch_size, device="cpu", eos_id=lm.eos_id,
                                  document_masking=masked)
    r = EvalResult(nll, tokens, trained.chars, trained.bytes)
    return {"file": str(lm.path), "type": GGUF_FILE_TYPES.get(lm.file_type, str(lm.file_type)),
            "text": "raw" if raw else "gguf_text",
            **{k: getattr(r, k) for k in FIELDS}, "tokens": r.tokens,
            "same_tokens": len(stream) == len(bnlit_stream) and bool((stream == bnlit_stream).all()),
            "same_pieces": lm.canonical(stream.tolist()) == bnlit_stream.tolist(),
            "bits_per_char_vs_trained": r.bits_per_char / trained.bits_per_char - 1}


STARTED = time.perf_counter()


def stage(message: str) -> None:
    """A progress line on stderr (stdout stays the report or the JSON), with the seconds so far."""
    print(f"evaluate: {message} ({time.perf_counter() - STARTED:.0f} s)", file=sys.stderr, flush=True)


def evaluate(args: argparse.Namespace) -> dict:
    import torch

    from bnlit.checkpointing import datamodule_state, load_model
    from bnlit.evaluation.heldout import read_documents, token_stream, twin_model

    stage("reading the texts")
    texts = parse_text(args.text or [])
    if not texts and not args.multiple_choice and not args.held_out:
        raise ConfigError("nothing to evaluate: pass --text LANG=FILE, --held-out LANG and/or --multiple-choice FILE")
    docs = {lang: read_documents(path) for lang, path in texts.items()}
    run_dir = find_run_dir(args.checkpoint, args.run_dir)
    for lang in args.held_out or []:
        from bnlit.data.report import held_out_documents

        if lang in docs or run_dir is None:
            raise ConfigError(f"--held-out {lang}: given with --text {lang}, or no run directory (pass --run-dir)")
        docs[lang] = held_out_documents(run_dir, lang)
    stage(f"loading {args.checkpoint}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, tok, ckpt = load_model(args.checkpoint)
    model.to(device)
    cfg = model.config
    seq_len = args.seq_len or datamodule_state(ckpt).get("seq_len") or cfg.max_seq_len
    # checkpoints written before the flag was saved trained with the mask (the default since it exists)
    masked = ckpt.get("document_masking", True) if args.document_masking is None else args.document_masking
    if not 0 < seq_len <= cfg.max_seq_len:
        raise ConfigError(f"--seq-len {seq_len}: must be in 1..{cfg.max_seq_len} (model.config.max_seq_len)")
    ggufs = []
    if args.gguf:
        from bnlit.serving import LlamaCppLM

        ggufs = [LlamaCppLM(path, n_ctx=seq_len) for path in args.gguf]
    twin = twin_model(model, args.twin_seed, device=device) if args.twin else None
    if docs:
        stage("the run's n-gram baselines")
    counts, source = run_baselines(run_dir, list(docs), tok.eos_id, cfg.vocab_size) if docs else ({}, "")
    out: dict = {"checkpoint": str(args.checkpoint), "step": ckpt.get("global_step"), "vocab_size": cfg.vocab_size,
                 "ln_vocab": math.log(cfg.vocab_size), "seq_len": seq_len,
                 "document_masking": masked, "run_dir": str(run_dir) if run_dir else None, "baselines": source}
    for lang, d in docs.items():
        stream = token_stream(tok.encode_batch(d), tok.eos_id)
        chars, nbytes = sum(len(x) for x in d), sum(len(x.encode("utf-8")) for x in d)
        stage(f"{lang}: {len(d):,} documents, {len(stream):,} tokens: the checkpoint")
        r = score(model, stream, seq_len, args.batch_size, device, chars, nbytes, tok.eos_id, masked)
        row = {k: getattr(r, k) for k in FIELDS} | {"tokens": r.tokens, "chars": r.chars, "bytes": r.bytes,
                                                     "documents": len(d)}
        if twin is not None:
            stage(f"{lang}: the random twin")
            t = score(twin, stream, seq_len, args.batch_size, device, chars, nbytes, tok.eos_id, masked)
            row |= {f"twin_{k}": getattr(t, k) for k in FIELDS}
            row["nll_gap"] = t.nll_per_token - r.nll_per_token
        if lang in counts:
            for order, b in counts[lang].evaluate(stream, chars, nbytes).items():
                row |= {f"{order}_{k}": getattr(b, k) for k in BASELINE_FIELDS}
            row["learned_context"] = row["bigram_bits_per_char"] - r.bits_per_char
        row["beats"] = {name: row[f"{name}_bits_per_char"] > r.bits_per_char
                        for name in ("twin", *BASELINES) if f"{name}_bits_per_char" in row}
        if ggufs:
            stage(f"{lang}: {len(ggufs)} GGUF file(s) through llama.cpp")
            row["gguf"] = {str(lm.path): score_gguf(lm, d, seq_len, args.batch_size, stream, r, masked, args.gguf_raw)
                           for lm in ggufs}
        if args.contamination:
            stage(f"{lang}: overlap with the training text")
            row["contamination"] = contamination(d, run_dir, f"--text {lang}")
        out[lang] = row
    for lm in ggufs:
        lm.close()
    if args.multiple_choice:
        from bnlit.evaluation.multiple_choice import load_items, score_items

        items = load_items(args.multiple_choice)
        stage(f"multiple choice: {len(items):,} items")
        scores = score_items(model, tok, items, seq_len)
        scores.pop("predictions")
        if twin is not None:
            scores["twin_acc_norm"] = score_items(twin, tok, items, seq_len)["acc_norm"]
        out["multiple_choice"] = {"file": str(args.multiple_choice), **scores}
        if args.contamination:
            out["multiple_choice"]["contamination"] = contamination(
                [f"{it.context} {it.choices[it.label]}" for it in items], run_dir, "--multiple-choice")
    return out


def same_tokens_note(g: dict) -> str:
    if g["same_tokens"]:
        return "the same tokens as bnlit"
    if g.get("same_pieces"):
        return "bnlit's pieces (raw spellings read through their alias tokens)"
    return "OTHER TOKENS than bnlit"


def contamination_note(c: dict | None) -> str:
    if c is None:
        return ""
    if "unknown" in c:
        return "contamination unknown"
    return (f"{100 * c['ngram_rate']:.1f}% of 13-grams in training, "
            f"{100 * c['contamination_rate']:.1f}% of docs contaminated")


def format_report(res: dict) -> str:
    lines = [f"checkpoint {res['checkpoint']} (step {res['step']}), vocab {res['vocab_size']} "
             f"(ln V = {res['ln_vocab']:.3f}), windows of {res['seq_len']} tokens, "
             + ("document-masked attention (as trained)" if res["document_masking"] else
                "causal attention across documents (as trained: module.document_masking=false)")]
    langs = [k for k in res if k not in RESERVED]
    if langs:
        head = f"{'lang':<6}{'model':<9}{'docs':>6}{'tokens':>10}{'chars':>11}{'nll/tok':>9}{'bits/char':>11}{'bits/byte':>11}"
        lines.append(head + "  beaten by trained / contamination")
        for lang in langs:
            r = res[lang]
            rows = [("trained", "")] + [(m, m + "_") for m in ("twin", *BASELINES) if f"{m}_nll_per_token" in r]
            for name, p in rows:
                beaten = "" if not p else ("yes" if r["beats"][name] else "NO")
                note = contamination_note(r.get("contamination")) if name == "trained" else beaten
                lines.append(f"{lang:<6}{name:<9}{r['documents']:>6}{r['tokens']:>10}{r['chars']:>11}"
                             f"{r[p + 'nll_per_token']:>9.4f}{r[p + 'bits_per_char']:>11.4f}{r[p + 'bits_per_byte']:>11.4f}"
                             f"  {note}")
            for g in r.get("gguf", {}).values():
                lines.append(f"{lang:<6}llama.cpp {g['type']} ({g['file']}, {g['text']} text): "
                             f"nll/tok {g['nll_per_token']:.4f}, "
                             f"bits/char {g['bits_per_char']:.4f} ({100 * g['bits_per_char_vs_trained']:+.3f}% vs "
                             f"trained), bits/byte {g['bits_per_byte']:.4f}, "
                             f"{same_tokens_note(g)}")
            if "learned_context" in r:
                lines.append(f"{lang:<6}learned context (bigram - trained bits/char): {r['learned_context']:+.4f}")
        if res["baselines"]:
            lines.append(f"baselines: {res['baselines']}")
    if "multiple_choice" in res:
        m = res["multiple_choice"]
        lines.append(f"multiple choice {m['file']}: {m['n']} items, acc_norm {m['acc_norm']:.3f}, acc {m['acc']:.3f}, "
                     f"chance {m['chance']:.3f}" + (f", twin acc_norm {m['twin_acc_norm']:.3f}" if "twin_acc_norm" in m else "")
                     + (f"; {contamination_note(m['contamination'])}" if "contamination" in m else ""))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, type=Path, help="a bnlit last.ckpt or step*.ckpt")
    p.add_argument("--text", action="append", metavar="LANG=FILE", help="held-out text of one language (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--twin", action=argparse.BooleanOptionalAction, default=True,
                   help="also score a randomly initialised twin (default: on)")
    p.add_argument("--twin-seed", type=int, default=1234, help="init seed of the random twin (default 1234)")
    p.add_argument("--multiple-choice", type=Path, help='multiple-choice JSONL: {"context", "choices", "label"} per line')
    p.add_argument("--seq-len", type=int, help="window length (default: the training seq_len)")
    p.add_argument("--batch-size", type=int, default=8, help="windows scored per forward pass (default 8)")
    p.add_argument("--document-masking", action=argparse.BooleanOptionalAction, default=None,
                   help="attend within each document only (default: as the checkpoint was trained)")
    p.add_argument("--run-dir", type=Path, help="the training run (default: the checkpoint's run directory)")
    p.add_argument("--contamination", action=argparse.BooleanOptionalAction, default=True,
                   help="measure each text's overlap with the run's training data (default: on)")
    p.add_argument("--held-out", action="append", metavar="LANG",
                   help="score the run's own validation documents of LANG (repeatable; needs its cleaning cache)")
    p.add_argument("--gguf", action="append", type=Path, metavar="FILE",
                   help="also score this GGUF export through llama.cpp (repeatable; pip install -e '.[serve]')")
    p.add_argument("--gguf-raw", action="store_true",
                   help="give llama.cpp the raw text (as its CLI, server and ollama do), not bnlit.export.gguf_text(text)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        res = evaluate(args)
    except BnlitError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(json.dumps(res, indent=2, ensure_ascii=False) if args.json else format_report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

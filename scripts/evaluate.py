"""Held-out NLL/token, bits/char and bits/byte of a checkpoint per language, against its random
twin; optionally English multiple-choice accuracy (lm-eval-harness ``acc_norm`` scoring).

    python scripts/evaluate.py --checkpoint CKPT --text bn=FILE --text en=FILE [--json]
                               [--twin/--no-twin] [--multiple-choice FILE]

A ``.txt`` file is one document per blank-line separated paragraph, a ``.jsonl`` file one
``{"text": ...}`` per line. Every document token and one end-of-document token per document are
scored once, in windows of the training ``seq_len``. ``--json`` prints one JSON object keyed by
language, with top-level ``vocab_size`` (and ``multiple_choice`` when asked).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from bnlit.checkpoint import DATAMODULE_KEY, load_model
from bnlit.errors import BnlitError, ConfigError
from bnlit.evaluation import evaluate_documents, read_documents, twin_model

RESERVED = ("vocab_size", "ln_vocab", "checkpoint", "step", "seq_len", "multiple_choice")
FIELDS = ("nll_per_token", "perplexity", "bits_per_char", "bits_per_byte")


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


def evaluate(args: argparse.Namespace) -> dict:
    texts = parse_text(args.text or [])
    if not texts and not args.multiple_choice:
        raise ConfigError("nothing to evaluate: pass --text LANG=FILE and/or --multiple-choice FILE")
    docs = {lang: read_documents(path) for lang, path in texts.items()}
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, tok, ckpt = load_model(args.checkpoint)
    model.to(device)
    cfg = model.config
    seq_len = args.seq_len or (ckpt.get(DATAMODULE_KEY) or {}).get("seq_len") or cfg.max_seq_len
    if not 0 < seq_len <= cfg.max_seq_len:
        raise ConfigError(f"--seq-len {seq_len}: must be in 1..{cfg.max_seq_len} (model.config.max_seq_len)")
    twin = twin_model(model, args.twin_seed, device=device) if args.twin else None
    out: dict = {"checkpoint": str(args.checkpoint), "step": ckpt.get("global_step"), "vocab_size": cfg.vocab_size,
                 "ln_vocab": math.log(cfg.vocab_size), "seq_len": seq_len}
    for lang, d in docs.items():
        r = evaluate_documents(model, tok, d, seq_len, args.batch_size, device)
        row = {k: getattr(r, k) for k in FIELDS} | {"tokens": r.tokens, "chars": r.chars, "bytes": r.bytes,
                                                     "documents": len(d)}
        if twin is not None:
            t = evaluate_documents(twin, tok, d, seq_len, args.batch_size, device)
            row |= {f"twin_{k}": getattr(t, k) for k in FIELDS}
            row["nll_gap"] = t.nll_per_token - r.nll_per_token
        out[lang] = row
    if args.multiple_choice:
        from bnlit.multiple_choice import load_items, score_items

        items = load_items(args.multiple_choice)
        scores = score_items(model, tok, items, seq_len)
        scores.pop("predictions")
        if twin is not None:
            scores["twin_acc_norm"] = score_items(twin, tok, items, seq_len)["acc_norm"]
        out["multiple_choice"] = {"file": str(args.multiple_choice), **scores}
    return out


def format_report(res: dict) -> str:
    lines = [f"checkpoint {res['checkpoint']} (step {res['step']}), vocab {res['vocab_size']} "
             f"(ln V = {res['ln_vocab']:.3f}), windows of {res['seq_len']} tokens"]
    langs = [k for k in res if k not in RESERVED]
    if langs:
        twin = "twin_nll_per_token" in res[langs[0]]
        head = f"{'lang':<6}{'docs':>6}{'tokens':>10}{'chars':>11}{'nll/tok':>9}{'ppl':>10}{'bits/char':>11}{'bits/byte':>11}"
        lines.append(head + (f"{'twin nll':>10}{'twin b/c':>10}" if twin else ""))
        for lang in langs:
            r = res[lang]
            line = (f"{lang:<6}{r['documents']:>6}{r['tokens']:>10}{r['chars']:>11}{r['nll_per_token']:>9.4f}"
                    f"{r['perplexity']:>10.2f}{r['bits_per_char']:>11.4f}{r['bits_per_byte']:>11.4f}")
            if twin:
                line += f"{r['twin_nll_per_token']:>10.4f}{r['twin_bits_per_char']:>10.4f}"
            lines.append(line)
    if "multiple_choice" in res:
        m = res["multiple_choice"]
        lines.append(f"multiple choice {m['file']}: {m['n']} items, acc_norm {m['acc_norm']:.3f}, acc {m['acc']:.3f}, "
                     f"chance {m['chance']:.3f}" + (f", twin acc_norm {m['twin_acc_norm']:.3f}" if "twin_acc_norm" in m else ""))
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

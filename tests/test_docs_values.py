"""The config values the docs quote are the config's: every presets table (a Markdown table whose
first column is ``preset`` and that has a ``dim`` column) in README.md and docs/ lists every ``conf/model/*.yaml`` preset with its
dim, layers, heads (kv), vocabulary and parameter count (counted on the ``meta`` device), and each
quote of a run's shape in :data:`QUOTES` (steps, micro-batch, accumulation, sequence length,
vocabulary, learning rate, validation interval, nodes x GPUs) equals the composed config it
describes. Any ``A x B [x C] = N`` product written in the docs is also checked to multiply out."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import bnlit.resolvers  # noqa: F401  (the train config's resolvers)
from bnlit import CONF_DIR

ROOT = CONF_DIR.parent


def tokens_per_step(c: DictConfig) -> int:
    return c.data.batch_size * c.trainer.accumulate_grad_batches * c.data.seq_len


# (file, a regex over the file's text with runs of whitespace made one space, the group choices of
# the config it describes, the config's values for the regex's groups in order). Each must match
# at least once: a quote that is reworded gets its entry updated here, not dropped.
QUOTES: list[tuple[str, str, tuple[str, ...], Callable[[DictConfig], tuple]]] = [
    ("README.md", r"fused AdamW and ([\d,]+) tokens per optimizer step", ("model=400m", "trainer=h100"),
     lambda c: (tokens_per_step(c),)),
    ("docs/production.md",
     r"accumulation to (\d+) x (\d+) x (\d+) = ([\d,]+) tokens per optimizer step; `trainer\.max_steps=(\d+)`",
     ("model=400m", "trainer=h100"),
     lambda c: (c.data.batch_size, c.trainer.accumulate_grad_batches, c.data.seq_len, tokens_per_step(c),
                c.trainer.max_steps)),
    ("docs/production.md", r"\(DDP over (\d+) nodes x (\d+) GPUs", ("trainer=multinode",),
     lambda c: (c.trainer.num_nodes, c.trainer.devices)),
    ("docs/throughput.md", r"micro-batch (\d+) x (\d+) accumulation at seq (\d+) \(~[\d.]+ GiB for `400m`",
     ("model=400m", "trainer=h100"),
     lambda c: (c.data.batch_size, c.trainer.accumulate_grad_batches, c.data.seq_len)),
    ("docs/getting-started.md", r"default \((\d+) steps of (\d+) x (\d+) tokens, validation every (\d+) steps[;)]", (),
     lambda c: (c.trainer.max_steps, c.data.batch_size, c.data.seq_len, c.trainer.val_check_interval)),
    ("docs/getting-started.md", r"tokenizer \((\d+) (\w+) pieces\)", (),
     lambda c: (c.model.config.vocab_size, str(c.tokenizer.model_type).upper())),
    ("docs/getting-started.md", r"\(`trainer\.val_check_interval: (\d+)`\)", (),
     lambda c: (c.trainer.val_check_interval,)),
    ("docs/evaluation.md",
     r"no overrides: (\w+), vocabulary (\d+), (\d+) steps of (\d+) x (\d+) tokens, lr ([\d.e-]+) ([\w-]+)",
     (), lambda c: (c.model.config.name, c.model.config.vocab_size, c.trainer.max_steps, c.data.batch_size,
                    c.data.seq_len, c.optimizer.lr, schedule(c))),
    ("docs/evaluation.md",
     r"\*\*default now\*\*: (\w+), seq (\d+), batch (\d+), lr ([\d.e-]+) (\w+), [^|]*validation every (\d+), [^|]*\| (\d+) \|",
     (), lambda c: (optimizer(c), c.data.seq_len, c.data.batch_size, c.optimizer.lr, schedule(c, short=True),
                    c.trainer.val_check_interval, c.trainer.max_steps)),
    ("docs/evaluation.md", r"warmup-stable-decay, (\w+) on the blocks' matrices and AdamW on the embeddings", (),
     lambda c: (optimizer(c),)),
    ("conf/data/embedded.yaml", r"# (\d+) x (\d+) = (\d+) tokens per step with the (\w+) preset", (),
     lambda c: (c.data.batch_size, c.data.seq_len, c.data.batch_size * c.data.seq_len, c.model.config.name)),
]


SCHEDULES = {"warmup_stable_decay": ("warmup-stable-decay", "WSD"), "warmup_cosine": ("warmup-cosine", "cosine")}


def optimizer(c: DictConfig) -> str:
    """The optimizer as the docs name it (``conf/optimizer/*.yaml`` ``_target_``)."""
    return {"MuonAdamW": "Muon", "AdamW": "AdamW"}[str(c.optimizer._target_).rsplit(".", 1)[-1]]


def schedule(c: DictConfig, short: bool = False) -> str:
    """The schedule as the docs name it (``conf/scheduler/*.yaml`` ``_target_``)."""
    return SCHEDULES[str(c.scheduler._target_).rsplit(".", 1)[-1]][short]


@functools.lru_cache(maxsize=None)
def composed(choices: tuple[str, ...]) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=list(choices))


def same(doc: str, value) -> bool:
    """A quoted figure equals the config's: ``524,288`` is 524288, ``2e-2`` is 0.02."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(doc.replace(",", "")) == pytest.approx(float(value), rel=1e-9)
        except ValueError:
            return False
    return doc == str(value)


def flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def quote_mismatches(root: Path = ROOT) -> list[str]:
    out = []
    for file, rx, choices, values in QUOTES:
        text = flat((root / file).read_text())
        found = list(re.finditer(rx, text))
        if not found:
            out.append(f"{file}: the quote /{rx}/ is gone; restore it or update QUOTES in tests/test_docs_values.py")
        want = values(composed(choices))
        for m in found:
            for i, (doc, value) in enumerate(zip(m.groups(), want, strict=True), 1):
                if not same(doc, value):
                    under = " ".join(choices) or "the default config"
                    out.append(f"{file}: {m.group(0)!r} quotes {doc} where {under} has {value} (group {i})")
    return out


# -- presets tables ---------------------------------------------------------------------------------

def tables(text: str) -> list[list[list[str]]]:
    """The Markdown tables of a page, as rows of stripped cells (the separator row left out)."""
    out, rows = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                rows.append(cells)
        elif rows:
            out.append(rows)
            rows = []
    return out


@functools.lru_cache(maxsize=None)
def preset(name: str) -> dict[str, str]:
    """A preset's figures as the docs write them."""
    from bnlit.model import Transformer

    cfg = instantiate(OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml").model.config)
    with torch.device("meta"):
        n = Transformer(cfg).num_params()
    millions = n / 1e6
    return {"dim": str(cfg.dim), "layers": str(cfg.n_layer), "heads (kv)": f"{cfg.n_head} ({cfg.n_kv_heads})",
            "vocab": f"{cfg.vocab_size:,}", "parameters": n, "tied": cfg.tie_embeddings, "_m": millions}


def parameters_match(cell: str, fig: dict) -> bool:
    """``0.62M``, ``24.9M (tied)``: the count rounded to the digits shown; ``(tied)`` iff tied."""
    m = re.fullmatch(r"([\d.]+)M( \(tied\))?", cell)
    if not m:
        return False
    digits = len(m.group(1).partition(".")[2])
    return float(m.group(1)) == round(fig["_m"], digits) and bool(m.group(2)) == fig["tied"]


def preset_mismatches(root: Path = ROOT) -> list[str]:
    names = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
    out, seen = [], 0
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for table in tables(page.read_text()):
            head = [h.lower() for h in table[0]]
            if head[0] != "preset" or "dim" not in head:  # not the model presets (data presets, memory)
                continue
            seen += 1
            rel = page.relative_to(root)
            listed = [r[0].strip("`") for r in table[1:]]
            if sorted(listed) != names:
                out.append(f"{rel}: the presets table lists {listed}; conf/model/ has {names}")
            for row in table[1:]:
                name = row[0].strip("`")
                if name not in names:
                    continue
                fig = preset(name)
                for col, cell in zip(head, row):
                    if col == "parameters":
                        if not parameters_match(cell, fig):
                            out.append(f"{rel}: {name} parameters {cell!r}; the model has {fig['_m']:.4f}M"
                                       f"{' (tied)' if fig['tied'] else ''}")
                    elif col in fig and cell != fig[col]:
                        out.append(f"{rel}: {name} {col} {cell!r}; conf/model/{name}.yaml gives {fig[col]!r}")
    if not seen:
        out.append("no presets table found in README.md or docs/")
    return out


# -- products written out ---------------------------------------------------------------------------

PRODUCT = re.compile(r"(?<![\w.,])(\d[\d,]*)((?: x \d[\d,]*){1,3}) = (\d[\d,]*)(?![\d.])")


def product_mismatches(root: Path = ROOT) -> list[str]:
    out = []
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "conf").glob("**/*.yaml"))]:
        for m in PRODUCT.finditer(flat(page.read_text())):
            factors = [int(m.group(1).replace(",", ""))] + [int(f.replace(",", "")) for f in m.group(2).split(" x ")[1:]]
            if eval("*".join(map(str, factors))) != int(m.group(3).replace(",", "")):  # noqa: S307  (digits only)
                out.append(f"{page.relative_to(root)}: {m.group(0)!r} does not multiply out")
    return out


def test_the_shapes_the_docs_quote_are_the_configs():
    assert quote_mismatches() == []


def test_every_presets_table_matches_the_presets():
    assert preset_mismatches() == []


def test_every_product_the_docs_write_multiplies_out():
    assert len(PRODUCT.findall(flat((ROOT / "docs" / "production.md").read_text()))) >= 1
    assert product_mismatches() == []


def test_planted_drift_is_caught(tmp_path):
    """A copy of the docs with a preset's width, the default's steps, a learning rate and a product
    changed, and one quote reworded away."""
    for rel in ["README.md", *[str(p.relative_to(ROOT)) for p in ROOT.glob("docs/*.md")],
                *[str(p.relative_to(ROOT)) for p in ROOT.glob("conf/**/*.yaml")]]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((ROOT / rel).read_text())

    def edit(rel: str, old: str, new: str) -> None:
        text = (tmp_path / rel).read_text()
        assert old in text, (rel, old)
        (tmp_path / rel).write_text(text.replace(old, new, 1))

    edit("README.md", "| `tiny` | 128 | 2 |", "| `tiny` | 96 | 2 |")
    edit("docs/configuration.md", "| 395.9M |", "| 395.8M |")
    edit("docs/configuration.md", "| `1b` |", "| `2b` |")
    edit("docs/getting-started.md", "default (800 steps of 32 x 128", "default (1000 steps of 32 x 128")
    edit("docs/evaluation.md", "128 tokens, lr 1e-2", "128 tokens, lr 3e-3")
    edit("docs/production.md", "= 524,288 tokens", "= 524,287 tokens")
    edit("docs/throughput.md", "micro-batch 16 x 16", "micro-batches of 16 x 16")
    presets = preset_mismatches(tmp_path)
    assert "README.md: tiny dim '96'; conf/model/tiny.yaml gives '128'" in presets
    assert "docs/configuration.md: 400m parameters '395.9M'; the model has 395.8958M" not in presets
    assert any(p.startswith("docs/configuration.md: 400m parameters '395.8M'") for p in presets)
    assert any(p.startswith("docs/configuration.md: the presets table lists") for p in presets)
    assert len(presets) == 3
    quotes = quote_mismatches(tmp_path)
    assert any(q.startswith("docs/getting-started.md:") and "quotes 1000 where the default config has 800" in q
               for q in quotes)
    assert any(q.startswith("docs/evaluation.md:") and "quotes 3e-3 where the default config has 0.01" in q
               for q in quotes)
    assert any(q.startswith("docs/production.md:") and "quotes 524,287 where model=400m trainer=h100 has 524288" in q
               for q in quotes)
    assert any(q.startswith("docs/throughput.md: the quote") and "is gone" in q for q in quotes)
    assert len(quotes) == 4
    assert product_mismatches(tmp_path) == ["docs/production.md: '16 x 16 x 2048 = 524,287' does not multiply out"]

"""The docs and comments cannot name a config key that does not exist: every dotted key under a
config root (``trainer.max_steps``, ``callbacks.gradient_flow.fast_path_parity``,
``+data.sources.<i>.max_docs``, ``hydra.launcher.partition``) written in README.md, docs/*.md,
the comments of conf/**/*.yaml, and the comments and strings of the Python code is a key of the
composed ``train`` config, or an argument its ``_target_`` (or ``bnlit.data.sources.Source``)
accepts, as ``python -m bnlit.train`` itself decides (:func:`bnlit.command_line.known_keys`,
:func:`~bnlit.command_line.key_defined`).

A key is looked up in the config the text is talking about: the default composition, the group
choices on the same line (a command: ``data=bn_web data/executor=slurm data.executor.partition=cpu``),
the choices named in the same section of a page (``data=bn_web``, ``conf/data/bn_web.yaml``), the
option a conf file is, or the choices named anywhere in a Python file. ``<i>``, ``<name>`` and ``*``
are wildcards. What looks like a key but is not one (a Hugging Face parameter name, a GGUF metadata
key, a Lightning ``Trainer`` attribute) is in :data:`NOT_KEYS` with its reason."""

from __future__ import annotations

import functools
import io
import re
import tokenize
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, ListConfig

import bnlit.resolvers  # noqa: F401  (the train config's resolvers)
from bnlit import CONF_DIR
from bnlit.command_line import FREE_FORM, _exists, _node, known_keys, target_params

ROOT = CONF_DIR.parent
ROOTS = ("hydra", "optimizer", "scheduler", "model", "tokenizer", "data", "module", "hardware", "trainer",
         "callbacks", "logger", "paths")
SEG = r"(?:[A-Za-z_][\w*]*|\d+|<\w+>|\*)"
# a key: not part of a longer name, a path, a Python module path (bnlit.data.report) or a value
KEY = re.compile(rf"(?<![\w.$/{{<*\[=-])([+~]*)((?:{'|'.join(ROOTS)})(?:\.{SEG})+)(?![\w(/-])")
COMMAND = re.compile(r"python3? -m bnlit\.[a-z_]+")
FILE_SUFFIXES = {"py", "json", "model", "gguf", "md", "safetensors", "yaml", "ckpt", "txt", "jsonl", "pt", "png",
                 "csv", "log", "sh", "bin", "vocab", "toml"}
# names that look like keys and are not, each with its reason (a prefix covers what is under it)
NOT_KEYS = {
    "trainer.max_stepz": "docs/configuration.md's bad-input table: the typo the command line refuses",
    "model.layers": "Hugging Face Llama parameter names and bnlit.model.Transformer's blocks (export, allow patterns)",
    "model.embed_tokens": "a Hugging Face Llama parameter name (bnlit/export.py's rename table)",
    "model.norm": "a Hugging Face Llama parameter name (bnlit/export.py's rename table)",
    "model.loss_fn": "bnlit.model.Transformer's loss head (bnlit/speed/compile.py), not config",
    "module.loss_for_batch": "a method of the LightningModule (bnlit/module.py), not config",
    "tokenizer.ggml": "GGUF metadata keys that llama.cpp reads (bnlit/serving.py, docs/export.md)",
    "tokenizer.encode": "a tokenizer's method (bnlit/hf_tokenizer.py), not config",
    "hydra.utils": "the hydra package's module (hydra.utils.instantiate), not config",
}


def trainer_attribute(key: str) -> bool:
    """``trainer.global_step``, ``trainer.validate``: an attribute of the Lightning ``Trainer`` that
    code comments talk about (checked only for a key the config does not have)."""
    import lightning

    parts = key.split(".")
    return parts[0] == "trainer" and len(parts) > 1 and hasattr(lightning.Trainer, parts[1])


# -- where the text is ------------------------------------------------------------------------------

def group_dirs() -> set[str]:
    return {str(p.relative_to(CONF_DIR)) for p in CONF_DIR.rglob("*") if p.is_dir()} - {"hydra/job_logging"}


def choices_in(text: str) -> set[str]:
    """The group choices a text names: ``data=bn_web``, ``hardware=h200|a100``, ``data/executor=slurm``,
    ``conf/data/bn_web.yaml``."""
    groups = group_dirs()
    out = set()
    for m in re.finditer(r"(?<![\w.+~/-])([a-z_]+(?:/[a-z_]+)?)=([\w|-]+)", text):
        if m.group(1) in groups:
            out |= {f"{m.group(1)}={o}" for o in m.group(2).split("|") if (CONF_DIR / m.group(1) / f"{o}.yaml").exists()}
    for m in re.finditer(r"conf/([\w/]+)/([\w-]+)\.yaml", text):
        if m.group(1) in groups and m.group(1) != "hydra/job_logging":
            out.add(f"{m.group(1)}={m.group(2)}")
    return out


def markdown_lines(path: Path) -> list[tuple[int, str, str]]:
    """``(line number, line, its section's text)``; a fenced command continued with ``\\`` is one
    line (reported at its first line); a ``#`` inside a fence is not a heading."""
    lines = path.read_text().splitlines()
    # the section of every line: the lines between the headings around it
    out, section_of, fence, start = [], [], False, 0
    for i, line in enumerate(lines):
        fence ^= line.startswith("```")
        if line.startswith("#") and not fence:
            start = i
        section_of.append(start)
    bounds = sorted(set(section_of)) + [len(lines)]
    text_of = {b: "\n".join(lines[b:bounds[k + 1]]) for k, b in enumerate(bounds[:-1])}
    i = 0
    while i < len(lines):
        first, line = i, lines[i]
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i].strip()
        out.append((first + 1, line, text_of[section_of[first]]))
        i += 1
    return out


def setting(line: str, m: re.Match) -> bool:
    """``key=value`` (an override that Hydra applies only to a key the config holds), not ``+key=``."""
    return line[m.end():m.end() + 1] == "=" and "+" not in m.group(1)


def python_text(path: Path) -> list[tuple[int, str]]:
    """Comments and string literals (docstrings, messages) of a Python file, line by line."""
    middle = getattr(tokenize, "FSTRING_MIDDLE", -1)
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING, middle):
            out += [(tok.start[0] + j, s) for j, s in enumerate(tok.string.splitlines())]
    return out


def conf_choice(path: Path) -> set[str]:
    """The group choice a conf file is (``conf/data/bn_web.yaml`` -> ``data=bn_web``)."""
    group = str(path.parent.relative_to(CONF_DIR))
    return {f"{group}={path.stem}"} if group in group_dirs() else set()


def mentions(files: list[Path]):
    """``(file, line number, +/~ prefix, key, whether the text sets it, the choices of the line,
    the choices of the section)``."""
    for path in files:
        if path.suffix == ".md":
            for n, line, section in markdown_lines(path):
                command = COMMAND.search(line) is not None  # its own choices only: it runs with them
                for m in KEY.finditer(line):
                    yield (path, n, m.group(1), m.group(2), setting(line, m), choices_in(line),
                           set() if command else choices_in(section))
        elif path.suffix == ".yaml":
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if "#" in line:
                    comment = line[line.index("#"):]
                    for m in KEY.finditer(comment):
                        yield path, n, m.group(1), m.group(2), setting(comment, m), conf_choice(path), set()
        else:
            text = python_text(path)
            whole = choices_in("\n".join(s for _, s in text))
            for n, line in text:
                for m in KEY.finditer(line):
                    yield path, n, m.group(1), m.group(2), setting(line, m), set(), whole


# -- the configs ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def composed(choices: frozenset[str]) -> tuple[DictConfig, frozenset[str]]:
    """The ``train`` config under these group choices, with its Hydra node, and its known keys."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=sorted(choices), return_hydra_config=True)
    return cfg, frozenset(known_keys(cfg)) | frozenset(f"hydra.{k}" for k in flat_keys(cfg.hydra))


def flat_keys(node, prefix: str = "") -> list[str]:
    out = []
    items = node.items_ex(resolve=False) if isinstance(node, DictConfig) else enumerate(node)
    for k, v in items:
        out.append(f"{prefix}{k}")
        if isinstance(v, (DictConfig, ListConfig)) and not v._is_none() and not v._is_missing():
            out += flat_keys(v, f"{prefix}{k}.")
    return out


def pattern(key: str) -> re.Pattern:
    parts = []
    for seg in key.split("."):
        parts.append(r"[^.]+" if seg == "*" or seg.startswith("<") else re.escape(seg).replace(r"\*", r"[^.]*"))
    return re.compile(r"\.".join(parts))


def defined(key: str, choices: frozenset[str], override: bool = False) -> bool:
    """Whether ``key`` is in the config composed under ``choices``, or an argument that the
    ``_target_`` of the node it goes into names in its signature (a ``**kwargs`` class names none:
    its schema lists its keys in the config). ``override``: the text sets it (``key=value`` without
    ``+``), which Hydra allows only for a key the config holds."""
    cfg, known = composed(choices)
    if key in known:
        return not override or _exists(cfg, key) or key.startswith("hydra.")
    segs = key.split(".")
    wild = next((i for i, s in enumerate(segs) if "*" in s or s.startswith("<")), None)
    if wild is None:
        parent = _node(cfg, ".".join(segs[:-1]))
        if ".".join(segs[:-1]) in FREE_FORM:  # +callbacks.multiple_choice.tasks.belebele_bn
            return True
        if override or not isinstance(parent, DictConfig) or "_target_" not in parent:
            return False
        return segs[-1] in (target_params(str(parent._target_)) or ())
    prefix = ".".join(segs[:wild])
    node = _node(cfg, prefix) if prefix not in ROOTS else None
    if wild == len(segs) - 1 and (prefix in ROOTS or prefix in FREE_FORM or (
            isinstance(node, DictConfig) and "_target_" in node and target_params(str(node._target_)) is None)):
        return True  # data.*, +logger.wandb.<anything> (wandb.init takes **kwargs), tasks.<task>
    rx = pattern(key)
    return any(rx.fullmatch(k) for k in known)


def not_a_key(key: str) -> bool:
    return (key.rsplit(".", 1)[-1] in FILE_SUFFIXES or trainer_attribute(key)
            or any(key == k or key.startswith(k + ".") for k in NOT_KEYS))


def undefined(files: list[Path], root: Path = ROOT) -> list[str]:
    out = []
    for path, n, sign, key, sets, line_choices, section_choices in mentions(files):
        if not_a_key(key):
            continue
        if any("<" in c for c in line_choices):
            line_choices = set()
        tries = [frozenset(), frozenset(line_choices), *(frozenset(line_choices | {c}) for c in section_choices)]
        if not any(defined(key, t, override=sets) for t in dict.fromkeys(tries)):
            where = f" (looked under {', '.join(sorted(line_choices | section_choices))})" if line_choices | section_choices else ""
            out.append(f"{path.relative_to(root)}:{n}: {sign}{key} is not a config key{where}")
    return out


def sources() -> list[Path]:
    return [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md")), *sorted(ROOT.glob("conf/**/*.yaml")),
            *sorted(ROOT.glob("bnlit/**/*.py")), *sorted(ROOT.glob("callbacks/*.py")),
            *sorted(ROOT.glob("scripts/*.py")), *sorted(ROOT.glob(".ci/*.py"))]


def test_every_config_key_the_docs_and_comments_name_exists():
    found = list(mentions(sources()))
    assert len(found) > 150  # the extraction sees the docs' keys
    assert undefined(sources()) == []


def test_a_planted_missing_key_is_caught(tmp_path):
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text(
        "# Page\n\n## Defaults\n\n"
        "Set `trainer.max_steps=10` and `data.num_procs=2`, or `+data.sources.0.max_docs=5`.\n"  # 5
        "`callbacks.gradient_flow.fast_path_parity=false`, `callbacks.gradient_flow.fast_path_parity_x`.\n"  # 6
        "`+trainer.profiler=simple`, not `trainer.profiler=simple`; `model.config.dim` sets the width.\n\n"  # 7
        "## Hub data\n\n`data=bn_web` streams; `data.executor.partition` is for a cluster.\n\n"  # 11
        "## Cluster\n\n```bash\npython -m bnlit.prepare data=bn_web data/executor=slurm \\\n"  # 16
        "    data.executor.partition=cpu\npython -m bnlit.prepare data.executor.partition=cpu\n```\n\n"  # 18
        "## Elsewhere\n\n`data.executor.partition` without naming the option.\n")  # 23
    code = tmp_path / "bnlit" / "x.py"
    code.parent.mkdir()
    code.write_text('"""Reads ``model.config.dimm``."""\n\nx = 1  # trainer.global_step is the Trainer\'s\n'
                    'raise ValueError("set tokenizer.vocab_size or model.config.vocab_size")\n')
    assert undefined([page, code], root=tmp_path) == [
        "docs/page.md:5: data.num_procs is not a config key",
        "docs/page.md:6: callbacks.gradient_flow.fast_path_parity_x is not a config key",
        "docs/page.md:7: trainer.profiler is not a config key",
        "docs/page.md:11: data.executor.partition is not a config key (looked under data=bn_web)",
        "docs/page.md:18: data.executor.partition is not a config key",
        "docs/page.md:23: data.executor.partition is not a config key",
        "bnlit/x.py:1: model.config.dimm is not a config key",
    ]


@pytest.mark.parametrize("key,choices,ok", [
    ("data.executor.partition", set(), False),  # data/executor=local has no partition
    ("data.executor.partition", {"data/executor=slurm"}, True),
    ("data.sources.0.max_docs", set(), True),  # a field of bnlit.data.sources.Source
    ("data.sources.3.path", set(), False),  # the embedded corpus has two sources
    ("hydra.launcher.partition", {"hydra/launcher=slurm"}, True),
    ("+data.sources.<i>.max_docs", set(), True),  # a field of bnlit.data.sources.Source
    ("trainer.profiler", set(), True),  # a lightning.Trainer argument the YAML leaves out
    ("callbacks.<name>._target_", set(), True),
    ("callbacks.<name>.no_such_key", set(), False),
])
def test_keys_are_looked_up_under_the_option_named(key, choices, ok):
    assert defined(key.lstrip("+"), frozenset(choices)) is ok

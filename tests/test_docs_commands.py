"""The docs and comments cannot show a command that does not exist: every ``python scripts/X.py``
written in README.md, docs/, conf comments or the code names a script whose argument parser has
each ``--option`` the command passes, and every ``python -m bnlit.X`` names a module that runs.
(Which documented commands CI runs is tests/test_documented_commands.py's; the config keys they
set are tests/test_docs_keys.py's.)"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import re
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = re.compile(r"python3? (scripts/[\w]+\.py)((?: +[^\s`|;&#)\"']+)*)")
MODULE = re.compile(r"python3? -m (bnlit(?:\.\w+)+)")
OPTION = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")


def commands(path: Path) -> list[tuple[int, str]]:
    """``(line, command)`` for each ``python scripts/...`` and ``python -m bnlit...`` in a file; in
    Markdown a fenced command continued with ``\\`` and inline code that wraps are one line."""
    text = path.read_text()
    out = []
    lines = text.splitlines()
    i, fence = 0, False
    while i < len(lines):
        first, line = i, lines[i]
        if line.startswith("```"):
            fence = not fence
            i += 1
            continue
        while line.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i].strip()
        if path.suffix == ".md" and not fence:  # inline code that wraps onto the next line
            while line.count("`") % 2 and i + 1 < len(lines) and lines[i + 1].strip():
                i += 1
                line += " " + lines[i].strip()
        for m in [*SCRIPT.finditer(line), *MODULE.finditer(line)]:
            out.append((first + 1, m.group(0)))
        i += 1
    return out


class Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


@functools.lru_cache(maxsize=None)
def options(script: str) -> frozenset[str] | None:
    """The option strings of a script's parser (run up to its ``parse_args``), ``None`` if it has no file."""
    path = ROOT / script
    if not path.exists():
        return None

    def capture(self, *args, **kwargs):
        raise Parsed(self)

    saved = (argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args, sys.argv, list(sys.path))
    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = capture
    sys.argv = [str(path), "--help"]
    sys.path.insert(0, str(path.parent))
    try:
        runpy.run_path(str(path), run_name="__main__")
    except Parsed as e:
        return frozenset(s for a in e.parser._actions for s in a.option_strings)
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args, sys.argv, sys.path[:] = saved
    raise AssertionError(f"{script} never built an argument parser")


def module_runs(name: str) -> bool:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        return False
    if spec.submodule_search_locations:  # a package: python -m runs its __main__
        return importlib.util.find_spec(name + ".__main__") is not None
    return "__main__" in Path(spec.origin).read_text()


def wrong(files: list[Path], root: Path = ROOT) -> list[str]:
    out = []
    for path in files:
        for line, command in commands(path):
            where = f"{path.relative_to(root)}:{line}"
            m = MODULE.match(command)
            if m:
                if not module_runs(m.group(1)):
                    out.append(f"{where}: {m.group(1)} is not a module python -m can run")
                continue
            script = command.split()[1]
            known = options(script)
            if known is None:
                out.append(f"{where}: {script} does not exist")
                continue
            bad = [o for o in OPTION.findall(command) if o not in known]
            if bad:
                out.append(f"{where}: {script} has no option {', '.join(bad)}")
    return out


def sources() -> list[Path]:
    return [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md")), *sorted(ROOT.glob("conf/**/*.yaml")),
            *sorted(ROOT.glob("bnlit/**/*.py")), *sorted(ROOT.glob("callbacks/*.py")),
            *sorted(ROOT.glob("scripts/*.py")), *sorted(ROOT.glob(".ci/*.py"))]


def test_every_command_the_docs_and_comments_show_exists():
    found = [c for f in sources() for c in commands(f)]
    assert sum("--" in c for _, c in found) > 30  # the extraction sees the commands' options
    assert wrong(sources()) == []


def test_a_planted_wrong_command_is_caught(tmp_path):
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text(
        "# Page\n\n"
        "`python scripts/bench.py --json --threads 1 --stepz 50` and `python scripts/bench.py --json\n"
        "--threads 1 --steps 50` (wrapped), `python scripts/no_such.py --help`.\n\n"
        "```bash\npython scripts/evaluate.py --checkpoint CKPT \\\n    --held-out bn --no-twinn\n"
        "python -m bnlit.train model=tiny\npython -m bnlit.trian\n```\n")
    assert wrong([page], root=tmp_path) == [
        "docs/page.md:3: scripts/bench.py has no option --stepz",
        "docs/page.md:3: scripts/no_such.py does not exist",
        "docs/page.md:7: scripts/evaluate.py has no option --no-twinn",
        "docs/page.md:10: bnlit.trian is not a module python -m can run",
    ]


@pytest.mark.parametrize("module", ["bnlit.train", "bnlit.info", "bnlit.prepare", "bnlit.run_report",
                                    "bnlit.sweep_report"])
def test_the_documented_modules_run(module):
    assert module_runs(module)

"""Every option of every script in scripts/ has help text: a user reads ``--help``, not the source."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parent.parent / "scripts").glob("*.py"))


class Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_every_option_has_help(script, monkeypatch):
    """Run the script up to its ``parse_args`` (in this process) and read the parser it built."""

    def capture(self, *args, **kwargs):
        raise Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    monkeypatch.syspath_prepend(str(script.parent))
    with pytest.raises(Parsed) as e:
        runpy.run_path(str(script), run_name="__main__")
    parser = e.value.parser
    assert parser.description, f"{script.name}: no description"
    missing = [a.option_strings[0] if a.option_strings else a.dest for a in parser._actions
               if not isinstance(a, argparse._HelpAction) and not (a.help and a.help.strip())]
    assert not missing, f"{script.name}: options without help: {missing}"
    assert parser.format_help()


HEAVY = ("torch", "lightning", "transformers", "datasets")
PROBE = """
import contextlib, io, json, runpy, sys
path = sys.argv[1]
sys.argv = [path, "--help"]
sys.path.insert(0, str(__import__("pathlib").Path(path).parent))
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit:
        pass
print(json.dumps({"help": out.getvalue(), "heavy": sorted(m for m in %r if m in sys.modules)}))
""" % (HEAVY,)


# scripts whose --help still imports torch (strict: the test fails the day one passes, and its entry must go)
PENDING: dict[str, str] = {}


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.xfail(strict=True, reason=PENDING[s.name]))
                                    if s.name in PENDING else s for s in SCRIPTS], ids=[s.name for s in SCRIPTS])
def test_help_answers_without_importing_torch(script):
    """``--help`` is for reading, not for waiting: it answers before torch or Lightning is imported
    (6-7 s of imports on a quiet machine, a minute on a busy one)."""
    import json
    import subprocess

    out = subprocess.run([sys.executable, "-c", PROBE, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["help"].startswith("usage: "), result["help"][:200]
    assert result["heavy"] == [], f"{script.name} --help imports {result['heavy']}"


def test_constants_the_scripts_repeat_agree_with_their_modules():
    """The scripts name a few choices without importing their heavy modules; they must not drift."""
    from bnlit.evaluation.ngram import BASELINES
    from bnlit.export import GGUF_TYPES

    scripts = Path(__file__).resolve().parent.parent / "scripts"
    assert runpy.run_path(str(scripts / "export_gguf.py"))["GGUF_TYPES"] == GGUF_TYPES
    from bnlit.raw_spellings import DEFAULT_KINDS, RAW_SPELLINGS

    names = runpy.run_path(str(scripts / "export_gguf.py"))
    assert names["RAW_SPELLING_KINDS"] == tuple(RAW_SPELLINGS) and names["DEFAULT_RAW_SPELLINGS"] == DEFAULT_KINDS
    from bnlit.alias_logits import DEFAULT_OFFSET

    assert names["DEFAULT_ALIAS_LOGIT_OFFSET"] == DEFAULT_OFFSET
    assert runpy.run_path(str(scripts / "evaluate.py"))["BASELINES"] == tuple(BASELINES)

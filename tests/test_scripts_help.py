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

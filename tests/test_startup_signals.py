"""A stop signal during ``python -m bnlit.train``'s imports (bnlit/startup_signals.py): held, then
acted on once the run's stop handler is in place; never swallowed by a ``__del__`` (chaos.py's
trial 34 of seed 1: a Ctrl-C in the imports, then a whole run and exit 0)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bnlit import startup_signals
from conftest import TINY

TESTS = Path(__file__).resolve().parent


class SignalsItself:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)  # Python acts on it here, inside __del__


def test_a_signal_while_held_is_remembered_and_the_old_handler_comes_back():
    before = signal.getsignal(signal.SIGINT)
    startup_signals.hold()
    try:
        SignalsItself()  # dropped at once: the signal lands in its __del__
        assert startup_signals.release() == signal.SIGINT
        assert signal.getsignal(signal.SIGINT) is before
        assert startup_signals.release() is None  # given once
    finally:
        signal.signal(signal.SIGINT, before)


# `python -m bnlit.train`, but a Ctrl-C arrives inside a __del__ while `lightning` is imported
IN_IMPORTS = """
import importlib.abc, os, runpy, signal, sys

class Ctrl_C(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "lightning":
            sys.meta_path.remove(self)
            class SignalsItself:
                def __del__(self):
                    os.kill(os.getpid(), signal.SIGINT)
            SignalsItself()
        return None

sys.meta_path.insert(0, Ctrl_C())
sys.argv = ["bnlit.train", *sys.argv[1:]]
runpy.run_module("bnlit.train", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow  # 15 s at load 9: the imports and Hydra's start
def test_a_ctrl_c_in_the_imports_stops_the_run_with_one_line(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", IN_IMPORTS, *TINY, f"hydra.run.dir={run}",
                           f"paths.cache_dir={tmp_path / 'cache'}"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                              [str(TESTS), os.environ.get("PYTHONPATH", "")])))
    out = proc.stdout + proc.stderr
    lines = [ln for ln in out.splitlines() if ln.startswith("interrupted ")]
    assert proc.returncode == 128 + signal.SIGINT, out[-3000:]
    assert lines == [f"interrupted before the first checkpoint: nothing to resume; rerun the same command "
                     f"(hydra.run.dir={run} may be reused)"], out[-3000:]
    assert "Exception ignored" not in out and "Traceback" not in out, out[-3000:]
    assert not (tmp_path / "cache").exists()  # stopped before the data build

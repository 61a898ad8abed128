"""Compiling ahead (bnlit/speed/compile_ahead.py): the evaluation and training graphs a child
process compiles while the run builds its data are the graphs the run loads; a child that fails
costs one line."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest
from omegaconf import open_dict

from bnlit.speed import compile_ahead
from conftest import TINY

LOADED = re.compile(r"torch\.compile: \d+ graphs? \((?P<kinds>[^)]*)\), .*? s compiling(?: \((?P<loaded>\d+) loaded)?")


def test_only_a_compiling_single_process_cpu_run_compiles_ahead(make_cfg):
    assert compile_ahead.wanted(make_cfg("module.compile=true", "trainer.accelerator=cpu"))
    for overrides in (["module.compile=false"], ["module.compile=true", "compile_ahead=false"],
                      ["module.compile=true", "trainer.devices=2"], ["module.compile=true", "trainer.num_nodes=2"]):
        assert not compile_ahead.wanted(make_cfg(*overrides, "trainer.accelerator=cpu")), overrides


def test_a_child_that_fails_costs_one_line_and_the_run_compiles_itself(make_cfg, caplog):
    cfg = make_cfg("module.compile=true")
    with open_dict(cfg):
        cfg.model.config.n_head = 3  # dim 64 has no 3 heads: the child's model refuses, as the run's would
    compile_ahead.start(cfg)
    with caplog.at_level(logging.INFO, logger="bnlit"):
        assert compile_ahead.wait("eval", timeout=120) is False
        assert compile_ahead.wait("train") is False  # said once; nothing left to wait on
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compile ahead")]
    assert len(lines) == 1 and re.fullmatch(r"compile ahead: the child exited with code [1-9]\d*; compiling the "
                                            r"remaining graphs in this process", lines[0]), lines


def fake_child(monkeypatch, script: str) -> None:
    """A child that prints what ``script`` prints, in place of the compiling one."""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, bufsize=0)
    monkeypatch.setattr(compile_ahead, "_child", proc)
    monkeypatch.setattr(compile_ahead, "_ready", set())
    monkeypatch.setattr(compile_ahead, "_expected", compile_ahead.STAGES)


def test_each_stage_is_waited_for_once_it_is_reported(monkeypatch, caplog):
    """Both stages in one write (the run read neither yet): no wait blocks on the second. A child
    that reports one stage and dies: that stage is ready, the other one is compiled by the run,
    said in one line; a child that reports nothing within the bound is killed."""
    with caplog.at_level(logging.INFO, logger="bnlit"):
        fake_child(monkeypatch, "import sys; sys.stdout.write('eval\\ntrain\\n')")
        assert compile_ahead.wait("train", timeout=30) and compile_ahead.wait("eval", timeout=0.5)
        fake_child(monkeypatch, "print('eval', flush=True); raise SystemExit(3)")
        assert compile_ahead.wait("eval", timeout=30) is True
        assert compile_ahead.wait("train", timeout=30) is False
        fake_child(monkeypatch, "import time; time.sleep(60)")
        assert compile_ahead.wait("eval", timeout=0.5) is False
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compile ahead")]
    assert [re.sub(r"\d+\.\d s", "N s", line) for line in lines] == [
        "compile ahead: train graph ready (waited N s)", "compile ahead: eval graph ready (waited N s)",
        "compile ahead: the child exited with code 3; compiling the remaining graphs in this process",
        "compile ahead: no eval graph after 0 s; compiling the remaining graphs in this process"], lines


def run(tmp_path, cache_dir, *overrides: str) -> str:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), BNLIT_CACHE=str(cache_dir))
    out = subprocess.run([sys.executable, "-m", "bnlit.train", *TINY, "module.compile=true", "trainer.max_steps=2",
                          *overrides, f"hydra.run.dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return (tmp_path / "run" / "train.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("ahead,validate_first", [(True, True), (True, False), (False, True)])
def test_the_run_loads_the_graphs_the_child_compiled(tmp_path, cache_dir, ahead, validate_first):
    """Each run starts from an empty Inductor cache. With compiling ahead, the run's two training
    graphs (a block and the loss) are loads of what the child wrote, and so are its two evaluation
    graphs when it validates before its first step (the child compiles them first); a run that
    trains first compiles its evaluation graphs itself. Without, all four are its own compiles."""
    log = run(tmp_path, cache_dir, f"compile_ahead={str(ahead).lower()}", f"validate_at_start={str(validate_first).lower()}")
    summary = LOADED.search(log)
    assert summary and summary["kinds"] == "train 2, eval 2", log[-3000:]
    assert ("compile ahead: train graph ready" in log) == ahead, log[-3000:]
    assert ("compile ahead: eval graph ready" in log) == (ahead and validate_first), log[-3000:]
    assert "compiling the remaining graphs" not in log, log[-3000:]
    assert int(summary["loaded"] or 0) == ((4 if validate_first else 2) if ahead else 0), summary.group(0)

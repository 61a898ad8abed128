"""Compiling ahead (bnlit/speed/compile_ahead.py): the training graph a child process compiles
while the run builds its data is the graph the run loads; a child that fails costs one line."""

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
        assert compile_ahead.wait(timeout=120) is False
        assert compile_ahead.wait() is False  # waited for once; nothing left to wait on
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compile ahead")]
    assert len(lines) == 1 and re.fullmatch(r"compile ahead: the child exited with code [1-9]\d*; compiling the "
                                            r"training graph in this process", lines[0]), lines


def run(tmp_path, cache_dir, *overrides: str) -> str:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), BNLIT_CACHE=str(cache_dir))
    out = subprocess.run([sys.executable, "-m", "bnlit.train", *TINY, "module.compile=true", "trainer.max_steps=2",
                          "validate_at_start=false", *overrides, f"hydra.run.dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return (tmp_path / "run" / "train.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("ahead", [True, False])
def test_the_run_loads_the_training_graph_the_child_compiled(tmp_path, cache_dir, ahead):
    """Each run starts from an empty Inductor cache. With compiling ahead, the run's two training
    graphs (a block and the loss) are loads of what the child wrote, its evaluation graphs (the
    final validation) its own compiles; without, all four are its own."""
    log = run(tmp_path, cache_dir, f"compile_ahead={str(ahead).lower()}")
    summary = LOADED.search(log)
    assert summary and summary["kinds"] == "train 2, eval 2", log[-3000:]
    assert ("compile ahead: training graph ready" in log) == ahead
    assert int(summary["loaded"] or 0) == (2 if ahead else 0), summary.group(0)

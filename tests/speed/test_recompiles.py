"""No recompiles after warm-up (issue 30 item 2): a run logs each Dynamo compile with the step it
happened at and warns about a recompile with Dynamo's reason.

- A planted shape change in a real Lightning fit (a loader whose last batch is short) is warned about
  by name, step and reason, and the first compiles are logged, not warned about.
- (slow) ``model=tiny trainer=h100 debug=rehearsal`` with validation (at start and inside the run),
  checkpoints, the gradient-flow parity probe and then a resume (``ckpt_path=last``, a second process)
  compiles exactly one block graph and one loss graph per kind (train, eval) in each process, each
  at the first step of its kind, and never again."""

from __future__ import annotations

import logging
import re
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from bnlit.model import ModelConfig, Transformer
from bnlit.module import LMModule
from bnlit.speed.compile import CompileWatch, compile_model

VOCAB = 96
# "torch.compile: compiled forward (bnlit/model.py:141) [train] compile 0/1: <Dynamo's reason> at step 0 (0.8 s)"
COMPILED = re.compile(r"torch\.compile: compiled (\S+) \(\S+\) \[(train|eval)\] compile .*? at step (\d+)")
RECOMPILED = "torch.compile recompiled after warm-up"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiles(log: str) -> list[tuple[str, str, int]]:
    """``(code, kind, step)`` of each first compile a run logged: code is ``forward`` (a block)
    or the loss function's name."""
    return [(m[1], m[2], int(m[3])) for m in COMPILED.finditer(log)]


def test_a_planted_shape_change_is_warned_with_the_step_and_dynamos_reason(caplog):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(name="test", vocab_size=VOCAB, dim=32, n_layer=2, n_head=4, n_kv_heads=2,
                                    multiple_of=16, max_seq_len=64))
    module = LMModule(model, optimizer=partial(torch.optim.AdamW, lr=1e-3))
    # what configure_model does under module.compile=true, with Dynamo's eager backend (tracing and
    # guards without Inductor's code generation: milliseconds on CPU)
    compile_model(model, backend="eager")
    module.compile_watch = CompileWatch().start()
    x = torch.randint(0, VOCAB, (10, 17), generator=torch.Generator().manual_seed(0))
    # the planted fault: 10 windows in batches of 4 keep a short last batch of 2 (drop_last=False)
    loader = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    try:
        with caplog.at_level(logging.INFO, logger="bnlit"), pytest.warns(UserWarning, match=RECOMPILED):
            trainer.fit(module, train_dataloaders=loader)
    finally:
        module.compile_watch.stop()
    first = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "torch.compile" in r.getMessage()]
    # the blocks (configure_model sets the eager loss: module.compile is off here)
    assert compiles("\n".join(first)) == [("forward", "train", 0)]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned  # the short batch trains in step 2 (0-based), reported once
    assert RECOMPILED + " at step 2: forward (bnlit/model.py:" in warned[0] and "[train]" in warned[0], warned
    assert "size mismatch at index 0. expected 4, actual 2" in warned[0], warned[0]
    assert module.compile_watch.summary().startswith("torch.compile: 1 graph (train 1), 1 recompile,")


@pytest.mark.slow
def test_h100_rehearsal_with_validation_checkpoint_probe_and_resume_compiles_once_per_kind(tmp_path, cache_dir):
    from test_rehearsal import run_cli

    run = tmp_path / "h100" / "run"
    out = run_cli(run, "model=tiny", "trainer=h100", "debug=rehearsal")
    assert out.returncode == 0, out.stderr[-4000:]
    first = (run / "train.log").read_text()
    # the run: validation at start (step 0) and after steps 2 and 4, checkpoints at 2 and 4, the
    # parity probe at step 1 (at the training shape: no compile of its own)
    assert "fast-path parity (bf16-mixed, compiled)" in first and (run / "checkpoints" / "step0000002.ckpt").is_file()
    out = run_cli(run, "model=tiny", "trainer=h100", "debug=rehearsal", "ckpt_path=last", "trainer.max_steps=6")
    assert out.returncode == 0, out.stderr[-4000:]
    log = (run / "train.log").read_text()
    resumed = log[len(first):] if log.startswith(first) else log
    assert "step0000006.ckpt" in {p.name for p in (run / "checkpoints").iterdir()}

    # one process: the fresh run validates first (eval graphs at step 0), then trains (train
    # graphs at its first micro-batch, step 0); the resumed one starts training at step 4 and
    # validates after step 6 (no validation at start when resuming)
    expected = [("forward", "eval", 0), ("chunked_loss", "eval", 0), ("forward", "train", 0), ("chunked_loss", "train", 0)]
    assert compiles(first) == expected, [l for l in first.splitlines() if "torch.compile" in l]
    assert compiles(resumed) == [("forward", "train", 4), ("chunked_loss", "train", 4),
                                 ("forward", "eval", 6), ("chunked_loss", "eval", 6)], \
        [l for l in resumed.splitlines() if "torch.compile" in l]
    for part in (first, resumed):
        assert RECOMPILED not in part
        assert "torch.compile: 4 graphs (train 2, eval 2), 0 recompiles" in part
    summary = (run / "summary.md").read_text()
    assert "torch.compile: 4 graphs (train 2, eval 2), 0 recompiles" in summary


class SecondThread(L.Callback):
    """What callbacks.threads does when the load drops: one more torch thread from step 1 on."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 1:
            torch.set_num_threads(torch.get_num_threads() + 1)


def test_a_recompile_for_a_new_thread_count_is_logged_not_warned(caplog, recwarn):
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    model = Transformer(ModelConfig(name="test", vocab_size=VOCAB, dim=32, n_layer=2, n_head=4, n_kv_heads=2,
                                    multiple_of=16, max_seq_len=64))
    module = LMModule(model, optimizer=partial(torch.optim.AdamW, lr=1e-3))
    compile_model(model)  # Inductor: its CPU code, unlike the eager backend's, depends on the thread count
    module.compile_watch = CompileWatch().start()
    x = torch.randint(0, VOCAB, (8, 17), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[SecondThread()],
                        val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0)
    try:
        with caplog.at_level(logging.INFO, logger="bnlit"):
            # the eval graphs compile at the start count (bnlit.train validates before the first step),
            # again after the change: Dynamo's reason for that one names grad_mode, not num_threads
            trainer.validate(module, loader, verbose=False)
            trainer.fit(module, train_dataloaders=loader, val_dataloaders=loader)
    finally:
        module.compile_watch.stop()
        torch.set_num_threads(threads)
    assert not [w for w in recwarn if RECOMPILED in str(w.message)]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "torch.compile" in r.getMessage()]
    lines = [r.getMessage() for r in caplog.records if "for the new thread count" in r.getMessage()]
    assert any("[train]" in line and "num_threads" in line and "at step 1" in line for line in lines), lines
    assert any("[eval]" in line for line in lines), lines
    assert "(2 for a new thread count)" in module.compile_watch.summary(), module.compile_watch.summary()

"""Compile ahead: a CPU run's training graph is compiled by a child process while this one builds
the data and validates.

From a cold cache a default CPU run (``python -m bnlit.train``, ~5 minutes) spends ~30 s
compiling: Inductor's one-time set-up (its vector-ISA probe, its compile workers), the evaluation
graph of the first validation, then the training graph and its backward. Until its first step
this process uses one core for the data build, and then compiles the evaluation graph on one core.
So :func:`start` launches ``python -m bnlit.speed.compile_ahead`` on the other core with the run's
resolved config and thread count: it builds the same :class:`bnlit.module.LMModule`, configures it
under the run's Lightning precision and runs one training forward and backward on random windows
of the run's batch shape. That runs Inductor's ISA probe (whose programs land in its cache, where
this process's probe finds them) and writes the training graph and its backward to Inductor's
on-disk caches (the FX graph and AOTAutograd caches, keyed by the graph, shapes, dtypes, thread
count and config), so this run's own compile of them is a cache load.

The module waits for the child before its first training step (:func:`wait`, bounded by
``WAIT_S``). A child that fails, is killed or runs past the bound costs nothing but the compile
the run then does itself, with one log line saying so. The child ends when its parent does.
Measured side by side in docs/throughput.md ("Compiling ahead").
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import torch

log = logging.getLogger("bnlit")

WAIT_S = 180.0  # the longest a run waits for the child (a cold compile of the default model: ~15 s)

_child: subprocess.Popen | None = None


def wanted(cfg) -> bool:
    """Whether the run ``cfg`` (``compile_ahead: true``) compiles on CPU in one process, the case
    compiling ahead serves (a GPU's compile of the default model is seconds; the ranks of a
    multi-process run each compile the same graphs anyway)."""
    trainer = cfg.trainer
    return (bool(cfg.get("compile_ahead")) and bool(cfg.module.get("compile")) and str(trainer.get("accelerator")) == "cpu"
            and str(trainer.get("devices", 1)) == "1" and int(trainer.get("num_nodes", 1)) == 1)


def start(cfg) -> subprocess.Popen:
    """Launch the child for the run ``cfg`` (resolved, sent on its stdin) at this process's torch
    thread count, and start Inductor's compile workers here too (their pool is per process)."""
    from omegaconf import OmegaConf
    from torch._inductor.async_compile import AsyncCompile

    global _child

    def resolved(node):
        return OmegaConf.to_container(node, resolve=True)  # in the run's config, where its interpolations point

    spec = OmegaConf.to_yaml({"model": resolved(cfg.model), "module": resolved(cfg.module),
                              "optimizer": resolved(cfg.optimizer), "precision": cfg.trainer.precision,
                              "batch_size": cfg.data.batch_size, "seq_len": cfg.data.seq_len})
    _child = subprocess.Popen([sys.executable, "-m", "bnlit.speed.compile_ahead", str(torch.get_num_threads()),
                               str(os.getpid())], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, text=True)
    _child.stdin.write(spec)
    _child.stdin.close()
    AsyncCompile.warm_pool()
    AsyncCompile.wakeup()
    return _child


def wait(timeout: float = WAIT_S) -> bool:
    """Block until the child has compiled the training graph; True if it has. No child (or one
    already waited for): returns at once."""
    global _child
    if _child is None:
        return False
    child, _child = _child, None
    began = time.perf_counter()
    try:
        code = child.wait(timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        log.info("compile ahead: no training graph after %.0f s; compiling it in this process", timeout)
        return False
    if code != 0:
        log.info("compile ahead: the child exited with code %s; compiling the training graph in this process", code)
        return False
    log.info("compile ahead: training graph ready (waited %.1f s)", time.perf_counter() - began)
    return True


def _exit_with(parent: int) -> None:
    """In the child: end when the run does (its parent pid changes when it exits)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def random_windows(batch_size: int, seq_len: int, vocab_size: int, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` of the run's shape and dtype, with document boundaries in it (the mask's values
    do not change the graph, its shape and dtype do)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(eos_id + 1, vocab_size, (batch_size, seq_len + 1), generator=g)
    ids[:, ::37] = eos_id
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def compile_training_graph(spec) -> None:
    """In the child: the run's module, configured as the run configures it, then one training
    forward and backward under the run's precision."""
    import lightning as L
    from hydra.utils import instantiate

    from bnlit.tokenizer import EOS_ID

    model = instantiate(spec.model)
    module = instantiate(spec.module)(model=model, optimizer=instantiate(spec.optimizer))
    trainer = L.Trainer(accelerator="cpu", devices=1, precision=spec.precision, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module.trainer = trainer
    module.configure_model()
    x, y = random_windows(spec.batch_size, spec.seq_len, model.config.vocab_size, EOS_ID)
    module.train()
    with trainer.precision_plugin.forward_context():
        loss = module.loss_for_batch((x, y))
    loss.backward()


def main() -> None:
    from omegaconf import OmegaConf
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    threads, parent = int(sys.argv[1]), int(sys.argv[2])
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    torch.set_num_threads(threads)
    spec = OmegaConf.create(sys.stdin.read())
    pick_vec_isa()  # first: the run's own evaluation compile, after its data build, finds the probe's programs
    compile_training_graph(spec)


if __name__ == "__main__":
    main()

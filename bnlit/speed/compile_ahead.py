"""Compile ahead: a CPU run's graphs are compiled by a child process while this one builds the
data.

From a cold cache a default CPU run (``python -m bnlit.train``, ~5 minutes) spends ~30 s
compiling: Inductor's one-time set-up (its vector-ISA probe, its compile workers), the evaluation
graph of the first validation, then the training graph and its backward. Until its first
validation this process uses one core, for the data build. So :func:`start` launches
``python -m bnlit.speed.compile_ahead`` on the other core with the run's resolved config and
thread count: it builds the same :class:`bnlit.module.LMModule`, configures it under the run's
Lightning precision and runs, on random windows of the run's batch shape, one evaluation forward
(eval mode, no_grad: a validation's), when the run validates before its first step, and one
training forward and backward. That runs Inductor's ISA probe (whose programs land in its cache,
where this process's probe finds them) and writes the graphs to Inductor's on-disk caches (the FX
graph and AOTAutograd caches, keyed by the graph, shapes, dtypes, thread count and config), so
this run's own compiles of them are cache loads. The child prints each stage's name (``STAGES``)
on its stdout when that graph is in the cache.

The module waits for a stage before the first forward that needs it (:func:`wait`: the
evaluation graph at the first validation, the training graph at the first step), bounded by
``WAIT_S``. A child that fails, is killed or runs past the bound costs nothing but the compiles
the run then does itself, with one log line saying so. The child ends when its parent does.
Measured side by side in docs/throughput.md ("Compiling ahead").
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import threading
import time

import torch

log = logging.getLogger("bnlit")

WAIT_S = 180.0  # the longest a run waits for the child (a cold compile of the default model: ~25 s)
STAGES = ("eval", "train")  # what the child compiles: a validation's forward, a training step


_child: subprocess.Popen | None = None
_ready: set[str] = set()  # the stages the child has reported
_expected: tuple[str, ...] = ()  # the stages it compiles, in order


def wanted(cfg) -> bool:
    """Whether the run ``cfg`` (``compile_ahead: true``) compiles on CPU in one process, the case
    compiling ahead serves (a GPU's compile of the default model is seconds; the ranks of a
    multi-process run each compile the same graphs anyway)."""
    trainer = cfg.trainer
    return (bool(cfg.get("compile_ahead")) and bool(cfg.module.get("compile")) and str(trainer.get("accelerator")) == "cpu"
            and str(trainer.get("devices", 1)) == "1" and int(trainer.get("num_nodes", 1)) == 1)


def start(cfg) -> subprocess.Popen:
    """Launch the child for the run ``cfg`` (resolved, sent on its stdin) at this process's torch
    thread count, and start Inductor's compile workers here too (their pool is per process). The
    child compiles the evaluation graph, first, only when the run validates before its first step."""
    from omegaconf import OmegaConf
    from torch._inductor.async_compile import AsyncCompile

    global _child, _ready, _expected

    def resolved(node):
        return OmegaConf.to_container(node, resolve=True)  # in the run's config, where its interpolations point

    # the evaluation graph only for a run that validates before its first step: compiled after the
    # training graph, the child's evaluation graph is not the one the run looks up (measured: the
    # run compiles it again), so a run that trains first compiles it itself, as before
    validates_first = bool(cfg.get("validate_at_start")) and cfg.get("ckpt_path") is None
    stages = STAGES if validates_first else ("train",)
    spec = OmegaConf.to_yaml({"model": resolved(cfg.model), "module": resolved(cfg.module),
                              "optimizer": resolved(cfg.optimizer), "precision": cfg.trainer.precision,
                              "batch_size": cfg.data.batch_size, "seq_len": cfg.data.seq_len,
                              "stages": list(stages)})
    proc = subprocess.Popen([sys.executable, "-m", "bnlit.speed.compile_ahead", str(torch.get_num_threads()),
                             str(os.getpid())], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, bufsize=0)
    proc.stdin.write(spec.encode())
    proc.stdin.close()
    _child, _ready, _expected = proc, set(), stages
    AsyncCompile.warm_pool()
    AsyncCompile.wakeup()
    return proc


def wait(stage: str = "train", timeout: float = WAIT_S) -> bool:
    """Block until the child has the graph of ``stage`` (one of ``STAGES``) in the cache; True if
    it has. A child that ends without it or runs past ``timeout`` is said in one line, and a later
    call for a stage it did not report returns False at once, as it does with no child."""
    global _child
    child = _child
    if stage in _ready or child is None or stage not in _expected:
        return stage in _ready
    began = time.perf_counter()
    while stage not in _ready:
        left = began + timeout - time.perf_counter()
        # unbuffered reads: a line already read into a buffer would wait out the bound in select
        out = os.read(child.stdout.fileno(), 4096) if left > 0 and select.select([child.stdout], [], [], left)[0] else None
        if not out:  # past the bound, or the child ended before reporting the stage
            if out is None:
                child.kill()
            code = child.wait()
            _child = None
            why = f"no {stage} graph after {timeout:.0f} s" if out is None else f"the child exited with code {code}"
            log.info("compile ahead: %s; compiling the remaining graphs in this process", why)
            return False
        _ready.update(out.decode().split())
    log.info("compile ahead: %s graph ready (waited %.1f s)", stage, time.perf_counter() - began)
    if _ready.issuperset(_expected):
        child.wait()
        _child = None
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


def compile_graphs(spec) -> None:
    """In the child: the run's module, configured as the run configures it, then one forward of
    each stage of ``spec.stages``, in order, under the run's precision, each reported on stdout."""
    import lightning as L
    from hydra.utils import instantiate

    from bnlit.tokenizer import EOS_ID

    model = instantiate(spec.model)
    module = instantiate(spec.module)(model=model, optimizer=instantiate(spec.optimizer))
    trainer = L.Trainer(accelerator="cpu", devices=1, precision=spec.precision, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module.trainer = trainer
    module.configure_model()
    batch = random_windows(spec.batch_size, spec.seq_len, model.config.vocab_size, EOS_ID)
    for stage in spec.stages:
        if stage == "eval":  # as the run validates: eval mode, no_grad (conf/trainer: inference_mode false)
            module.eval()
            with torch.no_grad(), trainer.precision_plugin.forward_context():
                module.loss_for_batch(batch)
        else:
            module.train()
            with trainer.precision_plugin.forward_context():
                loss = module.loss_for_batch(batch)
            loss.backward()
        print(stage, flush=True)


def main() -> None:
    from omegaconf import OmegaConf
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    threads, parent = int(sys.argv[1]), int(sys.argv[2])
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    torch.set_num_threads(threads)
    spec = OmegaConf.create(sys.stdin.read())
    pick_vec_isa()  # first: Inductor's one-time probe, whose programs every later compile here and in the run finds
    compile_graphs(spec)


if __name__ == "__main__":
    main()

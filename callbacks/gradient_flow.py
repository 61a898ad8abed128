"""``GradientFlowArbiter``: turn a parameter that silently stops learning into a named error.

A thin adapter over :mod:`bnlit.gradient_flow`. At fit start it checks param-group membership; at the
first optimizer step and then every ``every_n_steps`` it checks the gradients (in
``on_before_optimizer_step``: after the last micro-batch of an accumulated step, after AMP
unscaling, before clipping), compares the fast path with an eager fp32 copy on the step's batch,
snapshots the parameters and checks after the step that each one changed. Every check reaches one
verdict on all ranks (an all-reduce), so under DDP/FSDP all ranks fail together instead of one
rank raising while the others wait in the next collective.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection

from bnlit.errors import BnlitError
from bnlit.gradient_flow import (
    fast_path_parity,
    gradient_flow_report,
    param_group_report,
    snapshot_parameters,
    total_grad_norm,
    update_flow_report,
)
from bnlit.module import next_token_loss
from bnlit.reporting import write_json_atomic

log = logging.getLogger("bnlit")

REPORT_NAME = "gradient_flow.json"
MAX_DEFERRED = 10  # consecutive fp16 overflow steps tolerated before non-finite gradients fail


class GradientFlowError(BnlitError):
    """A trainable parameter gets no gradient, a non-finite or all-zero one, no update, or a fast
    path gradient that disagrees with the eager fp32 reference."""


def lm_probe_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    """The training loss of :class:`bnlit.module.LMModule` on an ``(x, y)`` batch."""
    x, y = batch
    return next_token_loss(model(x), y)


def checkpoint_dir(trainer: L.Trainer) -> Path:
    """Where the checkpoints go: the ModelCheckpoint's dirpath, else ``<root>/checkpoints``."""
    cb = trainer.checkpoint_callback
    dirpath = getattr(cb, "dirpath", None)
    return Path(dirpath) if dirpath else Path(trainer.default_root_dir) / "checkpoints"


def _is_sharded(trainer: L.Trainer) -> bool:
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    return isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy))


class GradientFlowArbiter(Callback):
    """Args:
    every_n_steps: check at optimizer step 1 and then every this many steps. The default keeps
        the overhead at or below 1% of step time on CPU (figures in the README).
    on_fail: ``"raise"`` a :class:`GradientFlowError` (after writing the report) or ``"warn"``.
    check_updates: snapshot the parameters on check steps and verify the optimizer changed each.
    fast_path_parity: compare the configured fast path (precision plugin's autocast, compiled
        model, fused kernels) with an eager fp32 copy on the first check step's batch.
    parity_every_n_steps: repeat the parity check this often (None: first check only; it costs
        two extra forward/backward passes and a copy of the model).
    min_cosine, max_rel_norm_error: per-parameter parity tolerances.
    probe_samples: the parity probe uses the first this many sequences of the step's batch.
    log_param_norms: log ``grad/<parameter>`` norms on check steps (``grad/norm`` is logged on
        every logging step either way).
    probe_loss: ``loss(model, batch) -> scalar`` for parity; default: next-token loss of
        ``pl_module.model`` on an ``(x, y)`` batch.
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        on_fail: Literal["raise", "warn"] = "raise",
        check_updates: bool = True,
        fast_path_parity: bool = True,
        parity_every_n_steps: int | None = None,
        min_cosine: float = 0.99,
        max_rel_norm_error: float = 0.05,
        probe_samples: int = 4,
        log_param_norms: bool = True,
        probe_loss=None,
    ):
        if every_n_steps < 1:
            raise ValueError(f"callbacks.gradient_flow.every_n_steps={every_n_steps}: must be >= 1")
        if on_fail not in ("raise", "warn"):
            raise ValueError(f"callbacks.gradient_flow.on_fail={on_fail!r}: use 'raise' or 'warn'")
        if parity_every_n_steps is not None and parity_every_n_steps < 1:
            raise ValueError(f"callbacks.gradient_flow.parity_every_n_steps={parity_every_n_steps}: must be >= 1 or null")
        self.every_n_steps = every_n_steps
        self.on_fail = on_fail
        self.check_updates = check_updates
        self.fast_path_parity = fast_path_parity
        self.parity_every_n_steps = parity_every_n_steps
        self.min_cosine = min_cosine
        self.max_rel_norm_error = max_rel_norm_error
        self.probe_samples = probe_samples
        self.log_param_norms = log_param_norms
        self.probe_loss = probe_loss or lm_probe_loss
        self.checks = 0  # gradient checks run in this fit
        self.last_report: dict[str, Any] | None = None
        self._batch = None
        self._snapshot = None
        self._spare = None
        self._snapshot_step = -1
        self._checked_step = -1
        self._parity_done = False
        self._deferred = 0
        self._payload: dict[str, Any] = {}
        self._parity_report: dict[str, Any] | None = None  # the latest, carried into every report

    # -- helpers -------------------------------------------------------------------------------

    def _reduce(self, trainer: L.Trainer):
        if trainer.world_size <= 1:
            return None
        return lambda t, op: trainer.strategy.reduce(t, reduce_op=op)

    def _is_check_step(self, step: int) -> bool:
        # the first step of every fit (a resumed one too), a deferred check, then the cadence
        return self.checks == 0 or self._deferred > 0 or step % self.every_n_steps == 0

    def _parity_due(self, trainer: L.Trainer, step: int) -> bool:
        if not self.fast_path_parity or _is_sharded(trainer):
            return False  # FSDP: the eager reference would need the whole unsharded model
        if not self._parity_done:
            return True
        return self.parity_every_n_steps is not None and step % self.parity_every_n_steps == 0

    def _fail(self, trainer: L.Trainer, step: int, check: str, problems: dict[str, str], payload: dict) -> None:
        path = checkpoint_dir(trainer) / REPORT_NAME
        payload = {"step": step, "check": check, "ok": False, "problems": problems, **payload}
        self.last_report = payload
        if trainer.is_global_zero:
            write_json_atomic(path, payload)
        lines = "; ".join(f"{name}: {why}" for name, why in problems.items())
        message = (f"{check} failed at step {step} for {len(problems)} parameter(s): {lines}. "
                   f"Full report: {path}")
        if self.on_fail == "raise":
            raise GradientFlowError(message)
        rank_zero_warn(message)

    def _save(self, trainer: L.Trainer, payload: dict) -> None:
        self.last_report = payload
        if trainer.is_global_zero:
            write_json_atomic(checkpoint_dir(trainer) / REPORT_NAME, payload)

    def _log_metrics(self, trainer: L.Trainer, metrics: dict[str, float]) -> None:
        # check steps need not be logging steps: write straight to the loggers
        if trainer.is_global_zero and metrics:
            for lg in trainer.loggers:
                lg.log_metrics(metrics, step=trainer.global_step)

    # -- hooks ---------------------------------------------------------------------------------

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.checks, self._parity_done, self._checked_step, self._deferred = 0, False, -1, 0
        report = param_group_report(pl_module.named_parameters(), trainer.optimizers)
        reduce = self._reduce(trainer)
        if reduce is not None:
            bad = reduce(torch.tensor([0.0 if report.ok else 1.0], device=pl_module.device), "sum").item()
            if bad > 0 and report.ok:
                # another rank's optimizer is mis-built: stop here too, so no rank waits for it
                self._fail(trainer, trainer.global_step, "param-group check",
                           {"(all parameters)": f"the optimizer is mis-built on {int(bad)} other rank(s)"}, {})
        if not report.ok:
            self._fail(trainer, trainer.global_step, "param-group check", report.problems(),
                       {"param_groups": report.to_dict()})

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if self.fast_path_parity and (not self._parity_done or self.parity_every_n_steps):
            self._batch = batch  # a reference, for the parity probe of the coming optimizer step

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        step = trainer.global_step + 1  # the optimizer step about to be taken, 1-based
        if step == self._checked_step:
            return  # a second optimizer of the same step
        if getattr(trainer._logger_connector, "should_update_logs", False):
            norm = total_grad_norm(pl_module.named_parameters())
            if norm is not None:
                pl_module.log("grad/norm", norm, on_step=True, on_epoch=False)
        if not self._is_check_step(step):
            return
        self._checked_step = step
        reduce, sharded, world = self._reduce(trainer), _is_sharded(trainer), trainer.world_size
        report = gradient_flow_report(pl_module.named_parameters(), reduce=reduce, sharded=sharded, world_size=world)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if report.nonfinite and scaler is not None and self._deferred < MAX_DEFERRED:
            # fp16 loss scaling: the GradScaler skips this step and lowers the scale; not (yet) a fault
            self._deferred += 1
            log.warning("gradient flow: non-finite fp16 gradients at step %d (loss-scale overflow %d/%d); the "
                        "scaler skips this step, checking again at step %d", step, self._deferred, MAX_DEFERRED, step + 1)
            return
        self._deferred = 0
        self.checks += 1
        payload: dict[str, Any] = {"step": step, "gradients": report.to_dict()}
        if self.log_param_norms:
            metrics = {f"grad/{n}": v for n, v in report.norms.items() if math.isfinite(v)}
            self._log_metrics(trainer, metrics)
        problems = report.problems()
        if self.checks == 1 and trainer.is_global_zero:
            log.info("gradient flow: %d/%d parameters ok at step %d (grad norm %.4g)",
                     report.num_ok, len(report.names), step, report.total_norm)
        if self._parity_due(trainer, step) and self._batch is not None:
            parity = self._parity(trainer, pl_module, reduce)
            self._parity_report = {"step": step, "precision": str(trainer.precision), **parity.to_dict()}
            self._log_metrics(trainer, {"grad/parity_min_cosine": parity.worst_cosine,
                                        "grad/parity_max_rel_norm_error": parity.worst_rel_norm_error})
            if trainer.is_global_zero:
                log.info("fast-path parity (%s%s): %d/%d parameters within tolerance (min cosine %.5f, "
                         "max relative norm error %.4f)", trainer.precision,
                         ", compiled" if getattr(pl_module, "compile", False) else "", parity.num_ok,
                         len(parity.names), parity.worst_cosine, parity.worst_rel_norm_error)
            prefix = "model." if hasattr(pl_module, "model") else ""
            problems |= {prefix + n: why for n, why in parity.problems().items() if prefix + n not in problems}
        if self._parity_report is not None:
            payload["fast_path_parity"] = self._parity_report
        self._payload = {**payload, "ok": not problems}
        if problems:
            self._fail(trainer, step, "gradient-flow check", problems, payload)
        else:
            self._save(trainer, self._payload)
        if self.check_updates:
            self._snapshot = snapshot_parameters(pl_module.named_parameters(), trainer.optimizers, reuse=self._spare)
            self._snapshot_step = step

    def _parity(self, trainer: L.Trainer, pl_module: L.LightningModule, reduce):
        self._parity_done = True
        model = getattr(pl_module, "model", pl_module)
        was_training = model.training
        try:
            probe = apply_to_collection(self._batch, torch.Tensor, lambda t: t[: self.probe_samples])
            return fast_path_parity(
                model, probe, self.probe_loss, fast_context=trainer.precision_plugin.forward_context(),
                min_cosine=self.min_cosine, max_rel_norm_error=self.max_rel_norm_error, reduce=reduce,
            )
        finally:
            model.train(was_training)
            self._batch = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        if self._snapshot is None or trainer.global_step < self._snapshot_step:
            return  # still accumulating micro-batches of the snapshot's step
        snapshot, step, self._snapshot = self._snapshot, self._snapshot_step, None
        self._spare = snapshot  # its buffers are refilled at the next check
        report = update_flow_report(snapshot, pl_module.named_parameters(), reduce=self._reduce(trainer),
                                    sharded=_is_sharded(trainer), world_size=trainer.world_size)
        payload = {**self._payload, "updates": report.to_dict()}
        payload["ok"] = payload["ok"] and report.ok
        if self.checks == 1 and trainer.is_global_zero:
            skipped = f", {len(report.skipped)} skipped (lr 0 by schedule)" if report.skipped else ""
            log.info("update flow: %d/%d parameters updated at step %d%s", report.num_ok, len(report.names),
                     step, skipped)
        if not report.ok:
            self._fail(trainer, step, "update-flow check", report.problems(), payload)
        else:
            self._save(trainer, payload)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._snapshot, self._spare, self._batch = None, None, None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._snapshot, self._spare, self._batch = None, None, None


# -- overhead measurement ---------------------------------------------------------------------------


class _StepTimer(Callback):
    """Wall time between consecutive ``on_train_batch_end`` calls (one optimizer step each)."""

    def __init__(self):
        self.times: list[float] = []  # times[i] is optimizer step i + 1
        self._last: float | None = None

    def on_train_start(self, trainer, pl_module):
        import time

        self._last = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import time

        now = time.perf_counter()
        self.times.append(now - self._last)
        self._last = now


def measure_overhead(
    preset: str = "tiny", steps: int = 101, cadences: tuple[int | None, ...] = (None, 50, 1), repeats: int = 2,
    batch_size: int = 16, seq_len: int = 256, threads: int | None = None, seed: int = 0,
) -> dict[str, Any]:
    """Mean optimizer-step time of a CPU fit of ``conf/model/<preset>.yaml`` on random tokens
    without the arbiter (``None``) and with it at each cadence, runs alternating ``repeats``
    times. Step 1 (membership, first check and the one-time parity probe) is reported apart;
    the steady-state mean covers steps 2..``steps``, check steps included."""
    from functools import partial
    from statistics import mean, median

    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from torch.utils.data import DataLoader, TensorDataset

    from bnlit import CONF_DIR
    from bnlit.module import LMModule

    if threads:
        torch.set_num_threads(threads)
    preset_cfg = OmegaConf.load(CONF_DIR / "model" / f"{preset}.yaml")
    n_tokens = batch_size * (seq_len + 1) * steps
    data = torch.randint(0, preset_cfg.model.config.vocab_size, (n_tokens,), generator=torch.Generator().manual_seed(seed))
    data = data.view(batch_size * steps, seq_len + 1)
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=batch_size)
    times: dict[str, list[float]] = {}
    first: dict[str, list[float]] = {}
    check_cost: dict[str, list[float]] = {}
    for _ in range(repeats):
        for cadence in cadences:
            torch.manual_seed(seed)
            model = instantiate(preset_cfg.model)
            module = LMModule(model, optimizer=partial(torch.optim.AdamW, lr=float(preset_cfg.optimizer.lr),
                                                       weight_decay=0.1, betas=(0.9, 0.95)))
            timer = _StepTimer()
            cbs = [] if cadence is None else [GradientFlowArbiter(every_n_steps=cadence)]
            trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                gradient_clip_val=1.0, callbacks=[*cbs, timer], default_root_dir="/tmp/bnlit_gradflow_bench")
            logging.getLogger("bnlit").setLevel(logging.WARNING)
            trainer.fit(module, train_dataloaders=loader)
            key = "off" if cadence is None else f"every_{cadence}"
            first.setdefault(key, []).append(timer.times[0])
            times.setdefault(key, []).append(mean(timer.times[1:]))
            if cadence is not None and cadence > 1:  # paired within the run: check steps vs the others
                checked = [t for i, t in enumerate(timer.times[1:], 2) if i % cadence == 0]
                others = [t for i, t in enumerate(timer.times[1:], 2) if i % cadence != 0]
                check_cost.setdefault(key, []).append(mean(checked) - median(others))
    base, base_first = mean(times["off"]), mean(first["off"])
    out: dict[str, Any] = {"preset": preset, "steps": steps, "batch_size": batch_size, "seq_len": seq_len,
                           "threads": torch.get_num_threads(), "repeats": repeats,
                           "step_s": {k: mean(v) for k, v in times.items()},
                           "step_s_runs": times, "first_step_s": {k: mean(v) for k, v in first.items()}}
    out["overhead"] = {k: mean(v) / base - 1.0 for k, v in times.items() if k != "off"}
    out["first_step_extra_s"] = {k: mean(v) - base_first for k, v in first.items() if k != "off"}
    # one check's cost spread over its cadence: the overhead estimate least sensitive to machine noise
    out["check_s"] = {k: mean(v) for k, v in check_cost.items()}
    out["overhead_from_check_cost"] = {k: mean(v) / (int(k.split("_")[1]) * base) for k, v in check_cost.items()}
    return out


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Step-time overhead of GradientFlowArbiter (CPU, one process)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=101)
    ap.add_argument("--cadences", default="50,1", help="comma-separated every_n_steps values to time")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    result = measure_overhead(args.preset, args.steps, (None, *map(int, args.cadences.split(","))), args.repeats,
                              args.batch_size, args.seq_len, args.threads)
    import json

    print(json.dumps(result, indent=2))
    for k, v in result["overhead"].items():
        line = (f"{args.preset}: {k}: {100 * v:+.2f}% mean step time (off {result['step_s']['off'] * 1e3:.1f} ms, "
                f"with {result['step_s'][k] * 1e3:.1f} ms); first step +{result['first_step_extra_s'][k]:.3f} s")
        if k in result["check_s"]:
            line += (f"; one check {result['check_s'][k] * 1e3:.1f} ms = "
                     f"{100 * result['overhead_from_check_cost'][k]:.2f}% at this cadence")
        print(line)

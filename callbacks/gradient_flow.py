"""``GradientFlowArbiter``: turn a parameter that silently stops learning into a named error.

A thin adapter over :mod:`bnlit.checks.gradient_flow` (the checks, their settings and the report;
its docstring lists what each check finds). At fit start it checks optimizer membership. Every
optimizer step (``on_before_optimizer_step``: after the last micro-batch, after AMP unscaling,
before clipping) the sentinel takes one fused norm pass, read every step on CPU and on logging
steps on CUDA (the only host sync). At the first step, every ``every_n_steps``, the last step and
at once when the sentinel trips, the full check runs: gradients, membership, the fast path against
the eager fp32 reference (first check) and, after the step, that each parameter changed. Every
verdict is all-reduced, so under DDP/FSDP all ranks fail together.
``<checkpoint dir>/gradient_flow.json`` is written only when a check fails."""

from __future__ import annotations

import collections
import logging
import math
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from bnlit.checks import gradient_flow as gf
from bnlit.checkpointing import trainer_checkpoint_dir
from bnlit.strategy import sharded_strategy
from bnlit.loggers import log_metrics, write_json_atomic

GradientFlowError = gf.GradientFlowError  # raised here, defined with the checks
__all__ = ["GradientFlowArbiter", "GradientFlowError"]
log = logging.getLogger("bnlit")


def _found_inf(trainer: L.Trainer) -> torch.Tensor | None:
    """The NaN guard's on-device skip flag handed to a fused optimizer, if any."""
    return next((f for o in trainer.optimizers if (f := getattr(o, "found_inf", None)) is not None), None)


class GradientFlowArbiter(Callback):
    """Args: those of :class:`bnlit.checks.gradient_flow.ArbiterSettings`, kept as ``self.settings``; the
    per-step bookkeeping (what is due, counters) is ``self.state``, a :class:`bnlit.checks.gradient_flow.ArbiterState`."""

    def __init__(self, **settings: Any):
        self.settings = gf.ArbiterSettings(**settings)
        self.state = gf.ArbiterState(self.settings)
        self.last_report: dict[str, Any] | None = None
        self._batches: collections.deque = collections.deque(maxlen=64)  # this step's micro-batches
        self._grouped: list[tuple[str, torch.Tensor]] = []
        self._snapshot = self._spare = None
        self._snapshot_step = -1
        self._payload: dict[str, Any] = {}
        self._parity_report: dict[str, Any] | None = None  # the latest, carried into every report

    def _reduce(self, trainer: L.Trainer):
        if trainer.world_size <= 1:
            return None
        return lambda t, op: trainer.strategy.reduce(t, reduce_op=op)

    def _fail(self, trainer: L.Trainer, step: int, check: str, findings: list[dict], payload: dict) -> None:
        path = trainer_checkpoint_dir(trainer) / gf.REPORT_NAME
        self.last_report, message = gf.failure_report(check, step, findings, payload, path)
        if trainer.is_global_zero:
            write_json_atomic(path, self.last_report)
        if self.settings.on_fail == "raise":
            raise GradientFlowError(message)
        rank_zero_warn(message)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.state = gf.ArbiterState(self.settings, sharded=sharded_strategy(trainer.strategy))
        self._batches.clear()
        ids = {id(p) for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]}
        self._grouped = [(n, p) for n, p in pl_module.named_parameters() if id(p) in ids]
        if self.settings.fast_path_parity and self.state.sharded and trainer.is_global_zero:
            log.info("fast-path parity: skipped under FSDP/HSDP, its parameters are cast inside FSDP2's hooks "
                     "(no eager fp32 reference; see docs/gradient-flow.md, 'Under FSDP and HSDP')")
        elif self.settings.fast_path_parity and not callable(getattr(pl_module, gf.PROBE_HOOK, None)) \
                and trainer.is_global_zero:
            log.info("fast-path parity: skipped, %s has no %s(batch) -> loss hook "
                     "(see docs/gradient-flow.md)", type(pl_module).__name__, gf.PROBE_HOOK)
        findings, payload = gf.membership_verdict(pl_module.named_parameters(), trainer.optimizers, self.settings.allow,
                                                  self._reduce(trainer), pl_module.device)
        if findings:
            self._fail(trainer, trainer.global_step, "param-group check", findings, payload)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self._batches.append(batch)  # a reference: the probe batch, and the tokens present (dead rows)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        step = trainer.global_step + 1  # the optimizer step about to be taken, 1-based
        if not self.state.new_step(step):
            return  # a second optimizer of the same step
        try:
            self._on_step(trainer, pl_module, step)
        finally:
            self._batches.clear()

    def _on_step(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        due = self.state.due(step, trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None)
        if all(p.grad is None for _, p in gf.unique_trainable(pl_module.named_parameters())[0]):
            return self.state.skip(due)  # a loss with no graph fails in backward instead
        if self.state.run_check(due, self._sentinel_step(trainer, pl_module, step)):
            self._full_check(trainer, pl_module, step, self._reduce(trainer))

    def _sentinel_step(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> bool:
        """The every-step pass: logs ``grad/norm`` on logging steps; True when it trips."""
        t0, sentinel, state = time.perf_counter(), self.settings.sentinel, self.state
        logging_step = step % max(1, trainer.log_every_n_steps) == 0
        # a step the NaN guard skips on the device (fused AdamW's found_inf) is the guard's to report
        # sharded: one all-reduce of the shards' squared norms, so norms and verdicts are the full parameters'
        reduce = self._reduce(trainer) if state.sharded else None
        norm = state.sentinel.observe(pl_module.named_parameters(), step, _found_inf(trainer), reduce) if sentinel else None
        if logging_step:
            norm = norm if sentinel else gf.total_grad_norm(pl_module.named_parameters(), reduce)
            if norm is not None:
                pl_module.log("grad/norm", norm, on_step=True, on_epoch=False)
        if not sentinel:
            return False
        tripped = state.sentinel_tripped(any(not p.requires_grad for _, p in self._grouped), trainer.world_size == 1,
                                         pl_module.device.type == "cpu" or logging_step, self._reduce(trainer))
        state.sentinel_seconds += time.perf_counter() - t0  # host time (CUDA: launches, not kernels)
        state.sentinel_steps += 1
        return tripped

    def _full_check(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int, reduce) -> None:
        s, state, named = self.settings, self.state, list(pl_module.named_parameters())
        seen = state.sentinel.findings(reduce) if s.sentinel else {}
        state.sentinel.reset()
        report, findings, payload = gf.full_check(
            named, trainer.optimizers, s, gf.embedding_row_exempt(pl_module, list(self._batches)), seen, step,
            reduce=reduce, sharded=state.sharded, world_size=trainer.world_size)
        guard = _found_inf(trainer)
        warning = state.defer(step, bool(report.nonfinite), getattr(trainer.precision_plugin, "scaler", None) is not None,
                              lambda: guard is not None and bool(guard.item()))
        if warning:
            return log.warning("%s", warning)
        state.checks += 1
        state.sentinel.set_weight_norms(report.weight_norms,
                                        [n for n in report.names if gf.allowed(n, s.allow.get("vanishing"))])
        if state.checks == 1 and trainer.is_global_zero:
            log.info("gradient flow: %d/%d parameters ok at step %d (grad norm %.4g)",
                     report.num_ok, len(report.names), step, report.total_norm)
        if state.parity_due(step):
            findings += self._parity(trainer, pl_module, reduce, step)
        if self._parity_report is not None:
            payload["fast_path_parity"] = self._parity_report
        self._payload = {**payload, "ok": not findings}
        if findings:
            self._fail(trainer, step, "gradient-flow check", findings, payload)
        else:
            self.last_report = self._payload
        if s.log_param_norms:
            log_metrics(trainer, {f"grad/{n}": v for n, v in report.norms.items() if math.isfinite(v)})
        if s.check_updates:
            self._snapshot = gf.snapshot_parameters(named, trainer.optimizers, reuse=self._spare)
            self._snapshot_step = step

    def _parity(self, trainer: L.Trainer, pl_module: L.LightningModule, reduce, step: int) -> list[dict]:
        self.state.parity_done = True
        batch = self._batches[-1] if self._batches else None
        self._parity_report, parity = gf.parity_probe(pl_module, batch, self.settings,
                                                      trainer.precision_plugin.forward_context(), reduce, step,
                                                      str(trainer.precision))
        if parity is None:
            if trainer.is_global_zero and batch is not None and callable(getattr(pl_module, gf.PROBE_HOOK, None)):
                log.warning("fast-path parity: probe skipped at step %d, %s.%s raised %s", step,
                            type(pl_module).__name__, gf.PROBE_HOOK, self._parity_report["skipped"])
            return []
        log_metrics(trainer, {"grad/parity_min_cosine": parity.worst_cosine,
                              "grad/parity_max_rel_norm_error": parity.worst_rel_norm_error})
        if trainer.is_global_zero:
            log.info("%s", parity.summary(trainer.precision, getattr(pl_module, "compile", False) is True))
        return parity.findings(step)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        if self._snapshot is None or trainer.global_step < self._snapshot_step:
            return  # still accumulating micro-batches of the snapshot's step
        snapshot, step, self._snapshot = self._snapshot, self._snapshot_step, None
        self._spare = snapshot  # its buffers are refilled at the next check
        report = gf.update_flow_report(snapshot, pl_module.named_parameters(), reduce=self._reduce(trainer),
                                    sharded=self.state.sharded, world_size=trainer.world_size)
        payload = {**self._payload, "updates": report.to_dict()}
        payload["ok"] = payload["ok"] and report.ok
        if self.state.checks == 1 and trainer.is_global_zero:
            skipped = f", {len(report.skipped)} skipped (lr 0 by schedule)" if report.skipped else ""
            log.info("update flow: %d/%d parameters updated at step %d%s", report.num_ok, len(report.names),
                     step, skipped)
        if not report.ok:
            self._fail(trainer, step, "update-flow check", report.findings(step), payload)
        else:
            self.last_report = payload

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._snapshot, self._spare = None, None
        self._batches.clear()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.on_fit_end(trainer, pl_module)

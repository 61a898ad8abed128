"""``GradientFlowArbiter``: turn a parameter that silently stops learning into a named error; a
thin adapter that decides when the checks of :mod:`bnlit.gradient_flow` run (its docstring says
when and why) and fails every rank together."""

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

from bnlit import gradient_flow as gf
from bnlit.checkpointing import sharded_strategy, trainer_checkpoint_dir
from bnlit.run_report import log_metrics, write_json_atomic

GradientFlowError = gf.GradientFlowError  # raised here, defined with the checks
__all__ = ["GradientFlowArbiter", "GradientFlowError"]
log = logging.getLogger("bnlit")


def _found_inf(trainer: L.Trainer) -> torch.Tensor | None:
    """The NaN guard's on-device skip flag handed to a fused optimizer, if any."""
    return next((f for o in trainer.optimizers if (f := getattr(o, "found_inf", None)) is not None), None)


class GradientFlowArbiter(Callback):
    """Args: those of :class:`bnlit.gradient_flow.ArbiterSettings` (every_n_steps, on_fail,
    check_updates, fast_path_parity, parity_every_n_steps, min_cosine, max_rel_norm_error,
    probe_samples, probe_seq_len, log_param_norms, sentinel, vanishing_factor, dead_row_share,
    allow), kept as ``self.settings``."""

    def __init__(self, **settings: Any):
        self.settings = gf.ArbiterSettings(**settings)
        self.checks = 0  # full checks run in this fit
        self.sentinel_trips = 0  # full checks the sentinel asked for
        self.sentinel_seconds, self.sentinel_steps = 0.0, 0  # its own cost, for scripts/bench.py
        self.skipped_steps = 0  # steps with no gradient at all (dropped by the NaN guard): not judged
        self.last_report: dict[str, Any] | None = None
        self._batches: collections.deque = collections.deque(maxlen=64)  # this step's micro-batches
        self._sentinel = gf.GradientSentinel(self.settings.vanishing_factor)
        self._grouped: list[tuple[str, torch.Tensor]] = []
        self._snapshot = self._spare = None
        self._snapshot_step = self._seen_step = -1
        self._parity_done, self._pending, self._deferred = False, False, 0
        self._payload: dict[str, Any] = {}
        self._parity_report: dict[str, Any] | None = None  # the latest, carried into every report

    # -- helpers -------------------------------------------------------------------------------

    def _reduce(self, trainer: L.Trainer):
        if trainer.world_size <= 1:
            return None
        return lambda t, op: trainer.strategy.reduce(t, reduce_op=op)

    def _parity_due(self, trainer: L.Trainer, step: int) -> bool:
        s = self.settings
        if not s.fast_path_parity or sharded_strategy(trainer.strategy):
            return False  # FSDP: the eager reference would need the whole unsharded model
        return not self._parity_done or (s.parity_every_n_steps is not None and step % s.parity_every_n_steps == 0)

    def _fail(self, trainer: L.Trainer, step: int, check: str, findings: list[dict], payload: dict) -> None:
        path = trainer_checkpoint_dir(trainer) / gf.REPORT_NAME
        self.last_report, message = gf.failure_report(check, step, findings, payload, path)
        if trainer.is_global_zero:
            write_json_atomic(path, self.last_report)
        if self.settings.on_fail == "raise":
            raise GradientFlowError(message)
        rank_zero_warn(message)

    # -- hooks ---------------------------------------------------------------------------------

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.checks, self.sentinel_trips, self._parity_done, self._seen_step, self._deferred = 0, 0, False, -1, 0
        self.sentinel_seconds, self.sentinel_steps, self.skipped_steps, self._pending = 0.0, 0, 0, False
        self._sentinel = gf.GradientSentinel(self.settings.vanishing_factor, sharded=sharded_strategy(trainer.strategy))
        self._batches.clear()
        ids = {id(p) for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]}
        self._grouped = [(n, p) for n, p in pl_module.named_parameters() if id(p) in ids]
        if self.settings.fast_path_parity and not callable(getattr(pl_module, gf.PROBE_HOOK, None)) \
                and trainer.is_global_zero:
            log.info("fast-path parity: skipped, %s has no %s(batch) -> loss hook "
                     "(see the README, \"Gradient flow (the arbiter)\")", type(pl_module).__name__, gf.PROBE_HOOK)
        findings, payload = gf.membership_verdict(pl_module.named_parameters(), trainer.optimizers, self.settings.allow,
                                                  self._reduce(trainer), pl_module.device)
        if findings:
            self._fail(trainer, trainer.global_step, "param-group check", findings, payload)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self._batches.append(batch)  # a reference: the probe batch, and the tokens present (dead rows)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        step = trainer.global_step + 1  # the optimizer step about to be taken, 1-based
        if step == self._seen_step:
            return  # a second optimizer of the same step
        self._seen_step = step
        try:
            self._on_step(trainer, pl_module, step)
        finally:
            self._batches.clear()

    def _on_step(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        # due: the first step of every fit (a resumed one too), a deferred check, the cadence, and
        # the run's last step (so the grad/* values a summary calls final are the final step's)
        last = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        due = (self.checks == 0 or self._deferred > 0 or self._pending
               or step % self.settings.every_n_steps == 0 or step == last)
        if all(p.grad is None for _, p in gf.unique_trainable(pl_module.named_parameters())[0]):
            # a step dropped by design (the NaN guard's skip policy sets every .grad to None; a loss
            # with no graph fails in backward instead): nothing to judge, a due check runs next step
            self._pending, self.skipped_steps = self._pending or due, self.skipped_steps + 1
            return
        self._pending = False
        tripped = self._sentinel_step(trainer, pl_module, step)
        if tripped and not due:
            self.sentinel_trips += 1
        if due or tripped:
            self._full_check(trainer, pl_module, step, self._reduce(trainer))

    def _sentinel_step(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> bool:
        """The every-step pass: logs ``grad/norm`` on logging steps; True when it trips."""
        t0, sentinel = time.perf_counter(), self.settings.sentinel
        logging_step = step % max(1, trainer.log_every_n_steps) == 0
        # a step the NaN guard skips on the device (fused AdamW's found_inf) is the guard's to report
        norm = self._sentinel.observe(pl_module.named_parameters(), step, _found_inf(trainer)) if sentinel else None
        if logging_step:
            norm = norm if sentinel else gf.total_grad_norm(pl_module.named_parameters())
            if norm is not None:
                pl_module.log("grad/norm", norm, on_step=True, on_epoch=False)
        if not sentinel:
            return False
        frozen, tripped = any(not p.requires_grad for _, p in self._grouped), False
        if trainer.world_size == 1 and (frozen or self._sentinel.missing):
            tripped = True  # known on the host: no sync needed
        elif pl_module.device.type == "cpu" or logging_step:
            tripped = self._sentinel.tripped(self._reduce(trainer), extra=frozen)
        self.sentinel_seconds += time.perf_counter() - t0  # host time (CUDA: launches, not kernels)
        self.sentinel_steps += 1
        return tripped

    def _defer(self, trainer: L.Trainer, step: int, nonfinite: bool) -> bool:
        """Non-finite gradients that are not (yet) a fault: the NaN guard's on-device skip, or an
        fp16 loss-scale overflow the GradScaler skips (up to ``MAX_DEFERRED`` in a row)."""
        scaler, skipped = getattr(trainer.precision_plugin, "scaler", None), _found_inf(trainer)
        if nonfinite and skipped is not None and scaler is None and bool(skipped.item()):
            log.warning("gradient flow: non-finite gradients at step %d; the NaN guard skips this step", step)
            return True
        if nonfinite and scaler is not None and self._deferred < gf.MAX_DEFERRED:
            self._deferred += 1
            log.warning("gradient flow: non-finite fp16 gradients at step %d (loss-scale overflow %d/%d); the "
                        "scaler skips this step, checking again at step %d", step, self._deferred, gf.MAX_DEFERRED, step + 1)
            return True
        self._deferred = 0
        return False

    def _full_check(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int, reduce) -> None:
        s, named = self.settings, list(pl_module.named_parameters())
        seen = self._sentinel.findings(reduce) if s.sentinel else {}
        self._sentinel.reset()
        report, findings, payload = gf.full_check(
            named, trainer.optimizers, s, gf.embedding_row_exempt(pl_module, list(self._batches)), seen, step,
            reduce=reduce, sharded=sharded_strategy(trainer.strategy), world_size=trainer.world_size)
        if self._defer(trainer, step, bool(report.nonfinite)):
            return
        self.checks += 1
        self._sentinel.set_weight_norms(report.weight_norms,
                                        [n for n in report.names if gf.allowed(n, s.allow.get("vanishing"))])
        if self.checks == 1 and trainer.is_global_zero:
            log.info("gradient flow: %d/%d parameters ok at step %d (grad norm %.4g)",
                     report.num_ok, len(report.names), step, report.total_norm)
        if self._parity_due(trainer, step):
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
        self._parity_done = True
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
            log.info("fast-path parity (%s%s): %d/%d parameters within tolerance (min cosine %.5f, "
                     "max relative norm error %.4f)", trainer.precision,
                     ", compiled" if getattr(pl_module, "compile", False) is True else "", parity.num_ok,
                     len(parity.names), parity.worst_cosine, parity.worst_rel_norm_error)
        return parity.findings(step)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        if self._snapshot is None or trainer.global_step < self._snapshot_step:
            return  # still accumulating micro-batches of the snapshot's step
        snapshot, step, self._snapshot = self._snapshot, self._snapshot_step, None
        self._spare = snapshot  # its buffers are refilled at the next check
        report = gf.update_flow_report(snapshot, pl_module.named_parameters(), reduce=self._reduce(trainer),
                                    sharded=sharded_strategy(trainer.strategy), world_size=trainer.world_size)
        payload = {**self._payload, "updates": report.to_dict()}
        payload["ok"] = payload["ok"] and report.ok
        if self.checks == 1 and trainer.is_global_zero:
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

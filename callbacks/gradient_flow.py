"""``GradientFlowArbiter``: turn a parameter that silently stops learning into a named error.

A thin adapter over :mod:`bnlit.gradient_flow`. At fit start it checks optimizer membership. Every
optimizer step (in ``on_before_optimizer_step``: after the last micro-batch of an accumulated
step, after AMP unscaling, before clipping) the :class:`~bnlit.gradient_flow.GradientSentinel` takes
one fused norm pass over the gradients; it is read every step on CPU and on logging steps on CUDA
(the only host sync). At the first step, every ``every_n_steps`` and at once when the sentinel
trips, the full check runs: gradients (missing, non-finite, zero, vanishing, dead rows),
membership, the fast path against the eager fp32 reference (first check; the module's own loss
through ``pl_module.loss_for_batch(batch)``), and after the step that each parameter changed.
Every check reaches one verdict on all ranks (an all-reduce), so under DDP/FSDP all ranks fail
together instead of one rank raising while the others wait in the next collective. The report,
``<checkpoint dir>/gradient_flow.json``, is written only when a check fails.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from bnlit.errors import BnlitError, ConfigError
from bnlit.gradient_flow import (
    CATEGORIES,
    DEAD_ROW_SHARE,
    VANISHING_FACTOR,
    GradientSentinel,
    allowed,
    embedding_row_exempt,
    fast_path_parity,
    gradient_flow_report,
    param_group_report,
    slice_batch,
    snapshot_parameters,
    total_grad_norm,
    unique_trainable,
    update_flow_report,
)
from bnlit.run_report import log_metrics, write_json_atomic

log = logging.getLogger("bnlit")

REPORT_NAME = "gradient_flow.json"
MAX_DEFERRED = 10  # consecutive fp16 overflow steps tolerated before non-finite gradients fail
PROBE_HOOK = "loss_for_batch"
ALLOW_CATEGORIES = ("vanishing", "dead_rows", "frozen_in_optimizer")


class GradientFlowError(BnlitError):
    """A trainable parameter gets no gradient, a non-finite, all-zero, vanishing or partly dead
    one, no update, sits frozen in an optimizer group, or gets a fast-path gradient that disagrees
    with the eager fp32 reference."""


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
    every_n_steps: the full check at optimizer step 1, then every this many steps, at the run's
        last step (so the final ``grad/*`` values are the final step's), and at once whenever the
        every-step sentinel trips.
    on_fail: ``"raise"`` a :class:`GradientFlowError` (after writing the report) or ``"warn"``.
    check_updates: snapshot the parameters on check steps and verify the optimizer changed each.
    fast_path_parity: compare the configured fast path (precision plugin's autocast, compiled
        model, fused kernels) with the eager fp32 reference on the first check step's batch,
        through ``pl_module.loss_for_batch(batch) -> scalar loss``; a module without that hook
        gets the probe skipped with one log line.
    parity_every_n_steps: repeat the parity check this often (None: first check only; it costs
        two extra forward/backward passes of the probe batch).
    min_cosine, max_rel_norm_error: per-parameter parity tolerances.
    probe_samples: the probe uses the first this many sequences of the step's last micro-batch.
    probe_seq_len: and the first this many positions of each (dim 1 of 2+-dim tensors; None:
        all). The eager fp32 reference with math attention is quadratic in it: the bound is
        ``bnlit.flops.parity_probe_memory_bytes`` (printed by ``python -m bnlit.info``).
    log_param_norms: log ``grad/<parameter>`` norms on check steps (``grad/norm`` is logged on
        every logging step either way).
    sentinel: run the every-step sentinel (missing, non-finite, zero and vanishing gradients,
        frozen parameters in an optimizer group) between full checks.
    vanishing_factor: a gradient-to-weight norm ratio this many times below the median of all
        parameters is ``vanishing``.
    dead_row_share: a matrix with at least this share of exactly-zero gradient rows is
        ``dead_rows``.
    allow: ``{category: [fnmatch patterns of parameter names]}`` exempt from ``vanishing``,
        ``dead_rows`` or ``frozen_in_optimizer`` (names as ``pl_module.named_parameters()``).
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
        probe_samples: int | None = 4,
        probe_seq_len: int | None = None,
        log_param_norms: bool = True,
        sentinel: bool = True,
        vanishing_factor: float = VANISHING_FACTOR,
        dead_row_share: float = DEAD_ROW_SHARE,
        allow: dict[str, list[str]] | None = None,
    ):
        where = "callbacks.gradient_flow"
        if every_n_steps < 1:
            raise ConfigError(f"{where}.every_n_steps={every_n_steps}: must be >= 1")
        if on_fail not in ("raise", "warn"):
            raise ConfigError(f"{where}.on_fail={on_fail!r}: use 'raise' or 'warn'")
        if parity_every_n_steps is not None and parity_every_n_steps < 1:
            raise ConfigError(f"{where}.parity_every_n_steps={parity_every_n_steps}: must be >= 1 or null")
        if not vanishing_factor > 1:
            raise ConfigError(f"{where}.vanishing_factor={vanishing_factor}: must be > 1 (the default is {VANISHING_FACTOR:g})")
        if not 0 < dead_row_share <= 1:
            raise ConfigError(f"{where}.dead_row_share={dead_row_share}: must be in (0, 1] (the default is {DEAD_ROW_SHARE})")
        for key, value in (("probe_samples", probe_samples), ("probe_seq_len", probe_seq_len)):
            if value is not None and value < 1:
                raise ConfigError(f"{where}.{key}={value}: must be >= 1 or null (all)")
        allow = {k: list(v or []) for k, v in dict(allow or {}).items()}
        unknown = sorted(set(allow) - set(ALLOW_CATEGORIES))
        if unknown:
            raise ConfigError(f"{where}.allow has unknown categor{'y' if len(unknown) == 1 else 'ies'} {unknown}: "
                             f"use {list(ALLOW_CATEGORIES)}")
        self.every_n_steps = every_n_steps
        self.on_fail = on_fail
        self.check_updates = check_updates
        self.fast_path_parity = fast_path_parity
        self.parity_every_n_steps = parity_every_n_steps
        self.min_cosine = min_cosine
        self.max_rel_norm_error = max_rel_norm_error
        self.probe_samples, self.probe_seq_len = probe_samples, probe_seq_len
        self.log_param_norms = log_param_norms
        self.sentinel = sentinel
        self.vanishing_factor, self.dead_row_share, self.allow = vanishing_factor, dead_row_share, allow
        self.checks = 0  # full checks run in this fit
        self.sentinel_trips = 0  # full checks the sentinel asked for
        self.sentinel_seconds, self.sentinel_steps = 0.0, 0  # its own cost, for scripts/bench.py
        self.skipped_steps = 0  # steps with no gradient at all (dropped by the NaN guard): not judged
        self._pending = False  # a full check due on a dropped step runs at the next one
        self.last_report: dict[str, Any] | None = None
        self._batches: collections.deque = collections.deque(maxlen=64)  # this step's micro-batches
        self._sentinel = GradientSentinel(vanishing_factor)
        self._grouped: list[tuple[str, torch.Tensor]] = []
        self._snapshot = None
        self._spare = None
        self._snapshot_step = -1
        self._seen_step = -1
        self._parity_done = False
        self._deferred = 0
        self._payload: dict[str, Any] = {}
        self._parity_report: dict[str, Any] | None = None  # the latest, carried into every report

    # -- helpers -------------------------------------------------------------------------------

    def _reduce(self, trainer: L.Trainer):
        if trainer.world_size <= 1:
            return None
        return lambda t, op: trainer.strategy.reduce(t, reduce_op=op)

    def _parity_due(self, trainer: L.Trainer, step: int) -> bool:
        if not self.fast_path_parity or _is_sharded(trainer):
            return False  # FSDP: the eager reference would need the whole unsharded model
        if not self._parity_done:
            return True
        return self.parity_every_n_steps is not None and step % self.parity_every_n_steps == 0

    def _fail(self, trainer: L.Trainer, step: int, check: str, findings: list[dict], payload: dict) -> None:
        path = checkpoint_dir(trainer) / REPORT_NAME
        problems: dict[str, str] = {}
        for f in findings:
            line = f"[{f['category']}] {f['message']}"
            problems[f["parameter"]] = f"{problems[f['parameter']]}; {line}" if f["parameter"] in problems else line
        payload = {**payload, "step": step, "check": check, "ok": False, "findings": findings, "problems": problems}
        self.last_report = payload
        if trainer.is_global_zero:
            write_json_atomic(path, payload)
        lines = "; ".join(f"{name} {why}" for name, why in problems.items())
        message = (f"{check} failed at step {step} for {len(problems)} parameter(s): {lines}. "
                   f"Full report: {path}")
        if self.on_fail == "raise":
            raise GradientFlowError(message)
        rank_zero_warn(message)

    # -- hooks ---------------------------------------------------------------------------------

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.checks, self.sentinel_trips, self._parity_done, self._seen_step, self._deferred = 0, 0, False, -1, 0
        self.sentinel_seconds, self.sentinel_steps = 0.0, 0
        self.skipped_steps, self._pending = 0, False
        self._sentinel = GradientSentinel(self.vanishing_factor, sharded=_is_sharded(trainer))
        self._batches.clear()
        ids = {id(p) for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]}
        self._grouped = [(n, p) for n, p in pl_module.named_parameters() if id(p) in ids]
        if self.fast_path_parity and not callable(getattr(pl_module, PROBE_HOOK, None)) and trainer.is_global_zero:
            log.info("fast-path parity: skipped, %s has no %s(batch) -> loss hook "
                     "(see the README, \"Gradient flow (the arbiter)\")", type(pl_module).__name__, PROBE_HOOK)
        report = param_group_report(pl_module.named_parameters(), trainer.optimizers, self.allow)
        reduce = self._reduce(trainer)
        if reduce is not None:
            bad = reduce(torch.tensor([0.0 if report.ok else 1.0], device=pl_module.device), "sum").item()
            if bad > 0 and report.ok:
                # another rank's optimizer is mis-built: stop here too, so no rank waits for it
                self._fail(trainer, trainer.global_step, "param-group check", [dict(
                    category="not_in_optimizer", parameter="(all parameters)", figure=None, threshold=None,
                    message=f"the optimizer is mis-built on {int(bad)} other rank(s)")], {})
        if not report.ok:
            self._fail(trainer, trainer.global_step, "param-group check", report.findings(),
                       {"param_groups": report.to_dict()})

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
        reduce, world = self._reduce(trainer), trainer.world_size
        logging_step = step % max(1, trainer.log_every_n_steps) == 0
        last = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        due = (self.checks == 0 or self._deferred > 0 or self._pending or step % self.every_n_steps == 0
               or step == last)
        if all(p.grad is None for _, p in unique_trainable(pl_module.named_parameters())[0]):
            # no gradient on any parameter: a step dropped by design (the NaN guard's skip policy
            # sets every .grad to None; a loss with no graph at all fails in backward instead).
            # Nothing to judge: a check that was due runs at the next step with gradients.
            self._pending = self._pending or due
            self.skipped_steps += 1
            return
        self._pending = False
        t0 = time.perf_counter()
        # a step the NaN guard skips on the device (fused AdamW's found_inf) is the guard's to report
        skipped = next((f for o in trainer.optimizers if (f := getattr(o, "found_inf", None)) is not None), None)
        norm = self._sentinel.observe(pl_module.named_parameters(), step, skipped) if self.sentinel else None
        if logging_step:
            norm = norm if self.sentinel else total_grad_norm(pl_module.named_parameters())
            if norm is not None:
                pl_module.log("grad/norm", norm, on_step=True, on_epoch=False)
        tripped = False
        if self.sentinel:
            frozen = any(not p.requires_grad for _, p in self._grouped)
            if world == 1 and (frozen or self._sentinel.missing):
                tripped = True  # known on the host: no sync needed
            elif pl_module.device.type == "cpu" or logging_step:
                tripped = self._sentinel.tripped(reduce, extra=frozen)
            self.sentinel_seconds += time.perf_counter() - t0  # host time (CUDA: launches, not kernels)
            self.sentinel_steps += 1
        # due: the first step of every fit (a resumed one too), a deferred check, the cadence, and
        # the run's last step (so the grad/* values a summary calls final are the final step's)
        if tripped and not due:
            self.sentinel_trips += 1
        if due or tripped:
            self._full_check(trainer, pl_module, step, reduce)

    def _full_check(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int, reduce) -> None:
        sharded, world = _is_sharded(trainer), trainer.world_size
        named = list(pl_module.named_parameters())
        membership = param_group_report(named, trainer.optimizers, self.allow)
        report = gradient_flow_report(named, reduce=reduce, sharded=sharded, world_size=world,
                                      vanishing_factor=self.vanishing_factor, dead_row_share=self.dead_row_share,
                                      row_exempt=embedding_row_exempt(pl_module, list(self._batches)), allow=self.allow)
        seen = self._sentinel.findings(reduce) if self.sentinel else {}
        self._sentinel.reset()
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        skipped = next((f for o in trainer.optimizers if (f := getattr(o, "found_inf", None)) is not None), None)
        if report.nonfinite and skipped is not None and scaler is None and bool(skipped.item()):
            log.warning("gradient flow: non-finite gradients at step %d; the NaN guard skips this step", step)
            return
        if report.nonfinite and scaler is not None and self._deferred < MAX_DEFERRED:
            # fp16 loss scaling: the GradScaler skips this step and lowers the scale; not (yet) a fault
            self._deferred += 1
            log.warning("gradient flow: non-finite fp16 gradients at step %d (loss-scale overflow %d/%d); the "
                        "scaler skips this step, checking again at step %d", step, self._deferred, MAX_DEFERRED, step + 1)
            return
        self._deferred = 0
        self.checks += 1
        self._sentinel.set_weight_norms(report.weight_norms,
                                        [n for n in report.names if allowed(n, self.allow.get("vanishing"))])
        findings = [{**f, "step": step} for f in membership.findings() + report.findings()]
        named_now = {f["parameter"] for f in findings}
        for name, (category, first) in seen.items():
            if first < step and name not in named_now and category in CATEGORIES:
                findings.append(dict(category=category, parameter=name, figure=None, threshold=None, step=first, message=(
                    f"{category} gradient at step {first}, seen by the every-step sentinel (gone by the full check "
                    f"at step {step})")))
        payload: dict[str, Any] = {"step": step, "gradients": report.to_dict(), "param_groups": membership.to_dict(),
                                   "sentinel": {n: {"category": c, "first_step": s} for n, (c, s) in seen.items()}}
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
        if self.log_param_norms:
            log_metrics(trainer, {f"grad/{n}": v for n, v in report.norms.items() if math.isfinite(v)})
        if self.check_updates:
            self._snapshot = snapshot_parameters(named, trainer.optimizers, reuse=self._spare)
            self._snapshot_step = step

    def _parity(self, trainer: L.Trainer, pl_module: L.LightningModule, reduce, step: int) -> list[dict]:
        """Run the probe; a probe that cannot run is logged and skipped, never a crash, and never
        hides the verdict the gradient check already reached."""
        self._parity_done = True
        hook = getattr(pl_module, PROBE_HOOK, None)
        if not callable(hook) or not self._batches:
            self._parity_report = {"step": step, "skipped": f"no {PROBE_HOOK}(batch) hook" if not callable(hook) else "no batch"}
            return []
        probe = slice_batch(self._batches[-1], self.probe_samples, self.probe_seq_len)
        was_training = pl_module.training
        try:
            parity = fast_path_parity(
                pl_module, probe, hook, fast_context=trainer.precision_plugin.forward_context(),
                min_cosine=self.min_cosine, max_rel_norm_error=self.max_rel_norm_error, reduce=reduce,
            )
        except Exception as e:  # noqa: BLE001 -- a diagnostic must not take the run down
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self._parity_report = {"step": step, "skipped": reason}
            if trainer.is_global_zero:
                log.warning("fast-path parity: probe skipped at step %d, %s.%s raised %s",
                            step, type(pl_module).__name__, PROBE_HOOK, reason)
            return []
        finally:
            pl_module.train(was_training)
        self._parity_report = {"step": step, "precision": str(trainer.precision), **parity.to_dict()}
        log_metrics(trainer, {"grad/parity_min_cosine": parity.worst_cosine,
                                    "grad/parity_max_rel_norm_error": parity.worst_rel_norm_error})
        if trainer.is_global_zero:
            log.info("fast-path parity (%s%s): %d/%d parameters within tolerance (min cosine %.5f, "
                     "max relative norm error %.4f)", trainer.precision,
                     ", compiled" if getattr(pl_module, "compile", False) is True else "", parity.num_ok,
                     len(parity.names), parity.worst_cosine, parity.worst_rel_norm_error)
        return [dict(category="fast_path_parity", parameter=n, figure=parity.cosine[n], threshold=self.min_cosine,
                     step=step, message=why) for n, why in parity.problems().items()]

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
            findings = [dict(category="update", parameter=n, figure=report.update_ratio.get(n), threshold=None,
                             step=step, message=why) for n, why in report.problems().items()]
            self._fail(trainer, step, "update-flow check", findings, payload)
        else:
            self.last_report = payload

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._snapshot, self._spare = None, None
        self._batches.clear()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._snapshot, self._spare = None, None
        self._batches.clear()

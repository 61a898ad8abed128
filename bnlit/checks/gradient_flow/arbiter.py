"""The arbiter's settings and verdicts, apart from Lightning: :class:`ArbiterSettings` (the
``callbacks.gradient_flow.*`` keys, validated), :class:`ArbiterState` (what is due at each step), the
full check and the fit-start membership check as findings, the parity probe that never takes the
run down, and the failure report with its one-paragraph message. ``bnlit.callbacks.gradient_flow``
chooses when to run them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from bnlit.checks.gradient_flow.gradients import CATEGORIES, DEAD_ROW_SHARE, VANISHING_FACTOR, GradientFlowReport, gradient_flow_report
from bnlit.checks.gradient_flow.params import NamedParameters, Reduce
from bnlit.checks.gradient_flow.parity import ParityReport, fast_path_parity, ignore_outside, slice_batch
from bnlit.checks.gradient_flow.sentinel import GradientSentinel
from bnlit.checks.gradient_flow.updates import param_group_report
from bnlit.errors import BnlitError, ConfigError


REPORT_NAME = "gradient_flow.json"  # in the checkpoint directory, written only when a check fails
MAX_DEFERRED = 10  # consecutive fp16 overflow steps tolerated before non-finite gradients fail
PROBE_HOOK = "loss_for_batch"
ALLOW_CATEGORIES = ("vanishing", "dead_rows", "frozen_in_optimizer")


class GradientFlowError(BnlitError):
    """A trainable parameter gets no gradient, a non-finite, all-zero, vanishing or partly dead
    one, no update, sits frozen in an optimizer group, or gets a fast-path gradient that disagrees
    with the eager fp32 reference."""


@dataclass
class ArbiterSettings:
    """The arbiter's settings (``callbacks.gradient_flow.*``), validated on construction.

    every_n_steps: the full check at optimizer step 1, then every this many steps, at the run's
        last step (so the final ``grad/*`` values are the final step's), and at once whenever the
        every-step sentinel trips.
    on_fail: ``"raise"`` a :class:`GradientFlowError` (after writing the report) or ``"warn"``.
    check_updates: snapshot the parameters on check steps and verify the optimizer changed each.
    fast_path_parity: compare the configured fast path (precision plugin's autocast, compiled
        model, fused kernels) with the eager fp32 reference on the first check step's batch,
        through ``pl_module.loss_for_batch(batch) -> scalar loss``; a module without that hook
        gets the probe skipped with one log line, and so does a sharded (FSDP/HSDP) run.
    parity_every_n_steps: repeat the parity check this often (None: first check only; it costs
        two extra forward/backward passes of the probe batch).
    min_cosine, max_rel_norm_error: per-parameter parity tolerances.
    probe_samples: the probe uses the first this many sequences of the step's last micro-batch.
    probe_seq_len: and the first this many positions of each (dim 1 of 2+-dim tensors; None:
        all). The eager fp32 reference with math attention is quadratic in it. The fast path
        runs the whole micro-batch with the other targets ignored (:func:`ignore_outside`: the
        compiled graph the steps use, no recompile), a training step's memory plus one gradient
        copy; the bound is ``bnlit.speed.flops.parity_probe_memory_bytes`` (``python -m bnlit.info``).
    log_param_norms: log ``grad/<parameter>`` norms on check steps (``grad/norm`` is logged on
        every logging step either way).
    sentinel: run the every-step sentinel (missing, non-finite, zero and vanishing gradients,
        frozen parameters in an optimizer group) between full checks.
    vanishing_factor: a gradient-to-weight norm ratio this many times below the median of all
        parameters is ``vanishing``.
    dead_row_share: a matrix with at least this share of exactly-zero gradient rows is ``dead_rows``.
    allow: ``{category: [fnmatch patterns of parameter names]}`` exempt from ``vanishing``,
        ``dead_rows`` or ``frozen_in_optimizer`` (names as ``pl_module.named_parameters()``).
    """

    every_n_steps: int = 50
    on_fail: str = "raise"
    check_updates: bool = True
    fast_path_parity: bool = True
    parity_every_n_steps: int | None = None
    min_cosine: float = 0.99
    max_rel_norm_error: float = 0.05
    probe_samples: int | None = 4
    probe_seq_len: int | None = None
    log_param_norms: bool = True
    sentinel: bool = True
    vanishing_factor: float = VANISHING_FACTOR
    dead_row_share: float = DEAD_ROW_SHARE
    allow: dict[str, list[str]] | None = None

    def __post_init__(self) -> None:
        where = "callbacks.gradient_flow"
        if self.every_n_steps < 1:
            raise ConfigError(f"{where}.every_n_steps={self.every_n_steps}: must be >= 1")
        if self.on_fail not in ("raise", "warn"):
            raise ConfigError(f"{where}.on_fail={self.on_fail!r}: use 'raise' or 'warn'")
        if self.parity_every_n_steps is not None and self.parity_every_n_steps < 1:
            raise ConfigError(f"{where}.parity_every_n_steps={self.parity_every_n_steps}: must be >= 1 or null")
        if not self.vanishing_factor > 1:
            raise ConfigError(f"{where}.vanishing_factor={self.vanishing_factor}: must be > 1 "
                              f"(the default is {VANISHING_FACTOR:g})")
        if not 0 < self.dead_row_share <= 1:
            raise ConfigError(f"{where}.dead_row_share={self.dead_row_share}: must be in (0, 1] "
                              f"(the default is {DEAD_ROW_SHARE})")
        for key in ("probe_samples", "probe_seq_len"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"{where}.{key}={value}: must be >= 1 or null (all)")
        self.allow = {k: list(v or []) for k, v in dict(self.allow or {}).items()}
        unknown = sorted(set(self.allow) - set(ALLOW_CATEGORIES))
        if unknown:
            raise ConfigError(f"{where}.allow has unknown categor{'y' if len(unknown) == 1 else 'ies'} {unknown}: "
                              f"use {list(ALLOW_CATEGORIES)}")


def sentinel_findings(seen: Mapping[str, tuple[str, int]], named: set[str], step: int) -> list[dict]:
    """Findings for what the every-step sentinel saw (``{name: (category, first step)}``) before
    the full check at ``step`` and that check no longer names (``named``)."""
    return [dict(category=category, parameter=name, figure=None, threshold=None, step=first, message=(
                f"{category} gradient at step {first}, seen by the every-step sentinel (gone by the full check "
                f"at step {step})"))
            for name, (category, first) in seen.items() if first < step and name not in named and category in CATEGORIES]


def failure_report(check: str, step: int, findings: list[dict], payload: dict, path) -> tuple[dict, str]:
    """The failed check's report (``payload`` with the findings and ``{parameter: problems}``) and
    its one-paragraph message naming every parameter and the report's ``path``."""
    problems: dict[str, str] = {}
    for f in findings:
        line = f"[{f['category']}] {f['message']}"
        problems[f["parameter"]] = f"{problems[f['parameter']]}; {line}" if f["parameter"] in problems else line
    report = {**payload, "step": step, "check": check, "ok": False, "findings": findings, "problems": problems}
    lines = "; ".join(f"{name} {why}" for name, why in problems.items())
    return report, (f"{check} failed at step {step} for {len(problems)} parameter(s): {lines}. Full report: {path}"
                    f"{parity_alarm_hint(findings)}")


PARITY_OFF = "callbacks.gradient_flow.fast_path_parity=false"


def parity_alarm_hint(findings: Sequence[Mapping]) -> str:
    """The line a failure adds when the fast-path parity probe is its only finding: every other
    gradient check passed that step, so the disagreement may be the probe's own false alarm (bf16
    rounding on small gradients, e.g. the first check after a resume; docs/gradient-flow.md) rather
    than a broken fast path. Empty when any other check failed too."""
    if not findings or any(f.get("category") != "fast_path_parity" for f in findings):
        return ""
    return (". Every other gradient check passed at this step, so this may be a false alarm of the parity probe "
            f"(bf16 rounding of small gradients; docs/gradient-flow.md): rerun with {PARITY_OFF} to switch it off.")


def parity_probe(module: nn.Module, batch, settings: ArbiterSettings, fast_context, reduce: Reduce | None,
                 step: int, precision: str) -> tuple[dict, ParityReport | None]:
    """:func:`fast_path_parity` on the first ``probe_samples`` x ``probe_seq_len`` of ``batch``
    through ``module.loss_for_batch``, and its report entry. A probe that cannot run (no hook, no
    batch, or the hook raised) gives ``{"step", "skipped": why}`` and None, never an exception:
    a diagnostic must not take the run down, nor hide the gradient check's verdict."""
    hook = getattr(module, PROBE_HOOK, None)
    if not callable(hook) or batch is None:
        return {"step": step, "skipped": f"no {PROBE_HOOK}(batch) hook" if not callable(hook) else "no batch"}, None
    probe = slice_batch(batch, settings.probe_samples, settings.probe_seq_len)
    # the fast path at the training shape (no recompile of a compiled model), the reference on the slice
    whole = ignore_outside(batch, settings.probe_samples, settings.probe_seq_len)
    was_training = module.training
    try:
        parity = fast_path_parity(module, probe, hook, fast_context=fast_context, min_cosine=settings.min_cosine,
                                  max_rel_norm_error=settings.max_rel_norm_error, reduce=reduce, fast_batch=whole)
    except Exception as e:  # noqa: BLE001
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return {"step": step, "skipped": reason}, None
    finally:
        module.train(was_training)
    return {"step": step, "precision": precision, **parity.to_dict()}, parity


def membership_verdict(named_parameters: NamedParameters, optimizers: Sequence[torch.optim.Optimizer],
                       allow: Mapping[str, list[str]], reduce: Reduce | None,
                       device: torch.device | str = "cpu") -> tuple[list[dict], dict]:
    """The fit-start optimizer-membership check (:func:`param_group_report`) as (findings, report
    payload), empty when it passes on every rank. Under ``reduce`` a rank whose own optimizer is
    fine fails too when another's is mis-built, so no rank waits for it in a collective."""
    report = param_group_report(named_parameters, optimizers, allow)
    if reduce is not None:
        bad = reduce(torch.tensor([0.0 if report.ok else 1.0], device=device), "sum").item()
        if bad > 0 and report.ok:
            return [dict(category="not_in_optimizer", parameter="(all parameters)", figure=None, threshold=None,
                         message=f"the optimizer is mis-built on {int(bad)} other rank(s)")], {}
    return ([], {}) if report.ok else (report.findings(), {"param_groups": report.to_dict()})


def full_check(named: list[tuple[str, torch.Tensor]], optimizers: Sequence[torch.optim.Optimizer],
               settings: ArbiterSettings, row_exempt: Mapping, seen: Mapping[str, tuple[str, int]], step: int, *,
               reduce: Reduce | None, sharded: bool, world_size: int) -> tuple[GradientFlowReport, list[dict], dict]:
    """The full check at ``step``: gradients and optimizer membership, plus what the sentinel saw
    since the last one. Returns the gradient report, the findings and the report payload."""
    membership = param_group_report(named, optimizers, settings.allow)
    report = gradient_flow_report(named, reduce=reduce, sharded=sharded, world_size=world_size,
                                  vanishing_factor=settings.vanishing_factor, dead_row_share=settings.dead_row_share,
                                  row_exempt=row_exempt, allow=settings.allow)
    findings = [{**f, "step": step} for f in membership.findings() + report.findings()]
    findings += sentinel_findings(seen, {f["parameter"] for f in findings}, step)
    payload = {"step": step, "gradients": report.to_dict(), "param_groups": membership.to_dict(),
               "sentinel": {n: {"category": c, "first_step": f} for n, (c, f) in seen.items()}}
    return report, findings, payload


class ArbiterState:
    """The arbiter's per-step bookkeeping, apart from Lightning: which optimizer step is new, when a
    full check is due, which steps are skipped or deferred, and the counters a run reports."""

    def __init__(self, settings: ArbiterSettings, sharded: bool = False):
        self.settings, self.sharded = settings, sharded
        self.checks = 0  # full checks run in this fit
        self.sentinel_trips = 0  # full checks the sentinel asked for
        self.sentinel_seconds, self.sentinel_steps = 0.0, 0  # its own cost, for scripts/bench.py
        self.skipped_steps = 0  # steps with no gradient at all (dropped by the NaN guard): not judged
        self.seen_step, self.deferred, self.pending, self.parity_done = -1, 0, False, False
        self.sentinel = GradientSentinel(settings.vanishing_factor, sharded=sharded)

    def new_step(self, step: int) -> bool:
        """False for a second optimizer of the same step."""
        new, self.seen_step = step != self.seen_step, step
        return new

    def due(self, step: int, last_step: int | None) -> bool:
        """The first step of every fit (a resumed one too), a deferred check, the cadence, and the
        run's last step (so the grad/* values a summary calls final are the final step's)."""
        return (self.checks == 0 or self.deferred > 0 or self.pending
                or step % self.settings.every_n_steps == 0 or step == last_step)

    def skip(self, due: bool) -> None:
        """A step dropped by design (the NaN guard's skip policy sets every .grad to None): nothing to
        judge, a due check runs next step."""
        self.pending, self.skipped_steps = self.pending or due, self.skipped_steps + 1

    def run_check(self, due: bool, tripped: bool) -> bool:
        self.pending = False
        if tripped and not due:
            self.sentinel_trips += 1
        return due or tripped

    def sentinel_tripped(self, frozen: bool, single: bool, sync_now: bool, reduce: Reduce | None) -> bool:
        if not self.settings.sentinel:
            return False
        if single and (frozen or self.sentinel.missing):
            return True  # known on the host: no sync needed
        return sync_now and self.sentinel.tripped(reduce, extra=frozen)

    def defer(self, step: int, nonfinite: bool, fp16: bool, guard_skips: Callable[[], bool]) -> str | None:
        """Non-finite gradients that are not (yet) a fault, as the warning to log: the NaN guard's
        on-device skip, or an fp16 loss-scale overflow the GradScaler skips (up to ``MAX_DEFERRED``
        in a row). None: judge the step."""
        if nonfinite and not fp16 and guard_skips():
            return f"gradient flow: non-finite gradients at step {step}; the NaN guard skips this step"
        if nonfinite and fp16 and self.deferred < MAX_DEFERRED:
            self.deferred += 1
            return (f"gradient flow: non-finite fp16 gradients at step {step} (loss-scale overflow "
                    f"{self.deferred}/{MAX_DEFERRED}); the scaler skips this step, checking again at step {step + 1}")
        self.deferred = 0
        return None

    def parity_due(self, step: int) -> bool:
        s = self.settings
        if not s.fast_path_parity or self.sharded:
            return False  # FSDP/HSDP: no eager fp32 reference (docs/gradient-flow.md, "Under FSDP and HSDP")
        return not self.parity_done or (s.parity_every_n_steps is not None and step % s.parity_every_n_steps == 0)

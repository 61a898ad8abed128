"""Gradient-flow checks: no trainable parameter may silently stop learning.

Pure checks, each tested without a Trainer (``bnlit.callbacks.gradient_flow`` decides when to run
them and what to do with a failure), one job per module:

* :mod:`~bnlit.checks.gradient_flow.gradients` -- :func:`gradient_flow_report`: after backward,
  every trainable parameter has a gradient that is present, finite, not all zeros, not vanishing
  against its peers, and reaches at least half of a matrix's output rows.
* :mod:`~bnlit.checks.gradient_flow.sentinel` -- :class:`GradientSentinel`: the same verdicts but
  exact-zero rows, from one fused norm pass per step with no host sync; when it trips the full
  report runs.
* :mod:`~bnlit.checks.gradient_flow.updates` -- :func:`param_group_report` and
  :func:`update_flow_report`: optimizer membership both ways (every trainable parameter in a group
  with a non-zero learning rate, no frozen parameter in a group), and the optimizer step changed
  every parameter.
* :mod:`~bnlit.checks.gradient_flow.parity` -- :func:`fast_path_parity`: on one probe batch the
  configured fast path (bf16 autocast, ``torch.compile``, fused kernels) gives per-parameter
  gradients with the direction (cosine similarity) and size (relative norm error) of the same
  module run eagerly in fp32, within tolerances that each gradient's bf16 rounding floor widens.
* :mod:`~bnlit.checks.gradient_flow.rounding` -- :class:`RoundLikeAutocast`: the fast path's
  rounding (bf16/fp16 at every matmul, FlashAttention-2's rounding points in attention) computed
  with fp32 eager kernels: the parity probe's rounding floor.
* :mod:`~bnlit.checks.gradient_flow.arbiter` -- the verdict logic that combines them: the
  settings (``callbacks.gradient_flow.*``), what is due at each step, the findings and the
  failure report.
* :mod:`~bnlit.checks.gradient_flow.params` -- what they share: each trainable tensor once, its
  rank-local shard, allow-list patterns and exact per-tensor norms.

All of them accept ``reduce(tensor, op) -> tensor`` (``op`` in ``"sum" | "min" | "max"``; an
all-reduce across ranks) so every rank reaches the same verdict, and the distributed callers fail
together instead of leaving one rank waiting in a collective. ``sharded=True`` (FSDP/HSDP) means each
rank holds a dim-0 shard of a parameter: the verdicts are the full parameter's (squared norms
summed over shards, each once; zero only when every shard is; dead rows by global row index), from
one collective per check. The parity probe does not run sharded (docs/gradient-flow.md).

The exactness matters: one fused L2-norm pass finds the candidates, and a candidate is called zero
or non-finite only after an exact re-check -- the fp32 L2 norm underflows to 0 for gradients around
1e-23 and overflows to Inf above 1e19.

Every public name is importable from here (``from bnlit.checks.gradient_flow import
gradient_flow_report``), as it was when this package was one module.
"""

from __future__ import annotations

from bnlit.checks.gradient_flow.arbiter import (
    ALLOW_CATEGORIES,
    MAX_DEFERRED,
    PARITY_OFF,
    PROBE_HOOK,
    REPORT_NAME,
    ArbiterSettings,
    ArbiterState,
    GradientFlowError,
    failure_report,
    full_check,
    membership_verdict,
    parity_alarm_hint,
    parity_probe,
    sentinel_findings,
)
from bnlit.checks.gradient_flow.gradients import (
    CATEGORIES,
    DEAD_ROW_SHARE,
    VANISHING_FACTOR,
    GradientFlowReport,
    embedding_row_exempt,
    gradient_flow_report,
    integer_tensors,
    row_ranges,
)
from bnlit.checks.gradient_flow.params import INF, NamedParameters, Reduce, allowed, shard_layout, unique_trainable
from bnlit.checks.gradient_flow.parity import (
    FLOOR_FACTOR,
    ParityReport,
    compare_gradients,
    eager_fp32,
    fast_path_parity,
    floor_tolerances,
    ignore_outside,
    probe_gradients,
    reference_context,
    slice_batch,
)
from bnlit.checks.gradient_flow.rounding import (
    MATMULS,
    FlashRounding,
    Round,
    RoundLikeAutocast,
    flash_rounded_attention,
    rounded,
)
from bnlit.checks.gradient_flow.sentinel import GradientSentinel, total_grad_norm
from bnlit.checks.gradient_flow.updates import (
    ParameterSnapshot,
    ParamGroupReport,
    UpdateFlowReport,
    param_group_report,
    snapshot_parameters,
    update_flow_report,
)

__all__ = [
    "ALLOW_CATEGORIES", "CATEGORIES", "DEAD_ROW_SHARE", "FLOOR_FACTOR", "FlashRounding", "INF", "MATMULS", "MAX_DEFERRED", "PARITY_OFF", "PROBE_HOOK",
    "REPORT_NAME", "VANISHING_FACTOR", "ArbiterSettings", "ArbiterState", "GradientFlowError", "GradientFlowReport",
    "GradientSentinel", "NamedParameters", "ParameterSnapshot", "ParamGroupReport", "ParityReport", "Reduce", "Round",
    "RoundLikeAutocast",
    "UpdateFlowReport", "allowed", "compare_gradients", "eager_fp32", "embedding_row_exempt", "failure_report",
    "fast_path_parity", "flash_rounded_attention", "floor_tolerances", "full_check", "gradient_flow_report", "ignore_outside", "integer_tensors",
    "membership_verdict", "param_group_report", "parity_alarm_hint", "parity_probe", "probe_gradients",
    "reference_context", "rounded", "row_ranges", "sentinel_findings", "shard_layout", "slice_batch", "snapshot_parameters", "total_grad_norm",
    "unique_trainable", "update_flow_report",
]

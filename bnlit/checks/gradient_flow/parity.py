"""Fast-path parity: on one probe batch the configured fast path (bf16 autocast, ``torch.compile``,
fused kernels) gives per-parameter gradients with the direction (cosine similarity) and size
(relative norm error) of the same module run eagerly in fp32 (:func:`fast_path_parity`)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
from lightning_utilities.core.apply_func import apply_to_collection

from bnlit.checks.gradient_flow.params import INF, Reduce, _local, _reduce, unique_trainable
from bnlit.checks.gradient_flow.rounding import RoundLikeAutocast

# A correct fast path may miss the exact gradient by up to this many times its rounding floor (the
# miss of the fp32 emulation of its rounding, bnlit.checks.gradient_flow.rounding): both round at the
# same points, not always the same elements. Measured: at most 3.6x where the floor decided a verdict,
# 4.8x on any parameter (docs/gradient-flow.md, "The rounding floor"); 6 leaves a margin of 1.25-1.7x.
FLOOR_FACTOR = 6.0


def slice_batch(batch, samples: int | None = None, seq_len: int | None = None):
    """The probe batch: the first ``samples`` rows (dim 0) of every tensor in ``batch`` (any
    nesting of tuples, lists and dicts) and, with ``seq_len``, the first ``seq_len`` positions of
    dim 1 of tensors with two or more dims (token sequences: inputs, targets and masks alike)."""

    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.ndim >= 1 and samples:
            t = t[:samples]
        if t.ndim >= 2 and seq_len:
            t = t[:, :seq_len]
        return t

    return apply_to_collection(batch, torch.Tensor, cut)


def ignore_outside(batch, samples: int | None = None, seq_len: int | None = None):
    """The probe at the training shape: an ``(x, y)`` batch of token windows, whole, with every
    target outside :func:`slice_batch`'s ``samples x seq_len`` set to ``IGNORE_INDEX`` -- the same
    mean loss and gradients as the slice (causal attention: no position sees a later one), through
    the compiled graph the training steps use rather than a recompile at the slice's shape. None
    for any other batch (the fast path then runs the slice)."""
    from bnlit.loss import IGNORE_INDEX

    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch)):
        return None
    x, y = batch
    if y.is_floating_point() or y.ndim != 2 or x.shape[:2] != y.shape:
        return None
    keep = torch.zeros_like(y, dtype=torch.bool)
    keep[:samples or None, :seq_len or None] = True
    return type(batch)((x, y.masked_fill(~keep, IGNORE_INDEX))) if isinstance(batch, tuple) else \
        [x, y.masked_fill(~keep, IGNORE_INDEX)]


@contextlib.contextmanager
def eager_fp32(module: nn.Module):
    """``module`` as the reference runs it: ``torch.compile`` off (``force_eager``) and fp32
    parameters and buffers. Parameters that are fp32 already are used as they are (no copy: the
    reference costs no weight memory under mixed precision); others (bf16-true) are swapped for
    fp32 copies for the duration. Yields ``{name: tensor}`` of the trainable parameters to
    differentiate."""
    from torch.nn.utils.stateless import _reparametrize_module

    params, _, _ = unique_trainable(module.named_parameters())
    swap: dict[str, torch.Tensor] = {}
    for n, p in module.named_parameters():
        if p.is_floating_point() and p.dtype != torch.float32:
            swap[n] = p.detach().float().requires_grad_(p.requires_grad)
    for n, b in module.named_buffers():
        if b.is_floating_point() and b.dtype != torch.float32:
            swap[n] = b.float()
    with torch.compiler.set_stance("force_eager"):
        if not swap:
            yield dict(params)
            return
        with _reparametrize_module(module, swap, tie_weights=True):
            yield {n: swap.get(n, p) for n, p in params}


@contextlib.contextmanager
def reference_context(device: torch.device):
    """No autocast, the math SDPA kernel, full-precision fp32 matmuls (no TF32)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.autocast(device.type, enabled=False), sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.set_float32_matmul_precision(precision)


def probe_gradients(params: Mapping[str, torch.Tensor], loss: Callable[[], torch.Tensor],
                    context: contextlib.AbstractContextManager | None = None, seed: int = 0) -> dict[str, torch.Tensor | None]:
    """Gradients of ``loss()`` w.r.t. ``params`` via ``torch.autograd.grad`` (the parameters'
    ``.grad`` is left untouched). The RNG is seeded so a model with dropout draws the same masks
    on both paths."""
    tensors = list(params.values())
    device = tensors[0].device
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        with context if context is not None else contextlib.nullcontext():
            value = loss()
        if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.requires_grad:
            raise TypeError(f"the probe loss must be a scalar tensor that requires grad, got "
                            f"{type(value).__name__}{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}")
        grads = torch.autograd.grad(value.reshape(()), tensors, allow_unused=True)
    return {n: (None if g is None else g.detach()) for n, g in zip(params, grads)}


@dataclass
class ParityReport:
    """Per-parameter agreement of the fast path's gradients with the eager fp32 reference:
    ``cosine`` similarity and ``rel_norm_error`` = ``| ||g_fast|| - ||g_ref|| | / ||g_ref||``."""

    names: list[str]
    cosine: dict[str, float]
    rel_norm_error: dict[str, float]
    failed: dict[str, str] = field(default_factory=dict)
    min_cosine: float = 0.0
    max_rel_norm_error: float = 0.0
    rel_error: dict[str, float] = field(default_factory=dict)  # ||g_fast - g_ref|| / ||g_ref||
    # under mixed precision: {name: rounding floor and the tolerances it widened to} (floor: the
    # relative error ||g_floor - g_ref|| / ||g_ref|| of a correct implementation at that precision)
    floor: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def num_ok(self) -> int:
        return len(self.names) - len(self.failed)

    @property
    def worst_cosine(self) -> float:
        return min(self.cosine.values(), default=1.0)

    @property
    def worst_rel_norm_error(self) -> float:
        return max(self.rel_norm_error.values(), default=0.0)

    def problems(self) -> dict[str, str]:
        return dict(self.failed)

    def findings(self, step: int) -> list[dict]:
        return [dict(category="fast_path_parity", parameter=n, figure=self.cosine.get(n),
                     threshold=self.floor.get(n, {}).get("min_cosine", self.min_cosine),
                     step=step, message=why) for n, why in self.problems().items()]

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok, "num_ok": self.num_ok, "problems": self.problems()}

    @property
    def widened(self) -> list[str]:
        """Parameters whose tolerance the rounding floor widened past the configured bounds."""
        return [n for n, f in self.floor.items()
                if f["min_cosine"] < self.min_cosine or f["max_rel_norm_error"] > self.max_rel_norm_error]

    def summary(self, precision: str, compiled: bool) -> str:
        floor = ""
        if self.floor:
            worst = max(self.floor, key=lambda n: self.floor[n]["floor"])
            ratio = max((self.rel_error[n] / f["floor"] for n, f in self.floor.items() if f["floor"] > 0 and n in
                         self.rel_error), default=0.0)
            floor = (f"; rounding floor up to {self.floor[worst]['floor']:.4f} ({worst}), "
                     f"{len(self.widened)} tolerance(s) widened by it, miss/floor up to {ratio:.2f}")
        return (f"fast-path parity ({precision}{', compiled' if compiled else ''}): {self.num_ok}/{len(self.names)} "
                f"parameters within tolerance (min cosine {self.worst_cosine:.5f}, max relative norm error "
                f"{self.worst_rel_norm_error:.4f}{floor})")


def _agreement(fast: Mapping[str, torch.Tensor | None], ref: Mapping[str, torch.Tensor | None], names: list[str],
               device: torch.device, reduce: Reduce | None) -> tuple[list[float], list[float], list[float]]:
    """Per parameter, in fp64 with one host sync: the cosine of ``fast`` against ``ref``, the
    relative norm error ``| ||f|| - ||r|| | / ||r||`` and the relative error ``||f - r|| / ||r||``.
    Under ``reduce`` the worst rank decides (min cosine, max errors)."""
    cos = torch.ones(len(names), dtype=torch.float64, device=device)
    err = torch.zeros(len(names), dtype=torch.float64, device=device)
    dist = torch.zeros(len(names), dtype=torch.float64, device=device)
    for i, n in enumerate(names):
        f, r = fast.get(n), ref[n]
        if f is None or r is None:
            cos[i], err[i], dist[i] = 0.0, INF, INF
            continue
        f, r = _local(f).double().flatten(), _local(r).double().flatten()
        nf, nr = f.norm(), r.norm()
        c = torch.dot(f, r) / (nf * nr)
        # both zero: agree; exactly one zero: orthogonal; NaN/Inf in either: as bad as it gets
        c = torch.where((nf == 0) | (nr == 0), torch.where((nf == 0) & (nr == 0), 1.0, 0.0), c)
        cos[i] = torch.nan_to_num(c, nan=-1.0, posinf=-1.0, neginf=-1.0)
        e = (nf - nr).abs() / nr
        err[i] = torch.where(nr == 0, torch.where(nf == 0, 0.0, INF), torch.nan_to_num(e, nan=INF))
        d = (f - r).norm() / nr
        dist[i] = torch.where(nr == 0, torch.where(nf == 0, 0.0, INF), torch.nan_to_num(d, nan=INF))
    return (_reduce(cos, reduce, "min").cpu().tolist(), _reduce(err, reduce, "max").cpu().tolist(),
            _reduce(dist, reduce, "max").cpu().tolist())


def floor_tolerances(floor: float, min_cosine: float, max_rel_norm_error: float,
                     factor: float = FLOOR_FACTOR) -> tuple[float, float]:
    """The tolerances a gradient whose rounding floor (relative error of a correct implementation
    at the fast path's precision) is ``floor`` gets: a miss ``e`` with ``||e|| <= factor * floor *
    ||g||`` moves the norm by at most that and the direction by at most ``asin`` of it, so the
    norm error bound is ``max(max_rel_norm_error, factor * floor)`` and the cosine bound
    ``min(min_cosine, sqrt(1 - (factor * floor)^2))`` (0 once the floor reaches the gradient: bf16
    cannot resolve it). The configured bounds are never tightened."""
    x = factor * floor
    if not math.isfinite(x):
        return min_cosine, max_rel_norm_error
    return min(min_cosine, math.sqrt(max(0.0, 1.0 - x * x))), max(max_rel_norm_error, x)


def compare_gradients(
    fast: Mapping[str, torch.Tensor | None], ref: Mapping[str, torch.Tensor | None], *,
    min_cosine: float, max_rel_norm_error: float, reduce: Reduce | None = None,
    floor: Mapping[str, torch.Tensor | None] | None = None,
) -> ParityReport:
    """Compare two ``{name: gradient}`` maps parameter by parameter (in fp64, one host sync).
    Under ``reduce`` the worst value over ranks decides (min cosine, max error).

    ``floor``: the gradients of a correct implementation at the fast path's precision (the
    reference under :class:`~bnlit.checks.gradient_flow.rounding.RoundLikeAutocast`). Its miss of
    ``ref`` is the rounding floor of each gradient; :func:`floor_tolerances` widens that
    parameter's tolerance to ``FLOOR_FACTOR`` times it, never tightens it."""
    names = [n for n in ref if not (ref[n] is None and fast.get(n) is None)]
    if not names:
        return ParityReport([], {}, {}, min_cosine=min_cosine, max_rel_norm_error=max_rel_norm_error)
    device = next(g for g in ref.values() if g is not None).device
    cos, err, dist = _agreement(fast, ref, names, device, reduce)
    report = ParityReport(names, dict(zip(names, cos)), dict(zip(names, err)), rel_error=dict(zip(names, dist)),
                          min_cosine=min_cosine, max_rel_norm_error=max_rel_norm_error)
    floors = _agreement(floor, ref, names, device, reduce)[2] if floor is not None else [None] * len(names)
    for n, c, e, fl in zip(names, cos, err, floors):
        lo, hi = min_cosine, max_rel_norm_error
        if fl is not None and math.isfinite(fl):
            lo, hi = floor_tolerances(fl, min_cosine, max_rel_norm_error)
            report.floor[n] = {"floor": fl, "min_cosine": lo, "max_rel_norm_error": hi}
        if fast.get(n) is None or ref[n] is None:
            side = "fast path" if fast.get(n) is None else "reference"
            report.failed[n] = f"fast-path parity: no gradient on the {side}"
        elif c < lo or e > hi:
            why = f" (widened by its rounding floor {fl:.4f})" if n in report.widened else ""
            report.failed[n] = (f"fast-path gradient disagrees with the eager fp32 reference: cosine {c:.4f} "
                                f"(min {lo:.4g}), relative norm error {e:.4f} (max {hi:.4g}){why}")
    return report


def fast_path_parity(
    module: nn.Module, batch, loss_fn: Callable[[object], torch.Tensor], *,
    fast_context: contextlib.AbstractContextManager | None = None,
    min_cosine: float = 0.99, max_rel_norm_error: float = 0.05, reduce: Reduce | None = None,
    fast_batch=None,
) -> ParityReport:
    """Gradients of the fast path (``module`` as configured -- compiled or not -- under
    ``fast_context``, e.g. bf16 autocast) against the same module run eagerly in fp32 (math SDPA,
    no autocast, no TF32; :func:`eager_fp32`) on one probe ``batch``.

    Args:
        module: the module whose trainable parameters are compared (their ``.grad`` is not
            touched), e.g. the LightningModule.
        batch: the probe batch, passed to ``loss_fn(batch) -> scalar loss`` -- the module's own
            training loss (``pl_module.loss_for_batch``); :func:`slice_batch` cuts it down.
        fast_context: the training forward context (``trainer.precision_plugin.forward_context()``).
        min_cosine, max_rel_norm_error: per-parameter tolerances; see docs/gradient-flow.md for the bf16
            figures they were chosen from. Under mixed precision (autocast to bf16/fp16, or
            bf16/fp16 weights) a third pass, the reference with the fast path's rounding
            (:class:`~bnlit.checks.gradient_flow.rounding.RoundLikeAutocast`), gives each
            gradient's rounding floor, which widens its tolerances (:func:`floor_tolerances`).
        reduce: all-reduce across ranks (each rank probes its own batch; the worst rank decides).
        fast_batch: what the fast path runs instead of ``batch`` (the same loss at another shape:
            :func:`ignore_outside`); default ``batch``.
    """
    params = dict(unique_trainable(module.named_parameters())[0])
    device = next(iter(params.values())).device
    fast_batch = batch if fast_batch is None else fast_batch
    autocast: list[torch.dtype | None] = []  # read inside the call: a precision plugin's context is single-use

    def fast_loss():
        on = torch.is_autocast_enabled(device.type)
        autocast.append(torch.get_autocast_dtype(device.type) if on else None)
        return loss_fn(fast_batch)

    fast = probe_gradients(params, fast_loss, fast_context)
    fast = {n: (None if g is None else g.float()) for n, g in fast.items()}
    with eager_fp32(module) as ref_params, reference_context(device):
        ref = probe_gradients(ref_params, lambda: loss_fn(batch))
    floor = None
    lowered = autocast[0] if autocast else None
    if lowered is None:  # bf16-true / fp16-true weights: the fast path rounds at their dtype
        lowered = next((p.dtype for p in params.values() if p.dtype in (torch.bfloat16, torch.float16)), None)
    if lowered in (torch.bfloat16, torch.float16):
        with eager_fp32(module) as ref_params, reference_context(device), RoundLikeAutocast(lowered):
            floor = probe_gradients(ref_params, lambda: loss_fn(batch))
    return compare_gradients(fast, ref, min_cosine=min_cosine, max_rel_norm_error=max_rel_norm_error, reduce=reduce,
                             floor=floor)

"""The one line that says which fast path a run is really on, e.g.

``fast path: bf16-mixed autocast, torch.compile(fullgraph) x2 blocks + loss, fused AdamW, sdpa=flash,
attention=sdpa:flash (causal), loss=chunked, strategy=fsdp2(16, nccl), mesh=2x8 (replicate x shard),
all-gather=bf16, reduce-scatter=fp32, accumulate=16, workers=4 (prefetch 4, pinned),
peak=312 TFLOP/s bf16 dense (a100 datasheet), hardware=a100``

Every part is read from the live objects after the strategy has set up the model (precision
plugin, compiled submodules, the optimizer's own defaults, torch's SDPA switches, the process
group, the sharded parameters and their FSDP units, the train loader, the peak the throughput
callback resolved for the device), never from config strings, so a switch that did not take effect cannot appear as on. Where the device cannot do what was asked (flash SDPA or pinned memory on a CPU),
the part says what was asked and what runs instead.
"""

from __future__ import annotations

import torch
import torch.nn as nn

SDPA_SWITCHES = {  # bnlit name -> torch.backends.cuda query
    "flash": "flash_sdp_enabled",
    "efficient": "mem_efficient_sdp_enabled",
    "cudnn": "cudnn_sdp_enabled",
    "math": "math_sdp_enabled",
}


def precision_part(plugin) -> str:
    from lightning.pytorch.plugins.precision import MixedPrecision

    name = str(getattr(plugin, "precision", "32-true"))
    if isinstance(plugin, MixedPrecision):
        return f"{name} autocast" + (" + loss scaler" if plugin.scaler is not None else "")
    return name


def compile_part(model: nn.Module, fullgraph: bool) -> str:
    """``torch.compile`` state from the modules themselves (``nn.Module.compile`` sets
    ``_compiled_call_impl``): the whole model, or N blocks and the loss (``bnlit.speed.compile``), or eager."""
    from bnlit.speed.compile import is_compiled

    graph = "(fullgraph)" if fullgraph else ""
    if is_compiled(model):
        return f"torch.compile{graph}"
    n = sum(1 for m in model.modules() if getattr(m, "_compiled_call_impl", None) is not None)
    loss = " + loss" if is_compiled(getattr(model, "loss_fn", None)) else ""
    return f"torch.compile{graph} x{n} blocks{loss}" if n else "eager (no torch.compile)"


def optimizer_part(optimizer: torch.optim.Optimizer) -> str:
    """``fused``/``foreach``/``for-loop``: the kernel the optimizer's step really takes; ``None``
    defaults are resolved the way torch resolves them for these parameters."""
    name = type(optimizer).__name__
    fused, foreach = optimizer.defaults.get("fused"), optimizer.defaults.get("foreach")
    if fused is None and foreach is None:
        from torch.optim.optimizer import _default_to_fused_or_foreach

        params = [p for g in optimizer.param_groups for p in g["params"]]
        fused, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
    kind = "fused" if fused else "foreach" if foreach else "for-loop"
    return f"{kind} {name}"


def sdpa_part(device: torch.device, requested: str = "auto") -> str:
    """On CUDA: the SDPA kernels torch may pick now. Off CUDA those switches do not apply:
    torch's CPU kernel runs (``math`` on CPU calls the math kernel: ``bnlit.speed.sdpa.kernel_fn``),
    and another specific request says so."""
    if device.type == "cuda":
        on = [name for name, query in SDPA_SWITCHES.items() if getattr(torch.backends.cuda, query)()]
        return f"sdpa={on[0]}" if len(on) == 1 else f"sdpa=auto({','.join(on)})"
    if requested == "math" and device.type == "cpu":
        return "sdpa=math"
    if requested != "auto":
        return f"sdpa={device.type} ({requested} requested: CUDA-only, {device.type} kernel instead)"
    return f"sdpa={device.type}"


def attention_part(module) -> str | None:
    """The kernel the module found its training steps dispatch (``LMModule.attention_kernel``,
    PyTorch's own SDPA choice for the step's shapes, dtype and mask) and the mask it runs with."""
    kernel = getattr(module, "attention_kernel", None)
    if kernel is None:
        return None
    return f"attention={kernel} ({'document mask' if getattr(module, 'document_masking', False) else 'causal'})"


def strategy_part(strategy) -> str:
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    world = strategy.world_size
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    for cls, name in ((ModelParallelStrategy, "fsdp2"), (FSDPStrategy, "fsdp"), (DDPStrategy, "ddp")):
        if isinstance(strategy, cls):
            return f"strategy={name}({world}, {backend})"
    return f"strategy=single device ({strategy.root_device.type})"


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def _dtype_name(dtypes: set) -> str:
    return "/".join(sorted(DTYPE_NAMES.get(d, str(d).removeprefix("torch.")) for d in dtypes)) or "?"


def sharding_part(model: nn.Module) -> str | None:
    """FSDP2's mesh and its collectives' dtypes, read from the sharded module itself: the mesh
    and placements of a sharded parameter (a ``DTensor``: ``Shard(0)`` per sharded mesh dim,
    ``Replicate()`` per replicated one), and the ``MixedPrecisionPolicy`` each FSDP unit holds
    applied to its parameters' own dtype the way FSDP applies it (``FSDPParam.init_dtype_attrs``:
    all-gather in ``param_dtype``, else the parameter's dtype; reduce-scatter in ``reduce_dtype``,
    else the all-gather dtype). None when nothing is sharded."""
    from torch.distributed.fsdp import FSDPModule

    gather, reduce, first = set(), set(), None
    for m in model.modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        for fp in group.fsdp_params if group is not None else ():
            first = fp.sharded_param if first is None else first
            g = group.mp_policy.param_dtype or fp.sharded_param.dtype
            gather.add(g)
            reduce.add(group.mp_policy.reduce_dtype or g)
    if first is None:
        return None
    kinds = ["shard" if p.is_shard() else "replicate" for p in first.placements]
    layout = f"{'x'.join(map(str, first.device_mesh.shape))} ({' x '.join(kinds)})"
    return f"mesh={layout}, all-gather={_dtype_name(gather)}, reduce-scatter={_dtype_name(reduce)}"


def loader_part(loader) -> str:
    if loader is None:
        return "workers=?"
    workers = getattr(loader, "num_workers", 0)
    out = f"workers={workers}"
    extras = []
    if workers and getattr(loader, "prefetch_factor", None):
        extras.append(f"prefetch {loader.prefetch_factor}")
    if getattr(loader, "pin_memory", False):
        # torch pins only when an accelerator exists (DataLoader's own rule)
        extras.append("pinned" if torch.accelerator.is_available() else "pin_memory requested: no accelerator")
    return out + (f" ({', '.join(extras)})" if extras else "")


def peak_part(callbacks) -> str | None:
    """The peak MFU is measured against, as the throughput callback resolved it at fit start, and
    the ``hardware=`` profile it came with (``peak=312 TFLOP/s bf16 dense (a100 datasheet),
    hardware=a100``); on a CPU rehearsal of a GPU profile, the measured CPU peak and the profile's."""
    monitor = next((c for c in callbacks if hasattr(c, "hardware") and getattr(c, "peak", None) is not None), None)
    if monitor is None:
        return None
    peak, profile = monitor.peak, monitor.hardware or {}
    if peak.measured:
        out = f"peak={peak.flops / 1e12:.3g} TFLOP/s measured ({peak.device} {peak.dtype} matmul)"
    else:
        origin = f"{peak.key} datasheet" if peak.source.startswith("NVIDIA") else peak.source
        out = f"peak={peak.flops / 1e12:.4g} TFLOP/s {peak.dtype} dense ({origin})"
    name = profile.get("name")
    if not name:
        return out
    figure = (profile.get("peak_tflops") or {}).get(peak.dtype)
    if peak.measured and figure is not None:
        return out + f", hardware={name} ({figure:g} TFLOP/s {peak.dtype} dense on its GPU)"
    return out + f", hardware={name}"


def describe_fast_path(trainer, module) -> str:
    """The ``fast path: ...`` line of a run, from a Trainer whose fit has set up ``module``."""
    model = getattr(module, "model", module)
    parts = [
        precision_part(trainer.precision_plugin),
        compile_part(model, getattr(module, "fullgraph", False)),
        *(optimizer_part(o) for o in trainer.optimizers),
        sdpa_part(module.device, getattr(module, "sdpa_backend", "auto")),
        *filter(None, [attention_part(module)]),
        f"loss={getattr(module, 'loss_impl', 'plain')}",
        strategy_part(trainer.strategy),
        *filter(None, [sharding_part(model)]),
        f"accumulate={trainer.accumulate_grad_batches}",
        loader_part(trainer.train_dataloader),
        *filter(None, [peak_part(trainer.callbacks)]),
    ]
    if getattr(model, "activation_checkpointing", False):
        parts.append("activation checkpointing")
    return "fast path: " + ", ".join(parts)

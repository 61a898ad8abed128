"""The one line that says which fast path a run is really on, e.g.

``fast path: bf16-mixed autocast, torch.compile(fullgraph) x2 blocks + loss, fused AdamW, sdpa=flash,
attention=sdpa:flash (causal), loss=chunked, strategy=fsdp2(2, nccl), accumulate=16, workers=4
(prefetch 4, pinned)``

Every part is read from the live objects after the strategy has set up the model (precision
plugin, compiled submodules, the optimizer's own defaults, torch's SDPA switches, the process
group, the train loader), never from config strings, so a switch that did not take effect cannot
appear as on. Where the device cannot do what was asked (flash SDPA or pinned memory on a CPU),
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
    ``_compiled_call_impl``): the whole model, or N blocks and the loss (``bnlit.compile``), or eager."""
    from bnlit.compile import is_compiled

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
    torch's CPU kernel runs, and a specific request says so."""
    if device.type == "cuda":
        on = [name for name, query in SDPA_SWITCHES.items() if getattr(torch.backends.cuda, query)()]
        return f"sdpa={on[0]}" if len(on) == 1 else f"sdpa=auto({','.join(on)})"
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
        f"accumulate={trainer.accumulate_grad_batches}",
        loader_part(trainer.train_dataloader),
    ]
    if getattr(model, "activation_checkpointing", False):
        parts.append("activation checkpointing")
    return "fast path: " + ", ".join(parts)

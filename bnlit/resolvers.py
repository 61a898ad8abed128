"""What ``conf/`` needs before Hydra composes it, registered on import (idempotent): the
``${bnlit.*}`` OmegaConf resolvers, and the callbacks' config schemas
(:mod:`bnlit.callbacks.schemas`, the ``callbacks/schema`` group each ``conf/callbacks/*.yaml`` starts from)."""

from __future__ import annotations

import os

from omegaconf import OmegaConf


def wandb_offline() -> bool:
    """W&B stays offline unless the user asked for online logging, by WANDB_MODE=online or by
    providing an API key without WANDB_MODE=offline/disabled."""
    mode = os.environ.get("WANDB_MODE", "").lower()
    if mode:
        return mode != "online"
    return not os.environ.get("WANDB_API_KEY")


def rehearsal_devices(strategy) -> int:
    """Processes of a CPU rehearsal (``debug=rehearsal``): 1 for a single-device profile, 2 for a
    distributed strategy (a name such as ``ddp`` or a strategy node such as FSDP2's)."""
    return 1 if strategy in (None, "auto", "single_device") else 2


NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 instructions that multiply bf16 in hardware


def cpu_precision(cpuinfo: str = "/proc/cpuinfo") -> str:
    """``trainer.precision`` of a CPU run: ``bf16-mixed`` where the CPU multiplies bf16 natively
    (the default run's steps take ~0.75x the time of fp32 on an AVX512-BF16 EPYC at the same
    bits/char; docs/getting-started.md "How long the default run takes"), ``32-true`` anywhere else, where bf16 is
    emulated and slower."""
    try:
        flags = next((line.split(":", 1)[1].split() for line in open(cpuinfo) if line.startswith("flags")), [])
    except OSError:
        return "32-true"
    return "bf16-mixed" if any(f in flags for f in NATIVE_BF16_FLAGS) else "32-true"


def cpu_compile() -> bool:
    """``module.compile`` of a CPU run: True where Inductor finds its C++ compiler (the default run's
    step then takes ~0.66x the CPU time of eager after ~38 s of compiling; docs/evaluation.md, the
    levers), False where none is installed, so the run stays eager instead of failing."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception:  # no compiler found (RuntimeError), or an Inductor without this helper
        return False
    return True


def cpu_sdpa(precision: str) -> str:
    """``module.sdpa_backend`` of a CPU run at ``precision``: ``math`` (the math kernel) under bf16,
    where the default run's compiled step takes 0.79x the time of CPU flash, ``auto`` (CPU flash)
    in fp32, where math takes 1.08x (paired, ``scripts/bench_attention.py``; docs/throughput.md)."""
    return "math" if "bf16" in str(precision) else "auto"


def register() -> None:
    if not OmegaConf.has_resolver("bnlit.wandb_offline"):
        OmegaConf.register_new_resolver("bnlit.wandb_offline", wandb_offline)
    if not OmegaConf.has_resolver("bnlit.rehearsal_devices"):
        OmegaConf.register_new_resolver("bnlit.rehearsal_devices", rehearsal_devices)
    if not OmegaConf.has_resolver("bnlit.cpu_precision"):
        OmegaConf.register_new_resolver("bnlit.cpu_precision", cpu_precision)
    if not OmegaConf.has_resolver("bnlit.cpu_sdpa"):
        OmegaConf.register_new_resolver("bnlit.cpu_sdpa", cpu_sdpa)
    if not OmegaConf.has_resolver("bnlit.cpu_compile"):
        OmegaConf.register_new_resolver("bnlit.cpu_compile", cpu_compile)
    from bnlit.callbacks import schemas  # the callbacks import most of bnlit: only when configs compose

    schemas.register()


register()

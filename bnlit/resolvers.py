"""OmegaConf resolvers used by ``conf/``; registered on import (idempotent)."""

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


def register() -> None:
    if not OmegaConf.has_resolver("bnlit.wandb_offline"):
        OmegaConf.register_new_resolver("bnlit.wandb_offline", wandb_offline)
    if not OmegaConf.has_resolver("bnlit.rehearsal_devices"):
        OmegaConf.register_new_resolver("bnlit.rehearsal_devices", rehearsal_devices)


register()

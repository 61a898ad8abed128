"""Lightning's ``WandbLogger`` as bnlit configures it (``conf/logger/wandb.yaml``)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger


class WandbLogger(LightningWandbLogger):
    """Lightning's logger without the ``anonymous=None`` it always passes to ``wandb.init``: W&B
    0.31 deprecated that setting and warns on every run about a value nobody set. One W&B run per
    job (finished at the job's end) is ``bnlit.train``'s part (``finish_wandb_run``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)

"""Which Lightning strategy a ``trainer.strategy`` setting builds, and whether it shards parameters
(``trainer=fsdp``'s own strategy: :mod:`bnlit.fsdp`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hydra.utils import get_class
from lightning.pytorch.strategies import Strategy, StrategyRegistry


def strategy_class(strategy: Any) -> type[Strategy]:
    """The Lightning strategy class a ``trainer.strategy`` setting will build: an instance, a
    Hydra node with ``_target_``, or a registered name (``ddp``, ``fsdp``, ...). ``auto`` and
    unknown names give :class:`Strategy` (Lightning then picks a single-device or DDP strategy)."""
    if isinstance(strategy, Strategy):
        return type(strategy)
    if isinstance(strategy, Mapping) and "_target_" in strategy:
        return get_class(strategy["_target_"])
    if isinstance(strategy, str) and strategy in StrategyRegistry:
        return StrategyRegistry[strategy]["strategy"]
    return Strategy


def sharded_strategy(strategy: Any) -> bool:
    """Whether ``strategy`` (as :func:`strategy_class` reads it) shards parameters across ranks
    (FSDP, ModelParallel): each rank then holds a shard of every parameter and of its gradient."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    return issubclass(strategy_class(strategy), (FSDPStrategy, ModelParallelStrategy))


"""The callbacks' config schemas: one structured config per callback, generated from its class's
signature (or the settings dataclass it forwards ``**settings`` to), registered in Hydra's
ConfigStore as ``callbacks/schema/<name>``. Each default is written once, in the class; a
``conf/callbacks/<name>.yaml`` starts from its schema and writes only what differs, and every
argument can be overridden without ``++`` (``callbacks.nan_guard.policy=skip``): the schema
lists it, and keeps struct mode's refusal of a misspelt key."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from bnlit.callbacks.dead_vocabulary import DeadVocabulary
from bnlit.callbacks.fertility import FertilityCheck
from bnlit.callbacks.gradient_flow import GradientFlowArbiter
from bnlit.callbacks.interrupt import InterruptCheckpoint
from bnlit.callbacks.multiple_choice import MultipleChoiceEval
from bnlit.callbacks.nan_guard import NaNGuard
from bnlit.callbacks.progress_bar import RunProgressBar
from bnlit.callbacks.random_twin import RandomTwinNLL
from bnlit.callbacks.starvation import LanguageStarvation
from bnlit.callbacks.threads import ThreadsFollowLoad
from bnlit.callbacks.throughput import ThroughputMonitor
from bnlit.checks.fertility import FertilitySettings
from bnlit.checks.gradient_flow import ArbiterSettings
from bnlit.evaluation.heldout import TwinSettings
from bnlit.speed.throughput import MFUFloor

GROUP = "callbacks/schema"

# config name (``callbacks.<name>``) -> the callback class
CALLBACKS: dict[str, type] = {
    "dead_vocabulary": DeadVocabulary,
    "fertility": FertilityCheck,
    "gradient_flow": GradientFlowArbiter,
    "interrupt": InterruptCheckpoint,
    "multiple_choice": MultipleChoiceEval,
    "nan_guard": NaNGuard,
    "progress_bar": RunProgressBar,
    "random_twin": RandomTwinNLL,
    "starvation": LanguageStarvation,
    "threads": ThreadsFollowLoad,
    "throughput": ThroughputMonitor,
}
# a class whose ``__init__`` forwards ``**kwargs`` -> the dataclass that takes them
FORWARDED: dict[type, type] = {
    FertilityCheck: FertilitySettings,
    GradientFlowArbiter: ArbiterSettings,
    RandomTwinNLL: TwinSettings,
    ThroughputMonitor: MFUFloor,
}


def _config_value(value: Any) -> Any:
    """A default as a config holds it: tuples as lists, mappings as dicts."""
    if isinstance(value, (tuple, list)):
        return [_config_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _config_value(v) for k, v in value.items()}
    return value


def arguments(cls: type) -> dict[str, Any]:
    """``{argument: default}`` of everything a config may set on ``cls`` (``MISSING`` for an
    argument without a default): the ``__init__`` parameters, with ``**kwargs`` replaced by the
    init fields of the dataclass they are forwarded to. A parameter whose default is a function
    (a clock, for tests) is not configurable."""
    out: dict[str, Any] = {}
    for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if p.kind is p.VAR_KEYWORD:
            target = FORWARDED[cls]
            for f in dataclasses.fields(target):
                if f.init:
                    default = f.default if f.default is not dataclasses.MISSING else (
                        f.default_factory() if f.default_factory is not dataclasses.MISSING else MISSING)
                    out[f.name] = _config_value(default)
        elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and (p.default is p.empty or not callable(p.default)):
            out[p.name] = MISSING if p.default is p.empty else _config_value(p.default)
    return out


def schema(name: str, cls: type) -> type:
    """A dataclass with ``_target_`` and one ``Any`` field per argument of ``cls``, its default the class's."""
    fields = [("_target_", str, dataclasses.field(default=f"{cls.__module__}.{cls.__qualname__}"))]
    for arg, default in arguments(cls).items():
        mutable = isinstance(default, (list, dict))
        fields.append((arg, Any, dataclasses.field(default_factory=lambda d=default: _config_value(d)) if mutable
                       else dataclasses.field(default=default)))
    return dataclasses.make_dataclass(f"{cls.__name__}Config", fields)


def register() -> None:
    """Store every callback's schema in the ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    for name, cls in CALLBACKS.items():
        cs.store(group=GROUP, name=name, node=schema(name, cls))

"""Each callback default is written once, in its class: ``conf/callbacks/<name>.yaml`` starts from
the schema generated from the class (``bnlit.callbacks.schemas``) and writes only what differs;
every argument can be overridden without ``++``, a misspelt one is refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from bnlit import CONF_DIR
from bnlit.callbacks import schemas
from bnlit.errors import ConfigError

ROOT = CONF_DIR.parent
CALLBACK_FILES = sorted(p for p in (CONF_DIR / "callbacks").glob("*.yaml")
                        if "bnlit.callbacks." in p.read_text() or f"schema/{p.stem}@" in p.read_text())


def restated_defaults(name: str, text: str) -> list[str]:
    """The keys a callback file writes that its schema already holds, with the same value (and a
    written ``_target_``, which the schema holds too)."""
    body = OmegaConf.to_container(OmegaConf.create(text), resolve=False).get(name) or {}  # 1.0e6 a float, as Hydra reads it
    args = schemas.arguments(schemas.CALLBACKS[name])
    out = ["_target_"] if "_target_" in body else []
    for key, value in body.items():
        if key in args and args[key] == value:
            out.append(key)
    return out


def test_every_bnlit_callback_file_has_a_schema():
    names = {p.stem for p in CALLBACK_FILES}
    assert names == set(schemas.CALLBACKS), "a conf/callbacks file without a schema, or a schema without a file"
    for p in CALLBACK_FILES:
        defaults = yaml.safe_load(p.read_text())["defaults"]
        assert defaults[0] == f"schema/{p.stem}@{p.stem}" and "_self_" in defaults, p


@pytest.mark.parametrize("path", CALLBACK_FILES, ids=lambda p: p.stem)
def test_a_callback_file_writes_only_what_differs_from_its_class(path):
    assert restated_defaults(path.stem, path.read_text()) == []


def test_a_restated_default_is_found():
    assert restated_defaults("nan_guard", "nan_guard:\n  policy: halt\n  max_skips: 3\n") == ["policy"]
    assert restated_defaults("gradient_flow", "gradient_flow:\n  _target_: x\n  vanishing_factor: 1.0e6\n") == [
        "_target_", "vanishing_factor"]


def test_the_schema_is_the_class_signature():
    assert schemas.arguments(schemas.CALLBACKS["nan_guard"]) == dict(
        policy="halt", max_skips=10, spike_factor=3.0, spike_warmup=20, ema_beta=0.98, check_grads=True)
    throughput = schemas.arguments(schemas.CALLBACKS["throughput"])
    assert "clock" not in throughput and "low" not in throughput  # a test hook and a counter are no settings
    assert throughput["min_mfu_pct"] == 20.0 and throughput["window_steps"] == 50  # **floor: MFUFloor's fields


def test_the_composed_callbacks_hold_every_argument_and_build(make_cfg):
    cfg = make_cfg(tiny=False)
    for name, cls in schemas.CALLBACKS.items():
        node = cfg.callbacks[name]
        assert set(node) == {"_target_", *schemas.arguments(cls)}, name
        assert isinstance(instantiate(node), cls)


def documented_overrides() -> list[str]:
    """``callbacks.<name>.<key>=`` overrides the docs give without ``+``/``++``."""
    texts = [p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]]
    found = {m.group(1) for t in texts for m in re.finditer(r"(?<![+\w.])(callbacks\.\w+\.[\w.]+)=", t)}
    return sorted(found)


def test_documented_overrides_need_no_plus(make_cfg):
    overrides = documented_overrides()
    assert "callbacks.nan_guard.policy" in overrides, "the docs' overrides were not read"
    cfg = make_cfg(tiny=False)
    for key in overrides:
        assert OmegaConf.select(cfg, key, throw_on_missing=False, default="<absent>") != "<absent>", key
    # and a value goes in without ++, once per callback
    cfg = make_cfg("callbacks.nan_guard.policy=skip", "callbacks.random_twin.learning_after_steps=5",
                   "callbacks.threads.every_n_steps=7", "callbacks.throughput.peak_tflops=100",
                   "callbacks.dead_vocabulary.sample=3", "callbacks.starvation.patience=2",
                   "callbacks.progress_bar.leave=true", "callbacks.interrupt.signals=[SIGTERM]",
                   "callbacks.multiple_choice.max_items=5", "callbacks.fertility.max_factor=2.0",
                   "callbacks.gradient_flow.every_n_steps=10", tiny=False)
    assert cfg.callbacks.nan_guard.policy == "skip" and cfg.callbacks.random_twin.learning_after_steps == 5
    assert cfg.callbacks.threads.every_n_steps == 7 and cfg.callbacks.interrupt.signals == ["SIGTERM"]


def test_a_misspelt_argument_is_refused(make_cfg):
    with pytest.raises(Exception, match="polcy"):
        make_cfg("callbacks.nan_guard.polcy=skip")


def test_a_bad_value_is_still_refused_by_the_class(make_cfg):
    cfg = make_cfg("callbacks.nan_guard.policy=ignore")
    with pytest.raises(InstantiationException) as e:
        instantiate(cfg.callbacks.nan_guard)
    assert isinstance(e.value.__cause__, ConfigError) and "callbacks.nan_guard.policy='ignore'" in str(e.value)

"""Every option of every config group composes; the CPU-runnable ones instantiate."""

from pathlib import Path

import pytest
from hydra.utils import instantiate

from bnlit import CONF_DIR

GROUPS = ["model", "trainer", "hardware", "callbacks", "logger", "optimizer", "scheduler", "data", "experiment"]


def options(group):
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes(make_cfg, group, option, tmp_path):
    extra = []
    if group == "data" and option == "files":
        extra = [f"data.sources.0.path={tmp_path}/a.txt", f"data.sources.1.path={tmp_path}/b.txt"]
    cfg = make_cfg(f"{group}={option}", *extra, tiny=False)
    assert cfg.model.config.name
    if group in ("logger", "callbacks"):
        for node in (cfg[group] or {}).values():
            instantiate(node)
    if group in ("optimizer", "scheduler"):
        instantiate(cfg[group])


def test_h100_composes_the_production_setup(make_cfg):
    cfg = make_cfg("model=400m", "trainer=h100", tiny=False)
    assert cfg.trainer.precision == "bf16-mixed" and cfg.trainer.accelerator == "gpu"
    assert cfg.module.compile is True and cfg.module.sdpa_backend == "auto" and cfg.module.loss_impl == "chunked"
    assert cfg.optimizer.fused is True
    tokens = cfg.data.batch_size * cfg.trainer.accumulate_grad_batches * cfg.data.seq_len
    assert cfg.data.seq_len == 2048 and tokens == 524288
    assert cfg.optimizer.lr == pytest.approx(3e-4)


@pytest.mark.parametrize("trainer", options("trainer"))
def test_hardware_a100_composes_with_every_trainer_profile(make_cfg, trainer):
    """The device and the layout are independent: hardware=a100 under any trainer= profile gives the
    A100's name and peaks, and the trainer node is the one the same profile gets on an H100."""
    a100 = make_cfg(f"trainer={trainer}", "hardware=a100", tiny=False)
    h100 = make_cfg(f"trainer={trainer}", "hardware=h100", tiny=False)
    assert a100.hardware.name == "a100" and a100.hardware.peak_tflops.bf16 == 312
    assert a100.callbacks.throughput.hardware.name == "a100"  # what the fast path line and MFU read
    assert a100.trainer == h100.trainer
    assert (a100.trainer.accelerator, a100.trainer.precision) == ("gpu", "bf16-mixed")


def test_gpu_trainer_profiles_default_to_h100_and_the_command_line_wins(make_cfg):
    for trainer in ("single", "h100", "multigpu", "multinode", "fsdp"):
        assert make_cfg(f"trainer={trainer}", tiny=False).hardware.name == "h100"
        assert make_cfg(f"trainer={trainer}", "hardware=b200", tiny=False).hardware.name == "b200"
    assert make_cfg(tiny=False).hardware.name == "cpu"
    assert make_cfg("experiment=bn_400m_h100", "hardware=h200", tiny=False).hardware.name == "h200"


def test_fsdp_on_a100_composes_the_documented_command(make_cfg):
    cfg = make_cfg("model=1b", "trainer=fsdp", "hardware=a100", tiny=False)
    assert cfg.trainer.strategy._target_ == "bnlit.fsdp.FSDP2Strategy"
    assert cfg.callbacks.throughput.hardware.peak_tflops.bf16 == 312
    assert cfg.module.compile is True and cfg.optimizer.fused is True and cfg.data.batch_size == 16


def test_multinode_keeps_the_global_batch(make_cfg):
    cfg = make_cfg("model=400m", "trainer=multinode", tiny=False)
    world = cfg.trainer.devices * cfg.trainer.num_nodes
    assert cfg.trainer.strategy == "ddp"
    assert world * cfg.data.batch_size * cfg.trainer.accumulate_grad_batches * cfg.data.seq_len == 1 << 20


def test_pyproject_installs_every_package():
    """The explicit package list in pyproject.toml (needed for the callbacks/ -> bnlit.callbacks
    mapping) names every package directory, so a new subpackage is never left out of a wheel."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(root).parts) for p in (root / "bnlit").rglob("__init__.py")}
    on_disk |= {"bnlit.callbacks"} if (root / "callbacks" / "__init__.py").is_file() else set()
    assert set(setup["packages"]) == on_disk
    assert setup["package-dir"] == {"bnlit.callbacks": "callbacks"}

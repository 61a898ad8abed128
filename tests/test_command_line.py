"""The command line checked before Hydra runs (bnlit/command_line.py): an override of a key that no
config group or schema defines is refused in one line naming the closest key, with or without
``+``; documented free-form fields and schema keys pass; a group option that does not exist and an
output directory that cannot be written are one line each."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bnlit import CONF_DIR
from bnlit.command_line import check_command_line
from bnlit.errors import ConfigError
from conftest import TINY

HINT = "(python -m bnlit.train --cfg job lists every key)"


def check(tmp_path, *overrides: str) -> None:
    check_command_line([*overrides, f"hydra.run.dir={tmp_path}/run"], CONF_DIR)


def refusal(tmp_path, *overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        check(tmp_path, *overrides)
    return str(e.value)


@pytest.mark.parametrize("override,closest", [
    ("+learning_rate=1e-3", "optimizer.lr"),  # the spelling Hydra's own message suggests
    ("learning_rate=1e-3", "optimizer.lr"),
    ("+lr=1e-3", "optimizer.lr"),
    ("trainer.max_stepz=5", "trainer.max_steps"),
    ("+batch_size=8", "data.batch_size"),
    ("+model.config.n_layers=4", "model.config.n_layer"),
    ("+data.sources.0.max_dcos=20", "data.sources.0.max_docs"),  # a field of a source record
    ("++optimizer.betaz=[0.9,0.95]", "optimizer.betas"),
])
def test_unknown_key_is_refused_with_the_closest_known_key(tmp_path, override, closest):
    key = override.lstrip("+").split("=")[0]
    assert refusal(tmp_path, *TINY, override) == (f"{override}: no config group or schema defines {key}, so nothing "
                                                  f"would read it; did you mean {closest}? {HINT}")


@pytest.mark.parametrize("overrides", [
    TINY,  # +data.sources.<i>.max_docs: a field of bnlit.data.sources.Source
    ["+trainer.profiler=simple"],  # an argument of lightning.Trainer that the YAML does not list
    ["++callbacks.random_twin.learning_after_steps=8"],  # an argument of the callback's class
    ["+logger.wandb.entity=lab"],  # WandbLogger passes **kwargs to wandb.init
    ["+callbacks.poison._target_=test_nan_guard.Poison", "+callbacks.poison.batch_idx=2"],  # a callback of your own
    ["+callbacks.multiple_choice.tasks.belebele_bn=/data/belebele/ben_Beng.jsonl"],  # documented free-form
    ["~callbacks.progress_bar", "trainer.max_steps=4", "optimizer.lr=1e-3,3e-3"],
    ["model=tiny,25m", "hparams_search=optuna"],
    ["data=files", "data.sources.0.path=bn.txt", "data.sources.1.path=en.jsonl"],  # keys whose value is ???
])
def test_known_keys_and_free_form_fields_pass(tmp_path, overrides):
    check(tmp_path, *overrides)


def test_a_new_callback_needs_its_target(tmp_path):
    assert refusal(tmp_path, "+callbacks.foo.batch_idx=2").startswith(
        "+callbacks.foo.batch_idx=2: no config group or schema defines callbacks.foo.batch_idx")


def test_add_of_a_defined_key_and_delete_of_an_unknown_one(tmp_path):
    assert refusal(tmp_path, "+optimizer.lr=2e-3") == ("+optimizer.lr=2e-3: optimizer.lr is already defined (value 0.01); "
                                                       "drop the + to override it: optimizer.lr=2e-3")
    assert refusal(tmp_path, "~callbacks.progres_bar").startswith(
        "~callbacks.progres_bar: no config group or schema defines callbacks.progres_bar, so nothing to delete; "
        "did you mean callbacks.progress_bar?")
    # a schema key without +: Hydra would refuse it; the line says how to add it
    assert refusal(tmp_path, "trainer.profiler=simple") == ("trainer.profiler=simple: trainer.profiler is not in the "
                                                            "config yet; add it with +trainer.profiler=simple")


def test_group_option_that_does_not_exist(tmp_path):
    assert refusal(tmp_path, "model=tinyy") == ("model=tinyy: model has no option 'tinyy'; did you mean model=tiny? "
                                                "options: 125m, 1b, 25m, 400m, tiny")
    assert refusal(tmp_path, "-m", "model=tiny,40m").startswith("model=tiny,40m: model has no option '40m'; "
                                                                 "did you mean model=400m?")


def test_optuna_parameters_must_be_keys(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from bnlit.command_line import check_overrides

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["hparams_search=optuna"], return_hydra_config=True)
    check_overrides(cfg, [])
    with open_dict(cfg):
        cfg.hydra.sweeper.params["optimizer.lrr"] = "interval(1e-4, 1e-2)"
    with pytest.raises(ConfigError, match=r"^hydra.sweeper.params.optimizer.lrr: no config group or schema defines "
                                          r"optimizer.lrr, so nothing would read it; did you mean optimizer.lr\?"):
        check_overrides(cfg, [])


def test_output_dir_that_cannot_be_written(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ConfigError) as e:
        check_command_line([f"hydra.run.dir={blocker}/run"], CONF_DIR)
    assert str(e.value) == f"hydra.run.dir={blocker}/run: {blocker} is a file, not a directory; choose another hydra.run.dir"
    with pytest.raises(ConfigError) as e:
        check_command_line(["-m", "hydra.sweep.dir=/proc/bnlit/sweep"], CONF_DIR)
    assert str(e.value).startswith("hydra.sweep.dir=/proc/bnlit/sweep: cannot write in /proc (the nearest existing "
                                   "directory on its path): ")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root to run as another user")
def test_read_only_output_dir_as_another_user():
    """A directory its user may not write (as root, every directory is writable, so the command runs
    as nobody): one line, exit 2, before Hydra's mkdir."""
    import tempfile

    as_nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable]
    if subprocess.run([*as_nobody, "-c", "import bnlit.train"], capture_output=True, cwd="/").returncode != 0:
        pytest.skip("machine: nobody cannot import bnlit from this checkout (a parent directory is private)")
    top = Path(tempfile.mkdtemp(prefix="bnlit-ro-", dir="/tmp"))  # pytest's tmp_path is private to root
    try:
        ro, home = top / "ro", top / "home"
        home.mkdir()
        ro.mkdir(mode=0o555)
        os.chmod(top, 0o755)
        shutil.chown(home, "nobody")
        out = subprocess.run([*as_nobody, "-m", "bnlit.train", f"hydra.run.dir={ro}/run"], capture_output=True, text=True, timeout=300,
                             cwd=ro, env=dict(os.environ, HOME=str(home), MPLCONFIGDIR=str(home)))
    finally:
        shutil.rmtree(top)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip() == (f"error: hydra.run.dir={ro}/run: cannot write in {ro} (the nearest existing directory "
                                  "on its path): Permission denied; choose another hydra.run.dir (or paths.log_dir for "
                                  "the default run dirs)")


def test_a_missing_hydra_plugin_names_the_extra(monkeypatch):
    """``hparams_search=optuna`` after the quick-start install (no sweeps extra): Hydra cannot find
    hydra/sweeper/optuna; the line says what to install (.ci/quickstart runs it for real)."""
    import bnlit.command_line as command_line

    monkeypatch.setattr(command_line, "_importable", lambda module: False)
    error = command_line.composition_error(Exception("In 'hparams_search/optuna': Could not load 'hydra/sweeper/optuna'."
                                                     "\n\nAvailable options in 'hydra/sweeper':\n\tbasic"))
    assert str(error) == ("this command needs Hydra's Optuna sweeper (hydra/sweeper/optuna), which is not installed; "
                          "pip install -e '.[sweeps]'")
    other = command_line.composition_error(Exception("Interpolation key 'x' not found\n    full_key: y"))
    assert str(other) == "Interpolation key 'x' not found (HYDRA_FULL_ERROR=1 shows Hydra's whole message)"

"""Bad inputs through the real entry point (``bnlit.train.main`` with a command line): each gives
one ``error:`` line, a non-zero exit and leaves the artifacts already written untouched. The
skeleton's cases (missing/empty/non-UTF-8 data file, tokenizer size, seq_len, unknown preset,
foreign run dir, hub without network) live in test_train.py and test_data.py."""

from __future__ import annotations

import errno
import shutil
import sys
from pathlib import Path

import pytest
import torch

import bnlit.data.shards as shards
import bnlit.data.sources as sources
from bnlit.checkpointing import AtomicCheckpointIO
from bnlit.train import main
from conftest import TINY


def run_main(run_dir: Path, *overrides: str, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bnlit.train", *TINY, f"hydra.run.dir={run_dir}", *overrides])
    capsys.readouterr()
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip() and not l.startswith(("[", "INFO", "WARNING"))]
    return code, err


@pytest.fixture
def cli(monkeypatch, capsys, cache_dir):
    """``cli(run_dir, *overrides) -> (exit code, stderr lines)`` through ``main`` in this process."""
    return lambda run_dir, *overrides: run_main(run_dir, *overrides, monkeypatch=monkeypatch, capsys=capsys)


@pytest.fixture(scope="module")
def good_run(cache_dir, tmp_path_factory):
    """A finished 4-step run shared by the checkpoint cases (none may change it), and the bytes of
    its last checkpoint."""
    run = tmp_path_factory.mktemp("good") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["bnlit.train", *TINY, f"hydra.run.dir={run}"])
        main()
    last = run / "checkpoints" / "last.ckpt"
    return run, last, last.read_bytes()


def only_error(err: list[str]) -> str:
    errors = [l for l in err if l.startswith("error: ")]
    assert len(errors) == 1, err
    return errors[0]


def test_truncated_checkpoint(cli, good_run, tmp_path):
    run, last, before = good_run
    bad = tmp_path / "truncated.ckpt"
    bad.write_bytes(before[: len(before) // 2])
    code, err = cli(run, f"ckpt_path={bad}")
    assert code == 2
    assert only_error(err).startswith(f"error: checkpoint {bad} is truncated or corrupt (")
    assert last.read_bytes() == before


def test_foreign_file_as_checkpoint(cli, good_run, tmp_path):
    run, last, before = good_run
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"weights": torch.ones(2)}, foreign)
    code, err = cli(run, f"ckpt_path={foreign}")
    assert code == 2 and "is not a bnlit training checkpoint" in only_error(err)
    assert last.read_bytes() == before


def test_checkpoint_of_another_model_shape(cli, good_run):
    run, last, before = good_run
    code, err = cli(run, "ckpt_path=last", "model.config.dim=96", "trainer.max_steps=6")
    assert code == 2
    assert only_error(err) == (f"error: ckpt_path={last} holds a tiny model of another shape: dim=64 (config: 96); "
                               "resume with model=tiny or start a fresh run")
    assert last.read_bytes() == before


def test_missing_checkpoint_file(cli, tmp_path):
    code, err = cli(tmp_path / "r", f"ckpt_path={tmp_path}/nope.ckpt")
    assert code == 2 and only_error(err).startswith(f"error: ckpt_path={tmp_path}/nope.ckpt: no such file")


def test_config_typo_names_the_key(tmp_path, cache_dir):
    import subprocess

    out = subprocess.run([sys.executable, "-m", "bnlit.train", "trainer.max_stepz=5", f"hydra.run.dir={tmp_path}/r"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "Could not override 'trainer.max_stepz'" in out.stderr and "Key 'max_stepz' is not in struct" in out.stderr
    assert not (tmp_path / "r").exists()  # refused before any output


def test_shard_that_does_not_match_its_index(cli, good_run, cache_dir, tmp_path, monkeypatch):
    run, last, before = good_run
    cache = tmp_path / "cache"
    shutil.copytree(cache_dir, cache)  # a private copy of the built cache: this test damages it
    damaged = sorted(cache.glob("shards/*/*.train.bin"))  # every shard set the session built so far
    for shard in damaged:
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size - 2)
    code, err = cli(tmp_path / "second", "trainer.max_steps=1", f"paths.cache_dir={cache}")
    assert code == 2
    line = only_error(err)
    named = line.split("error: shard ", 1)[1].split(" does not match its index (", 1)[0]
    assert Path(named) in damaged and "; delete " in line and line.endswith(" to rebuild")
    assert last.read_bytes() == before


def test_hub_dataset_without_network_through_a_run(cli, tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "hub_reachable", lambda timeout=3.0: False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, err = cli(tmp_path / "r", "data.sources.0.path=null", "+data.sources.0.hub_id=nobody/no-such-bangla-set",
                    f"paths.cache_dir={tmp_path}/cache")
    assert code == 2
    assert "hub dataset nobody/no-such-bangla-set is not cached" in only_error(err)
    assert not (tmp_path / "r" / "checkpoints").exists()


@pytest.mark.slow  # trains a tokenizer and builds shards twice in a private cache
def test_disk_full_while_writing_shards(cli, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    real = shards._build_source
    built = []

    def full_disk(work, name, *a, **k):
        if built:  # the second source's shard file hits a full disk
            with open(work / f"{name}.train.bin", "ab") as f:
                f.write(b"\0" * 10)
            raise OSError(errno.ENOSPC, "No space left on device", str(work / f"{name}.train.bin"))
        built.append(name)
        return real(work, name, *a, **k)

    monkeypatch.setattr(shards, "_build_source", full_disk)
    code, err = cli(tmp_path / "r", f"paths.cache_dir={cache}")
    assert code == 2
    line = only_error(err)
    assert line.startswith("error: no space left on device writing ") and "free space under paths.cache_dir=" in line
    assert not list((cache / "shards").glob("*/index.json"))  # no half-built shard set looks finished
    monkeypatch.setattr(shards, "_build_source", real)
    code, err = cli(tmp_path / "r2", f"paths.cache_dir={cache}", "trainer.max_steps=1")  # space freed: it completes
    assert code == 0, err
    assert len(list((cache / "shards").glob("*/index.json"))) == 1


def test_disk_full_while_writing_a_checkpoint(cli, tmp_path, monkeypatch):
    run = tmp_path / "r"
    saves = []
    real = AtomicCheckpointIO._serialize

    def serialize(self, checkpoint, f):
        saves.append(checkpoint["global_step"])
        if checkpoint["global_step"] >= 4:
            f.write(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, checkpoint, f)

    monkeypatch.setattr(AtomicCheckpointIO, "_serialize", serialize)
    code, err = cli(run, "trainer.max_steps=6")
    assert code == 2
    line = only_error(err)
    assert line.startswith(f"error: cannot write checkpoint {run}/checkpoints/step0000004.ckpt: No space left on device")
    last = run / "checkpoints"
    assert sorted(p.name for p in last.iterdir() if "ckpt" in p.name) == ["last.ckpt", "step0000002.ckpt"]
    assert torch.load(last / "last.ckpt", weights_only=True)["global_step"] == 2


def test_nan_halt_is_one_line_and_exit_3(cli, tmp_path):
    code, err = cli(tmp_path / "r", "+callbacks.poison._target_=test_nan_guard.Poison", "+callbacks.poison.batch_idx=1")
    assert code == 3
    assert only_error(err).startswith("error: non-finite loss (nan) at step 1, batch index 1 (epoch 0)")


def test_unknown_guard_policy(cli, tmp_path):
    code, err = cli(tmp_path / "r", "callbacks.nan_guard.policy=ignore")
    assert code == 2
    assert only_error(err) == "error: callbacks.nan_guard.policy='ignore': use one of ['halt', 'skip']"

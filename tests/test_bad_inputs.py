"""Bad inputs through the real entry point (``bnlit.train.main`` with a command line): each gives
one ``error:`` line, a non-zero exit and leaves the artifacts already written untouched. The
skeleton's cases (missing/empty/non-UTF-8 data file, tokenizer size, seq_len, unknown preset,
foreign run dir, hub without network) live in test_train.py and test_data.py."""

from __future__ import annotations

import errno
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np
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
    # `last` resolves to the newest complete checkpoint by step: last.ckpt or the step file of the same step
    assert re.fullmatch(rf"error: ckpt_path={re.escape(str(last.parent))}/(last|step\d{{7}})\.ckpt holds a tiny model of "
                        r"another shape: dim=64 \(config: 96\); resume with model=tiny or start a fresh run",
                        only_error(err)), only_error(err)
    assert last.read_bytes() == before


def test_resume_of_a_run_dir_without_checkpoints_is_one_line(cli, tmp_path):
    code, err = cli(tmp_path / "r", "ckpt_path=last")
    assert code == 2
    assert only_error(err) == (f"error: ckpt_path=last: no complete checkpoint in {tmp_path}/r/checkpoints; set "
                               "hydra.run.dir to the run you want to resume")  # once (only_error: exactly one line)
    assert not (tmp_path / "r").exists()


def test_missing_checkpoint_file(cli, tmp_path):
    code, err = cli(tmp_path / "r", f"ckpt_path={tmp_path}/nope.ckpt")
    assert code == 2 and only_error(err).startswith(f"error: ckpt_path={tmp_path}/nope.ckpt: no such file")


def test_config_typo_names_the_key(tmp_path, cache_dir):
    import subprocess

    out = subprocess.run([sys.executable, "-m", "bnlit.train", "trainer.max_stepz=5", f"hydra.run.dir={tmp_path}/r"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == ("error: trainer.max_stepz=5: no config group or schema defines trainer.max_stepz, so "
                                  "nothing would read it; did you mean trainer.max_steps? (python -m bnlit.train --cfg "
                                  "job lists every key)")
    assert not (tmp_path / "r").exists()  # refused before any output


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (``None`` for a directory)."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def test_refused_run_leaves_an_existing_run_dir_byte_identical(cli, good_run):
    """Refused after Hydra composed it (a fresh run into a run dir with checkpoints): the run's
    record (.hydra/*.yaml, train.log) is what it was; bnlit writes it only once a run is accepted."""
    run, last, before = good_run
    was = snapshot(run)
    assert {".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "train.log"} <= set(was)
    code, err = cli(run, "optimizer.lr=0.5", "model.config.dim=128")
    assert code == 2 and "already holds checkpoints of another run" in only_error(err)
    assert snapshot(run) == was


@pytest.mark.parametrize("overrides", [["trainer.max_steps=0"], ["+learning_rate=1e-3"]])
def test_refused_run_leaves_no_new_directory(cli, tmp_path, monkeypatch, overrides):
    """Refused in the job (a bad value) or before Hydra starts (an unknown key): no run dir, no
    ``outputs/``, in the directory the command ran in."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["bnlit.train", *TINY, *overrides])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2
    assert list(tmp_path.iterdir()) == []


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


def test_shard_whose_bytes_changed_is_refused_before_training(cli, good_run, cache_dir, tmp_path):
    """Same size, other tokens (all inside the vocabulary, so nothing downstream would notice):
    the block checksums in the index catch it when the data module opens the shards."""
    cache = tmp_path / "cache"
    shutil.copytree(cache_dir, cache)
    damaged = sorted(cache.glob("shards/*/bn_books.train.bin"))
    for shard in damaged:
        tokens = np.fromfile(shard, dtype=np.uint16)
        mid = len(tokens) // 2
        before = tokens[mid:mid + 32].copy()
        # ids from the same shard stay inside its vocabulary (the session cache holds shards of other
        # tests' tokenizers too, of other sizes)
        tokens[mid:mid + 32] = np.roll(before, 1) if len(set(before.tolist())) > 1 else before + 1
        assert not np.array_equal(tokens[mid:mid + 32], before) and tokens.max() == np.fromfile(shard, dtype=np.uint16).max()
        tokens.tofile(shard)
    code, err = cli(tmp_path / "second", "trainer.max_steps=1", f"paths.cache_dir={cache}")
    assert code == 2
    line = only_error(err)
    named = line.split("error: shard ", 1)[1].split(" is corrupt: block 0 (bytes 0-", 1)[0]
    assert Path(named) in damaged, line
    assert f"; delete {Path(named).parent} and rerun to rebuild it" in line
    assert not (tmp_path / "second" / "checkpoints").exists()  # refused before training
    assert not (tmp_path / "second" / "csv").exists() or not list((tmp_path / "second" / "csv").glob("*.csv"))


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
    real = shards.block_checksums
    built = []

    def full_disk(path, *a, **k):
        if built:  # the shard file written after the first one hits a full disk
            with open(path, "ab") as f:
                f.write(b"\0" * 10)
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        built.append(path)
        return real(path, *a, **k)

    monkeypatch.setattr(shards, "block_checksums", full_disk)
    code, err = cli(tmp_path / "r", f"paths.cache_dir={cache}")
    assert code == 2
    line = only_error(err)
    assert line.startswith("error: no space left on device writing ") and "free space under paths.cache_dir=" in line
    assert not list((cache / "shards").glob("*/index.json"))  # no half-built shard set looks finished
    monkeypatch.setattr(shards, "block_checksums", real)
    code, err = cli(tmp_path / "r2", f"paths.cache_dir={cache}", "trainer.max_steps=1")  # space freed: it completes
    assert code == 0, err
    assert len(list((cache / "shards").glob("*/index.json"))) == 1


@pytest.mark.parametrize("code, says", [
    (errno.EFBIG, "error: file too large for this process's file-size limit (ulimit -f) writing {path}; "
                  "raise the limit or move paths.cache_dir="),
    (errno.EDQUOT, "error: disk quota exceeded writing {path}; free space in your quota under paths.cache_dir="),
])
def test_storage_refusals_other_than_a_full_disk_are_one_line(cli, tmp_path, monkeypatch, code, says):
    """A file-size limit or a quota, raised where the run writes (here: the data build), ends in one
    line that names what refused and its fix, exit 2; any other OSError still raises."""
    import bnlit.train as entry

    path = tmp_path / "cache" / "shards" / "x.train.bin"

    def refused(cfg):
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(entry, "train", refused)
    exit_code, err = cli(tmp_path / "r")
    assert exit_code == 2
    assert only_error(err).startswith(says.format(path=path))


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
    code, err = cli(tmp_path / "r", "+callbacks.poison._target_=helpers_faults.Poison", "+callbacks.poison.batch_idx=1")
    assert code == 3
    assert only_error(err).startswith("error: non-finite loss (nan) at step 1, batch index 1 (epoch 0)")


def test_unknown_guard_policy(cli, tmp_path):
    code, err = cli(tmp_path / "r", "callbacks.nan_guard.policy=ignore")
    assert code == 2
    assert only_error(err) == "error: callbacks.nan_guard.policy='ignore': use one of ['halt', 'skip']"


# ---- validation before any expensive work (bnlit/preflight.py) ---------------------------------
# (overrides, the exact error line): each must come within seconds, before the corpus is cleaned,
# the tokenizer trained or a shard built, and leave the (private) cache empty
BAD_VALUES = [
    (["threads=0"], "threads=0: must be auto or an integer >= 1; auto uses the idle cores; e.g. threads=1 on a busy machine"),
    (["data.batch_size=0"], "data.batch_size=0: must be an integer >= 1; e.g. 32 windows per micro-batch"),
    (["optimizer.lr=-1"], "optimizer.lr=-1: must be a finite number > 0; e.g. 1e-2 for the tiny preset"),
    (["optimizer.lr=nan"], "optimizer.lr=nan: must be a finite number > 0; e.g. 1e-2 for the tiny preset"),
    (["data.seq_len=0"], "data.seq_len=0: must be an integer >= 2; a window needs at least 2 tokens to predict "
                         "one from another; e.g. 128"),
    (["data.seq_len=1"], "data.seq_len=1: must be an integer >= 2; a window needs at least 2 tokens to predict "
                         "one from another; e.g. 128"),
    (["trainer.accumulate_grad_batches=0"],
     "trainer.accumulate_grad_batches=0: must be an integer >= 1; use 1 for no gradient accumulation"),
    (["trainer.max_steps=0"],
     "trainer.max_steps=0: must be an integer >= 1; set it to the number of optimizer steps to train, e.g. 500"),
    (["trainer.max_steps=-1"],
     "trainer.max_steps=-1: must be an integer >= 1; set it to the number of optimizer steps to train, e.g. 500"),
    (["trainer.val_check_interval=0"],
     "trainer.val_check_interval=0: must be an integer >= 1 (optimizer steps); validate every N steps with an N >= 1"),
    (["trainer.limit_val_batches=0"], "trainer.limit_val_batches=0: must be an integer >= 1 or a fraction in (0, 1]; "
                                      "score at least one validation batch, e.g. 50"),
    (["trainer.log_every_n_steps=0"], "trainer.log_every_n_steps=0: must be an integer >= 1; e.g. 10"),
    (["data.val_fraction=1.0"], "data.val_fraction=1.0: must be a fraction in (0, 1); hold out a small share, e.g. 0.05"),
    (["data.val_fraction=0"], "data.val_fraction=0: must be a fraction in (0, 1); hold out a small share, e.g. 0.05"),
    (["data.num_proc=0"], "data.num_proc=0: must be auto or an integer >= 1; the processes that clean and tokenize, e.g. 2 (auto: this machine's cores)"),
    (["data.num_workers=-1"], "data.num_workers=-1: must be an integer >= 0; use 0 to load in the main process"),
    (["data.multiprocessing_context=threads"], "data.multiprocessing_context='threads': must be forkserver, fork or "
     "spawn; use forkserver (fork starts faster but can inherit a lock another thread holds: docs/data.md)"),
    (["trainer.strategy={_target_:bnlit.fsdp.FSDP2Strategy}"],
     "optimizer._target_=bnlit.optim.MuonAdamW: Muon needs whole matrices and trainer.strategy "
     "bnlit.fsdp.FSDP2Strategy shards them; use optimizer=adamw"),
    (["optimizer.weight_decay=-0.1"], "optimizer.weight_decay=-0.1: must be a number >= 0; e.g. 0.1, or 0 for none"),
    (["optimizer.betas=[0.9,1.5]"], "optimizer.betas=[0.9, 1.5]: must be two numbers in [0, 1); e.g. [0.9, 0.95]"),
    (["scheduler.warmup_fraction=1.0"],
     "scheduler.warmup_fraction=1.0: must be a fraction in [0, 1); e.g. 0.05 (5% of max_steps)"),
    (["scheduler.min_lr_ratio=2"],
     "scheduler.min_lr_ratio=2: must be a fraction in [0, 1]; e.g. 0.1 (the final LR is 10% of the peak)"),
    (["scheduler.total_steps=2"], "scheduler.total_steps=2 < trainer.max_steps=4: the LR would sit at its floor for "
                                  "the last steps; leave scheduler.total_steps at ${trainer.max_steps}"),
    (["model.config.n_head=3"], "model.config (tiny): n_head=3 must divide dim=64"),
    (["model.config.vocab_size=10"],
     "model.config.vocab_size=10: a trained tokenizer needs at least 392 tokens (4 special, 256 byte fallback, "
     "the required characters); raise it to at least 392, e.g. 8192"),
    (["data.seq_len=1024"], "data.seq_len=1024 exceeds model.config.max_seq_len=128 of preset tiny; "
                            "lower data.seq_len or raise max_seq_len"),
    (["data.sources.0.weight=0", "data.sources.1.weight=0"],
     "data.sources: weights [0, 0] sum to 0; give at least one source a weight > 0"),
    (["data.sources.1.weight=-1"], "data.sources[1].weight=-1: must be a number >= 0; e.g. 0.8"),
    (["tokenizer.model_type=wordpiece"], "tokenizer.model_type='wordpiece': must be bpe or unigram; use bpe"),
    (["module.sdpa_backend=fast"], "module.sdpa_backend='fast': must be one of auto, flash, efficient, math, cudnn; "
                                   "use auto unless you are pinning a CUDA kernel"),
    (["module.loss_impl=fused", "trainer.precision=bf16-mixed"],
     "module.loss_impl=fused at trainer.precision=bf16-mixed: torch's F.linear_cross_entropy accumulates the bf16 "
     "mean loss and weight gradient across chunks in bf16 (measured at 2,048 rows: loss 0.19 nats off, weight "
     "gradient 3.2% off against 0.28% for plain); use module.loss_impl=chunked (fp32 accumulation) or "
     "trainer.precision=32-true"),
    (["module.loss_impl=sparse"], "module.loss_impl='sparse': use one of ['plain', 'chunked', 'fused']"),
    (["callbacks.gradient_flow.every_n_steps=0"], "callbacks.gradient_flow.every_n_steps=0: must be >= 1"),
    (["callbacks.gradient_flow.on_fail=ignore"], "callbacks.gradient_flow.on_fail='ignore': use 'raise' or 'warn'"),
    (["callbacks.throughput.on_low_mfu=stop"], "callbacks.throughput.on_low_mfu='stop': use 'warn' or 'raise'"),
    (["callbacks.random_twin.max_tokens=1"],
     "callbacks.random_twin.max_tokens=1: must be >= 2 or null (whole slice)"),
    (["callbacks.nan_guard.policy=ignore"], "callbacks.nan_guard.policy='ignore': use one of ['halt', 'skip']"),
    (["tokenizer.path=/nonexistent/tok.model"], "tokenizer.path: file /nonexistent/tok.model does not exist; fix the path"),
    (["tokenizer.vocab_size=10"],
     "tokenizer.vocab_size=10: a trained tokenizer needs at least 392 tokens (4 special, 256 byte fallback, "
     "the required characters); raise it to at least 392, e.g. 8192"),
    (["tokenizer.vocab_size=2048"], "tokenizer.vocab_size=2048 > model.config.vocab_size=1024: its token ids would not "
                                    "fit the embedding; set model.config.vocab_size instead (the tokenizer follows it)"),
    (["trainer.precision=fp8"], "trainer.precision='fp8': not a precision Lightning knows; use one of 32-true, "
                                "bf16-mixed, 16-mixed, bf16-true, 16-true, 64-true"),
    (["trainer.precision=16-mixed"], "trainer.precision=16-mixed: float16 autocast has no CPU support in Lightning; "
                                     "use bf16-mixed or 32-true on CPU"),
]
if not torch.cuda.is_available():
    BAD_VALUES.append((["trainer.accelerator=gpu"], "trainer.accelerator=gpu: this machine has no GPU (" + (
        "a CPU-only torch build" if torch.version.cuda is None else "no CUDA device visible") + "); rehearse this "
        "profile on CPU with debug=rehearsal, or train on CPU with trainer=cpu hardware=cpu"))


@pytest.fixture(scope="module")
def tiny_cfg(cache_dir):
    """The composed TINY config, once: each case edits a copy (composing per case costs seconds)."""
    from hydra import compose, initialize_config_dir

    from bnlit import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=TINY)


def with_overrides(cfg, tmp_path: Path, *overrides: str):
    """A copy of ``cfg`` with Hydra command-line overrides applied (parsed by Hydra's own grammar),
    writing into ``tmp_path`` with a private cache."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf, open_dict

    cfg = cfg.copy()
    with open_dict(cfg):
        for o in OverridesParser.create().parse_overrides([*overrides, f"paths.output_dir={tmp_path}/r",
                                                           f"paths.checkpoint_dir={tmp_path}/r/checkpoints",
                                                           f"paths.cache_dir={tmp_path}/cache"]):
            OmegaConf.update(cfg, o.key_or_group, o.value(), merge=False)
    return cfg


@pytest.mark.parametrize("overrides,message", BAD_VALUES, ids=[" ".join(o) for o, _ in BAD_VALUES])
def test_bad_value_is_refused_before_any_work(tiny_cfg, tmp_path, overrides, message):
    from bnlit.errors import BnlitError
    from bnlit.train import train

    with pytest.raises(BnlitError) as e:
        train(with_overrides(tiny_cfg, tmp_path, *overrides))
    assert str(e.value) == message
    assert not (tmp_path / "cache").exists()  # nothing cached, not even the embedded corpus
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("overrides", [["data.batch_size=0"], ["callbacks.gradient_flow.every_n_steps=0"],
                                       ["model.config.n_head=3"]])
def test_bad_value_through_the_command_line(cli, tmp_path, overrides):
    """The same refusals from ``python -m bnlit.train``: one line, exit 2, within seconds."""
    import time

    message = dict((tuple(o), m) for o, m in BAD_VALUES)[tuple(overrides)]
    start = time.perf_counter()
    code, err = cli(tmp_path / "r", f"paths.cache_dir={tmp_path}/cache", *overrides)
    assert (code, only_error(err)) == (2, f"error: {message}")
    assert time.perf_counter() - start < 30  # the data build it used to wait for takes minutes
    assert not (tmp_path / "cache").exists()


def write(path: Path, data: str | bytes) -> Path:
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return path


GOOD_TEXT = "এটি একটি বাংলা অনুচ্ছেদ। " * 20


def bad_files(d: Path) -> list[tuple[str, Path, str]]:
    """(case, the data file, the expected error after 'error: data.sources[0].path: ')."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    (d / "folder.txt").mkdir()
    pq.write_table(pa.table({"text": [1, 2]}), d / "numbers.parquet")
    write(d / "junk.parquet", b"PAR1 this is not parquet")
    return [
        ("directory", d / "folder.txt",
         f"{d}/folder.txt is a directory, not a file; point it at one .txt/.text/.jsonl/.json/.parquet file inside it"),
        ("missing", d / "missing.jsonl", f"file {d}/missing.jsonl does not exist; fix the path"),
        ("empty", write(d / "empty.txt", ""), f"file {d}/empty.txt is empty; point it at a file with text"),
        ("whitespace", write(d / "blank.txt", " \n\n\t \n"),
         f"file {d}/blank.txt holds only whitespace; point it at a file with text"),
        ("non-utf8", write(d / "latin.txt", "ok ".encode() + "café ok".encode("latin-1")),
         f"file {d}/latin.txt is not valid UTF-8 (byte 6); re-encode it, e.g. `iconv -f <encoding> -t utf-8`"),
        ("text is a number", write(d / "num.jsonl", "\n".join(json.dumps(r) for r in
                                                              [{"text": GOOD_TEXT}, {"text": "ok"}, {"text": 42}])),
         f'{d}/num.jsonl:3: "text" is a number (42), not a string; quote it or drop that line'),
        ("text is a list", write(d / "list.jsonl", json.dumps({"text": ["a", "b"]}) + "\n"),
         f'{d}/list.jsonl:1: "text" is a list (["a", "b"]), not a string; quote it or drop that line'),
        ("malformed JSON", write(d / "broken.jsonl", json.dumps({"text": GOOD_TEXT}) + '\n\n{"text": "unterminated\n'),
         f"{d}/broken.jsonl:3: malformed JSON (Unterminated string starting at column 10); "
         "fix or delete that line (JSON Lines: one object a line)"),
        ("not an object", write(d / "array.jsonl", json.dumps({"text": GOOD_TEXT}) + '\n["x"]\n'),
         f'{d}/array.jsonl:2: a list, not a JSON object; write one {{"text": "..."}} object per line'),
        ("non-UTF-8 JSON line", write(d / "latin.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n'),
         f"file {d}/latin.jsonl is not valid UTF-8 (line 2, column 14); re-encode it, e.g. `iconv -f <encoding> -t utf-8`"),
        ("only blank text", write(d / "blanks.jsonl", '{"text": "  "}\n{"text": null}\n'),
         f'every "text" in {d}/blanks.jsonl is empty or whitespace; point it at a file with text'),
        ("JSON array, bad element", write(d / "rows.json", json.dumps([{"text": GOOD_TEXT}, {"text": 1.5}])),
         f'{d}/rows.json element 2: "text" is a number (1.5), not a string; quote it or drop that element'),
        ("parquet of numbers", d / "numbers.parquet",
         f"column 'text' of {d}/numbers.parquet is int64, not a string; cast it to string or choose another text_field"),
        ("not parquet", d / "junk.parquet", None),
        ("unknown extension", write(d / "doc.pdf", GOOD_TEXT),
         f"{d}/doc.pdf has an unknown extension; use one of ['.txt', '.text', '.jsonl', '.json', '.parquet']"),
    ]


def test_bad_data_files_are_refused_with_the_line_and_the_fix(tmp_path):
    from bnlit.errors import DataError
    from bnlit.preflight import check_data_file

    for case, path, message in bad_files(tmp_path):
        with pytest.raises(DataError) as e:
            check_data_file(path, "data.sources[0].path")
        if message is None:
            assert str(e.value).startswith(f"data.sources[0].path: {path} is not a readable Parquet file ("), case
        else:
            assert str(e.value) == f"data.sources[0].path: {message}", case


def test_bad_data_file_through_the_command_line(cli, tmp_path):
    import json

    good = write(tmp_path / "en.txt", "An English paragraph of some length. " * 20)
    bad = write(tmp_path / "bn.jsonl", "\n".join(json.dumps({"text": t}) for t in [GOOD_TEXT, 7]))
    code, err = cli(tmp_path / "r", "data=files", f"data.sources.0.path={bad}", f"data.sources.1.path={good}",
                    f"paths.cache_dir={tmp_path}/cache")
    assert code == 2
    assert only_error(err) == (f'error: data.sources[0].path: {bad}:2: "text" is a number (7), not a string; '
                               "quote it or drop that line")
    assert not (tmp_path / "cache").exists()


def test_non_string_text_while_reading_is_an_error_not_a_skip(tmp_path):
    """A source read without the up-front check (a hub dataset, a script) fails on the row too."""
    import json

    from bnlit.data.sources import Source, iter_documents
    from bnlit.errors import DataError

    path = write(tmp_path / "a.jsonl", "\n".join(json.dumps({"text": t}) for t in ["one", "two", 3]))
    with pytest.raises(DataError, match=r"row 3 of .*a.jsonl: 'text' is int \(3\), not a string"):
        list(iter_documents(Source(name="s", language="bn", path=str(path)), path, cache_dir=str(tmp_path / "hf")))


def test_missing_text_field_and_unreadable_file(tmp_path, monkeypatch):
    import os

    import bnlit.preflight as validate
    from bnlit.errors import DataError

    body = write(tmp_path / "body.jsonl", '{"body": "x"}\n')
    with pytest.raises(DataError) as e:
        validate.check_data_file(body, "data.sources[0].path")
    assert str(e.value) == (f"data.sources[0].text_field='text': no line of {body} has that key; "
                            "set text_field to the key that holds the text")
    secret = write(tmp_path / "secret.txt", GOOD_TEXT)
    real = os.access
    monkeypatch.setattr(validate.os, "access", lambda p, mode: False if str(p) == str(secret) else real(p, mode))
    with pytest.raises(DataError) as e:  # a planted fault: the tests run as root, who reads everything
        validate.check_data_file(secret, "data.sources[0].path")
    assert str(e.value) == (f"data.sources[0].path: file {secret} is not readable (permission denied); "
                            f"`chmod a+r {secret}` or copy it somewhere readable")


def test_tokenizer_too_small_for_the_text_says_raise(tmp_path):
    from bnlit.errors import TokenizerError
    from bnlit.tokenizer import MIN_VOCAB_SIZE, train_tokenizer

    with pytest.raises(TokenizerError, match=rf"raise tokenizer.vocab_size={MIN_VOCAB_SIZE} \(it follows "
                                             rf"model.config.vocab_size\) to at least \d+ "):
        train_tokenizer([GOOD_TEXT, "Some English words too, with Capitals."], tmp_path / "t.model",
                        vocab_size=MIN_VOCAB_SIZE)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU profile runs where there is a GPU")
def test_gpu_profile_on_a_cpu_machine_names_the_rehearsal(cli, tmp_path):
    code, err = cli(tmp_path / "r", "trainer=h100")
    assert code == 2
    assert only_error(err).startswith("error: trainer.accelerator=gpu: this machine has no GPU (")
    assert "debug=rehearsal" in only_error(err)
    assert not (tmp_path / "r").exists()


def test_more_cpu_devices_than_cores_warns_with_the_slowdown(tiny_cfg, tmp_path, monkeypatch, caplog):
    import bnlit.speed.threads
    from bnlit.preflight import check_hardware

    monkeypatch.setattr(bnlit.speed.threads, "available_cpus", lambda: 2)
    with caplog.at_level("WARNING", logger="bnlit"):
        check_hardware(with_overrides(tiny_cfg, tmp_path, "trainer.devices=4"))
    assert [r.getMessage() for r in caplog.records] == [
        "trainer.devices=4 on 2 CPU core(s): 4 processes time-slice the cores, so expect each step to take at least "
        "2.0x as long as with trainer.devices=2 (the same work per process on fewer cores each), plus the switching; "
        "fine to rehearse a 4-rank layout, slow to train"]
    caplog.clear()
    check_hardware(with_overrides(tiny_cfg, tmp_path, "trainer.devices=2"))
    assert caplog.records == []


def test_cache_dir_that_cannot_be_written(tiny_cfg, tmp_path):
    from omegaconf import open_dict

    from bnlit.errors import ConfigError
    from bnlit.train import train

    cfg = with_overrides(tiny_cfg, tmp_path)
    with open_dict(cfg):
        cfg.paths.cache_dir = "/proc/bnlit/cache"
    with pytest.raises(ConfigError) as e:
        train(cfg)
    assert str(e.value) == ("paths.cache_dir=/proc/bnlit/cache: cannot write in /proc (the nearest existing directory on "
                            "its path): No such file or directory; choose another paths.cache_dir")
    assert not (tmp_path / "r").exists()

"""A full disk, a quota or a file-size limit where a run writes (bnlit/storage.py): the tokenizer,
the metrics log, the embedded corpus and the datasets cache each end in one line naming the file
and what refused, exit 2, with the previous file, checkpoint and cache entry intact and no
temporary file left; a run whose checkpoint filesystem cannot hold its first checkpoint is refused
before any work. The faults are real where a limit can reach them (``RLIMIT_FSIZE``, here or in a
child; a small tmpfs where this machine lets the tests mount one) and planted where it cannot
(a write that raises ``ENOSPC``). Checkpoints and shards under a full disk: tests/test_bad_inputs.py."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from bnlit import storage
from conftest import TINY
from test_bad_inputs import cli, only_error  # noqa: F401 (the fixture)

TEMP = ".tmp"


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """``ulimit -f`` for this process while the block runs: a write past ``nbytes`` fails with
    EFBIG (Python ignores SIGXFSZ). Only the soft limit moves, so it is restored."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def limited(nbytes: int):
    """``preexec_fn`` for a child under ``ulimit -f``."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.RLIM_INFINITY))


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if TEMP in p.name]


# ---- the write-then-rename every kept file goes through ---------------------------------------
def test_a_refused_write_keeps_the_old_file_names_the_path_and_leaves_no_temp(tmp_path):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(b"old model")
    with file_size_limit(4096), pytest.raises(OSError) as e:
        storage.write_bytes(path, b"x" * 10_000)
    assert e.value.errno == errno.EFBIG and e.value.filename == str(path)  # a bare write() names no file
    assert path.read_bytes() == b"old model"
    assert temp_files(tmp_path) == []
    storage.write_bytes(path, b"x" * 10_000)  # the limit lifted: it writes
    assert path.read_bytes() == b"x" * 10_000 and temp_files(tmp_path) == []


def test_a_failed_writer_body_removes_its_temp_and_writes_nothing(tmp_path):
    path = tmp_path / "report.md"
    with pytest.raises(ValueError), storage.replacing(path, "w") as f:
        f.write("half")
        raise ValueError("the producer failed")
    assert not path.exists() and temp_files(tmp_path) == []


def test_storage_message_names_what_refused_the_file_and_the_fix():
    e = OSError(errno.EFBIG, "File too large", "/c/tokenizers/k/tokenizer.model")
    assert storage.storage_message(e, "/c", "/r") == (
        "file too large for this process's file-size limit (ulimit -f) writing /c/tokenizers/k/tokenizer.model; "
        "raise the limit or move paths.cache_dir=/c or paths.output_dir=/r and rerun (shards, tokenizers and "
        "checkpoints are written to a temporary name and renamed, so earlier ones are intact)")
    under = RuntimeError("generation failed")
    under.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert storage.storage_cause(under) is under.__cause__
    assert storage.storage_cause(RuntimeError("x")) is None


# ---- the tokenizer ----------------------------------------------------------------------------
def test_tokenizer_save_under_a_file_size_limit_keeps_the_old_model(tmp_path):
    from bnlit.data.embedded import word_lines
    from bnlit.tokenizer import Tokenizer, train_tokenizer

    model = train_tokenizer(word_lines("bn", 300_000), tmp_path / "trained" / "tokenizer.model", vocab_size=1024,
                            num_threads=1)
    tok = Tokenizer(model)
    copy = tmp_path / "run" / "tokenizer.model"
    copy.parent.mkdir()
    copy.write_bytes(b"the previous run's model")
    with file_size_limit(len(tok.model_bytes) // 2), pytest.raises(OSError) as e:
        tok.save(copy)
    assert e.value.errno == errno.EFBIG and e.value.filename == str(copy)
    assert copy.read_bytes() == b"the previous run's model" and temp_files(tmp_path) == []
    with file_size_limit(len(tok.model_bytes) // 2), pytest.raises(OSError) as e:  # training's own write
        train_tokenizer(word_lines("bn", 300_000), tmp_path / "fresh" / "tokenizer.model", vocab_size=1024,
                        num_threads=1)
    assert e.value.filename == str(tmp_path / "fresh" / "tokenizer.model")
    assert list((tmp_path / "fresh").iterdir()) == []  # no model for the next run to trust


# ---- the metrics log --------------------------------------------------------------------------
def metrics_writer(log_dir: Path):
    from bnlit.loggers import ResumableExperimentWriter

    return ResumableExperimentWriter(log_dir=str(log_dir))


def test_metrics_header_rewrite_under_a_full_disk_keeps_every_row(tmp_path):
    """A new metric's column rewrites metrics.csv; Lightning rewrote it in place, so a limit hit
    midway truncated the run's whole history. The rewrite that fails now leaves the old file."""
    w = metrics_writer(tmp_path)
    for step in range(400):
        w.log_metrics({"train/loss": 3.0 - step / 1000}, step=step)
    w.save()
    path = tmp_path / "metrics.csv"
    before = path.read_bytes()
    w.log_metrics({"train/loss": 2.5, "val/loss": 2.75}, step=400)  # a new column: the whole file again
    with file_size_limit(len(before) + 100), pytest.raises(OSError) as e:
        w.save()
    assert e.value.errno == errno.EFBIG and e.value.filename == str(path)
    assert path.read_bytes() == before and temp_files(tmp_path) == []


def test_metrics_append_under_a_full_disk_names_the_file_and_the_resumed_writer_drops_the_torn_row(tmp_path):
    w = metrics_writer(tmp_path)
    w.log_metrics({"train/loss": 3.0}, step=0)
    w.save()
    path = tmp_path / "metrics.csv"
    size = path.stat().st_size
    for step in range(1, 200):
        w.log_metrics({"train/loss": 3.0 - step / 1000}, step=step)
    with file_size_limit(size + 50), pytest.raises(OSError) as e:  # the append stops mid-row
        w.save()
    assert e.value.errno == errno.EFBIG and e.value.filename == str(path)
    from bnlit.loggers import read_whole_rows

    header, rows = read_whole_rows(path)
    assert rows[0] == {"step": "0", "train/loss": "3.0"}
    metrics_writer(tmp_path)  # the resumed run's writer keeps the whole rows, drops the torn one
    assert path.read_bytes().endswith(b"\n") and read_whole_rows(path)[1] == rows


@pytest.mark.slow  # two short runs (~20 s)
def test_metrics_log_full_during_a_run_is_one_line_and_the_run_resumes(cli, tmp_path, monkeypatch):
    """Planted (a limit would hit the larger checkpoint first): the metrics log's write after step 3
    raises ENOSPC as a full disk's write() does, without a file name."""
    from lightning.fabric.loggers.csv_logs import _ExperimentWriter

    real = _ExperimentWriter.save
    saved = []

    def full_after_step_3(self):
        if any(m.get("step", 0) >= 3 for m in self.metrics):
            raise OSError(errno.ENOSPC, "No space left on device")
        saved.append(len(self.metrics))
        return real(self)

    monkeypatch.setattr(_ExperimentWriter, "save", full_after_step_3)
    run = tmp_path / "r"
    code, err = cli(run, "+logger.csv.flush_logs_every_n_steps=1")
    assert code == 2 and saved
    assert only_error(err).startswith(f"error: no space left on device writing {run}/csv/metrics.csv; "
                                      "free space under paths.cache_dir=")
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "step0000002.ckpt"]
    assert temp_files(run) == []
    monkeypatch.setattr(_ExperimentWriter, "save", real)  # space freed
    code, err = cli(run, "ckpt_path=last")
    assert code == 0, err
    assert torch.load(ckpts / "last.ckpt", weights_only=True)["global_step"] == 4
    from bnlit.loggers import read_whole_rows

    steps = [int(r["step"]) for r in read_whole_rows(run / "csv" / "metrics.csv")[1]]
    assert {0, 1, 2, 3} <= set(steps)  # the rows before the refusal kept, the resumed steps added


class FillingFile:
    """A text stream that refuses writes like a full disk's write() once ``full()`` is true."""

    def __init__(self, stream, full):
        self.stream, self.full = stream, full

    def write(self, text: str) -> int:
        if self.full():
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


@pytest.mark.slow  # two short runs (~20 s)
def test_run_log_full_during_a_run_is_one_line_and_the_run_resumes(cli, tmp_path, monkeypatch):
    """train.log on a disk that fills mid-run: logging printed "--- Logging error ---" and a
    traceback for every record after it while the run went on; now the first refused record ends
    the run in the one line, the checkpoints intact, and the rerun with ``ckpt_path=last`` once
    space is freed completes (planted: a limit would refuse the larger checkpoint first)."""
    import logging

    real_open = logging.FileHandler._open
    run = tmp_path / "r"
    first = run / "checkpoints" / "step0000002.ckpt"  # the disk fills once it is written
    monkeypatch.setattr(logging.FileHandler, "_open", lambda self: FillingFile(real_open(self), first.exists))
    code, err = cli(run, "trainer.max_steps=6")
    assert code == 2, "\n".join(err)
    assert only_error(err).startswith(f"error: no space left on device writing {run}/train.log; free space under ")
    assert not [line for line in err if "Logging error" in line or "Traceback" in line]
    log = (run / "train.log").read_text()
    assert "gradient flow: " in log  # the records before the disk filled
    kept = sorted((run / "checkpoints").iterdir())
    assert kept and all(torch.load(p, weights_only=True)["global_step"] >= 2 for p in kept)  # whole
    monkeypatch.setattr(logging.FileHandler, "_open", real_open)
    code, err = cli(run, "trainer.max_steps=6", "ckpt_path=last")
    assert code == 0, "\n".join(err)
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6
    assert (run / "train.log").read_text().startswith(log)  # appended to, not replaced
    assert temp_files(run) == []


# ---- the embedded corpus and the datasets cache ------------------------------------------------
def test_embedded_corpus_reads_under_a_file_size_limit():
    """sqlite sorted the books in a temporary file, which a file-size limit (or a full /var/tmp)
    refused as "OperationalError: disk I/O error"; the sort is in memory now, so reading writes nothing."""
    from bnlit.data.embedded import bangla_documents

    with file_size_limit(300_000):
        docs = bangla_documents()
    assert len(docs) == 200


def test_datasets_cache_refusal_is_a_storage_error_naming_the_cache(tmp_path, monkeypatch):
    import datasets
    from datasets.exceptions import DatasetGenerationError

    from bnlit.data.sources import Source, open_dataset

    text = tmp_path / "bn.txt"
    text.write_text("আমার সোনার বাংলা, আমি তোমায় ভালোবাসি।\n\n" * 2000, encoding="utf-8")  # 200 kB
    cache = tmp_path / "hf"
    with file_size_limit(len(text.read_bytes()) // 4), pytest.raises(OSError) as e:  # datasets' Arrow writer hits the limit
        open_dataset(Source(name="bn", language="bn", path=str(text), field="data.sources[0]"), text, str(cache))
    assert e.value.errno == errno.EFBIG and e.value.filename == str(cache)

    def refused(*a, **k):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as cause:
            raise DatasetGenerationError("An error occurred while generating the dataset") from cause

    monkeypatch.setattr(datasets, "load_dataset", refused)
    with pytest.raises(OSError) as e:
        open_dataset(Source(name="bn", language="bn", path=str(text), field="data.sources[0]"), text, str(cache))
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(cache)


@pytest.mark.slow  # a child process that imports the trainer (~10-20 s on a loaded machine)
def test_cold_cache_under_a_file_size_limit_is_one_line(tmp_path):
    """``prlimit --fsize=300000 python -m bnlit.train`` with an empty cache: the embedded corpus
    (11 MB) is the first file past the limit; once the sqlite sort stopped writing it is refused by
    name, not as sqlite's "disk I/O error" traceback."""
    cache, run = tmp_path / "cache", tmp_path / "run"
    # without checkpoints: the file-size limit is below one checkpoint, which preflight refuses first
    out = subprocess.run([sys.executable, "-m", "bnlit.train", *TINY, f"hydra.run.dir={run}", "threads=1",
                          "~callbacks.model_checkpoint"],
                         capture_output=True, text=True, env=dict(os.environ, BNLIT_CACHE=str(cache)),
                         preexec_fn=limited(300_000), timeout=600)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: file too large for this process's file-size limit (ulimit -f) writing "
                      f"{cache}/embedded/bn.txt; raise the limit or move paths.cache_dir={cache} or "
                      f"paths.output_dir={run} and rerun (shards, tokenizers and checkpoints are written to a "
                      "temporary name and renamed, so earlier ones are intact)"], out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert temp_files(cache) == [] and not (cache / "embedded" / "bn.txt").exists()


@pytest.mark.slow  # three runs in a private cache: build, refused tokenizer, rebuild
def test_tokenizer_refused_mid_build_is_one_line_and_the_next_run_trains_it(tmp_path):
    """A child under ``ulimit -f`` set between what the build writes before the tokenizer (the
    reused cleaning, datatrove's stage records) and the 4096-piece model: one line naming the
    model, no model or temporary file in the cache, and the next run trains it and completes."""
    cache = tmp_path / "cache"
    env = dict(os.environ, BNLIT_CACHE=str(cache))

    def train(run: str, *extra: str, limit: int | None = None):
        return subprocess.run([sys.executable, "-m", "bnlit.train", *TINY, f"hydra.run.dir={tmp_path / run}",
                               "threads=1", "trainer.max_steps=2", *extra], capture_output=True, text=True, env=env,
                              preexec_fn=limited(limit) if limit else None, timeout=900)

    first = train("warm")  # cleaning, a 1024-piece tokenizer and its shards
    assert first.returncode == 0, first.stderr[-3000:]
    refused = train("refused", "model.config.vocab_size=4096", "~callbacks.model_checkpoint", limit=60_000)
    assert refused.returncode == 2, refused.stderr[-3000:]
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    models = sorted(cache.glob("tokenizers/*/tokenizer.model"))
    assert len(models) == 1  # the first run's, unchanged
    assert errors[0].startswith("error: file too large for this process's file-size limit (ulimit -f) writing "
                                f"{cache}/tokenizers/") and errors[0].split(" writing ")[1].split(";")[0].endswith(
                                    "/tokenizer.model")
    assert Path(errors[0].split(" writing ")[1].split(";")[0]).parent != models[0].parent
    assert temp_files(cache) == [] and temp_files(tmp_path / "refused") == []
    again = train("again", "model.config.vocab_size=4096")
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(sorted(cache.glob("tokenizers/*/tokenizer.model"))) == 2


# ---- free space before the run ------------------------------------------------------------------
Usage = namedtuple("Usage", "total used free")


def test_checkpoint_size_estimate_is_a_lower_bound_of_a_real_checkpoint(cli, make_cfg, tmp_path):
    from hydra.utils import instantiate

    from bnlit.speed.flops import param_counts

    # AdamW, whose two moments cover every parameter (the CPU default, MuonAdamW, keeps one on the
    # blocks' matrices: its bound, one state per parameter, is looser)
    code, err = cli(tmp_path / "r", "trainer.max_steps=2", "optimizer=adamw")
    assert code == 0, err
    real = (tmp_path / "r" / "checkpoints" / "last.ckpt").stat().st_size
    n = param_counts(instantiate(make_cfg().model.config))["n_params"]
    assert storage.checkpoint_bytes(n, "32-true", "bnlit.optim.MuonAdamW") == 8 * n
    estimate = storage.checkpoint_bytes(n, "32-true", "torch.optim.AdamW")
    assert estimate == 12 * n
    assert 0.9 * real < estimate <= real  # within the extras (tokenizer, RNG states) of the truth


def test_too_little_free_space_for_the_first_checkpoint_refuses_before_any_work(cli, tmp_path, monkeypatch):
    real = shutil.disk_usage
    asked = []

    def small_disk(path):
        asked.append(Path(path))
        return Usage(10 << 20, (10 << 20) - 1_000_000, 1_000_000)

    monkeypatch.setattr(shutil, "disk_usage", small_disk)
    cache, run = tmp_path / "cache", tmp_path / "r"
    code, err = cli(run, f"paths.cache_dir={cache}", "optimizer=adamw")
    assert code == 2
    n = 164_160  # the tiny preset at vocabulary 1024 (python -m bnlit.info)
    assert only_error(err) == (
        f"error: paths.checkpoint_dir={run}/checkpoints: 1.0 MB free on its filesystem ({run}), but the first "
        f"checkpoint needs at least 3.9 MB (2 checkpoint files of 2.0 MB: {n:,} parameters x 12 bytes, weights and "
        "AdamW state); free space there or point paths.checkpoint_dir (or paths.output_dir) at a larger disk")
    assert asked == [run]  # the nearest directory that exists (Hydra's run dir, removed again at the refusal)
    assert not run.exists() and (not cache.exists() or not any(cache.iterdir()))  # before the data build
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 << 20, 0, 4 * 12 * n))  # just enough
    code, err = cli(run, "trainer.max_steps=1", "callbacks.model_checkpoint.save_last=false", "optimizer=adamw")
    assert code == 0, err
    monkeypatch.setattr(shutil, "disk_usage", real)


def test_the_estimate_follows_precision_and_the_files_a_save_writes(make_cfg, monkeypatch, tmp_path):
    from bnlit.errors import CheckpointError
    from bnlit.preflight import check_disk_space

    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1, 1, 0))
    adamw = "optimizer=adamw"  # the CPU default is MuonAdamW (one state on the blocks' matrices)
    for overrides, bytes_per_param, files in [([adamw], 12, 2), ([adamw, "trainer.precision=bf16-true"], 6, 2),
                                              ([adamw, "callbacks.model_checkpoint.save_last=false"], 12, 1),
                                              ([], 8, 2)]:
        with pytest.raises(CheckpointError) as e:
            check_disk_space(make_cfg(*overrides))
        assert f"x {bytes_per_param} bytes" in str(e.value) and (f"{files} checkpoint file" in str(e.value))
    cfg = make_cfg("~callbacks.model_checkpoint")
    check_disk_space(cfg)  # writes no checkpoint: nothing to check


@pytest.mark.slow  # a child process that imports the trainer (~10-20 s on a loaded machine)
def test_a_file_size_limit_below_one_checkpoint_refuses_before_any_work(tmp_path):
    """``prlimit --fsize=300000 python -m bnlit.train``: the limit is below the tiny preset's
    checkpoint, so the run is refused in preflight with the numbers, not after its data build."""
    run, cache = tmp_path / "run", tmp_path / "cache"
    out = subprocess.run([sys.executable, "-m", "bnlit.train", *TINY, f"hydra.run.dir={run}", "threads=1",
                          "optimizer=adamw"],  # AdamW's 12 bytes per parameter, as docs/reliability.md quotes
                         capture_output=True, text=True, env=dict(os.environ, BNLIT_CACHE=str(cache)),
                         preexec_fn=limited(300_000), timeout=600)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: this process's file-size limit (ulimit -f) is 300.0 kB, but one checkpoint file needs "
                      "at least 2.0 MB (164,160 parameters x 12 bytes, weights and AdamW state); raise the limit "
                      "(ulimit -f unlimited) or train a smaller model"], out.stderr[-3000:]
    assert not cache.exists() and not run.exists()


# ---- a real small filesystem ------------------------------------------------------------------
@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"machine: cannot mount a tmpfs here ({made.stderr.strip() or made.returncode}; needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.slow  # two short runs
def test_a_real_full_disk_mid_run_keeps_the_first_checkpoint_and_the_run_resumes(cli, tmp_path):
    """A 6 MB tmpfs as the checkpoint dir, 2.5 MB of it filled: the free-space check passes (one
    2.0 MB checkpoint file per save), step 2's checkpoint fits, step 4's hits ENOSPC. One line, step
    2 intact, no temporary file; with the filler removed, ``ckpt_path=last`` resumes and finishes."""
    with tmpfs(tmp_path / "disk", "6m") as disk:
        filler = disk / "filler"
        filler.write_bytes(b"\0" * 2_500_000)
        run, ckpts = tmp_path / "r", disk / "checkpoints"
        # AdamW: its 2.0 MB checkpoint is what the tmpfs is sized for (Muon's is 1.6 MB)
        args = (f"paths.checkpoint_dir={ckpts}", "callbacks.model_checkpoint.save_last=false", "trainer.max_steps=6",
                "optimizer=adamw")
        code, err = cli(run, *args)
        assert code == 2, "\n".join(err)
        line = only_error(err)
        assert line.startswith(f"error: cannot write checkpoint {ckpts}/step0000004.ckpt: No space left on device; "
                               "free disk space or point paths.checkpoint_dir elsewhere"), line
        assert sorted(p.name for p in ckpts.iterdir()) == ["step0000002.ckpt"]
        assert torch.load(ckpts / "step0000002.ckpt", weights_only=True)["global_step"] == 2
        filler.unlink()  # space freed
        code, err = cli(run, *args, "ckpt_path=last")
        assert code == 0, err
        assert torch.load(ckpts / "step0000006.ckpt", weights_only=True)["global_step"] == 6
        assert temp_files(disk) == []


def test_a_real_small_disk_refuses_the_run_with_the_numbers(cli, tmp_path):
    with tmpfs(tmp_path / "disk", "1m") as disk:
        code, err = cli(tmp_path / "r", f"paths.checkpoint_dir={disk}/checkpoints", "optimizer=adamw")
        assert code == 2
        line = only_error(err)
        assert line.startswith(f"error: paths.checkpoint_dir={disk}/checkpoints: 1.0 MB free on its filesystem "
                               f"({disk}), but the first checkpoint needs at least 3.9 MB"), line
        assert list(disk.iterdir()) == []

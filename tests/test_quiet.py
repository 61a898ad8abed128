"""bnlit/quiet.py drops exactly the third-party messages it lists, and nothing else from the same
sources: a filter matches one message, never a module or a category."""

from __future__ import annotations

import logging
import warnings

from bnlit import quiet

SAMPLES = {
    r"The `srun` command is available on your system but is not used":
        "The `srun` command is available on your system but is not used. HINT: If your intention is to run Lightning "
        "on SLURM, prepend your python command with `srun` like so: srun python3 bnlit.train ...",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated":
        "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and treespec.is_leaf()` instead.",
    r"your dataloader is not resumable":
        "You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not resumable. "
        "This can cause unreliable results if further training is done.",
    r"does not have many workers which may be a bottleneck":
        "The 'train_dataloader' does not have many workers which may be a bottleneck. Consider increasing the value "
        "of the `num_workers` argument to `num_workers=7`",
    r"Precision bf16-mixed is not supported by the model summary":
        "Precision bf16-mixed is not supported by the model summary.  Estimated model size in MB will not be accurate. "
        "Using 32 bits instead.",
    r"^💡 Tip: ": "💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger](...)",
}


def test_every_filter_has_a_reason_and_a_sample():
    assert {pattern for pattern, *_ in quiet.FILTERS} == set(SAMPLES)
    assert all(len(why) > 40 for *_, why in quiet.FILTERS)


def test_listed_messages_are_dropped_and_others_stay(caplog, monkeypatch):
    lightning_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        monkeypatch.setattr(quiet, "_installed", False)  # install() acts once per process
        quiet.install()
        for pattern, category, logger, _ in quiet.FILTERS:
            if category is not None:
                warnings.warn(SAMPLES[pattern], UserWarning)
        warnings.warn("The `srun` command failed: a real problem", UserWarning)
        warnings.warn("Precision 16-mixed is not supported on CPU", UserWarning)
    assert [str(w.message) for w in caught] == ["The `srun` command failed: a real problem",
                                                "Precision 16-mixed is not supported on CPU"]
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        lightning_log.info(SAMPLES[r"^💡 Tip: "])
        lightning_log.info("GPU available: False, used: False")
    assert [r.getMessage() for r in caplog.records] == ["GPU available: False, used: False"]


def test_the_docs_list_every_filter():
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "getting-started.md").read_text()
    listed = page.split("## What the first screen leaves out", 1)[1]
    for needle in ("srun command is available", "LeafSpec", "not resumable", "does not have many workers",
                   "not supported by the model summary", "Tip: ", "anonymous setting"):
        assert needle in listed, needle
    assert len(quiet.FILTERS) == 6  # a new filter needs a row in the docs (and a sample above)

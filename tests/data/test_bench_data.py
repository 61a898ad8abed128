"""scripts/bench_data.py at a tiny size: a synthetic multi-source corpus with planted copies, the
build timed with one worker, and the dedup stages' peak memory measured and printed."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from bnlit.speed import tree_memory

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_data.py"


@pytest.mark.skipif(not tree_memory.supported(), reason="needs Linux /proc smaps_rollup and children")
def test_bench_data_prints_the_dedup_peak_memory_of_a_synthetic_corpus(capsys):
    sys.path.insert(0, str(SCRIPT.parent))
    import bench_data

    r = bench_data.main(["--synthetic-mb", "0.3", "--procs", "1", "--repeat", "1", "--vocab-size", "512"])
    out = capsys.readouterr().out
    assert r["sources"] == ["s0_bn", "s1_bn", "s2_bn", "s3_en"]
    planted = r["planted"]
    assert planted["exact_copies"] > 0 and planted["near_copies"] > 0
    (clean,) = r["clean"]
    names = [s["stage"] for s in clean["stages"]]
    assert names[:4] == ["read", "dedup_find", "dedup_cluster", "dedup"], names
    # the build's own statistics: planted copies were found (a copy of a filtered document is filtered)
    found = sum(v["dedup"]["exact"] + v["dedup"]["near"] for v in clean["stats"]["sources"].values())
    assert 0 < found <= planted["exact_copies"] + planted["near_copies"]
    # measured, not a constant: above the tree's baseline (the interpreter with its imports), below 4 GB
    dedup = [s for s in clean["stages"] if s["stage"].startswith("dedup")]
    assert all(s["samples"] >= 1 and s["tree_mb"] > 0 for s in dedup)
    assert 50 < clean["baseline_mb"] <= clean["dedup_peak_mb"] < 4000, clean
    assert clean["dedup_peak_mb"] == max(s["tree_mb"] for s in dedup)
    m = re.search(r"dedup peak ([\d,]+) MB \(process tree, baseline ([\d,]+) MB; largest process ([\d,]+) MB\)", out)
    assert m, out
    assert float(m[1].replace(",", "")) == pytest.approx(clean["dedup_peak_mb"], abs=1)
    assert re.search(r"dedup_find [\d.]+ s, peak [\d,]+ MB tree", out), out
    assert "exact and" in out and "near copies" in out

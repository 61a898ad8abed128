"""The data build on datatrove (bnlit/data/pipeline.py): byte-identical to the pipeline it
replaced, planted duplicates removed exactly once across sources and tasks, the same output for
any task count, resumable after a kill, and `python -m bnlit.prepare` building what training
reads."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bnlit.data.normalize import normalize_text
from bnlit.data.pipeline import CleanConfig, load_stats, read_clean, run_local, stages
from bnlit.errors import ConfigError
from bnlit.tokenizer import train_tokenizer
from helpers_data import PLANTED_VAL_FRACTION, document, near_copy, plan_build, planted_corpus, planted_eval

HERE = Path(__file__).parents[1]  # tests/
GOLDEN = json.loads((HERE / "fixtures" / "planted_golden.json").read_text())


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory) -> Path:
    texts = [d for _, _, docs in planted_corpus() for d in docs]
    path = train_tokenizer(texts, tmp_path_factory.mktemp("tok") / "t.model", vocab_size=600, num_threads=1)
    # the tokenizer the golden shards were encoded with (SentencePiece training is deterministic)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == GOLDEN["tokenizer_sha256"]
    return path


def build(tmp_path, tok_path, tasks: int = 1, workers: int = 1):
    plan = plan_build(tmp_path, planted_corpus(), tok_path, PLANTED_VAL_FRACTION, clean=CleanConfig(), tasks=tasks,
                      eval_texts=planted_eval())
    run_local(plan, workers=workers, quiet=True)
    return plan


def outputs(plan) -> dict:
    shard_dir = plan.shard_dir()
    index = json.loads((shard_dir / "index.json").read_text())
    return {"kept": {s.name: [sha(t) for t in read_clean(plan.clean_dir, s.name)] for s in plan.sources},
            "shards": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(shard_dir.glob("*.bin"))},
            "index": comparable(index)}


def comparable(index: dict) -> dict:
    """An index without what the golden run (shard format 1) could not share: the key and the
    fingerprints (it keyed its sources by name, this build by file), the format version and the
    block checksums that format 2 added."""
    index = json.loads(json.dumps(index))
    for k in ("key", "version", "checksum"):
        index.pop(k, None)
    for entry in index["sources"].values():
        entry.pop("fingerprint")
        for split in ("train", "val"):
            entry[split].pop("blocks", None)
    return index


@pytest.fixture(scope="module")
def one_task(tok_path, tmp_path_factory):
    return build(tmp_path_factory.mktemp("one"), tok_path)


def test_shards_and_statistics_equal_the_pipeline_datatrove_replaced(one_task):
    """tests/fixtures/planted_golden.json is the output of bnlit's hand-written multiprocess
    pipeline (before datatrove) on the planted corpus: the same documents kept, the same counts
    dropped by every filter, dedup and decontamination, byte-identical token shards."""
    out = outputs(one_task)
    assert out["kept"] == GOLDEN["kept"]
    assert out["shards"] == GOLDEN["shards"]
    assert out["index"] == comparable(GOLDEN["index"])
    stats = load_stats(one_task.clean_dir)
    for name, want in GOLDEN["stats"]["sources"].items():
        assert {k: stats["sources"][name][k] for k in want} == want, name
    assert stats["decontam"] == GOLDEN["stats"]["decontam"]
    assert stats["validation_decontaminated"] is True


def test_planted_duplicates_are_removed_exactly_once_across_sources_and_tasks(one_task, tok_path, tmp_path):
    plan = build(tmp_path, tok_path, tasks=3)  # 3 pieces per source: the copies sit in other tasks than their originals
    assert len(plan.pieces) == 9 and [p.index for p in plan.pieces[:3]] == [0, 1, 2]
    (web_name, _, web), (wiki_name, _, wiki), (news_name, _, news) = planted_corpus()
    kept = {s.name: list(read_clean(plan.clean_dir, s.name)) for s in plan.sources}
    assert kept["web"] == web[:36] and kept["wiki"] == wiki[:12] and kept["news"] == news[:12]  # originals once each
    everything = [t for ts in kept.values() for t in ts]
    assert everything.count(web[3]) == 1 and everything.count(web[0]) == 1  # exact copies across sources and tasks
    for copy in (near_copy(web[2]), near_copy(web[4]), near_copy(wiki[1])):
        assert copy not in everything
    s = load_stats(plan.clean_dir)["sources"]
    assert s["web"]["dedup"] == {"exact": 2, "near": 2, "exact_cross": 0, "near_cross": 0,
                                 "chars": sum(len(normalize_text(d)) for d in web[36:40])}
    assert s["wiki"]["dedup"] == {"exact": 2, "near": 2, "exact_cross": 1, "near_cross": 1,
                                  "chars": sum(len(normalize_text(d)) for d in wiki[12:16])}
    assert s["news"]["dedup"]["exact"] == 1 and s["news"]["filters"]["docs"] == {"script": 1}
    assert s["web"]["filters"]["details"] == {"length:min_chars": 1, "script:ratio": 1, "repetition:dup_lines": 2}
    assert s["web"]["decontam"]["by_set"] == {"val/bn": 1} and s["wiki"]["decontam"]["by_set"] == {"eval/bench": 1}
    assert outputs(plan) == outputs(one_task)  # the task count changes nothing that is built
    stages_ = {r["stage"]: r for r in load_stats(plan.clean_dir)["stages"]}
    assert stages_["dedup"]["docs_in"] - stages_["dedup"]["docs_out"] == 9 and stages_["dedup"]["clusters"] == 8
    assert stages_["filters"]["docs_in"] == sum(len(d) for _, _, d in planted_corpus())


def test_a_finished_build_has_nothing_left_to_run(one_task, tok_path):
    again = plan_build(one_task.cache_dir.parent, planted_corpus(), tok_path, PLANTED_VAL_FRACTION,
                       clean=CleanConfig(), eval_texts=planted_eval())
    assert again.clean_dir == one_task.clean_dir and stages(again) == []
    assert not (one_task.clean_dir / "filtered").exists()  # intermediate copies are removed


def test_cleaning_switches_leave_their_stages_out(tok_path, tmp_path):
    cfg = CleanConfig.from_dict({"dedup": {"near": False}, "decontam": {"enabled": False}, "filters": None})
    plan = build_with(tmp_path, tok_path, cfg)
    names = [s.name for s in stages(plan)]
    assert "dedup_cluster" not in names and "decontam" not in names and "dedup" in names
    run_local(plan, quiet=True)
    s = load_stats(plan.clean_dir)["sources"]["web"]
    # no filters: the repetitive document and its copy reach dedup too
    assert s["dedup"]["exact"] == 3 and s["dedup"]["near"] == 0 and s["filters"]["docs"] == {}
    assert normalize_text(near_copy(planted_corpus()[0][2][2])) in list(read_clean(plan.clean_dir, "web"))


def build_with(tmp_path, tok_path, cfg):
    return plan_build(tmp_path, planted_corpus(), tok_path, PLANTED_VAL_FRACTION, clean=cfg)


def test_prepare_builds_what_training_reads(make_cfg, tmp_path, capsys):
    from hydra.utils import instantiate

    from bnlit.prepare import prepare

    cfg = make_cfg("data.executor.tasks=2", "data.num_proc=1")
    done = prepare(cfg)
    assert done["kind"] == "local" and (done["shard_dir"] / "index.json").is_file()
    assert "## Cleaning stages" in capsys.readouterr().out
    dm = instantiate(cfg.data, _recursive_=False)
    assert stages(dm.plan()) == []  # a training run with the same config only reads
    dm.prepare_data()
    assert dm.shard_dir == done["shard_dir"]
    assert [r["stage"] for r in dm.report["stages"]] == ["normalize", "ocr_debris", "filters", "dedup", "decontam"]


def test_slurm_executor_without_a_partition_is_refused_in_one_line(make_cfg):
    from bnlit.prepare import prepare

    with pytest.raises(ConfigError, match=r"data.executor.partition is not set; .*data.executor.partition=cpu"):
        prepare(make_cfg("data/executor=slurm"))


KILLABLE = """
import sys
sys.path.insert(0, {here!r})
from pathlib import Path
from bnlit.data.normalize import normalize_text
from bnlit.data.pipeline import CleanConfig, run_local
from bnlit.tokenizer import Tokenizer
from helpers_data import plan_build, planted_corpus, planted_eval, PLANTED_VAL_FRACTION
if __name__ == "__main__":  # workers > 1: datatrove's forkserver pool imports this module
    plan = plan_build(Path({tmp!r}), planted_corpus(), {tok!r}, PLANTED_VAL_FRACTION, clean=CleanConfig(), tasks=3,
                      eval_texts=planted_eval())
    run_local(plan, workers={workers}, quiet=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_killed_build_relaunched_redoes_only_unfinished_tasks(one_task, tok_path, tmp_path, workers):
    script = tmp_path / "build.py"
    script.write_text(KILLABLE.format(here=str(HERE), tmp=str(tmp_path), tok=str(tok_path), workers=workers))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    logs = None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:  # kill it once some tasks, not all, are done
        found = list((tmp_path / "cache" / "clean").glob("*/logs/read/completions/*"))
        if len(found) >= 3:
            logs = found[0].parent.parent
            break
        time.sleep(0.05)
    assert proc.poll() is None and logs is not None, proc.stderr.read().decode()[-2000:] if proc.poll() else "timeout"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = {p.name: p.stat().st_mtime_ns for p in (logs / "completions").iterdir()}
    task_logs = {n: (logs / "logs" / f"task_{n}.log").stat().st_mtime_ns for n in done}
    assert 3 <= len(done) < 9
    again = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=600)
    assert again.returncode == 0, again.stderr.decode()[-3000:]
    for n, mtime in task_logs.items():  # finished tasks were skipped, not redone
        assert (logs / "logs" / f"task_{n}.log").stat().st_mtime_ns == mtime
    assert len(list((logs / "completions").iterdir())) == 9
    plan = plan_build(tmp_path, planted_corpus(), tok_path, PLANTED_VAL_FRACTION, clean=CleanConfig(), tasks=3,
                      eval_texts=planted_eval())
    assert outputs(plan) == outputs(one_task)  # equal to an uninterrupted run's


HOLDER = """
import os, sys, time
from types import SimpleNamespace
from pathlib import Path
from bnlit.data.pipeline import _ending_with_this_process, _lock

def child():  # like datatrove's Manager server: forked by the builder, serves forever
    time.sleep(120)
    os._exit(0)

out = Path({out!r})
with _lock(SimpleNamespace(cache_dir=out, work_key="k")):
    pids = []
    if (pid := os.fork()) == 0:
        child()
    pids.append(pid)  # forked holding the lock, outside a build
    with _ending_with_this_process():
        if (pid := os.fork()) == 0:
            child()
        pids.append(pid)  # forked during a build
    (out / "pids").write_text(" ".join(map(str, pids)))
    time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
def test_a_builder_killed_with_sigkill_frees_its_lock_and_ends_its_forked_processes(tmp_path):
    """The hang chaos.py found: a build killed with SIGKILL left datatrove's Manager server (a
    forked process) alive, holding the cache lock, and the next run waited for it forever."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER.format(out=str(tmp_path))])
    deadline = time.monotonic() + 60
    while not (tmp_path / "pids").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    outside, inside = map(int, (tmp_path / "pids").read_text().split())
    try:
        proc.send_signal(signal.SIGKILL)  # the builder only, not its process group
        proc.wait()
        # the next builder gets the lock at once, though `outside` still has the file open
        take = "from types import SimpleNamespace as N; from bnlit.data.pipeline import _lock\n" \
               f"with _lock(N(cache_dir=__import__('pathlib').Path({str(tmp_path)!r}), work_key='k')): pass"
        subprocess.run([sys.executable, "-c", take], timeout=30, check=True)
        assert alive(outside)
        while alive(inside) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not alive(inside), "a process forked during the build outlived the builder"
    finally:
        for pid in (outside, inside):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)

"""EleutherAI's lm-evaluation-harness (the ``eval`` extra) scores a bnlit Hugging Face export with
bnlit's task definitions (bnlit/evaluation/lm_eval_tasks) and agrees with ``scripts/evaluate.py``: held-out
bits/char and multiple-choice accuracy (slow; under CI=true a missing lm-eval fails)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bnlit.train import train

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "bnlit" / "evaluation" / "lm_eval_tasks"
FIXTURES = ROOT / "tests" / "fixtures"


@pytest.fixture(scope="module")
def lm_eval():
    try:
        import lm_eval
    except ImportError:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail('lm-eval is not installed: pip install -e ".[eval]" (.ci/run installs it)')
        pytest.skip('lm-eval is not installed: pip install -e ".[eval]"')
    return lm_eval


def run_lm_eval(export: Path, tasks: str, metadata: list[str], out: Path, max_length: int) -> dict:
    """The documented one-liner (README), as a subprocess; the results of its JSON file."""
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf",
           "--model_args", f"pretrained={export},max_length={max_length}", "--include_path", str(TASKS),
           "--tasks", tasks, "--metadata", *metadata, "--device", "cpu", "--batch_size", "8",
           "--output_path", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (results,) = out.rglob("results_*.json")
    return json.loads(results.read_text())["results"]


@pytest.mark.slow
def test_lm_eval_agrees_with_bnlit_on_bits_per_char_and_multiple_choice(make_cfg, tmp_path, capsys, lm_eval):
    from test_export import script

    from bnlit.data.report import held_out_documents

    cfg = make_cfg("trainer.max_steps=24", "callbacks.random_twin.max_tokens=400")
    train(cfg)
    run, ckpt = Path(cfg.paths.output_dir), Path(cfg.paths.checkpoint_dir) / "last.ckpt"
    export = tmp_path / "hf"
    assert script("export_hf").main(["--checkpoint", str(ckpt), "--out", str(export)]) == 0
    # held-out documents of the run: its validation books' pages (raw lengths: most are longer than
    # the 64-token window, so lm-eval's rolling windows are exercised) and English addresses
    bn = [p for doc in held_out_documents(run, "bn") for p in doc.split("\n") if len(p) > 40][:30]
    en = held_out_documents(run, "en")[:6]
    docs = tmp_path / "held_out.jsonl"
    docs.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in bn + en), encoding="utf-8")
    mc = FIXTURES / "multiple_choice_small.jsonl"
    capsys.readouterr()
    assert script("evaluate").main(["--checkpoint", str(ckpt), "--text", f"x={docs}", "--multiple-choice", str(mc),
                                    "--no-twin", "--no-contamination", "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)
    theirs = run_lm_eval(export, "bnlit_bits_per_char,bnlit_multiple_choice",
                         [f"text={docs}", f"multiple_choice={mc}"], tmp_path / "lm_eval", ours["seq_len"])
    text = [d for d in bn + en]
    chars, nbytes = sum(map(len, text)), sum(len(d.encode("utf-8")) for d in text)
    bpc_from_bpb = theirs["bnlit_bits_per_char"]["bits_per_byte,none"] * nbytes / chars
    bpc = ours["x"]["bits_per_char"]
    print(f"bits/char: bnlit {bpc:.5f}, lm-eval {theirs['bnlit_bits_per_char']['bits_per_char,none']:.5f}, "
          f"lm-eval bits/byte x bytes/char {bpc_from_bpb:.5f}")
    assert abs(bpc_from_bpb / bpc - 1) < 0.02  # the bound
    # the same documents, tokens, end-of-document tokens, attention and windows: equal to float rounding
    assert theirs["bnlit_bits_per_char"]["bits_per_char,none"] == pytest.approx(bpc, rel=1e-4)
    assert theirs["bnlit_bits_per_char"]["bits_per_byte,none"] == pytest.approx(ours["x"]["bits_per_byte"], rel=1e-4)
    m = ours["multiple_choice"]
    assert theirs["bnlit_multiple_choice"]["acc,none"] == pytest.approx(m["acc"])
    assert theirs["bnlit_multiple_choice"]["acc_norm,none"] == pytest.approx(m["acc_norm"])


def test_tasks_ship_with_the_package_and_name_their_inputs():
    """The task files are package data (an installed bnlit carries them) and a task without its
    file says which --metadata key names it."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert {p.name for p in TASKS.iterdir() if p.suffix in (".yaml", ".py")} == {
        "bnlit_bits_per_char.yaml", "bnlit_multiple_choice.yaml", "utils.py"}
    assert set(setup["package-data"]["bnlit.evaluation"]) == {"lm_eval_tasks/*.yaml", "lm_eval_tasks/*.py"}
    import importlib.util

    spec = importlib.util.spec_from_file_location("bnlit_lm_eval_task_utils", TASKS / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    with pytest.raises(ValueError, match="--metadata text=FILE"):
        utils.held_out_text(pretrained="x")
    with pytest.raises(ValueError, match="--metadata multiple_choice=FILE"):
        utils.multiple_choice_items()
    items = utils.multiple_choice_items(multiple_choice=str(FIXTURES / "multiple_choice_small.jsonl"))["test"]
    assert len(items) == 24 and utils.context(items[0]).startswith("</s>")

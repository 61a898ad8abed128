"""Every command the README and docs/ show, run with small arguments after the README's quick-start
install only (``.ci/quickstart`` makes that venv in a fresh clone and calls ``--run``).

``SMOKE`` is the list: each entry is a documented command cut to small arguments, with what it must
do there: exit 0, or exit with a one-line ``error:`` that matches (a GPU profile on a CPU machine,
an extra the quick start does not install, a hub dataset without network). ``COVERED_ELSEWHERE``
names the few documented commands too long for this step and the test that runs them.
``tests/test_documented_commands.py`` fails when a command in the docs is in neither (by script,
by module, or for ``python -m bnlit.train`` by its config-group choices), so the docs cannot show
a command this step does not run.

    python .ci/documented_commands.py --install-line README.md   # the quick-start install, as the README has it
    python .ci/documented_commands.py --run WORK_DIR             # --help of every script, then SMOKE
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BN_PROMPT = "আমার সোনার বাংলা"
# a few seconds of training on a slice of the embedded corpus
SMALL = ["model.config.vocab_size=1024", "+data.sources.0.max_docs=20", "+data.sources.1.max_docs=40",
         "data.val_fraction=0.2", "data.seq_len=64", "data.batch_size=4", "trainer.max_steps=2",
         "trainer.val_check_interval=2", "trainer.limit_val_batches=2", "callbacks.fertility.floors.bn=1.5",
         "threads=1"]
TRAIN = ["python", "-m", "bnlit.train"]
SWEEPS_EXTRA = r"pip install -e '\.\[sweeps\]'"

# (name, command, expected): expected 0, or a regex the one "error:" line of a refusal must match.
# {work}: this run's scratch dir; {run}: the first run's dir; {ckpt}: its last checkpoint.
SMOKE: list[tuple[str, list[str], int | str]] = [
    ("default run", [*TRAIN, *SMALL, "hydra.run.dir={run}"], 0),
    ("resume", [*TRAIN, *SMALL, "hydra.run.dir={run}", "ckpt_path=last", "trainer.max_steps=3"], 0),
    ("csv logger, fixed threads", [*TRAIN, *SMALL, "threads=2", "callbacks.threads=null", "logger=csv",
                                   "hydra.run.dir={work}/csv"], 0),
    ("tensorboard logger", [*TRAIN, *SMALL, "logger=tensorboard", "hydra.run.dir={work}/tb"], 0),
    # 512 pieces learned from 12 documents give bn ~1.3 chars/token: the floor is lowered to match
    ("your own files", [*TRAIN, *[a for a in SMALL[1:] if "floors.bn" not in a], "model.config.vocab_size=512",
                        "callbacks.fertility.floors.bn=1.2", "data=files",
                        "data.sources.0.path={work}/bn.txt", "data.sources.1.path={work}/en.jsonl",
                        "hydra.run.dir={work}/files"], 0),
    ("multiple-choice task", [*TRAIN, *SMALL, "+callbacks.multiple_choice.tasks.small=tests/fixtures/multiple_choice_small.jsonl",
                              "hydra.run.dir={work}/mc"], 0),
    ("grid sweep", [*TRAIN, "-m", *SMALL, "model=tiny", "optimizer.lr=1e-3,3e-3", "hydra.sweep.dir={work}/sweep"], 0),
    ("sweep table", ["python", "-m", "bnlit.sweep_report", "{work}/sweep"], 0),
    ("optuna without the sweeps extra", [*TRAIN, *SMALL, "hparams_search=optuna", "model=25m"], SWEEPS_EXTRA),
    ("slurm without the sweeps extra", [*TRAIN, "-m", "hydra/launcher=slurm", "trainer=multinode", "model=1b", "seed=1,2"],
     SWEEPS_EXTRA),
    ("production one-liner, composed", [*TRAIN, "model=400m", "trainer=h100", "--cfg", "job"], 0),
    ("FSDP on an A100 node, composed", [*TRAIN, "model=1b", "trainer=fsdp", "hardware=a100", "--cfg", "job"], 0),
    ("one B200, composed", [*TRAIN, "model=400m", "trainer=single", "hardware=b200", "--cfg", "job"], 0),
    ("production one-liner on a CPU machine", [*TRAIN, "model=400m", "trainer=h100"], r"debug=rehearsal"),
    ("hub data on a CPU machine", [*TRAIN, "model=400m", "data=bn_en_mix", "trainer=h100"], r"debug=rehearsal"),
    ("prepared hub data on a CPU machine", [*TRAIN, "model=400m", "data=bn_web", "trainer=h100"], r"debug=rehearsal"),
    ("data build alone", ["python", "-m", "bnlit.prepare", *SMALL[:4], "hydra.run.dir={work}/prepare"], 0),
    ("hub data without network", [*TRAIN, *SMALL[:1], "data=bn_web", "+data.sources.0.max_docs=20",
                                  "hydra.run.dir={work}/hub"], r"huggingface\.co is unreachable|not cached"),
    ("rehearsal of the GPU profile", [*TRAIN, *SMALL, "model=tiny", "trainer=h100", "debug=rehearsal", "trainer.max_steps=2",
                                      "hydra.run.dir={work}/rehearsal"], 0),
    ("run report", ["python", "-m", "bnlit.run_report", "{run}"], 0),
    ("model info", ["python", "-m", "bnlit.info"], 0),
    ("model info, production", ["python", "-m", "bnlit.info", "model=400m", "trainer=h100"], 0),
    ("W&B offline record", ["wandb", "leet", "inspect", "--summary", "{run}/wandb"], 0),
    ("export_hf", ["python", "scripts/export_hf.py", "--checkpoint", "{ckpt}", "--out", "{work}/hf", "--dtype", "bfloat16"], 0),
    ("export_gguf", ["python", "scripts/export_gguf.py", "--checkpoint", "{ckpt}", "--out", "{work}/model.gguf",
                     "--type", "q8_0"], 0),
    ("generate", ["python", "scripts/generate.py", "--checkpoint", "{ckpt}", "--prompt", BN_PROMPT, "--max-new-tokens", "20",
                  "--temperature", "0.8", "--top-k", "50", "--top-p", "0.95", "--seed", "0"], 0),
    ("evaluate held-out", ["python", "scripts/evaluate.py", "--checkpoint", "{ckpt}", "--held-out", "bn", "--no-twin",
                           "--no-contamination"], 0),
    ("evaluate files", ["python", "scripts/evaluate.py", "--checkpoint", "{ckpt}", "--text", "bn={work}/bn.txt",
                        "--text", "en={work}/en.jsonl", "--multiple-choice", "tests/fixtures/multiple_choice_small.jsonl",
                        "--json"], 0),
    ("fertility", ["python", "scripts/fertility.py", "--help"], 0),
    ("train_tokenizer", ["python", "scripts/train_tokenizer.py", "--help"], 0),
    ("compare_tokenizers", ["python", "scripts/compare_tokenizers.py", "--help"], 0),
    ("bench", ["python", "scripts/bench.py", "--help"], 0),
    ("bench_data", ["python", "scripts/bench_data.py", "--help"], 0),
    ("bench_compile", ["python", "scripts/bench_compile.py", "--help"], 0),
    ("compare_filters", ["python", "scripts/compare_filters.py", "--help"], 0),
    ("bench_dedup", ["python", "scripts/bench_dedup.py", "--help"], 0),
    ("bench_threads", ["python", "scripts/bench_threads.py", "--threads", "1", "--rounds", "1", "--steps", "1",
                       "--warmup", "1", "--batch-size", "2", "--seq-len", "32"], 0),
    ("bench_host_malloc", ["python", "scripts/bench_host_malloc.py", "--rounds", "1", "--steps", "1"], 0),
    ("bench_attention", ["python", "scripts/bench_attention.py", "--rounds", "2", "--steps", "1", "--eager"], 0),
    ("bench_loss", ["python", "scripts/bench_loss.py", "--rounds", "2", "--steps", "1", "--chunk-rows", "128", "--eager"], 0),
    ("ocr_debris", ["python", "scripts/ocr_debris.py", "--samples", "1"], 0),
    ("memory_check", ["python", "scripts/memory_check.py", "--presets", "tiny", "--precisions", "32-true",
                      "--seq-len", "32", "--batch-size", "2"], 0),
    ("gpu_check, dry run", ["python", "scripts/gpu_check.py", "--dry-run"], 0),
    ("chaos", ["python", "scripts/chaos.py", "--help"], 0),
    ("bench_shard_check", ["python", "scripts/bench_shard_check.py", "--gib", "0.01", "--rounds", "1",
                           "--dir", "{work}"], 0),
]

# documented commands this step does not run, each with the test that does (same dependencies)
COVERED_ELSEWHERE = {
    "trainer=fsdp debug=rehearsal model=tiny": "tests/test_rehearsal.py (slow): 2 processes, FSDP2 over gloo",
    "trainer=multinode debug=rehearsal model=tiny": "tests/test_rehearsal.py (slow): 2 processes, DDP over gloo",
    "trainer=multinode model=1b": "tests/test_slurm.py / tests/test_multinode.py: torchrun and SLURM need several processes",
    "llama_cpp.server": "the serve extra (docs/export.md); tests/test_gguf.py (slow, .ci/run installs the extra)",
}


# -- the commands in the docs -------------------------------------------------------------------------

def doc_files(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def documented_commands(root: Path = REPO) -> list[tuple[str, str]]:
    """``(file, command)`` for every ``python -m bnlit.*`` and ``python scripts/*.py`` the docs show,
    in fenced code blocks (continuation lines joined) and in inline code."""
    out = []
    for path in doc_files(root):
        text = path.read_text()
        spans = [block for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S)]
        spans = [re.sub(r"\\\n\s*", " ", s) for s in spans]
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        spans += re.findall(r"`([^`\n]+)`", prose)
        for span in spans:
            for line in span.splitlines():
                for m in re.finditer(r"python3? (-m bnlit\.[a-z_]+|scripts/[a-z_]+\.py)([^#;&|`)]*)", line):
                    out.append((path.name, (m.group(1) + m.group(2)).strip()))
    return out


def groups(root: Path = REPO) -> set[str]:
    conf = root / "conf"
    return {str(p.relative_to(conf)) for p in conf.rglob("*") if p.is_dir()}


def coverage_key(command: str, known_groups: set[str]) -> tuple[str, frozenset[str]]:
    """``("script", {name})``, ``("module", {name})``, or for bnlit.train ``("train", {group choices})``."""
    words = command.replace("\\", " ").split()
    head = words[0]
    if head.startswith("scripts/"):
        return "script", frozenset({Path(head).stem})
    module = words[1]
    if module != "bnlit.train":
        return "module", frozenset({module})
    # the model preset is left out: every preset is the same code (bnlit.model.Transformer) at another size
    choices = {w for w in words[2:] if "=" in w and w.split("=", 1)[0].lstrip("+~") in known_groups - {"model"}
               and "<" not in w}
    return "train", frozenset(choices)


def smoke_keys(known_groups: set[str]) -> list[tuple[str, frozenset[str]]]:
    keys = [coverage_key(" ".join(cmd[1:]), known_groups) for _, cmd, _ in SMOKE if cmd[0] == "python"]
    for text in COVERED_ELSEWHERE:
        keys.append(("train", frozenset(text.split())) if "=" in text else ("module", frozenset({text})))
    return keys


def uncovered(root: Path = REPO) -> list[tuple[str, str]]:
    known = groups(root)
    keys = smoke_keys(known)
    missing = []
    for file, command in documented_commands(root):
        kind, key = coverage_key(command, known)
        if not any(k == kind and key <= have for k, have in keys):
            missing.append((file, command))
    return missing


# -- running them ----------------------------------------------------------------------------------------

def install_line(readme: Path) -> str:
    """The README's first shell command up to (not including) its ``python -m bnlit.train``."""
    block = re.search(r"```bash\n(.*?)```", readme.read_text(), re.S).group(1).strip()
    parts = [p.strip() for p in block.split("&&")]
    return " && ".join(p for p in parts if not p.startswith("python -m bnlit.train"))


def write_files(work: Path) -> None:
    """A Bangla .txt and an English .jsonl for the ``data=files`` and ``--text`` commands."""
    import json

    from bnlit.data import embedded

    (work / "bn.txt").write_text("\n\n".join(embedded.bangla_documents()[:12]), encoding="utf-8")
    (work / "en.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in embedded.english_documents()[:12]),
                                   encoding="utf-8")


def run_all(work: Path) -> int:
    work.mkdir(parents=True, exist_ok=True)
    write_files(work)
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", BNLIT_CACHE=str(work / "cache"),
               HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    env.pop("WANDB_API_KEY", None)
    fill = {"work": str(work), "run": str(work / "run"), "ckpt": str(work / "run" / "checkpoints" / "last.ckpt")}
    failed = []
    helps = [("--help " + p.name, ["python", f"scripts/{p.name}", "--help"], 0) for p in sorted((REPO / "scripts").glob("*.py"))]
    import torch

    gpu = torch.cuda.is_available()
    for name, cmd, expected in [*helps, ("--help bnlit.train", [*TRAIN, "--help"], 0), *SMOKE]:
        if gpu and expected == r"debug=rehearsal":  # a GPU machine runs the profile for real: not a small command
            print(f"skip        {name}: this machine has a GPU", flush=True)
            continue
        cmd = [sys.executable if c == "python" else c.format(**fill) for c in cmd]
        if cmd[0] == "wandb":
            cmd[0] = str(Path(sys.executable).parent / "wandb")
        start = time.perf_counter()
        out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
        if expected == 0:
            ok = out.returncode == 0
        else:
            ok = out.returncode == 2 and len(errors) == 1 and re.search(expected, errors[0]) is not None
        print(f"{'ok  ' if ok else 'FAIL'} {time.perf_counter() - start:6.1f} s  {name}: {shlex.join(cmd[1:])[:160]}",
              flush=True)
        if not ok:
            failed.append(name)
            print(f"     exit {out.returncode}; expected {expected!r}\n" + (out.stdout + out.stderr)[-3000:], flush=True)
    if (work / "hf").is_dir():  # exports are readable by others (the umask decides, not mkdtemp's 0700)
        private = [p for p in [work / "hf", *(work / "hf").iterdir()] if not os.stat(p).st_mode & 0o004]
        if private and os.umask(os.umask(0)) & 0o004 == 0:
            failed.append("export_hf modes")
            print(f"FAIL export_hf wrote files others cannot read: {[str(p) for p in private]}")
    print(f"{len(failed)} failed: {failed}" if failed else "every documented command ran as documented")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--install-line", type=Path, metavar="README", help="print the README's quick-start install")
    p.add_argument("--run", type=Path, metavar="WORK_DIR", help="run every documented command with small arguments")
    p.add_argument("--uncovered", action="store_true", help="list documented commands no entry covers")
    args = p.parse_args(argv)
    if args.install_line:
        print(install_line(args.install_line))
        return 0
    if args.uncovered:
        for file, command in uncovered():
            print(f"{file}: {command}")
        return 0
    if args.run:
        return run_all(args.run)
    p.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())

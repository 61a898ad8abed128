"""Interrupts from outside, at random moments: ``python scripts/chaos.py --trials 50 --seed 0``.

Starts real ``python -m bnlit.train`` runs (a small fp32 CPU run, :data:`RUN`) and sends SIGINT,
SIGTERM or SIGKILL from this process at a moment drawn in one of the run's phases (start-up, data
build and tokenizer training on a cold cache, model set-up, training, validation, a checkpoint
write, the final report). After each interruption it reruns as a user or SLURM would: with
``ckpt_path=last`` when the run's last line (or, after SIGKILL, the checkpoint directory) says
there is a checkpoint, else the same command. Checked per trial:

- SIGINT/SIGTERM end with exit code 128+signal and exactly one ``interrupted ...`` line that names
  what to run next, without a traceback (a signal during Python's imports, before bnlit has
  started, ends as Python ends: by the signal, with nothing written);
- the final model and optimizer state equal the uninterrupted run's bit for bit, and so does
  ``train/loss`` of every step: nothing corrupt or partial was trusted;
- no temporary file is left in the run directory or the cache;
- the wall time lost per interruption, against one checkpoint interval plus start-up (reported,
  not judged: the machines are shared and noisy).

Writes ``report.json`` and ``report.md`` to ``--out`` and prints the summary; exits 1 when a
check failed. Phases are seen from outside: the run's log lines and progress bar (stderr), and
the checkpoint directory (a ``.tmp`` file is a checkpoint being written)."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

MAX_STEPS, CHECKPOINT_INTERVAL = 40, 8
# a small fp32 run: bitwise reproducible on CPU, 40 optimizer steps, 5 checkpoints, 4 validations
RUN = [
    "model=tiny", "model.config.vocab_size=1024", "+data.sources.0.max_docs=20", "+data.sources.1.max_docs=40",
    "data.val_fraction=0.2", "data.seq_len=64", "data.batch_size=4", "data.num_proc=1",
    "trainer.precision=32-true", "optimizer.lr=3e-3", "scheduler=cosine", f"trainer.max_steps={MAX_STEPS}",
    "trainer.val_check_interval=10", "trainer.limit_val_batches=4", "trainer.log_every_n_steps=1",
    "trainer.enable_model_summary=false", f"callbacks.model_checkpoint.every_n_train_steps={CHECKPOINT_INTERVAL}",
    "callbacks.progress_bar.refresh_rate=1", "logger=csv", "threads=1",
    "callbacks.fertility.floors.bn=1.5",  # 1024 pieces give Bangla ~1.9 chars/token
]
PHASES = ("startup", "data", "tokenizer", "shards", "setup", "compile", "training", "validation", "checkpoint",
          "report")
COLD_ONLY = ("data", "tokenizer", "shards")  # a warm cache skips them
SIGNALS = ("SIGINT", "SIGTERM", "SIGKILL")
# phase markers in the run's stderr, in the order a run reaches them (training and validation alternate;
# "compile" only in a compiled run, where the first step and the parity probe compile the graphs)
MARKERS = (("data", "Seed set to"), ("tokenizer", "tokenizer: "), ("shards", "data: tokenizer trained"),
           ("setup", "mixture "), ("compile", "document masking: leakage probe"), ("report", "`Trainer.fit` stopped"))
# (a compiled run's sanity validation comes before the first step's compile: the same rank)
ORDER = {"startup": 0, "data": 1, "tokenizer": 2, "shards": 3, "setup": 4, "compile": 6, "validation": 6,
         "training": 6, "report": 7, "exited": 8}
STEP = re.compile(r"Training(?: \(epoch \d+\))?:[^|]*\|[^|]*\|\s*(\d+)/(\d+)")  # bnlit's training bar
TEMP = re.compile(r"\.tmp|^tmp")


@dataclass
class Attempt:
    resume: bool
    signal: str | None = None
    target: str | None = None
    phase: str | None = None  # where the signal landed
    step: int | None = None  # the training step last shown when it landed
    first_step: int | None = None  # the step this run started training at (a resumed run: its checkpoint's)
    rc: int | None = None
    wall_s: float = 0.0
    lines: list[str] = field(default_factory=list)  # the "interrupted ..." lines
    problems: list[str] = field(default_factory=list)


class Watch:
    """Follows one run from outside: its phase (from stderr markers, the progress bar and the
    checkpoint directory) and the moment to send the signal."""

    def __init__(self, proc: subprocess.Popen, checkpoint_dir: Path, compiled: bool = False):
        self.proc, self.checkpoint_dir, self.compiled = proc, checkpoint_dir, compiled
        self.phase, self.step, self.text = "startup", None, []
        self.marks: dict[str, float] = {}
        self.start = time.perf_counter()
        self.stale = self._temp_files()  # a killed run's partial write: the next run removes it
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        buf = b""
        while chunk := os.read(self.proc.stdout.fileno(), 65536):
            buf += chunk
            *parts, buf = re.split(rb"[\r\n]", buf)
            for raw in parts:
                self._see(raw.decode("utf-8", "replace"))
        self._see(buf.decode("utf-8", "replace"))
        with self.changed:
            self.phase = "exited"
            self.changed.notify_all()

    def _see(self, line: str) -> None:
        if not line.strip():
            return
        self.text.append(line)
        phase = self.phase
        if (m := STEP.search(line)) and "?it/s" not in line:  # "?it/s": no step done yet
            phase, self.step = "training", int(m.group(1))
        elif line.startswith("Validation") and phase in ("training", "setup", "compile"):
            phase = "validation"
        for name, marker in MARKERS:  # after the bar: the fit's end is printed after its last refresh
            if marker in line and (name != "compile" or self.compiled):
                phase = name
        if ORDER[phase] < ORDER[self.phase]:  # the bar's last refresh after the fit stopped
            phase = self.phase
        with self.changed:
            if phase != self.phase:
                self.marks.setdefault(phase, time.perf_counter() - self.start)
            self.phase = phase
            self.changed.notify_all()

    def writing_checkpoint(self) -> bool:
        return bool(self._temp_files() - self.stale)

    def _temp_files(self) -> set[str]:
        try:
            return {p.name for p in self.checkpoint_dir.iterdir() if TEMP.search(p.name)}
        except FileNotFoundError:
            return set()

    def wait_for(self, ok, timeout: float = 600) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: ok() or self.phase == "exited", timeout) and self.phase != "exited"

    def now(self) -> str:
        return "checkpoint" if self.writing_checkpoint() else self.phase


def strike(watch: Watch, target: str, signum: int, rng: random.Random, timing: dict[str, float]) -> tuple[str, int | None] | None:
    """Send ``signum`` at a random moment of ``target``; the phase and step it landed in, or None
    when the run ended first."""
    if target == "checkpoint":  # polled: a checkpoint write takes milliseconds
        while watch.proc.poll() is None:
            if watch.writing_checkpoint():
                return fire(watch, signum)
            time.sleep(0.0005)
        return None
    if target == "training":
        step = rng.randint((watch.step or 0) + 1, MAX_STEPS - 1) if (watch.step or 0) + 1 < MAX_STEPS else None
        if step is None or not watch.wait_for(lambda: (watch.step or 0) >= step and watch.phase == "training"):
            return None
        time.sleep(rng.uniform(0, timing["step_s"]))
        return fire(watch, signum)
    if target == "startup":
        time.sleep(rng.uniform(0, timing["startup"]))
        return fire(watch, signum)
    # once the phase has begun, at a moment drawn over its length in the reference run; a short
    # phase may be over when the signal goes: it is recorded where it landed
    if target == "validation":  # it recurs: the next one, at a moment within it
        if not watch.wait_for(lambda: watch.phase == "validation"):
            return None
        time.sleep(rng.uniform(0, timing["validation"]))
        return fire(watch, signum)
    if not watch.wait_for(lambda: target in watch.marks):
        return None
    time.sleep(max(rng.uniform(0, timing[target]) - (time.perf_counter() - watch.start - watch.marks[target]), 0))
    return fire(watch, signum)


def fire(watch: Watch, signum: int) -> tuple[str, int | None] | None:
    if watch.proc.poll() is not None:
        return None
    phase, step = watch.now(), watch.step
    watch.proc.send_signal(signum)
    return phase, step


def start(run_dir: Path, cache: Path, resume: bool, compiled: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-u", "-m", "bnlit.train", *RUN, f"hydra.run.dir={run_dir}", f"paths.cache_dir={cache}"]
    cmd += ["module.compile=true"] if compiled else []
    # SIGINT at its default, as in a terminal's foreground job, also when this script runs in the
    # background (where a shell starts it ignored, and Python would keep it ignored until bnlit's handler)
    return subprocess.Popen(cmd + (["ckpt_path=last"] if resume else []), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd=run_dir.parent,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


RUN_TIMEOUT_S = [900.0]  # --run-timeout: a run still going after this is a hang (killed, and a problem)


def attempt(run_dir: Path, cache: Path, resume: bool, plan: tuple[str, str] | None, rng: random.Random,
            timing: dict[str, float], compiled: bool = False) -> tuple[Attempt, Watch]:
    a = Attempt(resume=resume, first_step=resumes_from(run_dir) if resume else 0)
    t0 = time.perf_counter()
    proc = start(run_dir, cache, resume, compiled)
    watch = Watch(proc, run_dir / "checkpoints", compiled)
    if plan is not None:
        a.target, a.signal = plan
        hit = strike(watch, a.target, getattr(signal, a.signal), rng, timing)
        if hit is None:
            a.signal = None  # the run ended before the moment came: no interruption
        else:
            a.phase, a.step = hit
    try:
        a.rc = proc.wait(timeout=RUN_TIMEOUT_S[0])
    except subprocess.TimeoutExpired:  # a hang: recorded with the run's last lines, the trials go on
        proc.kill()
        a.rc = proc.wait()
        watch.reader.join(timeout=30)
        a.wall_s = time.perf_counter() - t0
        a.problems.append(f"hung: still running after {RUN_TIMEOUT_S[0]:.0f} s (phase {watch.phase}, "
                          f"signal {a.signal} in {a.phase}); last lines: {' | '.join(watch.text[-6:])[-1200:]}")
        return a, watch
    watch.reader.join(timeout=30)
    a.wall_s = time.perf_counter() - t0
    a.lines = [ln for ln in watch.text if ln.startswith("interrupted ")]
    judge(a, watch)
    return a, watch


def judge(a: Attempt, watch: Watch) -> None:
    """The exit of one attempt: the documented code and one line, or a clean finish."""
    text = "\n".join(watch.text)
    if a.signal is None:
        if a.rc != 0:
            a.problems.append(f"exit {a.rc} without an interruption: {text[-600:]}")
        return
    signum = getattr(signal, a.signal)
    if a.signal == "SIGKILL":
        if a.rc != -signal.SIGKILL:
            a.problems.append(f"SIGKILL gave exit {a.rc}")
        return
    before_bnlit = a.phase == "startup" and "threads:" not in text
    # after the report's last line the process is exiting: Python's finalisation puts the default
    # handlers back, and a signal then ends it as the signal does; everything was written
    after_bnlit = re.search(r"^wall time ", text, re.M) is not None
    if a.rc == 0 and a.phase in ("report", "checkpoint", "training", "validation"):
        return  # landed as the run finished its last step: nothing left to interrupt
    if (before_bnlit or after_bnlit) and a.rc == -signum and not a.lines:
        return  # Python's own end, during its imports (nothing written yet) or its exit (all written)
    if a.rc != 128 + signum:
        a.problems.append(f"{a.signal} in {a.phase}: exit {a.rc}, expected {128 + signum}")
    if len(a.lines) != 1:
        a.problems.append(f"{a.signal} in {a.phase}: {len(a.lines)} 'interrupted' lines")
    if "Traceback" in text:
        a.problems.append(f"{a.signal} in {a.phase}: a traceback: {text[text.index('Traceback'):][:800]}")


def resumes_from(run_dir: Path) -> int:
    """The step ``ckpt_path=last`` resumes from: that of the newest complete checkpoint (0: none)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bnlit.checkpointing import newest_step

    return newest_step(run_dir / "checkpoints")[0]


def resume_next(a: Attempt, run_dir: Path) -> bool:
    """What a user does next: follow the run's line; after SIGKILL, resume if a checkpoint exists."""
    if a.lines:
        return "ckpt_path=last" in a.lines[0]
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bnlit.checkpointing import newest_checkpoint
    return newest_checkpoint(run_dir / "checkpoints") is not None


def final_state(run_dir: Path) -> dict:
    import torch

    from bnlit.run_report import read_metrics

    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    losses = dict(read_metrics(run_dir / "csv" / "metrics.csv")["train/loss"])
    return {"model": ckpt["state_dict"], "optimizer": ckpt["optimizer_states"], "step": ckpt["global_step"],
            "losses": losses}


def same(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def steps_redone(attempts: list[Attempt]) -> list[int]:
    """Per interruption in training: the steps it had shown minus the step the next run started
    from (SIGINT/SIGTERM save the step in flight: 0; SIGKILL: back to the last checkpoint)."""
    out = []
    for a, b in zip(attempts, attempts[1:]):
        if a.signal and a.step is not None:
            out.append(max(a.step - (b.first_step or 0), 0))
    return out


def debris(*dirs: Path) -> list[str]:
    return [str(p) for d in dirs if d.exists() for p in d.rglob("*") if TEMP.search(p.name)]


def trial(n: int, out: Path, rng: random.Random, references: "References", args) -> dict:
    cold, compiled = rng.random() < args.cold_share, rng.random() < args.compile_share
    ref, timing, warm_cache = references.get(compiled)
    later = [p for p in PHASES if p not in COLD_ONLY and (compiled or p != "compile")]
    # the phases only some trials have get the first interruption more often, so that each is hit
    first = rng.choice(COLD_ONLY if cold and rng.random() < 2 / 3 else
                       ["compile"] if compiled and rng.random() < 1 / 2 else later)
    k = rng.randint(1, args.max_interrupts)
    targets = [first] + [rng.choice(later) for _ in range(k - 1)]
    tdir = out / f"trial{n:03d}"
    run_dir, cache = tdir / "run", tdir / "cache"
    run_dir.parent.mkdir(parents=True)
    if not cold:
        shutil.copytree(warm_cache, cache)
    attempts, resume = [], False
    for _ in range(k + 3):
        plan = (targets.pop(0), rng.choice(args.signals)) if targets else None
        a, _watch = attempt(run_dir, cache, resume, plan, rng, timing, compiled)
        attempts.append(a)
        if a.signal is None and a.rc == 0 and not a.problems:
            break
        if a.problems and a.signal is None:
            break
        resume = resume_next(a, run_dir)
    else:
        attempts[-1].problems.append("no attempt finished")
    problems = [p for a in attempts for p in a.problems]
    done = attempts[-1].rc == 0
    if done:
        got = final_state(run_dir)
        for key in ("model", "optimizer", "step", "losses"):
            if not same(got[key], ref[key]):
                problems.append(f"final {key} differs from the uninterrupted run's")
    problems += [f"temporary file left: {p}" for p in debris(run_dir, cache)]
    redone = steps_redone(attempts)
    problems += [f"{n} steps trained again after an interruption, more than one checkpoint interval "
                 f"({CHECKPOINT_INTERVAL})" for n in redone if n > CHECKPOINT_INTERVAL]
    hits = [a for a in attempts if a.signal]
    wall = sum(a.wall_s for a in attempts)
    lost = (wall - timing["wall_cold" if cold else "wall_warm"]) / max(len(hits), 1)
    result = {"trial": n, "cold_cache": cold, "compiled": compiled, "attempts": [asdict(a) for a in attempts], "interruptions": len(hits),
              "phases": [a.phase for a in hits], "signals": [a.signal for a in hits], "finished": done,
              "problems": problems, "steps_redone": redone, "wall_s": round(wall, 2), "lost_per_interruption_s": round(lost, 2),
              "bound_s": round(timing["bound_s"], 2)}
    if not problems and not args.keep:
        shutil.rmtree(tdir)
    return result


def reference(out: Path, compiled: bool) -> tuple[dict, dict, Path]:
    """Two uninterrupted runs, on a cold and on the warm cache: the state every trial must end
    in (the two must agree), and the phase timings the random moments are drawn from."""
    runs, tag = {}, "-compiled" if compiled else ""
    for name in ("cold", "warm"):
        run_dir = out / f"reference{tag}-{name}" / "run"
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        a, watch = attempt(run_dir, out / f"reference{tag}-cold" / "cache", False, None, random.Random(0), {}, compiled)
        if a.rc != 0:
            raise SystemExit(f"chaos: the uninterrupted {name} run failed (exit {a.rc}): {' | '.join(watch.text[-8:])}")
        runs[name] = (a, watch, final_state(run_dir))
    if not same(runs["cold"][2], runs["warm"][2]):
        raise SystemExit("chaos: two uninterrupted runs differ: this run is not bitwise reproducible here")
    (cold, cw, ref), (warm, ww, _) = runs["cold"], runs["warm"]
    m, c = ww.marks, cw.marks
    train_s = m.get("report", warm.wall_s) - m.get("training", 0)

    def span(marks: dict, a: str, b: str, floor: float = 0.05) -> float:
        return max(marks.get(b, 0) - marks.get(a, 0), floor)

    timing = {"wall_cold": cold.wall_s, "wall_warm": warm.wall_s, "startup": m.get("data", 5.0),
              "data": span(c, "data", "tokenizer"), "tokenizer": span(c, "tokenizer", "shards"),
              "shards": span(c, "shards", "setup"), "setup": span(m, "setup", "compile" if compiled else "training"),
              "compile": span(m, "compile", "training") if compiled else 0.0, "step_s": max(train_s / MAX_STEPS, 0.01),
              "validation": 0.1, "report": max(warm.wall_s - m.get("report", warm.wall_s), 0.1)}
    timing["bound_s"] = m.get("training", 5.0) + CHECKPOINT_INTERVAL * timing["step_s"]
    return ref, timing, out / f"reference{tag}-cold" / "cache"


class References:
    """The uninterrupted runs of each kind (eager, compiled), made when a trial first needs them."""

    def __init__(self, out: Path):
        self.out, self.made = out, {}

    def get(self, compiled: bool) -> tuple[dict, dict, Path]:
        if compiled not in self.made:
            self.made[compiled] = reference(self.out, compiled)
        return self.made[compiled]


def report(results: list[dict], timing: dict, args, load: tuple[float, float]) -> str:
    """The summary: interruptions by phase and signal, what was checked, and every problem."""
    hits = Counter((p, s) for r in results for p, s in zip(r["phases"], r["signals"]))
    failed = [r for r in results if r["problems"]]
    lost = sorted(r["lost_per_interruption_s"] for r in results if r["interruptions"])
    over = sum(r["lost_per_interruption_s"] > r["bound_s"] for r in results if r["interruptions"])
    redone = sorted(n for r in results for n in r["steps_redone"])
    planned = sum(1 for r in results for a in r["attempts"] if a["target"])
    rows = ["| phase | " + " | ".join(args.signals) + " |", "|---" * (len(args.signals) + 1) + "|"]
    rows += [f"| {p} | " + " | ".join(str(hits[(p, s)]) for s in args.signals) + " |" for p in PHASES]
    median = lost[len(lost) // 2] if lost else 0.0
    lines = [
        f"chaos: {len(results)} trials (seed {args.seed}), {sum(r['interruptions'] for r in results)} interruptions, "
        f"{sum(r['cold_cache'] for r in results)} trials on a cold cache, {sum(r['compiled'] for r in results)} "
        f"compiled ({planned} interruptions planned: the rest came after the run had ended); "
        f"{len(failed)} trials with a problem",
        f"steps trained again after an interruption in training: max {max(redone, default=0)} (one checkpoint "
        f"interval is {CHECKPOINT_INTERVAL}), {sum(n == 0 for n in redone)} of {len(redone)} lost none",
        f"final model and optimizer bitwise equal to the uninterrupted run's: "
        f"{sum(r['finished'] and not r['problems'] for r in results)} of {len(results)}",
        f"wall time lost per interruption: median {median:.1f} s, max {max(lost, default=0):.1f} s; "
        f"bound (start-up {timing['bound_s'] - CHECKPOINT_INTERVAL * timing['step_s']:.1f} s + one checkpoint "
        f"interval {CHECKPOINT_INTERVAL * timing['step_s']:.1f} s) = {timing['bound_s']:.1f} s (eager; a compiled "
        f"run's start-up includes its compile), exceeded by {over} "
        f"(load average {load[0]:.1f} at start, {load[1]:.1f} at end; timings are noisy here)",
        "", "interruptions by phase (where the signal landed) and signal:", "", *rows,
    ]
    for r in failed:
        lines.append(f"trial {r['trial']}: " + "; ".join(r["problems"])[:1500])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=50, help="interrupted runs, each rerun until it finishes")
    ap.add_argument("--seed", type=int, default=0, help="draws the signals, phases and moments")
    ap.add_argument("--out", type=Path, default=Path("outputs/chaos"),
                    help="a new directory: the reference runs, failed trials, report.json and report.md")
    ap.add_argument("--signals", nargs="+", default=list(SIGNALS), choices=SIGNALS, help="the signals drawn from")
    ap.add_argument("--max-interrupts", type=int, default=3, help="interruptions per trial: 1 to this many")
    ap.add_argument("--cold-share", type=float, default=0.3, help="share of trials that start on an empty cache")
    ap.add_argument("--compile-share", type=float, default=0.15,
                    help="share of trials run with module.compile=true (Inductor on CPU: about 1-2 min more per run)")
    ap.add_argument("--run-timeout", type=float, default=900.0,
                    help="seconds after which a run counts as hung: it is killed and the trial fails")
    ap.add_argument("--keep", action="store_true", help="keep every trial's run dir (failed ones are always kept)")
    args = ap.parse_args(argv)
    RUN_TIMEOUT_S[0] = args.run_timeout
    out = args.out.resolve()
    if out.exists() and any(out.iterdir()):
        print(f"error: --out {out} is not empty; pass a new directory", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()[0]
    references = References(out)
    references.get(False)
    rng = random.Random(args.seed)
    results = []
    for n in range(args.trials):
        r = trial(n, out, rng, references, args)
        results.append(r)
        status = "ok" if not r["problems"] else "PROBLEM: " + r["problems"][0][:200]
        print(f"trial {n}{' (compiled)' if r['compiled'] else ''}{' (cold cache)' if r['cold_cache'] else ''}: "
              f"{', '.join(f'{s} in {p}' for s, p in zip(r['signals'], r['phases'])) or 'no hit'}; "
              f"{len(r['attempts'])} runs, {r['wall_s']:.0f} s; {status}", flush=True)
        text = report(results, references.get(False)[1], args, (load0, os.getloadavg()[0]))
        timings = {("compiled" if k else "eager"): v[1] for k, v in references.made.items()}
        (out / "report.json").write_text(json.dumps({"command": sys.argv, "timing": timings, "trials": results}, indent=1))
        (out / "report.md").write_text(text + "\n")  # after every trial: a stopped run still reports
    print(text)
    return 1 if any(r["problems"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

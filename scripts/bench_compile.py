"""``python scripts/bench_compile.py [--models 400m,1b]``: what ``module.compile: true`` costs and
buys on this machine's CPU (Inductor's C++ backend), per block against the whole model.

For each preset, alternated over ``--reps`` (per block, whole, whole, per block, ...), a fresh
process with a fresh, empty Inductor cache (the first run a user makes) builds the model, compiles
it as ``trainer=h100`` would (``fullgraph``, the chunked loss, the document mask, the trainer's
CPU precision: bf16-mixed autocast on a CPU with native bf16, else fp32) and times:

- ``first_step_s``: the first forward+backward, compilation included (what a run waits before
  its first step), in wall time and (``first_step_cpu_s``) in CPU time of the process and the C++
  compiler runs it waits for: on a loaded machine the CPU time is the figure that compares;
- ``step_s``: the median forward+backward of ``--steps`` more, after that warm-up (and
  ``step_cpu_s``);
- ``compile_s``: Dynamo's own account of its compile time (forward and backward graphs);
- ``graphs``: the graphs compiled (:class:`bnlit.speed.compile.CompileWatch`).

The backward computes every gradient but keeps none (``torch.autograd.grad`` of one small
parameter): ``1b``'s fp32 gradients alone would be 4 GiB more on a shared machine, and what is
measured (the graphs compiled and run) is the same. A child whose model does not fit in this
machine's available memory (with ``--memory-factor`` headroom) is skipped with one line.
Prints one JSON object: the runs, and per preset the paired ratios whole/per-block with the
load average at start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def child(preset: str, per_block: bool, seq_len: int, batch_size: int, steps: int) -> dict:
    import torch
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from bnlit import CONF_DIR
    from bnlit.speed.compile import CompileWatch, compile_model
    from bnlit.document_masking import document_mask
    from bnlit.loss import chunked_loss
    from bnlit.model import Transformer
    from bnlit.resolvers import cpu_precision
    from bnlit.tokenizer import EOS_ID

    torch.manual_seed(0)
    cfg = instantiate(OmegaConf.load(Path(CONF_DIR) / "model" / f"{preset}.yaml").model.config)
    model = Transformer(cfg)
    model.loss_fn = chunked_loss
    watch = CompileWatch().start()
    compile_model(model, fullgraph=True, per_block=per_block)
    precision = cpu_precision()
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-mixed")
    g = torch.Generator().manual_seed(1)
    x = torch.randint(EOS_ID + 1, cfg.vocab_size, (batch_size, seq_len), generator=g)
    x[:, seq_len // 3] = EOS_ID  # two documents per window: a real document mask
    y = torch.randint(0, cfg.vocab_size, (batch_size, seq_len), generator=g)
    keep = [model.norm.weight]  # every gradient is computed, this one is kept

    def cpu() -> float:  # this process and its reaped children (Inductor's C++ compiler runs)
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def step() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), cpu()
        with autocast:
            loss = model(x, y, mask=document_mask(x, EOS_ID))
        torch.autograd.grad(loss, keep)
        return time.perf_counter() - t0, cpu() - c0

    first, first_cpu = step()
    times = [step() for _ in range(steps)]
    rss = int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0]) * 1024
    return {"preset": preset, "per_block": per_block, "first_step_s": first, "first_step_cpu_s": first_cpu,
            "step_s": statistics.median(t for t, _ in times), "step_cpu_s": statistics.median(c for _, c in times),
            "compile_s": watch.seconds(), "graphs": len(watch.events), "recompiles": len(watch.recompiles),
            "precision": precision, "threads": torch.get_num_threads(), "peak_rss_gib": rss / 2**30,
            "n_layer": cfg.n_layer}


def weights_bytes(preset: str) -> int:
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from bnlit import CONF_DIR
    from bnlit.speed.flops import param_counts

    cfg = instantiate(OmegaConf.load(Path(CONF_DIR) / "model" / f"{preset}.yaml").model.config)
    return 4 * param_counts(cfg)["n_params"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=lambda v: v.split(","), default=["400m", "1b"],
                    help="presets, comma-separated (conf/model/<name>.yaml)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per window (compile time does not depend on it)")
    ap.add_argument("--batch-size", type=int, default=1, help="windows per step")
    ap.add_argument("--steps", type=int, default=3, help="timed steps after the first")
    ap.add_argument("--reps", type=int, default=2, help="alternated repetitions of each variant")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads of each child")
    ap.add_argument("--memory-factor", type=float, default=3.0,
                    help="skip a preset unless available memory >= this x its fp32 weights + 2 GiB")
    ap.add_argument("--child", nargs=2, metavar=("PRESET", "VARIANT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        r = child(args.child[0], args.child[1] == "blocks", args.seq_len, args.batch_size, args.steps)
        print(json.dumps(r))
        return r

    out = {"seq_len": args.seq_len, "batch_size": args.batch_size, "threads": args.threads, "reps": args.reps,
           "load_average_start": os.getloadavg()[0], "runs": [], "presets": {}, "skipped": []}
    for preset in args.models:
        need = args.memory_factor * weights_bytes(preset) + 2 * 2**30
        runs: dict[str, list[dict]] = {"blocks": [], "whole": []}
        for rep in range(args.reps):
            for variant in (("blocks", "whole") if rep % 2 == 0 else ("whole", "blocks")):
                if available_bytes() < need:
                    line = (f"{preset} {variant} rep {rep + 1}: skipped, {available_bytes() / 2**30:.1f} GiB available "
                            f"< {need / 2**30:.1f} GiB needed")
                    print(line, file=sys.stderr, flush=True)
                    out["skipped"].append(line)
                    continue
                with tempfile.TemporaryDirectory(prefix="bnlit_inductor_") as cache:
                    # compile in this process (its C++ compiler runs are then reaped children, counted
                    # in the CPU time), not in a pool of workers
                    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS=str(args.threads),
                               TORCHINDUCTOR_COMPILE_THREADS="1")
                    cmd = [sys.executable, __file__, "--child", preset, variant, "--seq-len", str(args.seq_len),
                           "--batch-size", str(args.batch_size), "--steps", str(args.steps),
                           "--threads", str(args.threads)]
                    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
                if p.returncode != 0:
                    raise SystemExit(f"{preset} {variant}: the child failed:\n{p.stderr[-3000:]}")
                r = json.loads(p.stdout.strip().splitlines()[-1]) | {"rep": rep, "load_average": os.getloadavg()[0]}
                runs[variant].append(r)
                out["runs"].append(r)
                print(f"{preset:5s} {variant:6s} rep {rep + 1}: first step {r['first_step_s']:7.1f} s wall, "
                      f"{r['first_step_cpu_s']:7.1f} s CPU (compile {r['compile_s']:6.1f} s, {r['graphs']} graphs), "
                      f"then {r['step_s']:6.2f} s/step ({r['step_cpu_s']:.2f} s CPU), "
                      f"peak RSS {r['peak_rss_gib']:.1f} GiB, load {r['load_average']:.1f}", file=sys.stderr, flush=True)
        pairs = [(w, b) for w in runs["whole"] for b in runs["blocks"] if w["rep"] == b["rep"]]
        if pairs:
            out["presets"][preset] = {
                "first_step_s_blocks": statistics.median(b["first_step_s"] for _, b in pairs),
                "first_step_s_whole": statistics.median(w["first_step_s"] for w, _ in pairs),
                "first_step_whole_vs_blocks": statistics.median(w["first_step_s"] / b["first_step_s"] for w, b in pairs),
                "first_step_cpu_s_blocks": statistics.median(b["first_step_cpu_s"] for _, b in pairs),
                "first_step_cpu_s_whole": statistics.median(w["first_step_cpu_s"] for w, _ in pairs),
                "first_step_cpu_whole_vs_blocks": statistics.median(
                    w["first_step_cpu_s"] / b["first_step_cpu_s"] for w, b in pairs),
                "compile_whole_vs_blocks": statistics.median(w["compile_s"] / b["compile_s"] for w, b in pairs),
                "step_s_blocks": statistics.median(b["step_s"] for _, b in pairs),
                "step_s_whole": statistics.median(w["step_s"] for w, _ in pairs),
                "step_whole_vs_blocks": statistics.median(w["step_s"] / b["step_s"] for w, b in pairs),
                "step_cpu_whole_vs_blocks": statistics.median(w["step_cpu_s"] / b["step_cpu_s"] for w, b in pairs),
                "graphs_blocks": pairs[0][1]["graphs"], "graphs_whole": pairs[0][0]["graphs"], "pairs": len(pairs),
            }
    out["load_average_end"] = os.getloadavg()[0]
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()

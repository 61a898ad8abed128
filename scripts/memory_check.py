"""``python scripts/memory_check.py [--presets tiny 25m] [--precisions 32-true bf16-mixed]``: check
``bnlit.info``'s training-memory estimate against a measurement.

For each preset and precision it composes the real config (``model=<preset> data.seq_len=T
data.batch_size=B``), takes the estimate that ``python -m bnlit.info`` prints
(:func:`bnlit.speed.flops.training_memory_bytes`), then runs training steps of the same model on CPU
(forward under the precision's autocast, the fp32 next-token loss, backward, a fused AdamW step,
gradients set to None) and measures the peak of live tensor memory during the second step (the
first creates the AdamW moments, so the second is the steady state) with torch's own
``MemTracker``, which counts every tensor storage (parameters, gradients, optimizer states,
activations and temporaries) the way a caching allocator's ``max_memory_allocated`` does, without
the allocator's rounding. One JSON line per case: estimate, measurement, ``measured/estimate`` and
the measured breakdown. A GPU adds its allocator's block rounding and workspace on top; the
CUDA figure is ``scripts/gpu_check.py``'s ``peak_memory_gib``.
"""

from __future__ import annotations

import argparse
import json
import sys

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MIB = 1 << 20


def compose_cfg(preset: str, seq_len: int, batch_size: int, extra: list[str] | None = None):
    from hydra import compose, initialize_config_dir

    import bnlit.resolvers  # noqa: F401
    from bnlit import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=[f"model={preset}", f"data.seq_len={seq_len}",
                                           f"data.batch_size={batch_size}", *(extra or [])])


def measure_step_peak(model: torch.nn.Module, seq_len: int, batch_size: int, precision: str) -> dict[str, int]:
    """Peak live tensor bytes per category over the second of two training steps on CPU."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from bnlit.module import next_token_loss, param_groups

    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False, enabled=precision == "bf16-mixed")

    def step():
        x = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g)
        with autocast:
            logits = model(x[:, :-1])
        next_token_loss(logits, x[:, 1:]).backward()
        del logits
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # creates the AdamW moments
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return {k: int(v) for k, v in peak.items()}


def check(preset: str, precision: str, seq_len: int, batch_size: int) -> dict:
    import torch
    from hydra.utils import instantiate

    from bnlit.speed.flops import training_memory_bytes

    cfg = compose_cfg(preset, seq_len, batch_size)
    model_cfg = instantiate(cfg.model.config)
    estimate = training_memory_bytes(model_cfg, seq_len, batch_size, cfg.model.activation_checkpointing)
    torch.manual_seed(0)
    model = instantiate(cfg.model)
    peak = measure_step_peak(model, seq_len, batch_size, precision)
    total = peak.pop("Total")
    return {
        "preset": preset,
        "precision": precision,
        "seq_len": seq_len,
        "micro_batch": batch_size,
        "estimate_mib": round(estimate["total"] / MIB, 1),
        "measured_peak_mib": round(total / MIB, 1),
        "measured_over_estimate": round(total / estimate["total"], 3),
        "estimate_breakdown_mib": {k: round(v / MIB, 1) for k, v in estimate.items() if k != "total"},
        "measured_breakdown_mib": {k: round(v / MIB, 1) for k, v in peak.items() if v},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "25m"], help="model presets to estimate and measure")
    p.add_argument("--precisions", nargs="+", default=["32-true", "bf16-mixed"], choices=["32-true", "bf16-mixed"],
                   help="trainer precisions to check, each with each preset")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per window (data.seq_len)")
    p.add_argument("--batch-size", type=int, default=4, help="windows per step (data.batch_size)")
    args = p.parse_args(argv)
    import torch  # after the arguments: --help answers without it

    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    for preset in args.presets:
        for precision in args.precisions:
            print(json.dumps(check(preset, precision, args.seq_len, args.batch_size)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m bnlit.info model=<preset> [data.seq_len=T] [data.batch_size=B]``: size a run
without a GPU. Prints one JSON object: parameter counts, training FLOPs per token and an estimate
of per-device training memory. Composes the same Hydra config as ``bnlit.train``."""

from __future__ import annotations

import json
import sys

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from hydra.utils import instantiate

import bnlit.resolvers  # noqa: F401
from bnlit import CONF_DIR
from bnlit.errors import BnlitError
from bnlit.speed.flops import flops_per_token, param_counts, parity_probe_memory_bytes, training_memory_bytes

GIB = 1 << 30


def model_info(overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    model_cfg = instantiate(cfg.model.config)
    seq_len, micro = cfg.data.seq_len, cfg.data.batch_size
    accum, devices = cfg.trainer.accumulate_grad_batches, cfg.trainer.devices
    mem = training_memory_bytes(model_cfg, seq_len, micro, cfg.model.activation_checkpointing)
    return {
        "preset": model_cfg.name,
        **param_counts(model_cfg),
        "vocab_size": model_cfg.vocab_size,
        "seq_len": seq_len,
        "flops_per_token": flops_per_token(model_cfg, seq_len),
        "flops_per_token_6n": 6 * param_counts(model_cfg)["n_params"],
        "micro_batch": micro,
        "tokens_per_optimizer_step_per_device": micro * seq_len * accum,
        "devices": devices,
        "memory_estimate_gib": {k: round(v / GIB, 2) for k, v in mem.items()},
        **probe_memory(cfg, model_cfg, seq_len, micro),
    }


def probe_memory(cfg, model_cfg, seq_len: int, micro: int) -> dict:
    """The gradient-flow arbiter's parity probe: its slice of the micro-batch and a bound on the
    device's peak while it runs (between the training backward and the optimizer step: the fast
    pass at the training shape costs a step plus one gradient copy, the reference on the slice)."""
    arbiter = (cfg.get("callbacks") or {}).get("gradient_flow")
    if not arbiter or not arbiter.get("fast_path_parity", True):
        return {}
    samples = min(micro, arbiter.get("probe_samples") or micro)
    tokens = min(seq_len, arbiter.get("probe_seq_len") or seq_len)
    mem = parity_probe_memory_bytes(model_cfg, samples, tokens, micro, seq_len,
                                    bool(cfg.model.get("activation_checkpointing", False)))
    return {"parity_probe": f"{samples} sequences x {tokens} tokens",
            "parity_probe_memory_estimate_gib": {k: round(v / GIB, 2) for k, v in mem.items()}}


def main(argv: list[str] | None = None) -> int:
    try:
        print(json.dumps(model_info(sys.argv[1:] if argv is None else argv), indent=2))
    except (BnlitError, HydraException) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

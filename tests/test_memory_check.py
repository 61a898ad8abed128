"""scripts/memory_check.py measures, it does not assume: on the tiny preset the measured parameter
and AdamW-state bytes are exactly what the parameter count implies, and bf16 autocast's peak is
below fp32's (activations in 16 bits)."""

from __future__ import annotations

import sys
from pathlib import Path

from hydra.utils import instantiate

from bnlit.speed.flops import param_counts

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from memory_check import MIB, check, compose_cfg  # noqa: E402


def test_measured_states_match_the_parameter_count_and_bf16_needs_less():
    fp32 = check("tiny", "32-true", seq_len=128, batch_size=4)
    bf16 = check("tiny", "bf16-mixed", seq_len=128, batch_size=4)
    n = param_counts(instantiate(compose_cfg("tiny", 128, 4).model.config))["n_params"]
    measured = fp32["measured_breakdown_mib"]
    assert abs(measured["Parameter"] - 4 * n / MIB) <= 0.1
    assert 8 * n / MIB - 0.1 <= measured["Optstate"] <= 8 * n / MIB + 0.1  # two fp32 moments (+ step counters)
    assert bf16["measured_peak_mib"] < fp32["measured_peak_mib"]
    assert abs(fp32["measured_over_estimate"] - fp32["measured_peak_mib"] / fp32["estimate_mib"]) < 0.01

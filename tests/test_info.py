import json
import subprocess
import sys

from bnlit.info import model_info


def test_info_400m_is_the_reference_size():
    info = model_info(["model=400m", "data.seq_len=2048"])
    assert 0.38e9 <= info["n_params"] <= 0.42e9
    assert info["vocab_size"] == 32000
    assert info["n_params_non_embedding"] < info["n_params"]
    # forward+backward: at least 6 FLOPs per non-embedding parameter, plus head and attention
    assert info["flops_per_token"] > 6 * info["n_params_non_embedding"]
    assert info["memory_estimate_gib"]["total"] > info["memory_estimate_gib"]["weights_grads_optimizer"] > 5


def test_info_h100_global_batch_is_half_a_million_tokens():
    info = model_info(["model=400m", "trainer=h100"])
    assert info["seq_len"] == 2048
    assert info["tokens_per_optimizer_step_per_device"] == 524288


def test_info_cli_prints_json_and_rejects_unknown_preset():
    out = subprocess.run([sys.executable, "-m", "bnlit.info", "model=125m"], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["preset"] == "125m"
    bad = subprocess.run([sys.executable, "-m", "bnlit.info", "model=7b"], capture_output=True, text=True)
    assert bad.returncode != 0
    assert "model/7b" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1

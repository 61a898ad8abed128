import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bnlit.speed.flops import flops_per_token, param_counts
from bnlit.model import ModelConfig, Transformer
from bnlit.module import next_token_loss


def measured_flops_per_token(cfg: ModelConfig, seq_len: int, batch: int = 2) -> float:
    with torch.device("meta"):
        model = Transformer(cfg)
    x = torch.randint(0, cfg.vocab_size, (batch, seq_len), device="meta")
    with FlopCounterMode(display=False) as counter:
        next_token_loss(model(x), x).backward()
    return counter.get_total_flops() / (batch * seq_len)


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig(name="tiny", vocab_size=8192, dim=64, n_layer=2, n_head=4, n_kv_heads=2, multiple_of=32, max_seq_len=512),
        ModelConfig(name="25m", vocab_size=32000, dim=384, n_layer=8, n_head=6, n_kv_heads=2, max_seq_len=2048),
    ],
    ids=["tiny", "25m"],
)
@pytest.mark.parametrize("seq_len", [128, 512])
def test_flops_per_token_matches_flop_counter(cfg, seq_len):
    predicted = flops_per_token(cfg, seq_len)
    measured = measured_flops_per_token(cfg, seq_len)
    assert predicted == pytest.approx(measured, rel=0.10), (predicted, measured)


@pytest.mark.parametrize("tie", [True, False])
def test_param_counts_match_the_built_model(tie):
    cfg = ModelConfig(vocab_size=1000, dim=128, n_layer=3, n_head=4, n_kv_heads=2, max_seq_len=64, tie_embeddings=tie)
    model = Transformer(cfg)
    counts = param_counts(cfg)
    assert counts["n_params"] == model.num_params()
    assert counts["n_params_non_embedding"] == model.num_params(non_embedding=True)

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


def test_attended_pairs_count_what_the_causal_and_document_masks_leave():
    from bnlit.speed.flops import attended_pairs

    eos = 3
    x = torch.tensor([[5, 6, eos, 7, 8], [eos, 5, 6, 7, 8]])
    # row 0: documents of 2 and 3 tokens (an eos opens a document): 3 + 6 pairs; row 1: one of 5: 15
    assert int(attended_pairs(x, eos)) == 9 + 15
    assert int(attended_pairs(x, None)) == 2 * 15  # causal: T(T+1)/2 per window
    t = torch.randint(4, 100, (3, 64))
    assert int(attended_pairs(t, eos)) == int(attended_pairs(t, None)) == 3 * 64 * 65 // 2


def test_hardware_flops_is_palm_with_the_attention_the_masks_leave():
    from bnlit.speed.flops import hardware_flops, matmul_params

    cfg = ModelConfig(name="t", vocab_size=1000, dim=128, n_layer=3, n_head=4, n_kv_heads=2, max_seq_len=64)
    B, T = 2, 64
    full = flops_per_token(cfg, T) * B * T
    assert hardware_flops(cfg, B * T, B * T * T) == full  # every pair: PaLM's count
    attention = 12 * cfg.n_layer * cfg.n_head * cfg.head_dim
    causal = hardware_flops(cfg, B * T, B * T * (T + 1) // 2)
    assert full - causal == attention * B * T * (T - 1) / 2
    # activation checkpointing: every block's forward again, the head's matmul not
    recompute = hardware_flops(cfg, B * T, 100, activation_checkpointing=True) - hardware_flops(cfg, B * T, 100)
    assert recompute == 2 * (matmul_params(cfg) - cfg.dim * cfg.vocab_size) * B * T + attention / 3 * 100

import math

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate

from bnlit.errors import ConfigError
from bnlit.model import Attention, ModelConfig, Transformer, apply_rope, rope_cache


def tiny(**kw) -> Transformer:
    torch.manual_seed(0)
    cfg = dict(vocab_size=97, dim=64, n_layer=2, n_head=4, n_kv_heads=2, multiple_of=32, max_seq_len=32)
    return Transformer(ModelConfig(**{**cfg, **kw}))


def test_shapes_and_dtype():
    m = tiny()
    logits = m(torch.randint(0, 97, (3, 17)))
    assert logits.shape == (3, 17, 97)
    assert logits.dtype == torch.float32


def test_causality_changing_token_t_leaves_earlier_logits_unchanged():
    m = tiny().eval()
    x = torch.randint(0, 97, (2, 20))
    t = 11
    y = x.clone()
    y[:, t] = (y[:, t] + 1) % 97
    a, b = m(x), m(y)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=0)
    assert not torch.allclose(a[:, t:], b[:, t:])


def reference_attention(attn: Attention, x, cos, sin):
    """Plain attention: explicit K/V repetition, masked softmax, no SDPA."""
    B, T, _ = x.shape
    H, KV, hd = attn.n_head, attn.n_kv_heads, attn.head_dim
    q = (x @ attn.wq.weight.T).view(B, T, H, hd).transpose(1, 2)
    k = (x @ attn.wk.weight.T).view(B, T, KV, hd).transpose(1, 2)
    v = (x @ attn.wv.weight.T).view(B, T, KV, hd).transpose(1, 2)

    def rope(t):
        half = hd // 2
        t1, t2 = t[..., :half], t[..., half:]
        return t * cos + torch.cat((-t2, t1), -1) * sin

    q, k = rope(q), rope(k)
    k = k.repeat_interleave(H // KV, dim=1)
    v = v.repeat_interleave(H // KV, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    y = F.softmax(scores, dim=-1) @ v
    return y.transpose(1, 2).reshape(B, T, H * hd) @ attn.wo.weight.T


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_attention_block_matches_plain_reference(n_kv_heads):
    m = tiny(n_kv_heads=n_kv_heads)
    attn = m.layers[0].attention
    x = torch.randn(2, 13, 64)
    cos, sin = m.rope_cos[:13], m.rope_sin[:13]
    torch.testing.assert_close(attn(x, cos, sin), reference_attention(attn, x, cos, sin), rtol=1e-5, atol=1e-5)


def test_rope_is_a_rotation_and_relative():
    cos, sin = rope_cache(16, 8, 10000.0)
    q = torch.randn(1, 1, 16, 8)
    rq = apply_rope(q, cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    # <R_m q, R_n k> depends only on m - n
    k = torch.randn(1, 1, 1, 8)
    qs, ks = q[:, :, :1].expand(1, 1, 16, 8), k.expand(1, 1, 16, 8)
    dots = (apply_rope(qs, cos, sin)[0, 0, 3:] * apply_rope(ks, cos, sin)[0, 0, :-3]).sum(-1)
    torch.testing.assert_close(dots, dots[:1].expand_as(dots), rtol=1e-4, atol=1e-4)


def test_tied_embeddings_share_storage_and_count_once():
    m = tiny(tie_embeddings=True)
    assert m.output.weight is m.tok_embeddings.weight
    untied = tiny(tie_embeddings=False)
    assert untied.num_params() - m.num_params() == 97 * 64
    assert m.num_params(non_embedding=True) == untied.num_params(non_embedding=True)


def test_scaled_init_residual_projections():
    m = Transformer(ModelConfig(vocab_size=512, dim=256, n_layer=8, n_head=4, max_seq_len=16))
    wq_std = m.layers[0].attention.wq.weight.std().item()
    wo_std = m.layers[0].attention.wo.weight.std().item()
    assert wq_std == pytest.approx(0.02, rel=0.05)
    assert wo_std == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert torch.all(m.norm.weight == 1)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(dim=64, n_head=5), "n_head=5 must divide dim=64"),
        (dict(n_head=4, n_kv_heads=3), "n_kv_heads=3 must divide n_head=4"),
        (dict(dim=12, n_head=4), "head_dim=3 must be even"),
        (dict(vocab_size=0), "vocab_size must be positive"),
    ],
)
def test_config_validation_names_the_field(kw, field):
    base = dict(vocab_size=97, dim=64, n_layer=2, n_head=4)
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**{**base, **kw})


def test_sequence_longer_than_max_is_refused():
    with pytest.raises(ValueError, match="max_seq_len=32"):
        tiny()(torch.zeros(1, 33, dtype=torch.long))


def test_hydra_instantiate_returns_module(make_cfg):
    m = instantiate(make_cfg().model)
    assert isinstance(m, Transformer)
    assert m.config.name == "tiny" and m.config.n_layer == 2 and m.config.dim == 64

"""The output head's loss implementations (bnlit/loss.py) against the plain fp32 path: loss and
every parameter's gradient, fp32 and bf16 autocast, tied and untied heads, several chunks."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from bnlit.errors import ConfigError
from bnlit.loss import chunked_loss, loss_fn, plain_loss
from bnlit.model import ModelConfig, Transformer


def tiny(tie: bool) -> Transformer:
    cfg = ModelConfig(name="t", vocab_size=1000, dim=64, n_layer=2, n_head=4, n_kv_heads=2, multiple_of=32,
                      max_seq_len=64, tie_embeddings=tie)
    torch.manual_seed(0)
    return Transformer(cfg)


def loss_and_grads(model: Transformer, fn, x, y, bf16: bool):
    model.zero_grad(set_to_none=True)
    model.loss_fn = fn
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_chunked_loss_and_gradients_match_the_plain_path(tie, bf16):
    model = tiny(tie)
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 1000, (3, 40), generator=gen) for _ in range(2))
    ref_loss, ref = loss_and_grads(model, plain_loss, x, y, bf16)
    # 120 rows in chunks of 16: eight chunks, the last one short
    got_loss, got = loss_and_grads(model, partial(chunked_loss, chunk_elements=16 * 1000), x, y, bf16)
    assert got_loss.dtype == torch.float32
    tol = dict(rtol=2e-2, atol=2e-4) if bf16 else dict(rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got_loss, ref_loss, **tol)
    assert set(got) == set(ref)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], **tol, msg=lambda m, n=name: f"{n}: {m}")
    # the comparison can fail: a different batch's gradients are not within the tolerance
    _, other = loss_and_grads(model, plain_loss, y, x, bf16)
    assert not torch.allclose(other["tok_embeddings.weight"], ref["tok_embeddings.weight"], **tol)


def test_chunked_loss_without_gradients_is_the_same_number():
    model = tiny(True)
    x, y = (torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(s)) for s in (2, 3))
    with torch.no_grad():
        plain = model(x, y)
        model.loss_fn = partial(chunked_loss, chunk_elements=7 * 1000)
        chunked = model(x, y)
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-6)
    # and the logits path is untouched by the loss choice
    torch.testing.assert_close(plain, torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))


def test_bad_loss_impl_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"module.loss_impl='sparse': use one of \['plain', 'chunked', 'fused'\]"):
        loss_fn("sparse", "cpu")
    with pytest.raises(ConfigError, match="module.loss_impl=fused .* CUDA only .* use module.loss_impl=chunked"):
        loss_fn("fused", "cpu")
    assert loss_fn("chunked", "cpu") is chunked_loss and loss_fn("plain", "cpu") is plain_loss

"""``module.sdpa_backend=math`` on CPU (bnlit/speed/sdpa.py): the math kernel, called directly,
gives the outputs and gradients of the default SDPA dispatch (CPU flash) under the document mask,
in fp32 and bf16, with grouped-query heads; the module sets it on every attention layer, and the
fast-path line says which kernel runs."""

from __future__ import annotations

from functools import partial

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from bnlit.document_masking import document_mask
from bnlit.model import ModelConfig, Transformer
from bnlit.module import LMModule
from bnlit.speed import sdpa

EOS = 3


def qkv(dtype: torch.dtype, n_kv_heads: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (2, 4, 48, 16)
    q = torch.randn(*shape, generator=g)
    k = torch.randn(shape[0], n_kv_heads, *shape[2:], generator=g)
    v = torch.randn(shape[0], n_kv_heads, *shape[2:], generator=g)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_math_kernel_matches_cpu_flash_with_the_document_mask(dtype, tol, n_kv_heads):
    tokens = torch.randint(4, 100, (2, 48), generator=torch.Generator().manual_seed(1))
    tokens[0, 10] = tokens[0, 30] = tokens[1, 0] = EOS
    mask = document_mask(tokens, EOS, flex=False)
    gqa = n_kv_heads != 4
    outs, grads = [], []
    for fn in (F.scaled_dot_product_attention, sdpa.math_attention):
        q, k, v = qkv(dtype, n_kv_heads)
        y = fn(q, k, v, attn_mask=mask, is_causal=False, enable_gqa=gqa)
        y.float().pow(2).sum().backward()
        outs.append(y.float())
        grads.append([t.grad.float() for t in (q, k, v)])
    torch.testing.assert_close(outs[1], outs[0], rtol=tol, atol=tol)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * 10)
    # the check can fail: without the mask the outputs differ
    q, k, v = qkv(dtype, n_kv_heads)
    causal = sdpa.math_attention(q, k, v, is_causal=True, enable_gqa=gqa).float()
    assert not torch.allclose(causal, outs[0], atol=1e-2)


def test_the_kernel_function_per_device_and_name():
    assert sdpa.kernel_fn("math", "cpu") is sdpa.math_attention
    for name in ("auto", "flash", "efficient", "cudnn"):
        assert sdpa.kernel_fn(name, "cpu") is F.scaled_dot_product_attention
    assert sdpa.kernel_fn("math", "cuda") is F.scaled_dot_product_attention  # the CUDA switches choose there
    with pytest.raises(Exception, match="sdpa_backend='fast'"):
        sdpa.kernel_fn("fast", "cpu")


@pytest.mark.parametrize("backend,kernel", [("math", "sdpa:math"), ("auto", "sdpa:flash")])
def test_the_module_sets_the_kernel_on_every_layer_and_names_it(backend, kernel):
    cfg = ModelConfig(name="t", vocab_size=256, dim=32, n_layer=2, n_head=4, n_kv_heads=2, multiple_of=16,
                      max_seq_len=32)
    torch.manual_seed(0)
    module = LMModule(Transformer(cfg), optimizer=partial(torch.optim.AdamW, lr=1e-3), sdpa_backend=backend)
    x = torch.randint(4, 256, (4, 33))
    loader = torch.utils.data.DataLoader(list(zip(x[:, :-1], x[:, 1:])), batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=loader)
    expected = sdpa.math_attention if backend == "math" else F.scaled_dot_product_attention
    assert all(layer.attention.sdpa is expected for layer in module.model.layers)
    assert module.attention_kernel == kernel

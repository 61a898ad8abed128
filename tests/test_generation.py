"""Generation with a KV cache (bnlit/generation.py, bnlit.model.KVCache) gives exactly the tokens of
generation without one, greedy, also past the model's context, where both re-read the last
``max_seq_len`` tokens; the cached logits match a full forward pass position by position."""

from __future__ import annotations

import pytest
import torch

from bnlit.generation import generate
from bnlit.model import KVCache, ModelConfig, Transformer


def tiny(n_kv_heads: int = 2) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=96, dim=64, n_layer=2, n_head=4, n_kv_heads=n_kv_heads, multiple_of=32,
                                   max_seq_len=24)).eval()


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])  # multi-head, grouped-query and multi-query attention
def test_cached_logits_equal_a_full_forward_pass(n_kv_heads):
    model = tiny(n_kv_heads)
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(model.config, 1, 24, ids.device, torch.float32)
        prompt = model(ids[:, :7], cache=cache)  # the prompt at once, then one token at a time
        steps = [model(ids[:, t:t + 1], cache=cache) for t in range(7, 20)]
    torch.testing.assert_close(torch.cat([prompt, *steps], dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.pos == 20


@pytest.mark.parametrize("prompt_len,new", [(3, 15), (5, 40), (30, 6)])  # inside the context, past it, prompt past it
def test_kv_cache_generation_equals_generation_without_it_greedy(prompt_len, new):
    model = tiny()
    ids = torch.randint(0, 96, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    cached = generate(model, ids, new, temperature=0, kv_cache=True)
    plain = generate(model, ids, new, temperature=0, kv_cache=False)
    assert len(cached) == new and cached == plain


def test_sampling_with_a_cache_is_seeded():
    model = tiny()
    a, b = generate(model, [3, 10, 11], 20, 1.0, 10, 0.9, seed=5), generate(model, [3, 10, 11], 20, 1.0, 10, 0.9, seed=5)
    assert a == b


def test_cache_takes_one_token_after_the_prompt():
    model = tiny()
    cache = KVCache(model.config, 1, 24, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), cache=cache)
        with pytest.raises(ValueError, match="only the first call may add more than one token"):
            model(torch.tensor([[4, 5]]), cache=cache)

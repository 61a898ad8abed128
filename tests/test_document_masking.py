"""Document masking (bnlit/document_masking.py): exact ids and masks, parity with causal attention
for one document per window, the flex-attention mask equal to the SDPA mask, the leakage probe,
the RoPE choice, and one document alone (as Hugging Face Llama sees it after export) equal to the
same document inside a packed window."""

from __future__ import annotations

import pytest
import torch

from bnlit.document_masking import document_ids, document_mask, leakage, leakage_probe
from bnlit.model import ModelConfig, Transformer

EOS = 3
CFG = ModelConfig(name="t", vocab_size=512, dim=64, n_layer=2, n_head=4, n_kv_heads=2, multiple_of=32,
                  max_seq_len=64, rope_theta=50000.0)


def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(CFG).eval()


def windows(*docs: list[int]) -> torch.Tensor:
    return torch.tensor([sum(docs, [])])


def text(n: int, seed: int) -> list[int]:
    return (torch.randint(4, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))).tolist()


def test_an_eos_opens_the_next_document():
    x = torch.tensor([[7, 8, EOS, 9, EOS, EOS, 10]])
    assert document_ids(x, EOS).tolist() == [[0, 0, 1, 1, 2, 3, 3]]
    m = document_mask(x, EOS, flex=False)[0, 0]
    allowed = {(q, k) for q in range(7) for k in range(7) if m[q, k]}
    assert allowed == {(0, 0), (1, 0), (1, 1), (2, 2), (3, 2), (3, 3), (4, 4), (5, 5), (6, 5), (6, 6)}


def test_one_document_per_window_is_causal_attention():
    m = model()
    for x in (windows(text(40, 1)), windows([EOS], text(39, 2))):  # no boundary, or one at position 0
        with torch.no_grad():
            torch.testing.assert_close(m(x, mask=document_mask(x, EOS, flex=False)), m(x), rtol=1e-5, atol=1e-5)


def test_flex_attention_mask_matches_the_sdpa_mask():
    m = model()
    x = torch.cat([windows(text(10, 3), [EOS], text(20, 4), [EOS], text(32, 5)),
                   windows(text(30, 6), [EOS], text(32, 7), [EOS])])
    with torch.no_grad():
        sdpa = m(x, mask=document_mask(x, EOS, flex=False))
        flex = m(x, mask=document_mask(x, EOS, flex=True))  # eager flex attention on CPU
    torch.testing.assert_close(flex, sdpa, rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # the comparison can fail: plain causal attention differs
        assert not torch.allclose(m(x), sdpa, atol=1e-3)


@pytest.mark.parametrize("seed", range(6))
def test_the_block_mask_built_per_block_is_create_block_masks(seed):
    """``document_block_mask`` (from block boundary ids) equals ``create_block_mask`` over every token
    pair: the same partial and full blocks in the same order, both directions; documents that start
    on a block boundary, span several blocks, fill one exactly, and windows with none."""
    from torch.nn.attention.flex_attention import create_block_mask

    from bnlit.document_masking import document_block_mask

    g = torch.Generator().manual_seed(seed)
    B, T = 4, 512
    x = torch.randint(4, 50, (B, T), generator=g)
    for b in range(B):
        x[b, torch.randint(0, T, (int(torch.randint(0, 10, (1,), generator=g)),), generator=g)] = EOS
    x[0, [0, 128, 256]] = EOS  # on block boundaries: block 1 is exactly one document
    x[1, 1:] = 5  # one document over the whole window
    x[2, 127] = EOS
    doc = document_ids(x, EOS)

    def same(b, h, q, kv):
        return (q >= kv) & (doc[b, q] == doc[b, kv])

    ref, got = create_block_mask(same, B, None, T, T, device="cpu"), document_block_mask(doc)
    assert torch.equal(got.to_dense(), ref.to_dense())
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
                 "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert int(got.full_kv_num_blocks[1].sum()) == 4 * 3 / 2  # one document: every block below the diagonal is full
    # a window that is not a whole number of blocks goes through create_block_mask
    assert torch.equal(document_block_mask(doc[:, :200]).to_dense(),
                       create_block_mask(same, B, None, 200, 200, device="cpu").to_dense())


def test_flex_attention_with_the_per_block_mask_is_sdpa_with_the_dense_mask():
    """Two blocks of 128 and more per window, documents across block boundaries (eager flex on CPU)."""
    x = torch.cat([windows(text(100, 1), [EOS], text(60, 2), [EOS], text(94, 3)),
                   windows(text(129, 4), [EOS], text(126, 5))])
    cfg = ModelConfig(**{**CFG.to_dict(), "max_seq_len": 256})
    torch.manual_seed(0)
    m = Transformer(cfg).eval()
    with torch.no_grad():
        sdpa = m(x, mask=document_mask(x, EOS, flex=False))
        flex = m(x, mask=document_mask(x, EOS, flex=True))
    torch.testing.assert_close(flex, sdpa, rtol=1e-4, atol=1e-4)


def test_leakage_probe_sees_through_causal_attention_and_not_through_the_mask():
    m = model()
    assert leakage(m, EOS, 64, masked=True) == 0.0
    assert leakage(m, EOS, 64, masked=False) > 1e-2
    assert leakage_probe(CFG, EOS, "cpu") == 0.0


def test_a_document_inside_a_window_scores_as_it_does_alone():
    """RoPE is relative, so under the mask a document's logits do not depend on where the window
    puts it: restarting positions per document would change rounding only, and scoring one
    ``[eos] + document`` at a time (generation, evaluation, Hugging Face Llama) matches training."""
    m = model()
    doc = [EOS] + text(20, 8)
    x = windows(text(25, 9), doc, [EOS], text(17, 10))
    with torch.no_grad():
        inside = m(x, mask=document_mask(x, EOS, flex=False))[0, 25:46]
        alone = m(torch.tensor([doc]))[0]
        unmasked = m(x)[0, 25:46]
    torch.testing.assert_close(inside, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unmasked, alone, atol=1e-3)


def test_exported_llama_on_one_document_matches_the_masked_window():
    transformers = pytest.importorskip("transformers")
    from bnlit.export import hf_config, hf_state_dict

    m = model()
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(CFG))).eval()
    hf.load_state_dict(hf_state_dict(m), strict=False)
    doc = [EOS] + text(30, 11)
    x = windows(text(12, 12), doc, [EOS], text(9, 13))
    with torch.no_grad():
        inside = m(x, mask=document_mask(x, EOS, flex=False))[0, 12:43]
        exported = hf(torch.tensor([doc])).logits[0]
    torch.testing.assert_close(exported, inside, rtol=1e-5, atol=1e-5)

"""bnlit.speed.compile: per-block compilation equals the whole-model graph and eager execution (outputs
and gradients), identical blocks share one graph, the watch tells a recompile from a first compile
and names Dynamo's reason, and the evaluation paths run at the one fixed shape (the parity probe,
a short validation batch, multiple choice)."""

from __future__ import annotations

import copy

import pytest
import torch

from bnlit.checks.gradient_flow import ignore_outside, slice_batch
from bnlit.document_masking import document_mask
from bnlit.evaluation.multiple_choice import continuation_logprob, continuation_logprobs
from bnlit.loss import chunked_loss, plain_loss
from bnlit.model import ModelConfig, Transformer
from bnlit.module import pad_rows
from bnlit.speed.compile import CompileWatch, compile_model, is_compiled
from bnlit.speed.fast_path import compile_part

EOS = 3


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts with Dynamo's caches empty, as a run's process does."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def model(loss=plain_loss, n_layer: int = 2) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(name="t", vocab_size=256, dim=64, n_layer=n_layer, n_head=4, n_kv_heads=2, multiple_of=32,
                      max_seq_len=64)
    m = Transformer(cfg)
    m.loss_fn = loss
    return m


def batch(b: int = 2, t: int = 32, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(4, 256, (b, t), generator=g)
    x[:, t // 3] = EOS  # two documents per window: the mask is a real document mask
    return x, torch.randint(4, 256, (b, t), generator=g)


def loss_and_grads(m: Transformer, x, y):
    m.zero_grad(set_to_none=True)
    loss = m(x, y, mask=document_mask(x, EOS))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("loss", [plain_loss, chunked_loss], ids=["plain", "chunked"])
def test_per_block_compile_equals_whole_model_and_eager(backend, loss):
    eager = model(loss)
    blocks, whole = copy.deepcopy(eager), copy.deepcopy(eager)
    compile_model(blocks, fullgraph=True, backend=backend)
    compile_model(whole, fullgraph=True, per_block=False, backend=backend)
    assert compile_part(blocks, fullgraph=True) == "torch.compile(fullgraph) x2 blocks + loss"
    assert compile_part(whole, fullgraph=True) == "torch.compile(fullgraph)"
    assert [n for n, _ in blocks.named_parameters()] == [n for n, _ in eager.named_parameters()]  # names kept
    x, y = batch()
    ref_loss, ref = loss_and_grads(eager, x, y)
    for compiled in (blocks, whole):
        for _ in range(2):  # the compiled step and the cached one
            got_loss, got = loss_and_grads(compiled, x, y)
            torch.testing.assert_close(got_loss, ref_loss, rtol=1e-5, atol=1e-6)
            for name in ref:
                torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    with torch.no_grad():  # the logits path (evaluation) through the compiled blocks
        torch.testing.assert_close(blocks(x), eager(x), rtol=1e-5, atol=1e-5)


def test_identical_blocks_share_one_graph_and_a_second_kind_is_no_recompile():
    m = model(chunked_loss, n_layer=6)
    watch = CompileWatch().start()
    try:
        compile_model(m, fullgraph=True, backend="eager")
        x, y = batch()
        for _ in range(3):
            m(x, y).backward()
        with torch.no_grad():  # validation: the second kind
            m(x, y)
            m(x)
        assert [(e.code.split(" ")[0], e.kind) for e in watch.events] == [
            ("forward", "train"), ("chunked_loss", "train"), ("forward", "eval"), ("chunked_loss", "eval")]
        assert [e.recompile for e in watch.poll()] == [False] * 4 and watch.recompiles == []
        assert watch.poll() == []  # each reported once
        assert watch.summary().startswith("torch.compile: 4 graphs (train 2, eval 2), 0 recompiles")
        # 6 blocks, one block graph: the blocks' code compiled once per kind
        assert sum(1 for e in watch.events if e.code.startswith("forward")) == 2
    finally:
        watch.stop()


def test_the_watch_names_a_recompile_and_dynamos_reason():
    m = model(plain_loss, n_layer=2)
    watch = CompileWatch().start()
    try:
        compile_model(m, backend="eager")
        x, y = batch(2, 32)
        m(x, y).backward()
        assert [e.recompile for e in watch.poll()] == [False, False]  # the first compiles
        m(*batch(3, 32)).backward()  # another micro-batch size: a recompile of the block and the loss
        new = watch.poll()
        assert [e.code.split(" ")[0] for e in new] == ["forward", "plain_loss"]
        assert all(e.recompile and e.kind == "train" for e in new)
        assert "size mismatch at index 0. expected 2, actual 3" in new[0].reason
        assert watch.poll() == []  # each reported once
        assert "2 recompiles" in watch.summary()
    finally:
        watch.stop()


def test_the_loss_is_compiled_once_however_often_it_is_set():
    m = model(plain_loss)
    compile_model(m, backend="eager")
    first = m.loss_fn
    m.loss_fn = plain_loss  # what LMModule.configure_model does at each fit/validate
    compile_model(m, backend="eager")
    assert m.loss_fn is first and is_compiled(first)


def test_the_parity_probe_at_the_training_shape_is_the_slice():
    """The fast pass runs the whole micro-batch with the targets outside the probe's slice ignored:
    the same loss and gradients as the slice itself (causal attention), at the compiled shape."""
    m = model(chunked_loss)
    x, y = batch(4, 32)
    whole = ignore_outside((x, y), 2, 16)
    assert whole[0].shape == x.shape and (whole[1][2:] == -100).all() and (whole[1][:, 16:] == -100).all()
    sliced = slice_batch((x, y), 2, 16)
    loss_whole, grads_whole = loss_and_grads(m, *whole)
    loss_slice, grads_slice = loss_and_grads(m, *sliced)
    torch.testing.assert_close(loss_whole, loss_slice)
    for name in grads_slice:
        torch.testing.assert_close(grads_whole[name], grads_slice[name], rtol=1e-4, atol=1e-7)
    assert ignore_outside({"x": x}, 2, 16) is None  # not an (x, y) batch: the fast path runs the slice


def test_a_short_validation_batch_is_padded_to_the_micro_batch_with_the_same_loss():
    m = model(chunked_loss)
    x, y = batch(3, 32)
    px, py = pad_rows((x, y), 5)
    assert px.shape == (5, 32) and (py[3:] == -100).all()
    with torch.no_grad():
        torch.testing.assert_close(m(px, py, mask=document_mask(px, EOS)), m(x, y, mask=document_mask(x, EOS)))
    assert pad_rows((x, y), 3)[0] is x and pad_rows((x, y), None)[0] is x


class Shapes(torch.nn.Module):
    """Records the shape of every forward of the wrapped model."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.shapes = inner, []

    def forward(self, x):
        self.shapes.append(tuple(x.shape))
        return self.inner(x)


def test_batched_multiple_choice_is_one_at_a_time_at_one_shape():
    m = Shapes(model().eval())
    g = torch.Generator().manual_seed(0)
    pairs = [(torch.randint(4, 256, (n,), generator=g).tolist(), torch.randint(4, 256, (k,), generator=g).tolist())
             for n, k in ((5, 2), (40, 7), (70, 3), (1, 1), (9, 4))]  # (70, 3): cut from the left to fit
    batched = continuation_logprobs(m, pairs, EOS, max_len=48, batch_size=3)
    assert set(m.shapes) == {(3, 48)}
    m.shapes.clear()
    assert continuation_logprob(m, *pairs[1], EOS, max_len=48) == pytest.approx(batched[1], rel=1e-5)
    assert m.shapes == [(1, 48)]

    def unpadded(ctx, cont):
        ids = ([EOS] + ctx + cont)[-49:]
        with torch.no_grad():
            logp = torch.log_softmax(m.inner(torch.tensor(ids[:-1])[None])[0].float(), -1)
        return float(logp[-len(cont):].gather(1, torch.tensor(ids[-len(cont):])[:, None]).sum())

    assert batched == pytest.approx([unpadded(c, k) for c, k in pairs], rel=1e-5)
    # with the document mask (one document per row): the same scores, the validation graph's inputs
    masked = continuation_logprobs(m.inner, pairs, EOS, max_len=48, batch_size=3, masked=True)
    assert masked == pytest.approx(batched, rel=1e-5)


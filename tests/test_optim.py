"""``MuonAdamW`` against torch's own optimizers: its AdamW groups step exactly as
``torch.optim.AdamW``, its Muon group as ``torch.optim.Muon`` with Moonshot's RMS matching, and a
resumed optimizer continues as the uninterrupted one."""

import copy

import pytest
import torch

from bnlit.model import ModelConfig, Transformer
from bnlit.module import param_groups
from bnlit.optim import MuonAdamW

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=64, dim=32, n_layer=2, n_head=4, n_kv_heads=2, multiple_of=16,
                                   max_seq_len=16, tie_embeddings=True))


def train(model, optimizer, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 64, (4, 16), generator=g)
        optimizer.zero_grad()
        model(x[:, :-1], x[:, 1:]).backward()
        optimizer.step()


def reference(model):
    """torch's AdamW on the no-decay group and torch's Muon on the matrices, side by side."""
    decay, no_decay = param_groups(model, HP["weight_decay"])
    muon = torch.optim.Muon(decay["params"], lr=HP["lr"], weight_decay=HP["weight_decay"], momentum=0.95,
                            nesterov=True, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([no_decay], lr=HP["lr"], betas=HP["betas"], eps=HP["eps"])

    class Both:
        def zero_grad(self):
            muon.zero_grad(), adamw.zero_grad()

        def step(self):
            muon.step(), adamw.step()
    return Both()


def test_matches_torch_muon_and_adamw():
    ours, theirs = tiny_model(), tiny_model()
    train(ours, MuonAdamW(param_groups(ours, HP["weight_decay"]), **HP), steps=5)
    train(theirs, reference(theirs), steps=5)
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_routes_only_the_blocks_matrices_to_muon():
    model = tiny_model()
    opt = MuonAdamW(param_groups(model, 0.1), **HP)
    assert [g["name"] for g in opt.muon.param_groups] == ["decay"]
    assert all(p.ndim == 2 and p is not model.tok_embeddings.weight for p in opt.muon.param_groups[0]["params"])
    assert any(p is model.tok_embeddings.weight for p in opt.adamw.param_groups[0]["params"])


def test_a_schedulers_lr_reaches_both_optimizers():
    model = tiny_model()
    opt = MuonAdamW(param_groups(model, 0.1), **HP)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    opt.step()  # no gradients yet: a no-op, in the order torch expects
    assert [g["lr"] for g in opt.muon.param_groups + opt.adamw.param_groups] == [HP["lr"] * 0.5] * 2
    opt.load_state_dict(opt.state_dict())
    sched.step()
    assert opt.muon.param_groups[0] is opt.param_groups[0] and opt.adamw.param_groups[0] is opt.param_groups[1]


@pytest.mark.parametrize("split", [1, 3])
def test_resume_continues_bit_for_bit(split):
    straight = tiny_model()
    train(straight, MuonAdamW(param_groups(straight, 0.1), **HP), steps=4)

    first = tiny_model()
    opt = MuonAdamW(param_groups(first, 0.1), **HP)
    train(first, opt, steps=split)
    saved_model, saved_opt = copy.deepcopy(first.state_dict()), copy.deepcopy(opt.state_dict())
    resumed = tiny_model(seed=5)
    resumed.load_state_dict(saved_model)
    opt2 = MuonAdamW(param_groups(resumed, 0.1), **HP)
    opt2.load_state_dict(saved_opt)
    g = torch.Generator().manual_seed(1)
    for _ in range(split):  # the batches already consumed
        torch.randint(0, 64, (4, 16), generator=g)
    for _ in range(4 - split):
        x = torch.randint(0, 64, (4, 16), generator=g)
        opt2.zero_grad()
        resumed(x[:, :-1], x[:, 1:]).backward()
        opt2.step()
    for a, b in zip(straight.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

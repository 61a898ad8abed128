"""FSDP2 as ``trainer=fsdp`` runs it, on 2 CPU ranks over gloo: under bf16 the parameters a block
computes with are all-gathered in bf16, gradients are reduce-scattered in fp32 into fp32 shards,
every rank holds its 1/world row slice of every parameter, and the ``fast path:`` line says so."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from bnlit.module import mixed_precision_policy
from helpers_dist import run_two_ranks

WORKER = textwrap.dedent('''
    import json, sys
    from functools import partial
    from pathlib import Path
    import lightning as L
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy
    from bnlit.module import LMModule
    from test_gradient_flow import RandomTokens, tiny

    torch.set_num_threads(1)
    precision = sys.argv[3] if len(sys.argv) > 3 else "bf16-mixed"

    class Probe(L.Callback):
        """What a block's linear layer computes with (a forward pre-hook runs inside FSDP's
        unsharded window) and what the optimizer is handed (the reduced, sharded gradients)."""
        def __init__(self):
            self.out = {}
        def on_train_start(self, trainer, pl_module):
            wq = pl_module.model.layers[0].attention.wq
            def seen(mod, args):
                w = mod.weight
                self.out["forward"] = [str(w.dtype), type(w).__name__, list(w.shape)]
            self.handle = wq.register_forward_pre_hook(seen)
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.handle.remove()
            self.out["params"] = {n: dict(local=list(p.to_local().shape), full=list(p.shape), dtype=str(p.dtype),
                                          grad_dtype=str(p.grad.dtype), grad_local=list(p.grad.to_local().shape),
                                          placements=[str(x) for x in p.placements])
                                  for n, p in pl_module.model.named_parameters()}
            self.out["fast_path"] = pl_module.fast_path

    probe = Probe()
    module = LMModule(tiny(), optimizer=partial(torch.optim.AdamW, lr=1e-3))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(save_distributed_checkpoint=False),
                        precision=precision, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=sys.argv[1],
                        use_distributed_sampler=True, callbacks=[probe])
    trainer.fit(module, datamodule=RandomTokens())
    (Path(sys.argv[1]) / f"rank{trainer.global_rank}.txt").write_text(json.dumps(probe.out))
''')


def test_policy_follows_the_precision():
    bf16 = mixed_precision_policy("bf16-mixed")
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision_policy("bf16-true").param_dtype == torch.bfloat16
    for precision in ("32-true", "16-mixed", "64-true"):
        p = mixed_precision_policy(precision)
        assert (p.param_dtype, p.reduce_dtype) == (None, None), precision


@pytest.mark.distributed
def test_bf16_all_gather_fp32_reduce_and_one_shard_per_rank(tmp_path):
    proc, msgs = run_two_ranks(WORKER, tmp_path, timeout=600)
    assert proc.returncode == 0 and all(msgs), proc.stderr[-4000:]
    ranks = [json.loads(m) for m in msgs]
    for rank, out in enumerate(ranks):
        # inside the block's forward: the whole (unsharded) weight, a plain tensor, in bf16
        assert out["forward"] == ["torch.bfloat16", "Parameter", [32, 32]], out["forward"]
        for name, p in out["params"].items():
            # the sharded parameters and their reduced gradients stay fp32
            assert (p["dtype"], p["grad_dtype"]) == ("torch.float32", "torch.float32"), name
            assert p["placements"] == ["R", "S(0)"], name  # Lightning's 1 x 2 mesh
            rows = p["full"][0]
            # torch.chunk's split of dim 0 over 2 ranks: ceil(rows / 2) on rank 0, the rest on rank 1
            mine = -(-rows // 2) if rank == 0 else rows - -(-rows // 2)
            assert p["local"] == p["grad_local"] == [mine, *p["full"][1:]], (name, rank, p)
        assert "strategy=fsdp2(2, gloo), mesh=1x2 (replicate x shard), all-gather=bf16, reduce-scatter=fp32" \
            in out["fast_path"], out["fast_path"]
    assert ranks[0]["params"].keys() == ranks[1]["params"].keys()
    assert sum(ranks[r]["params"]["tok_embeddings.weight"]["local"][0] for r in (0, 1)) == 96

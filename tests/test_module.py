"""LMModule under the production switches: gradient clipping with a fused AdamW under bf16-mixed
(the H100 profile's combination, which Lightning's MixedPrecision refuses) clips to the asked norm,
fp16 with a scaler is still refused, and the "fast path: ..." line names what really runs."""

from __future__ import annotations

from functools import partial

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from bnlit.speed.fast_path import compile_part, describe_fast_path, loader_part, optimizer_part, sdpa_part
from bnlit.model import ModelConfig, Transformer
from bnlit.module import LMModule

VOCAB = 96


def tiny() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(name="test", vocab_size=VOCAB, dim=32, n_layer=2, n_head=4, n_kv_heads=2,
                                   multiple_of=16, max_seq_len=64))


def loader(n: int = 8, t: int = 16, **kw) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (n, t + 1), generator=g)
    return DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4, **kw)


class GradNorms(L.Callback):
    """The total gradient norm before clipping (on_before_optimizer_step runs before it) and
    after (the gradients the optimizer stepped with, still there at batch end)."""

    def __init__(self):
        self.before, self.after = [], []

    @staticmethod
    def norm(module) -> float:
        return torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in module.parameters()
                                                     if p.grad is not None])).item()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.before.append(self.norm(pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after.append(self.norm(pl_module))


def fit(precision: str, clip: float, callbacks=(), max_steps: int = 2, **loader_kw):
    module = LMModule(tiny(), optimizer=partial(torch.optim.AdamW, lr=1e-3, fused=True))
    trainer = L.Trainer(accelerator="cpu", devices=1, precision=precision, gradient_clip_val=clip,
                        max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=list(callbacks))
    trainer.fit(module, train_dataloaders=loader(**loader_kw))
    return trainer, module


def test_bf16_mixed_clips_before_a_fused_adamw_step():
    norms = GradNorms()
    trainer, module = fit("bf16-mixed", clip=0.05, callbacks=[norms])
    assert trainer.optimizers[0].defaults["fused"] is True
    assert trainer.precision_plugin.scaler is None
    assert len(norms.before) == 2 and min(norms.before) > 0.05  # clipping was due on every step
    torch.testing.assert_close(torch.tensor(norms.after), torch.full((2,), 0.05), rtol=1e-4, atol=0)


def test_bf16_mixed_leaves_gradients_below_the_threshold_alone():
    norms = GradNorms()
    fit("bf16-mixed", clip=1e6, callbacks=[norms])
    torch.testing.assert_close(torch.tensor(norms.after), torch.tensor(norms.before), rtol=1e-6, atol=0)


def test_a_loss_scaler_keeps_lightnings_refusal():
    """With a GradScaler the fused step unscales after clipping, so clipping would act on scaled
    gradients: the refusal must stand (a plugin with a scaler, as 16-mixed builds on GPU)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    module = LMModule(tiny(), optimizer=partial(torch.optim.AdamW, lr=1e-3, fused=True))
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    trainer = L.Trainer(accelerator="cpu", devices=1, plugins=[plugin], gradient_clip_val=0.05, max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        trainer.fit(module, train_dataloaders=loader())


class Capture(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.line = describe_fast_path(trainer, pl_module)


def test_fast_path_line_reads_the_live_objects():
    cap = Capture()
    trainer, module = fit("bf16-mixed", clip=1.0, callbacks=[cap], max_steps=1, num_workers=1, prefetch_factor=3)
    assert module.fast_path == cap.line
    assert cap.line == ("fast path: bf16-mixed autocast, eager (no torch.compile), fused AdamW, sdpa=cpu, "
                        "attention=sdpa:flash (document mask), loss=plain, "
                        "strategy=single device (cpu), accumulate=1, workers=1 (prefetch 3)")


def test_fast_path_names_the_peak_and_the_hardware_profile():
    from types import SimpleNamespace

    from bnlit.speed.fast_path import peak_part
    from bnlit.speed.throughput import Peak

    a100 = {"name": "a100", "peak_tflops": {"bf16": 312, "fp32": 156}}
    on_gpu = SimpleNamespace(hardware=a100, peak=Peak(312e12, "NVIDIA A100-SXM4-80GB", "a100",
                                                      "NVIDIA A100 datasheet ...", measured=False))
    assert peak_part([object(), on_gpu]) == "peak=312 TFLOP/s bf16 dense (a100 datasheet), hardware=a100"
    rehearsal = SimpleNamespace(hardware=a100, peak=Peak(2.5e11, "cpu", "unknown", "measured", measured=True))
    assert peak_part([rehearsal]) == ("peak=0.25 TFLOP/s measured (cpu bf16 matmul), "
                                      "hardware=a100 (312 TFLOP/s bf16 dense on its GPU)")
    assert peak_part([SimpleNamespace(hardware=None, peak=None)]) is None and peak_part([]) is None


def test_fast_path_parts():
    model = tiny()
    assert compile_part(model, fullgraph=True) == "eager (no torch.compile)"
    for block in model.layers:
        block.compile(fullgraph=True)
    assert compile_part(model, fullgraph=True) == "torch.compile(fullgraph) x2 blocks"
    model.compile()
    assert compile_part(model, fullgraph=False) == "torch.compile"
    params = list(tiny().parameters())
    assert optimizer_part(torch.optim.AdamW(params, fused=True)) == "fused AdamW"
    assert optimizer_part(torch.optim.AdamW(params, foreach=True)) == "foreach AdamW"
    # fused=None, foreach=None: what torch picks for CPU tensors (no foreach kernels off CUDA)
    assert optimizer_part(torch.optim.AdamW(params)) == "for-loop AdamW"
    assert sdpa_part(torch.device("cpu"), "flash") == "sdpa=cpu (flash requested: CUDA-only, cpu kernel instead)"
    assert sdpa_part(torch.device("cpu"), "math") == "sdpa=math"  # called directly on CPU (bnlit.speed.sdpa)
    if not torch.accelerator.is_available():
        assert loader_part(loader(pin_memory=True)) == "workers=0 (pin_memory requested: no accelerator)"

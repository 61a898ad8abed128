"""bnlit.speed.profiling: a real CPU trace of a few training steps summarised in one "where the
time went" line; the categories follow the names of kernels and ops, the optimizer's and the data
loader's time follow where it was spent, and the shares add up to the profiled wall time."""

from __future__ import annotations

import time

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, TensorDataset

from bnlit.document_masking import document_mask
from bnlit.model import ModelConfig, Transformer
from bnlit.speed.profiling import CATEGORIES, category, where_time_went


@pytest.mark.parametrize("name, expected", [
    ("aten::mm", "matmul"), ("aten::addmm", "matmul"), ("sm90_xmma_gemm_bf16bf16_bf16f32", "matmul"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "matmul"), ("triton_tem_fused_mm_3", "matmul"),
    ("flash_fwd_kernel", "attention"), ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"), ("triton_tem_fused_flex_attention_0", "attention"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "communication"), ("triton_poi_fused_add_mul_0", "elementwise"),
    ("triton_red_fused__to_copy_mean_pow_1", "elementwise"), ("aten::mul", "elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, ...>", "elementwise"),
    ("void multi_tensor_apply_kernel<...FusedAdamMathFunctor...>", "optimizer"), ("aten::_fused_adamw_", "optimizer"),
    ("some_kernel_nobody_knows", "other"),
])
def test_categories_follow_the_names(name, expected):
    assert category(name) == expected


def test_a_cpu_trace_of_three_steps_in_one_line():
    torch.manual_seed(0)
    cfg = ModelConfig(name="t", vocab_size=512, dim=64, n_layer=2, n_head=4, n_kv_heads=2, multiple_of=32,
                      max_seq_len=64)
    model = Transformer(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, 512, (12, 65))
    batches = iter(DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(3):
            x, y = next(batches)  # the loader's __next__ is "enumerate(DataLoader)#..." in the trace
            model(x, y, mask=document_mask(x, 3)).backward()
            optimizer.step()
            optimizer.zero_grad()
        wall = time.perf_counter() - t0
    split = where_time_went(prof.events(), wall, steps=3)
    assert split.device == "cpu" and split.steps == 3
    assert set(split.seconds) == set(CATEGORIES)
    assert split.seconds["matmul"] > 0 and split.seconds["attention"] > 0 and split.seconds["elementwise"] > 0
    assert split.seconds["optimizer"] > 0 and split.data_wait_s > 0  # by where the time was spent
    total = sum(split.seconds.values()) + split.data_wait_s + split.host_gaps_s
    assert total == pytest.approx(wall, rel=0.05)  # every second is somewhere, once
    line = split.line()
    assert line.startswith("where the time went (3 steps, ") and "cpu ops" in line
    for word in ("matmul", "attention", "elementwise", "optimizer", "data wait", "host gaps"):
        assert word in line, (word, line)
    d = split.to_dict()
    assert d["pct"]["matmul"] == pytest.approx(100 * split.seconds["matmul"] / wall)


def test_the_throughput_monitor_traces_the_steps_it_is_asked_for(tmp_path, caplog):
    """``callbacks.throughput.profile_at_step`` (what ``scripts/gpu_check.py --profile`` sets): one
    trace of ``profile_steps`` optimizer steps after that step, accumulation included, its line in
    the log and its chrome trace in the run's plots/."""
    import json
    import logging
    from functools import partial

    import lightning as L

    from bnlit.callbacks.throughput import ThroughputMonitor
    from bnlit.module import LMModule

    torch.manual_seed(0)
    cfg = ModelConfig(name="t", vocab_size=512, dim=64, n_layer=2, n_head=4, n_kv_heads=2, multiple_of=32,
                      max_seq_len=64)
    data = torch.randint(0, 512, (2 * 2 * 6, 33))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=2)
    monitor = ThroughputMonitor(profile_at_step=2, profile_steps=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, accumulate_grad_batches=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, callbacks=[monitor])
    with caplog.at_level(logging.INFO, logger="bnlit"):
        trainer.fit(LMModule(Transformer(cfg), optimizer=partial(torch.optim.AdamW, lr=1e-3)), train_dataloaders=loader)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("profile: ")]
    assert len(lines) == 1 and lines[0].startswith("profile: where the time went (2 steps, "), lines
    trace = tmp_path / "plots" / "profile_step3.json"  # steps 3 and 4 (1-based): after step 2 completed
    assert lines[0].endswith(str(trace)) and monitor.profile["files"] == [str(trace)]
    events = json.loads(trace.read_text())["traceEvents"]
    # 2 optimizer steps of 2 micro-batches: 2 optimizer steps in the trace, and 3 loader fetches (the
    # trace starts at the first micro-batch's batch hook, after the loader handed that batch over)
    assert sum(e.get("name", "").startswith("Optimizer.step") for e in events) == 2
    assert sum(e.get("name", "").startswith("enumerate(DataLoader)") for e in events) == 3
    assert not (tmp_path / "plots" / "memory_snapshot.pickle").exists()  # the allocator's history: CUDA only

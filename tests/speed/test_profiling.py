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

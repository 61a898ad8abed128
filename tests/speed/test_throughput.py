"""MFU bookkeeping: the device table, the window maths, the monitor on a fake clock, the floor."""

from __future__ import annotations

import csv
import json
import re
import tempfile
from functools import partial

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from torch.utils.data import DataLoader, TensorDataset

from bnlit import CONF_DIR
from bnlit.speed.flops import flops_per_token
from bnlit.model import ModelConfig, Transformer
from bnlit.module import LMModule
from bnlit.speed.throughput import (
    UNKNOWN,
    PEAKS,
    StepRecord,
    StepTimer,
    match_device,
    lookup_peak,
    profile_mismatch,
    resolve_peak,
    table_peak,
    throughput_stats,
)
from bnlit.train import train
from bnlit.callbacks.throughput import LowMFUError, ThroughputMonitor, precision_dtype

# real torch.cuda.get_device_name() strings
DEVICE_NAMES = [
    ("NVIDIA H100 80GB HBM3", "h100-sxm", 989.5e12),
    ("NVIDIA H100 PCIe", "h100-pcie", 756.5e12),
    ("NVIDIA H100 NVL", "h100-nvl", 835.5e12),
    ("NVIDIA H200", "h200-sxm", 989.5e12),
    ("NVIDIA H200 NVL", "h200-nvl", 835.5e12),
    ("NVIDIA A100-SXM4-80GB", "a100", 312e12),
    ("NVIDIA A100-SXM4-40GB", "a100", 312e12),
    ("NVIDIA A100-PCIE-40GB", "a100", 312e12),
    ("NVIDIA A100 80GB PCIe", "a100", 312e12),
    ("NVIDIA L40S", "l40s", 362.05e12),
    ("NVIDIA L40", "l40", 181.05e12),
    ("NVIDIA L4", "l4", 121e12),
    ("NVIDIA A10G", "a10g", 125e12),
    ("NVIDIA A10", "a10", 125e12),
    ("NVIDIA GeForce RTX 4090", "rtx-4090", 165.2e12),
    ("NVIDIA GeForce RTX 3090", "rtx-3090", 71e12),
    ("NVIDIA RTX A6000", "rtx-a6000", 154.85e12),
]


@pytest.mark.parametrize("name,key,flops", DEVICE_NAMES, ids=[n for n, _, _ in DEVICE_NAMES])
def test_peak_table_resolves_real_device_names(name, key, flops):
    assert match_device(name) == key
    assert lookup_peak(name).bf16_flops == pytest.approx(flops)


@pytest.mark.parametrize("name", ["NVIDIA GeForce GTX 1080", "Tesla V100-SXM2-16GB", "NVIDIA GeForce RTX 3090 Ti",
                                  "AMD Instinct MI300X", "cpu", "", "NVIDIA A1000"])
def test_unknown_devices_are_unknown(name):
    assert match_device(name) == UNKNOWN
    assert lookup_peak(name) is None


def test_every_table_entry_is_dense_and_cited():
    for p in PEAKS:
        assert p.source.count("http") == 1, p.key
        assert 50e12 < p.bf16_flops < 2.5e15, p.key
    # dense, not the datasheets' headline 2:4-sparse figures (1,979 / 1,671 / 1,513 / 624)
    assert lookup_peak("NVIDIA H100 80GB HBM3").bf16_flops < 1e15
    assert lookup_peak("NVIDIA A100-SXM4-80GB").bf16_flops == 312e12


def _profiles():
    import yaml

    return {p.stem: yaml.safe_load(p.read_text())["hardware"] for p in sorted((CONF_DIR / "hardware").glob("*.yaml"))}


def test_hardware_profiles_hold_the_peak_tables_figures():
    """conf/hardware/<device>.yaml shows its peaks for a reader; bnlit.speed.throughput.PEAKS is the one
    table the run looks devices up in. A figure changed in one place and not the other fails here."""
    profiles = _profiles()
    assert {"cpu", "gpu", "h100", "h200", "a100", "b200"} <= set(profiles)
    for stem, hw in profiles.items():
        assert hw["name"] == stem
        if stem in ("cpu", "gpu"):
            assert hw["table_key"] is None and hw["peak_tflops"] == {"bf16": None, "fp32": None}
            continue
        entry = table_peak(hw["table_key"])
        assert re.search(entry.pattern, stem), (stem, entry.key)  # the profile is that device's entry
        for dtype, flops in (("bf16", entry.bf16_flops), ("fp32", entry.fp32_flops)):
            assert hw["peak_tflops"][dtype] * 1e12 == pytest.approx(flops), \
                f"conf/hardware/{stem}.yaml peak_tflops.{dtype}: set it to {flops / 1e12:g} (PEAKS[{entry.key!r}])"


def test_fp32_runs_use_the_tf32_figure_and_the_profile_covers_unnamed_gpus(monkeypatch):
    names = {"a100": "NVIDIA A100-SXM4-80GB", "new": "NVIDIA Quantum X9"}
    device = {"name": names["a100"]}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: device["name"])
    assert resolve_peak("cuda", torch.bfloat16).flops == 312e12
    fp32 = resolve_peak("cuda", torch.float32)
    assert fp32.flops == 156e12 and fp32.dtype == "fp32" and "dense fp32" in fp32.describe()
    b200 = _profiles()["b200"]
    device["name"] = names["new"]  # not in the table: the hardware= profile's figure, labelled as such
    peak = resolve_peak("cuda", torch.bfloat16, profile=b200)
    assert peak.flops == 2250e12 and not peak.measured and peak.source.startswith("hardware=b200 profile")
    assert resolve_peak("cuda", torch.float32, profile=b200).flops == 1100e12
    device["name"] = names["a100"]  # a named device: its own table entry wins over the profile's
    assert resolve_peak("cuda", torch.bfloat16, profile=b200).flops == 312e12


def test_a_profile_on_another_device_is_named():
    a100 = {"name": "a100", "peak_tflops": {"bf16": 312, "fp32": 156}}
    message = profile_mismatch(a100, "NVIDIA H100 80GB HBM3")
    assert "hardware=a100" in message and "NVIDIA H100 80GB HBM3" in message and "h100-sxm" in message
    assert profile_mismatch(a100, "NVIDIA A100-SXM4-40GB") is None
    assert profile_mismatch({"name": "h100"}, "NVIDIA H100 PCIe") is None  # any H100 form factor
    assert profile_mismatch({"name": "gpu"}, "NVIDIA L4") is None and profile_mismatch(None, "NVIDIA L4") is None


def test_cpu_peak_is_measured_and_labelled():
    peak = resolve_peak("cpu", torch.float32)
    assert peak.measured and peak.key == UNKNOWN and peak.device == "cpu"
    assert "measured" in peak.source and "measured" in peak.describe()
    assert 1e8 < peak.flops < 1e14
    assert resolve_peak("cpu", torch.float32, override_flops=5e12).flops == 5e12


def test_precision_dtypes():
    assert precision_dtype("bf16-mixed") is torch.bfloat16
    assert precision_dtype("16-mixed") is torch.float16
    assert precision_dtype("32-true") is torch.float32


def test_throughput_stats_is_the_palm_formula():
    records = [StepRecord(elapsed_s=0.5, wait_s=0.1, tokens=1000, samples=4, flops=1000 * 6e6),
               StepRecord(elapsed_s=1.5, wait_s=0.3, tokens=3000, samples=12, flops=3000 * 6e6)]
    s = throughput_stats(records, peak_flops=1e11, world_size=8)
    assert s["tokens_per_s_per_device"] == 2000.0
    assert s["tokens_per_s"] == 16000.0
    assert s["samples_per_s_per_device"] == 8.0 and s["samples_per_s"] == 64.0
    assert s["tflops_per_device"] == pytest.approx(2000 * 6e6 / 1e12)
    assert s["mfu_pct"] == pytest.approx(100 * 6e6 * 2000 / 1e11)  # flops_per_token * tokens_per_s / peak
    assert s["step_ms"] == 1000.0
    assert s["data_wait_pct"] == pytest.approx(20.0)
    assert throughput_stats(records, peak_flops=None)["mfu_pct"] is None
    with pytest.raises(ValueError):
        throughput_stats([], 1e12)


def test_step_timer_accumulates_micro_batches_and_skips_pauses():
    t = [0.0]
    timer = StepTimer(window_steps=2, clock=lambda: t[0])
    for i in range(3):  # 3 steps of 2 micro-batches: 0.1 s wait, 0.4 s work each
        for micro in range(2):
            t[0] += 0.1
            timer.batch_start()
            t[0] += 0.4
            timer.batch_end(tokens=10, samples=1, flops=10.0, stepped=micro == 1)
        if i == 1:
            timer.pause()
            t[0] += 100.0  # validation: never counted
    first, second = timer.window  # the window holds the last two steps
    assert (second.tokens, second.samples, second.flops) == (20, 2, 20.0)
    assert second.elapsed_s == pytest.approx(0.9) and second.wait_s == pytest.approx(0.1)  # first gap paused
    assert first.elapsed_s == pytest.approx(1.0) and first.wait_s == pytest.approx(0.2)
    assert timer.steps == 3


# ---- the callback in a real fit on a fake clock ------------------------------------------------

CFG = ModelConfig(name="tiny", vocab_size=256, dim=32, n_layer=2, n_head=2, n_kv_heads=1, multiple_of=32, max_seq_len=32)
B, T = 4, 16
WAIT, WORK = 0.25, 0.75  # binary fractions: the expected figures are exact


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Advance(L.Callback):
    """Moves the fake clock before the monitor reads it: ``WAIT`` before each batch (the loader),
    ``work(step)`` at its end (the step)."""

    def __init__(self, clock: FakeClock, work=lambda step: WORK):
        self.clock, self.work = clock, work

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.clock.t += WAIT

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.clock.t += self.work(trainer.global_step)


class Recording(ThroughputMonitor):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.reports: list[tuple[int, dict]] = []

    def _report(self, trainer, pl_module, step):
        super()._report(trainer, pl_module, step)
        self.reports.append((step, dict(self.last)))


def fit(monitor: ThroughputMonitor, clock: FakeClock, steps: int, work=lambda step: WORK, log_every_n_steps: int = 1):
    torch.manual_seed(0)
    data = torch.randint(0, CFG.vocab_size, (B * steps, T + 1))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=B)
    module = LMModule(Transformer(CFG), optimizer=partial(torch.optim.AdamW, lr=1e-3))
    # a floor that fires traces steps into <default_root_dir>/plots: a temporary directory, not the checkout
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        default_root_dir=tempfile.mkdtemp(prefix="bnlit_throughput_"),
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        log_every_n_steps=log_every_n_steps, callbacks=[Advance(clock, work), monitor])
    trainer.fit(module, train_dataloaders=loader)
    return trainer


def test_monitor_numbers_on_a_fake_clock_are_the_formula():
    clock = FakeClock()
    peak_tflops = 1e-3  # 1 GFLOP/s
    monitor = Recording(window_steps=3, log_every_n_steps=2, peak_tflops=peak_tflops, clock=clock)
    trainer = fit(monitor, clock, steps=6)
    # logged only every log_every_n_steps; step 1 (compilation, warm-up) never enters the window
    assert [s for s, _ in monitor.reports] == [2, 4, 6]
    fpt = flops_per_token(CFG, T)
    tps = B * T / (WAIT + WORK)
    expected = {
        "throughput/tokens_per_s": tps, "throughput/tokens_per_s_per_device": tps,
        "throughput/samples_per_s": B / (WAIT + WORK), "throughput/samples_per_s_per_device": B / (WAIT + WORK),
        "throughput/tflops": fpt * tps / 1e12, "throughput/tflops_per_device": fpt * tps / 1e12,
        "throughput/mfu": 100 * fpt * tps / (peak_tflops * 1e12),
        "throughput/step_ms": 1e3 * (WAIT + WORK),
        "throughput/data_wait_pct": 100 * WAIT / (WAIT + WORK),
    }
    last = monitor.reports[-1][1]
    for k, v in expected.items():
        assert last[k] == pytest.approx(v, rel=1e-12), k
        assert float(trainer.callback_metrics[k]) == pytest.approx(v, rel=1e-6), k
    assert last["memory/peak_rss_gib"] > 0.01
    # the hardware's count: causal (and document) masking leaves at most half the attention matrix
    assert 0 < last["throughput/hfu"] < last["throughput/mfu"]
    assert last["throughput/hardware_tflops"] / last["throughput/tflops"] == pytest.approx(
        last["throughput/hfu"] / last["throughput/mfu"])
    assert monitor.peak.key == "override" and last["throughput/peak_measured"] == 0.0
    assert last["throughput/peak_tflops"] == peak_tflops


def test_monitor_figures_include_a_slow_step_in_its_window():
    clock = FakeClock()
    monitor = Recording(window_steps=2, log_every_n_steps=1, peak_tflops=1e-3, clock=clock)
    fit(monitor, clock, steps=5, work=lambda step: 4.75 if step == 4 else WORK)
    by_step = dict(monitor.reports)
    assert by_step[3]["throughput/step_ms"] == pytest.approx(1000.0)
    assert by_step[4]["throughput/step_ms"] == pytest.approx(1e3 * (1.0 + 5.0) / 2)  # steps 3 and 4
    assert by_step[5]["throughput/step_ms"] == pytest.approx(1e3 * (5.0 + 1.0) / 2)


def _peak_for(mfu_pct: float) -> float:
    """The peak (TFLOP/s) at which the un-slowed fake step runs at ``mfu_pct``."""
    return flops_per_token(CFG, T) * B * T / (WAIT + WORK) / (mfu_pct / 100) / 1e12


def test_mfu_floor_raises_on_a_deliberately_slowed_step():
    clock = FakeClock()
    monitor = ThroughputMonitor(window_steps=1, log_every_n_steps=1, cpu_min_mfu_pct=20.0, warmup_steps=3,
                         on_low_mfu="raise", peak_tflops=_peak_for(50.0), clock=clock)
    with pytest.raises(LowMFUError, match=r"MFU 5\.00% is below the floor of 20% at step 5"):
        fit(monitor, clock, steps=8, work=lambda step: 10 * (WAIT + WORK) - WAIT if step == 5 else WORK)


def test_mfu_floor_is_quiet_at_full_speed_and_warns_when_asked():
    clock = FakeClock()
    quiet = ThroughputMonitor(window_steps=1, log_every_n_steps=1, cpu_min_mfu_pct=20.0, warmup_steps=3,
                       on_low_mfu="raise", peak_tflops=_peak_for(50.0), clock=clock)
    fit(quiet, clock, steps=6)  # 50% MFU throughout: no error
    assert quiet.where_time_went is None and not quiet.profiler.taken  # and no trace
    clock = FakeClock()
    warn = ThroughputMonitor(window_steps=1, log_every_n_steps=1, cpu_min_mfu_pct=20.0, warmup_steps=3,
                      on_low_mfu="warn", peak_tflops=_peak_for(10.0), clock=clock)
    with pytest.warns(UserWarning, match="below the floor of 20%"):
        fit(warn, clock, steps=5)


def test_low_mfu_takes_one_trace_and_says_where_the_time_went(tmp_path):
    """The floor fires at step 3 and at every step after it; one trace of the next 2 steps is taken
    (steps 4-5), summarised in one line and written as a chrome trace another tool can read; the
    traced steps leave the window (no report at step 5)."""
    clock = FakeClock()
    monitor = Recording(window_steps=1, log_every_n_steps=1, cpu_min_mfu_pct=20.0, warmup_steps=3, on_low_mfu="warn",
                        peak_tflops=_peak_for(10.0), profile_steps=2, profile_dir=str(tmp_path), clock=clock)
    with pytest.warns(UserWarning, match="below the floor of 20%"):
        fit(monitor, clock, steps=9)
    line = monitor.where_time_went
    assert line.startswith("where the time went (2 steps, ") and "cpu ops" in line, line
    for word in ("matmul", "attention", "elementwise", "optimizer", "data wait", "host gaps"):
        assert word in line, (word, line)
    assert [p.name for p in tmp_path.iterdir()] == ["profile_step4.json"]
    assert monitor.profile["files"] == [str(tmp_path / "profile_step4.json")]
    events = json.loads((tmp_path / "profile_step4.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert "Optimizer.step#AdamW.step" in names and any(n and n.startswith("aten::") for n in names)
    assert [s for s, _ in monitor.reports] == [2, 3, 4, 6, 7, 8, 9]


def test_low_mfu_raise_stops_after_the_trace_with_its_line(tmp_path):
    clock = FakeClock()
    monitor = ThroughputMonitor(window_steps=1, log_every_n_steps=1, cpu_min_mfu_pct=20.0, warmup_steps=3,
                                on_low_mfu="raise", peak_tflops=_peak_for(10.0), profile_steps=2,
                                profile_dir=str(tmp_path), clock=clock)
    with pytest.raises(LowMFUError, match=r"(?s)below the floor of 20% at step [34] .*where the time went \(2 steps, "):
        fit(monitor, clock, steps=9)
    assert monitor.profiler.taken and monitor.profile["files"] == [str(tmp_path / "profile_step4.json")]
    clock = FakeClock()
    off = ThroughputMonitor(window_steps=1, log_every_n_steps=1, cpu_min_mfu_pct=20.0, warmup_steps=3,
                            on_low_mfu="raise", peak_tflops=_peak_for(10.0), profile_on_low_mfu=False, clock=clock)
    with pytest.raises(LowMFUError, match="at step 3") as e:
        fit(off, clock, steps=9)
    assert "where the time went" not in str(e.value) and off.where_time_went is None


def test_mfu_floor_waits_for_warmup_and_is_off_on_cpu_by_default():
    clock = FakeClock()
    monitor = ThroughputMonitor(window_steps=1, log_every_n_steps=1, cpu_min_mfu_pct=20.0, warmup_steps=100,
                         on_low_mfu="raise", peak_tflops=_peak_for(1.0), clock=clock)
    fit(monitor, clock, steps=4)  # 1% MFU, but still warming up
    clock = FakeClock()
    fit(ThroughputMonitor(window_steps=1, log_every_n_steps=1, warmup_steps=0, on_low_mfu="raise",
                   peak_tflops=_peak_for(1.0), clock=clock), clock, steps=4)  # the 20% GPU floor: not on CPU


def test_bad_arguments_are_refused():
    for kw in ({"on_low_mfu": "explode"}, {"min_mfu_pct": 0.0}, {"cpu_min_mfu_pct": 150}, {"log_every_n_steps": 0},
               {"patience": 0}, {"window_steps": 0}):
        with pytest.raises(ValueError):
            ThroughputMonitor(**kw)


# ---- wiring ------------------------------------------------------------------------------------------


def test_default_run_logs_perf_and_memory(make_cfg, tmp_path):
    cfg = make_cfg()
    assert cfg.callbacks.throughput._target_ == "bnlit.callbacks.throughput.ThroughputMonitor"
    metrics = train(cfg)
    for k in ("throughput/tokens_per_s", "throughput/samples_per_s", "throughput/tflops", "throughput/mfu", "throughput/step_ms",
              "throughput/data_wait_pct", "memory/peak_rss_gib", "throughput/hfu", "throughput/hardware_tflops"):
        assert k in metrics and metrics[k] > 0, k
    assert metrics["throughput/mfu"] < 100 and metrics["throughput/peak_measured"] == 1.0  # this CPU's measured matmul peak
    rows = list(csv.DictReader(open(next((tmp_path / "run").rglob("metrics.csv")))))
    logged = [r for r in rows if r.get("throughput/tokens_per_s")]
    assert logged and all(r.get("train/lr") for r in rows if r.get("train/loss"))


@pytest.mark.slow
def test_a_run_whose_mfu_floor_fires_says_where_the_time_went_in_its_summary(make_cfg, tmp_path):
    """The floor (raised to 100% on CPU, where it is off by default: the CUDA path is the same
    code) fires at step 2; steps 3-4 are traced; the line reaches summary.md and the trace the run's plots/."""
    cfg = make_cfg("trainer.max_steps=5", "callbacks.throughput.cpu_min_mfu_pct=100",
                   "callbacks.throughput.warmup_steps=2", "callbacks.throughput.profile_steps=2")
    with pytest.warns(UserWarning, match="below the floor of 100%"):
        train(cfg)
    run = tmp_path / "run"
    summary = (run / "summary.md").read_text()
    assert re.search(r"^where the time went \(2 steps, [\d.]+ s, cpu ops\): .*matmul \d+%", summary, re.M), summary[:2000]
    assert [p.name for p in (run / "plots").glob("profile_step*.json")] == ["profile_step3.json"]


def test_h100_config_is_the_fast_path():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["model=400m", "trainer=h100"])
    assert cfg.trainer.precision == "bf16-mixed" and cfg.trainer.accelerator == "gpu"
    assert cfg.module.compile and cfg.module.fullgraph and cfg.module.sdpa_backend == "auto"
    assert cfg.optimizer.fused is True
    assert cfg.data.pin_memory and cfg.data.num_workers > 0 and cfg.data.prefetch_factor >= 2
    assert cfg.data.seq_len == 2048 and cfg.callbacks.throughput.min_mfu_pct == 20.0


@pytest.mark.parametrize("activation_checkpointing", [False, True])
def test_model_compiles_to_one_graph(activation_checkpointing):
    """``module.fullgraph: true`` on the H100 path needs a forward without graph breaks; dynamo's
    trace is device-independent, so the eager backend checks it on CPU."""
    model = Transformer(CFG, activation_checkpointing=activation_checkpointing)
    model.compile(fullgraph=True, backend="eager")
    x = torch.randint(0, CFG.vocab_size, (2, T))
    model(x).float().sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.slow
def test_bench_script_runs_on_cpu(cache_dir, capsys):
    """``scripts/bench.py --json`` end to end, cut to a few steps on the test corpus."""
    import importlib.util
    import json

    from conftest import TINY

    spec = importlib.util.spec_from_file_location("bench", CONF_DIR.parent / "scripts" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    keep = [o for o in TINY if not o.startswith(("trainer.max_steps", "trainer.val_check", "trainer.limit_val",
                                                  "callbacks.model_checkpoint", "logger", "~callbacks.progress_bar",
                                                  "trainer.enable_progress_bar"))]
    out = bench.main(["--json", "--warmup", "2", "--steps", "3", "--reps", "1", "--all", "--memory", "--memory-model", "tiny",
                      "--memory-seq-len", "64", "--memory-batch-size", "2", "--memory-reps", "1", "--masking-pairs", "3",
                      *(f"--override={o}" for o in keep)])
    printed = json.loads(capsys.readouterr().out)
    assert printed["lightning_vs_raw"] == pytest.approx(out["lightning_vs_raw"])
    for k in ("tokens_per_s_raw", "tokens_per_s_lightning", "lightning_vs_raw", "arbiter_overhead_ratio_default",
              "arbiter_overhead_ratio_every_step", "data_loader_share", "mfu_cpu_pct_lightning",
              "document_masking_step_time_ratio", "chunked_loss_step_time_ratio", "fused_loss_step_time_ratio"):
        assert printed[k] is not None and printed[k] > 0, k
    masking = printed["document_masking_interleaved"]
    assert masking["pairs"] == 3 and masking["ratio"] > 0 and masking["documents_per_window"] >= 1
    memory = printed["loss_memory"]
    for impl in ("plain", "chunked", "fused"):
        assert memory[f"{impl}_growth_mib"] > 0, impl
    assert memory["chunked_vs_plain"] > 0 and memory["fused_vs_plain"] > 0


def test_mfu_floor_patience_without_a_trainer():
    """Fires only after ``patience`` consecutive low logging steps past warmup; a good step resets it."""
    from bnlit.speed.throughput import MFUFloor, Peak
    floor, cpu = MFUFloor(cpu_min_mfu_pct=20.0, warmup_steps=2, patience=2), torch.device("cpu")
    peak = Peak(1e12, "cpu", "override", "test", False)
    low = {"mfu_pct": 5.0, "tokens_per_s": 1.0, "step_ms": 1.0, "data_wait_pct": 0.0}
    assert floor.judge(low, cpu, 1, peak) is None and floor.low == 0  # warming up
    assert floor.judge(low, cpu, 2, peak) is None and floor.low == 1
    assert floor.judge({**low, "mfu_pct": 50.0}, cpu, 3, peak) is None and floor.low == 0
    assert floor.judge(low, cpu, 4, peak) is None
    assert "MFU 5.00% is below the floor of 20% at step 5" in floor.judge(low, cpu, 5, peak)
    assert floor.pct(torch.device("cuda")) == 20.0 and MFUFloor().pct(cpu) is None


def test_measured_cpu_peak_follows_the_thread_count():
    """callbacks.threads changes the thread count during a run; MFU must use that count's peak."""
    from bnlit.speed.throughput import Peak, measure_matmul_peak, refresh_peak, resolve_peak

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = resolve_peak("cpu", torch.float32)
        assert one.measured and refresh_peak(one, "cpu", torch.float32).flops == one.flops  # cached per count
        torch.set_num_threads(2)
        two = refresh_peak(one, "cpu", torch.float32)
        assert two.flops == measure_matmul_peak("cpu", torch.float32)  # the 2-thread measurement
        assert two.flops != one.flops
        sheet = Peak(1e15, "gpu", "h100-sxm", "datasheet", measured=False)
        assert refresh_peak(sheet, "cpu", torch.float32) is sheet
    finally:
        torch.set_num_threads(before)

"""The CPU precision the default run picks: bf16 only where the CPU multiplies it natively; and
whether it compiles: only where Inductor finds a C++ compiler."""

from __future__ import annotations

import shutil

import pytest

from bnlit.resolvers import cpu_compile, cpu_precision


def _cpuinfo(tmp_path, flags: str):
    p = tmp_path / "cpuinfo"
    p.write_text(f"processor\t: 0\nmodel name\t: test\nflags\t\t: fpu sse2 avx2 {flags}\n\nprocessor\t: 1\n")
    return p


def test_native_bf16_cpu_trains_in_bf16_mixed(tmp_path):
    assert cpu_precision(_cpuinfo(tmp_path, "avx512f avx512_bf16")) == "bf16-mixed"
    assert cpu_precision(_cpuinfo(tmp_path, "amx_tile amx_bf16")) == "bf16-mixed"


def test_emulated_bf16_cpu_stays_in_fp32(tmp_path):
    # AVX512 without the BF16 extension: oneDNN emulates bf16, slower than fp32
    assert cpu_precision(_cpuinfo(tmp_path, "avx512f avx512bw avx512vl")) == "32-true"
    assert cpu_precision(tmp_path / "missing") == "32-true"  # no /proc/cpuinfo (macOS, Windows)


def test_cpu_trainer_resolves_to_a_lightning_precision(make_cfg):
    cfg = make_cfg("trainer.precision=${bnlit.cpu_precision:}")
    assert cfg.trainer.precision in ("bf16-mixed", "32-true")


def test_cpu_compiles_only_where_a_cxx_compiler_is_found(monkeypatch, tmp_path):
    # Inductor reads $CXX first: a compiler that is not there must leave the run eager
    from torch._inductor.cpp_builder import cpp_compiler_search  # Inductor caches the compiler it found

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv("PATH", str(tmp_path))
    cpp_compiler_search.cache_clear()  # an earlier compile in this process found one
    assert cpu_compile() is False
    monkeypatch.undo()
    cpp_compiler_search.cache_clear()
    if not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        pytest.skip("machine: no C++ compiler on PATH")
    assert cpu_compile() is True


def test_default_run_compiles_on_cpu_where_it_can(make_cfg):
    cfg = make_cfg(tiny=False)
    assert cfg.module.compile is cpu_compile() and cfg.trainer.accelerator == "cpu"


@pytest.mark.parametrize("precision,backend", [("bf16-mixed", "math"), ("32-true", "auto")])
def test_cpu_attention_kernel_follows_the_precision(make_cfg, precision, backend):
    # the math kernel is faster than CPU flash under bf16 only (scripts/bench_attention.py)
    cfg = make_cfg(f"trainer.precision={precision}", tiny=False)
    assert cfg.module.sdpa_backend == backend


def test_default_cpu_run_attention_matches_its_precision(make_cfg):
    cfg = make_cfg(tiny=False)
    assert cfg.module.sdpa_backend == ("math" if cfg.trainer.precision == "bf16-mixed" else "auto")

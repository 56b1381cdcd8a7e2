"""Which of vLLM's x86 kernel builds a CPU runs, and which one a process mapped."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_patch.runtime.cpu_library import loaded, runnable

SITE = "/venv/lib/python3.11/site-packages"


@pytest.mark.parametrize(
    "flags,classes",
    [
        (
            ["sse4_2", "avx2", "avx512f", "avx512_bf16"],
            ["avx512_bf16", "avx512", "avx2"],
        ),
        (["sse4_2", "avx2", "avx512f", "avx512bw"], ["avx512", "avx2"]),
        (["sse4_2", "avx2", "fma"], ["avx2"]),
        (["sse4_2"], []),
    ],
    ids=["AVX-512 with BF16", "AVX-512 without BF16", "AVX2 only", "neither"],
)
def test_a_cpu_runs_the_builds_of_its_class_and_older_ones(flags, classes) -> None:
    assert runnable(flags) == classes


@pytest.mark.parametrize(
    "libraries,expected",
    [
        ([f"{SITE}/vllm/_C_AVX2.abi3.so"], ["_C_AVX2"]),
        ([f"{SITE}/vllm/_C.abi3.so"], ["_C"]),
        ([f"{SITE}/torch/_C.cpython-311-x86_64-linux-gnu.so"], []),
    ],
    ids=[
        "vLLM's AVX2 build",
        "vLLM's AVX-512 BF16 build",
        "torch's _C is not vLLM's",
    ],
)
def test_the_mapped_kernel_build_is_read_from_the_process_maps(
    tmp_path: Path, libraries, expected
) -> None:
    lines = [
        f"7f0000000000-7f0000001000 r-xp 00000000 08:01 1234 {path}"
        for path in libraries
    ]
    maps = tmp_path / "maps"
    maps.write_text(
        "\n".join(["7ffd0000-7ffd1000 rw-p 00000000 00:00 0 [stack]", *lines])
    )
    assert loaded(maps) == expected

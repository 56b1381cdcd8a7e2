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


def said_by_a_spawned_interpreter(queue) -> None:
    """In a spawned interpreter: what vLLM's kernel-build choice reads."""
    import torch

    checks = ("_is_avx512_bf16_supported", "_is_avx512_supported")
    amx = ("_is_amx_tile_supported",)
    queue.put({name: getattr(torch.cpu, name)() for name in checks + amx})


@pytest.mark.integration
def test_an_older_build_is_forced_in_the_interpreters_vllm_spawns(
    monkeypatch,
) -> None:
    """vLLM's CPU platform spawns its workers: the AVX2 build forced here must
    reach them, AMX included (only the newest class has it)."""
    import multiprocessing

    torch = pytest.importorskip("torch")
    from vllm_patch.runtime.cpu_library import forced_in_spawned
    from vllm_patch.runtime.kernel_builds import CHECKS, NEWEST_CLASS_ONLY

    # It forces this process too: its checks come back after the test, or a
    # later test here would load a second kernel build, which aborts.
    for check in [*CHECKS.values(), *NEWEST_CLASS_ONLY]:
        was = getattr(torch.cpu, check, None)
        monkeypatch.setattr(torch.cpu, check, was, raising=False)

    spawn = multiprocessing.get_context("spawn")
    queue = spawn.Queue()
    with forced_in_spawned("avx2"):
        worker = spawn.Process(target=said_by_a_spawned_interpreter, args=(queue,))
        worker.start()
        said = queue.get(timeout=120)
        worker.join()
    assert not any(said.values()), said


@pytest.mark.integration
@pytest.mark.vllm
def test_pr_bias_runs_on_every_build_this_cpu_runs() -> None:
    """`pr`'s bias figure forces each build before vLLM loads the CPU's own: a
    second build registering the same ops would abort the child."""
    from vllm_patch.runtime import child, machine

    for library in runnable(machine.cpu()["flags"]):
        found = child.run(
            "vllm_patch.upstream.figures:bias", {"library": library}, timeout=300
        ).value()
        assert set(found["rms_norm"]) == {"kernel", "native", "this change"}, found

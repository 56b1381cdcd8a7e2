"""Which of vLLM's x86 kernel builds a CPU runs, and which one a process mapped."""

from __future__ import annotations

import multiprocessing
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


def said_under_the_avx2_build(queue) -> None:
    """In a new interpreter (the test's may hold a build): the AVX2 build forced,
    what an interpreter it spawns then reads."""
    from vllm_patch.runtime.cpu_library import forced_in_spawned

    spawn = multiprocessing.get_context("spawn")
    inner = spawn.Queue()
    with forced_in_spawned("avx2"):
        worker = spawn.Process(target=said_by_a_spawned_interpreter, args=(inner,))
        worker.start()
        queue.put(inner.get(timeout=120))
        worker.join()


@pytest.mark.integration
def test_an_older_build_is_forced_in_the_interpreters_vllm_spawns() -> None:
    """vLLM's CPU platform spawns its workers: the AVX2 build forced must reach
    them, AMX included (only the newest class has it)."""
    pytest.importorskip("torch")
    spawn = multiprocessing.get_context("spawn")
    queue = spawn.Queue()
    forcing = spawn.Process(target=said_under_the_avx2_build, args=(queue,))
    forcing.start()
    said = queue.get(timeout=240)
    forcing.join()
    assert not any(said.values()), said


def forced_after_loading(library: str, queue) -> None:
    """In a new interpreter: vLLM's kernels loaded, then ``library`` forced."""
    from vllm.platforms import current_platform

    from vllm_patch.runtime.cpu_library import force

    current_platform.import_kernels()
    try:
        force(library)
    except RuntimeError as exc:
        queue.put(str(exc))
        return
    queue.put("forced")


@pytest.mark.integration
@pytest.mark.vllm
def test_a_second_build_is_refused_with_a_message_not_an_abort() -> None:
    from vllm_patch.runtime import machine
    from vllm_patch.runtime.kernel_builds import LIBRARIES

    classes = runnable(machine.cpu()["flags"])
    if len(classes) < 2:
        pytest.skip("this CPU runs one kernel build: there is no second to load")
    spawn = multiprocessing.get_context("spawn")
    queue = spawn.Queue()
    loading = spawn.Process(target=forced_after_loading, args=(classes[-1], queue))
    loading.start()
    said = queue.get(timeout=240)
    loading.join()
    assert loading.exitcode == 0
    expected = f"this process has vLLM's {LIBRARIES[classes[0]]} build loaded"
    assert said.startswith(expected), said


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

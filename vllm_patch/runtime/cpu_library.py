"""Make vLLM load an older x86 class's kernel build (``_C_AVX512``, ``_C_AVX2``)
by having ``torch.cpu._is_avx512*_supported()`` say no. Also a pytest plugin:
``pytest -p vllm_patch.runtime.cpu_library --vllm-cpu-library=avx2``. The table
of classes and builds is ``kernel_builds``'s."""

from pathlib import Path

from vllm_patch.runtime.kernel_builds import CHECKS, LIBRARIES, runnable

# runnable and LIBRARIES are kernel_builds'; named here too until the bench and
# the conformance table import them from there.
__all__ = ["force", "loaded", "runnable", "LIBRARIES"]
OPTION = "--vllm-cpu-library"


def force(library: str) -> None:
    """Have vLLM load ``library``'s build: each newer class's check says no. A
    class newer than the CPU raises (its instructions would kill the process)."""
    import torch

    if library in CHECKS and not getattr(torch.cpu, CHECKS[library])():
        raise RuntimeError(f"this CPU cannot run vLLM's {LIBRARIES[library]} build")
    for newer in list(LIBRARIES)[: list(LIBRARIES).index(library)]:
        setattr(torch.cpu, CHECKS[newer], lambda: False)


def loaded(maps: Path = Path("/proc/self/maps")) -> list[str]:
    """The vLLM kernel libraries this process has mapped (``_C_AVX2``, ...)."""
    paths = {line.split(" ")[-1] for line in maps.read_text().splitlines()}
    return sorted(Path(p).name.split(".", 1)[0] for p in paths if "/vllm/_C" in p)


def pytest_addoption(parser) -> None:
    parser.addoption(
        OPTION,
        choices=sorted(LIBRARIES),
        help="the x86 CPU class whose vLLM kernel build to load",
    )


def pytest_configure(config) -> None:
    library = config.getoption(OPTION)
    if library:
        force(library)


def pytest_collection_finish(session) -> None:
    """The tests imported vLLM's kernels: they must be the chosen build's."""
    import pytest

    library = session.config.getoption(OPTION)
    if library and LIBRARIES[library] not in loaded():
        said = (
            f"vLLM loaded {loaded() or 'no kernel build'}, not {LIBRARIES[library]}"
        )
        raise pytest.UsageError(said)


def pytest_report_header(config) -> str | None:
    library = config.getoption(OPTION)
    return f"vLLM CPU kernels: the {LIBRARIES[library]} build" if library else None

"""Make vLLM load an older x86 class's kernel build (``_C_AVX512``, ``_C_AVX2``)
by having ``torch.cpu._is_avx512*_supported()`` say no. Also a pytest plugin:
``pytest -p vllm_patch.runtime.cpu_library --vllm-cpu-library=avx2``. The table
of classes and builds is ``kernel_builds``'s."""

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from vllm_patch.runtime.kernel_builds import (
    CHECKS,
    LIBRARIES,
    NEWEST_CLASS_ONLY,
    runnable,
)
from vllm_patch.runtime.startup import startup_folder

# runnable and LIBRARIES are kernel_builds'; named here too until the bench and
# the conformance table import them from there.
__all__ = ["force", "forced_in_spawned", "loaded", "runnable", "LIBRARIES"]
OPTION = "--vllm-cpu-library"


def force(library: str) -> None:
    """Have vLLM load ``library``'s build: each newer class's check says no. A
    class newer than the CPU raises (its instructions would kill the process),
    as does a process that has another build loaded already: a second build
    registers the same ``torch.ops._C`` ops, which aborts the process."""
    import torch

    if library in CHECKS and not getattr(torch.cpu, CHECKS[library])():
        raise RuntimeError(f"this CPU cannot run vLLM's {LIBRARIES[library]} build")
    held = [build for build in loaded() if build != LIBRARIES[library]]
    if held:
        raise RuntimeError(
            f"this process has vLLM's {held[0]} build loaded: force "
            f"{LIBRARIES[library]} before vLLM loads its kernels, or in a new "
            "process (a second build's ops would abort this one)"
        )
    newer = list(LIBRARIES)[: list(LIBRARIES).index(library)]
    says_no = [CHECKS[n] for n in newer]
    if newer:  # an older class than the newest has no AMX either
        says_no += NEWEST_CLASS_ONLY
    for check in says_no:
        setattr(torch.cpu, check, lambda: False)


@contextlib.contextmanager
def forced_in_spawned(library: str) -> Iterator[None]:
    """:func:`force` here and in every interpreter this process starts inside
    (vLLM's workers are spawned: a force here never reaches them), through a
    ``startup_folder`` put first on ``PYTHONPATH``."""
    force(library)
    lines = (
        "from vllm_patch.runtime.cpu_library import force",
        f"force({library!r})",
    )
    with startup_folder(lines) as folder:
        before = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [folder, before]))
        try:
            yield
        finally:
            if before is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = before


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

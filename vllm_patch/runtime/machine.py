"""The machine and the software a measurement ran on, from ``/proc``, ``os``
and package metadata (nothing here imports torch or vLLM)."""

import os
import platform
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from patcher.errors import PatchError
from patcher.tree import open_tree
from vllm_patch.runtime.kernel_builds import LIBRARIES, runnable

# The /proc/cpuinfo flags that decide which vLLM CPU kernels exist and how fast.
KERNEL_FLAGS = tuple(
    "avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_vnni avx512_bf16"
    " avx512_fp16 avx_vnni amx_tile amx_bf16 amx_int8 asimd sve bf16 vsx".split()
)
BUSY_SHARE = 0.25  # above this other_share, a repetition is flagged busy


def _read(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def cpu() -> dict[str, Any]:
    """``model`` and every CPU flag (``flags``: x86 ``flags``, Arm ``Features``)."""
    found = {}
    for line in _read("/proc/cpuinfo"):
        key, _, value = (part.strip() for part in line.partition(":"))
        found.setdefault(key, value)
    model = found.get("model name") or platform.processor() or platform.machine()
    flags = (found.get("flags") or found.get("Features") or "").split()
    return {"model": model, "flags": flags}


def kernel_build(
    vllm_dir: Path | None = None, flags: list[str] | None = None
) -> str:
    """The kernel build vLLM loads here (``kernel_builds``; ``_C`` from a wheel of
    one build), else the architecture; ``vllm_dir``: the installed ``vllm/``."""
    arch = platform.machine()
    if arch not in ("x86_64", "AMD64"):
        return arch
    vllm_dir = vllm_dir or open_tree(None).location / "vllm"
    if not any(vllm_dir.glob("_C_AVX512.*")):
        return "_C"
    flags = cpu()["flags"] if flags is None else flags
    return LIBRARIES[next(iter(runnable(flags)), "avx2")]


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def facts() -> dict[str, Any]:
    """What a result document records about the machine it was measured on."""
    found = cpu()
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {
        "cpu_model": found["model"],
        "arch": platform.machine(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "memory_gib": round(memory / 2**30, 1),
        "key_flags": [f for f in KERNEL_FLAGS if f in found["flags"]],
        "flags": found["flags"],
        "os": platform.platform(),
    }


def summary(m: dict[str, Any]) -> str:
    """One line for a report: ``CPU model (arch), N CPUs, OS``."""
    return f"{m['cpu_model']} ({m['arch']}), {m['usable_cpus']} CPUs, {m['os']}"


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def cpu_snapshot(pids: list[int] = ()) -> dict[str, float] | None:
    """Busy CPU seconds of the machine and of this process, its ended children
    and the running ``pids``: :func:`other_share` compares two."""
    tick = os.sysconf("SC_CLK_TCK")
    stat = _read("/proc/stat")
    if not stat:
        return None
    ticks = [int(x) for x in stat[0].split()[1:]]
    busy = (sum(ticks[:8]) - sum(ticks[3:5])) / tick  # less idle and iowait
    # user and system, of this process and its ended children
    own = sum(os.times()[:4])
    for lines in filter(None, (_read(f"/proc/{pid}/stat") for pid in pids)):
        fields = lines[0].rsplit(")", 1)[1].split()  # after the command's name
        own += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return {"wall": time.monotonic(), "busy_s": busy, "own_s": own}


def other_share(before: dict | None, pids: list[int] = ()) -> float | None:
    """Share of the CPU time this process may use that other processes used
    since ``before``: 0 is a quiet machine, 1 means they kept every core busy."""
    after = cpu_snapshot(pids)
    if not before or not after or after["wall"] <= before["wall"]:
        return None
    wall = after["wall"] - before["wall"]
    busy = after["busy_s"] - before["busy_s"]
    own = after["own_s"] - before["own_s"]
    others = busy - own
    share = max(0.0, others) / (wall * usable_cpus())
    return round(min(1.0, share), 3)  # ticks are coarse


def distribution_version(name: str) -> str | None:
    """An installed distribution's version from its metadata (no import)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def software() -> dict[str, Any]:
    """The versions of Python, torch and vLLM (a patched copy first on the path
    too): its folder and the distribution of the dist-info beside it."""
    try:
        tree = open_tree(None)
    except PatchError:  # no vLLM for this Python
        tree = None
    info = tree.dist_info if tree else None
    dist = metadata.PathDistribution(info) if info else None
    return {
        "python": platform.python_version(),
        "torch": distribution_version("torch"),
        "vllm": dist.version if dist else None,
        "vllm_distribution": dist.metadata["Name"] if dist else None,
        "vllm_file": str(tree.location / "vllm") if tree else None,
        "transformers": distribution_version("transformers"),
        "vllm_patch": distribution_version("vllm-patch"),
    }

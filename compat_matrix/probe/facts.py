"""Facts about the environment being probed, for the top of the document:
Python, the installed vLLM and torch, the CPU model and its kernel flags.
"""

from __future__ import annotations

import importlib.util
import platform
from pathlib import Path
from typing import Any

# CPU features that decide which vLLM CPU kernels exist and how fast they are.
KERNEL_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
    "bf16",
    "vsx",
)


def python_info() -> str:
    return platform.python_version()


def vllm_info() -> dict[str, Any]:
    info: dict[str, Any] = {"version": None, "distribution": None, "location": None}
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return info
    package = Path(next(iter(spec.submodule_search_locations)))
    info["location"] = str(package)
    name, version = _distribution_of(package)
    info["distribution"], info["version"] = name, version
    try:
        import vllm

        info["version"] = str(getattr(vllm, "__version__", None) or version)
    except Exception as exc:  # the version from the metadata is still worth having
        info["import_error"] = f"{type(exc).__name__}: {exc}"
    return info


def _distribution_of(package: Path) -> tuple[str | None, str | None]:
    """The installed distribution whose files include this ``vllm/`` package."""
    for dist_info in sorted(package.parent.glob("vllm*.dist-info")):
        record = dist_info / "RECORD"
        if record.is_file() and "vllm/__init__.py" not in record.read_text("utf-8"):
            continue
        meta = dist_info / "METADATA"
        if not meta.is_file():
            continue
        fields = dict(
            line.split(": ", 1)
            for line in meta.read_text("utf-8").splitlines()
            if line[:8] in ("Name: vl", "Version:")
        )
        return fields.get("Name"), fields.get("Version")
    return None, None


def torch_info() -> dict[str, Any]:
    try:
        import torch

        return {"version": torch.__version__}
    except Exception as exc:
        return {"version": None, "import_error": f"{type(exc).__name__}: {exc}"}


def cpu_info() -> dict[str, Any]:
    model, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name" and model is None:
                model = value
            elif key in ("flags", "Features") and not flags:  # x86, Arm
                flags = set(value.split())
    except OSError:
        pass
    return {
        "model": model or platform.processor() or platform.machine(),
        "flags": [f for f in KERNEL_FLAGS if f in flags],
    }

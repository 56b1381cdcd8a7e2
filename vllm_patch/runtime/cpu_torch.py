"""Packages that break beside vLLM's ``+cpu`` torch: PyPI's torchvision,
torchaudio and torchcodec are built against PyPI's torch (``operator
torchvision::nms does not exist``), taking transformers and ``vllm.config``
down; PyTorch's CPU index has builds that work. Standard library only (nox)."""

from __future__ import annotations

BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def remove_command(python: str, packages: list[str] | tuple[str, ...]) -> list[str]:
    """The command that removes ``packages`` from ``python``'s environment."""
    return [python, "-m", "pip", "uninstall", "-y", *packages]


def cpu_build_command(python: str, torch_version: str, packages) -> list[str]:
    """The command that replaces ``packages`` with PyTorch's ``+cpu`` builds: each
    pins its torch, so keeping torch at its version picks the matching build."""
    pip = [python, "-m", "pip", "install", "--upgrade", "--extra-index-url"]
    return [*pip, CPU_INDEX, f"torch=={torch_version}", *packages]

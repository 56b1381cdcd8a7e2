"""Packages that break beside a ``+cpu`` torch, and how to fix them.

vLLM's CPU build pins a ``+cpu`` torch but requires torchvision, torchaudio and
torchcodec, which pip takes from PyPI, built against PyPI's torch: they fail to
import beside it (``operator torchvision::nms does not exist``), and so do
transformers and ``vllm.config``. PyTorch's CPU index has builds that work.
Standard library only: the noxfile imports it.
"""

from __future__ import annotations

BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def remove_command(python: str, packages: list[str] | tuple[str, ...]) -> list[str]:
    """The command that removes ``packages`` from ``python``'s environment."""
    return [python, "-m", "pip", "uninstall", "-y", *packages]


def cpu_build_command(python: str, torch_version: str, packages) -> list[str]:
    """The command that replaces ``packages`` with PyTorch's ``+cpu`` builds: each
    pins its torch, so keeping torch at its version picks the matching build."""
    return [python, "-m", "pip", "install", "--upgrade"] + [
        "--extra-index-url",
        CPU_INDEX,
        f"torch=={torch_version}",
        *packages,
    ]

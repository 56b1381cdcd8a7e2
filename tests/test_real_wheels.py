"""The patch on real vLLM sources: every wheel shape, read-only and unpacked."""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import git

from patcher.cli import main

VLLM_C = "vllm/kernels/vllm_c.py"
CPU = "vllm/platforms/cpu.py"


def read(root: Path, *rels: str) -> dict[str, bytes]:
    return {rel: (root / rel).read_bytes() for rel in rels}


def test_check_and_diff_read_the_wheel(
    real_wheel: Path, extracted_wheel: Path, capsys
) -> None:
    assert main(["check", "--vllm", str(real_wheel)]) == 1
    assert "cpu_fused_norms: applicable" in capsys.readouterr().out
    assert main(["diff", "--vllm", str(real_wheel)]) == 0
    diff = capsys.readouterr().out
    assert f"+++ b/{VLLM_C}" in diff and f"+++ b/{CPU}" in diff
    # The wheel's diff applies to the same sources unpacked.
    repo = git.Repo.init(extracted_wheel)
    subprocess.run(
        ["git", "apply", "-"], cwd=repo.working_dir, input=diff.encode(), check=True
    )
    assert main(["check", "--vllm", str(extracted_wheel)]) == 0


def test_apply_apply_revert_on_unpacked_wheel(extracted_wheel: Path, capsys) -> None:
    root = extracted_wheel
    original = read(root, VLLM_C, CPU)
    assert main(["apply", "--vllm", str(root)]) == 0
    patched = read(root, VLLM_C, CPU)
    for data in patched.values():
        ast.parse(data)  # still valid Python
    assert b"current_platform.is_cpu()" in patched[VLLM_C]
    cpu_source = patched[CPU].decode()
    assert "def get_default_ir_op_priority(" in cpu_source
    assert '["vllm_c", "native"]' in cpu_source

    assert main(["apply", "--vllm", str(root)]) == 0
    assert "already applied" in capsys.readouterr().out
    assert read(root, VLLM_C, CPU) == patched

    assert main(["revert", "--vllm", str(root)]) == 0
    assert read(root, VLLM_C, CPU) == original


def test_inverse_edit_alone_restores_real_sources(extracted_wheel: Path) -> None:
    """A checkout has no backup: the inverse codemods must give the bytes back."""
    root = extracted_wheel
    for info in root.glob("*.dist-info"):
        shutil.rmtree(info)
    git.Repo.init(root)
    original = read(root, VLLM_C, CPU)
    assert main(["apply", "--vllm", str(root)]) == 0
    assert main(["revert", "--vllm", str(root)]) == 0
    assert read(root, VLLM_C, CPU) == original


def test_only_the_norm_impls_change(extracted_wheel: Path, capsys) -> None:
    """Every other "vllm_c" impl keeps its supported= exactly."""
    main(["diff", "--vllm", str(extracted_wheel)])
    removed = [
        line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("-") and not line.startswith("---")
    ]
    for line in removed:
        assert "GPGPU_DEVICE =" in line or "supported=CUDA_ALIKE" in line, line

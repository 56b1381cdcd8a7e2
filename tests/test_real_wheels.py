"""The patch on real vLLM sources: every wheel shape, read-only and unpacked."""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import git
import libcst as cst

from patcher.cli import main
from patches.cpu_fused_norms.enable_vllm_c import NORM_OPS, cpu_guard, vllm_c_impls

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


# What the patch inserts into a line of vllm_c.py; nothing else may change.
INSERTED = [
    " or current_platform.is_cpu()",
    " and " + cst.Module([]).code_for_node(cpu_guard(["x", "x_residual"])),
    " and " + cst.Module([]).code_for_node(cpu_guard(["x"])),
]


def test_the_patch_only_inserts_the_cpu_gate_and_guard(extracted_wheel: Path, capsys):
    """Every changed line of vllm_c.py is the old line plus the CPU gate or the
    contiguity guard; every other "vllm_c" impl keeps its arguments exactly."""
    source = (extracted_wheel / VLLM_C).read_text()
    main(["diff", "--vllm", str(extracted_wheel), "--patch", "cpu_fused_norms"])
    diff = capsys.readouterr().out
    hunk = diff[: diff.index(f"diff --git a/{CPU}")]
    lines = hunk.splitlines()[4:]  # past the headers
    removed = [x[1:] for x in lines if x.startswith("-")]
    added = [x[1:] for x in lines if x.startswith("+")]
    for line in added:
        for text in INSERTED:
            line = line.replace(text, "")
        if line.strip() not in ("", *(t.strip() for t in INSERTED)):
            assert line in removed, line
    assert len(removed) <= len(added)

    def others(code: str) -> list:
        module = cst.parse_module(code)
        text = cst.Module([]).code_for_node
        return [
            (i.op, text(i.supported), text(i.supports_args))
            for i in vllm_c_impls(module)
            if i.op not in NORM_OPS
        ]

    main(["apply", "--vllm", str(extracted_wheel)])
    assert others((extracted_wheel / VLLM_C).read_text()) == others(source)

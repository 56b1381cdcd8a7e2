"""The patch on real vLLM sources: every wheel shape, read-only and unpacked."""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import git
import libcst as cst
from vllm_ruff import touched_lines_ruff_moves

from patcher import engine
from patcher.backup import BACKUP_DIR
from patcher.patchset import select
from patcher.tree import open_tree
from patches.cpu_fused_norms.enable_vllm_c import norm_impls
from vllm_patch.cli import main

VLLM_C = "vllm/kernels/vllm_c.py"
CPU = "vllm/platforms/cpu.py"


def read(root: Path, *rels: str) -> dict[str, bytes]:
    return {rel: (root / rel).read_bytes() for rel in rels}


def test_check_and_diff_read_the_wheel(
    real_wheel: Path, extracted_wheel: Path, capsys
) -> None:
    assert (
        main(["check", "--patch", "cpu_fused_norms", "--vllm", str(real_wheel)])
        == 1
    )
    assert "cpu_fused_norms: applicable" in capsys.readouterr().out
    assert (
        main(["diff", "--patch", "cpu_fused_norms", "--vllm", str(real_wheel)]) == 0
    )
    diff = capsys.readouterr().out
    assert f"+++ b/{VLLM_C}" in diff and f"+++ b/{CPU}" in diff
    # The wheel's diff applies to the same sources unpacked.
    repo = git.Repo.init(extracted_wheel)
    subprocess.run(
        ["git", "apply", "-"], cwd=repo.working_dir, input=diff.encode(), check=True
    )
    assert (
        main(
            ["check", "--patch", "cpu_fused_norms", "--vllm", str(extracted_wheel)]
        )
        == 0
    )


def test_apply_apply_revert_on_unpacked_wheel(
    extracted_wheel: Path, capsys
) -> None:
    root = extracted_wheel
    original = read(root, VLLM_C, CPU)
    assert main(["apply", "--patch", "cpu_fused_norms", "--vllm", str(root)]) == 0
    patched = read(root, VLLM_C, CPU)
    for data in patched.values():
        ast.parse(data)  # still valid Python
    assert b"current_platform.is_cpu()" in patched[VLLM_C]
    cpu_source = patched[CPU].decode()
    assert "def get_default_ir_op_priority(" in cpu_source
    assert '["vllm_c", "native"]' in cpu_source

    assert main(["apply", "--patch", "cpu_fused_norms", "--vllm", str(root)]) == 0
    assert "already applied" in capsys.readouterr().out
    assert read(root, VLLM_C, CPU) == patched

    assert main(["revert", "--patch", "cpu_fused_norms", "--vllm", str(root)]) == 0
    assert read(root, VLLM_C, CPU) == original


def test_a_checkout_reverts_real_sources_byte_for_byte(extracted_wheel: Path):
    """From the backup a checkout keeps in its .git."""
    root = extracted_wheel
    for info in root.glob("*.dist-info"):
        shutil.rmtree(info)
    git.Repo.init(root)
    original = read(root, VLLM_C, CPU)
    assert main(["apply", "--patch", "cpu_fused_norms", "--vllm", str(root)]) == 0
    patched = read(root, VLLM_C, CPU)
    assert all(patched[rel] != original[rel] for rel in original)
    assert main(["revert", "--patch", "cpu_fused_norms", "--vllm", str(root)]) == 0
    assert read(root, VLLM_C, CPU) == original


def test_the_inverse_edit_alone_gives_the_same_code_back(extracted_wheel: Path):
    """Without a backup the inverse codemods are right in meaning."""
    root = extracted_wheel
    original = read(root, VLLM_C, CPU)
    assert main(["apply", "--patch", "cpu_fused_norms", "--vllm", str(root)]) == 0
    patched = read(root, VLLM_C, CPU)
    assert all(patched[rel] != original[rel] for rel in original)
    shutil.rmtree(root / BACKUP_DIR)
    assert main(["revert", "--patch", "cpu_fused_norms", "--vllm", str(root)]) == 0
    for rel, data in read(root, VLLM_C, CPU).items():
        assert ast.dump(ast.parse(data)) == ast.dump(ast.parse(original[rel]))


def test_pinned_ruff_changes_no_line_the_patch_touched(real_wheel: Path) -> None:
    """Every line the patch adds or edits is laid out as vLLM's ruff (the pinned
    one, 88 columns) lays it out: formatting the patched file leaves them be."""
    plan = engine.plan(open_tree(real_wheel), select(["cpu_fused_norms"])[0])
    assert sorted(plan.file_changes()) == sorted([VLLM_C, CPU])
    for rel, (before, after) in plan.file_changes().items():
        assert touched_lines_ruff_moves(before, after) == [], rel


def test_pinned_ruff_changes_no_line_the_inverse_edit_touched(
    extracted_wheel: Path,
):
    """So is every line the inverse edit writes back (no backup to restore)."""
    root = extracted_wheel
    assert main(["apply", "--patch", "cpu_fused_norms", "--vllm", str(root)]) == 0
    patched = read(root, VLLM_C, CPU)
    shutil.rmtree(root / BACKUP_DIR)
    assert main(["revert", "--patch", "cpu_fused_norms", "--vllm", str(root)]) == 0
    for rel, data in read(root, VLLM_C, CPU).items():
        assert (
            touched_lines_ruff_moves(patched[rel].decode(), data.decode()) == []
        ), rel


def test_only_the_norms_impls_change(extracted_wheel: Path) -> None:
    """Every statement of vllm_c.py but the norms' gates and predicates, and
    the CPU constant, is as it was."""
    before = (extracted_wheel / VLLM_C).read_text()
    main(["apply", "--patch", "cpu_fused_norms", "--vllm", str(extracted_wheel)])
    after = (extracted_wheel / VLLM_C).read_text()
    assert set(norm_impls(cst.parse_module(after))) == set(
        norm_impls(cst.parse_module(before))
    )
    kept = set(ast.unparse(s) for s in ast.parse(before).body)
    new = [
        ast.unparse(s) for s in ast.parse(after).body if ast.unparse(s) not in kept
    ]
    allowed = (
        "IS_CPU",
        "GPGPU_DEVICE",
        "RMS_NORM_DEVICE",
        "rms_",
        "@ir.ops.",
        "@functools.cache\ndef cpu_norm_dtypes(",
        "def cpu_threads_shared(",
        "CPU_DTYPES = ",
        "import functools",
        "import os",
    )
    assert new and all(s.startswith(allowed) or "CPU kernels" in s for s in new), (
        new
    )

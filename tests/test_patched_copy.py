"""vllm_patch.runtime.patched_copy: vLLM as a patch leaves it, without touching
the installed vLLM."""

from __future__ import annotations

from conftest import requires_vllm

from patcher.backup import hex_digest
from patcher.patchset import select
from patcher.tree import open_tree
from vllm_patch.runtime import child
from vllm_patch.runtime.patched_copy import patched_copy

PATCH = select(["cpu_fused_norms"])[0]


@requires_vllm
def test_a_patched_copy_leaves_the_installed_vllm_alone(targets):
    installed = open_tree(None)
    files = sorted({e.file for e in PATCH.edits})
    original = {f: hex_digest(installed.path(f).read_bytes()) for f in files}
    record: dict = {}
    with patched_copy(installed, PATCH, record=record) as site:
        assert record["copy"] == str(site) and record["changed"] is True
        for f in files:
            assert (
                hex_digest((site / f).read_bytes()) != original[f]
            )  # patched here ...
            assert (
                hex_digest(installed.path(f).read_bytes()) == original[f]
            )  # ... not there
        # Untouched files are the installed ones, linked: no copy of vLLM's bytes.
        init = "vllm/__init__.py"
        assert (site / init).stat().st_ino == installed.path(init).stat().st_ino
        # A child with the copy first imports vLLM from it.
        seen = child.run(
            "toolkit_targets:software_alone", pythonpath=[site, targets]
        ).value()["software"]
        assert seen["vllm_file"] == str(site / "vllm")
        assert seen["vllm"] == "0.32.0"
    assert not site.exists()
    assert record["restored"] is True and record["original_unchanged"] is True
    assert record["hashes"]["before"] == original
    assert {
        f: hex_digest(installed.path(f).read_bytes()) for f in files
    } == original


@requires_vllm
def test_a_copy_of_a_tree_with_the_patch_applied_already_records_no_change(
    tmp_path,
):
    with patched_copy(open_tree(None), PATCH) as site:
        record: dict = {}
        with patched_copy(open_tree(site), PATCH, parent=tmp_path, record=record):
            assert record["changed"] is False
            assert "already applied" in record["apply"]
        assert list(tmp_path.iterdir()) == []  # removed after

"""patcher.patchset: the provider a patch declares, and which patch a tree
gets (patch.toml's vllm, default and replaces; exclusive patches; an edit that
creates its file)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import make_tree, requires_vllm, snapshot
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from patcher import patchset
from patcher.patchset import Patch, provider_specs, select
from vllm_patch.cli import main

PATCH = select(["cpu_fused_norms"])[0]


@requires_vllm
def test_the_provider_is_what_its_module_declares():
    from patches.cpu_fused_norms import identity, provider

    spec = PATCH.provider()
    assert spec["module"] == "patches.cpu_fused_norms.provider"
    assert spec["patch"] == PATCH.name
    assert spec["name"] == provider.PROVIDER
    assert spec["ops"] == list(identity.OPS)
    assert spec["opt_in_env"] == provider.OPT_IN_ENV
    assert spec["upstream"] == identity.UPSTREAM_PROVIDER
    assert spec in provider_specs()


def test_a_patch_without_a_provider_table_declares_none():
    bare = Patch("bare", "t", SpecifierSet(">=0"), (), Path("."), meta={})
    assert bare.provider() is None


# Patch choice per tree, on two patches of a package made here: "old" where
# IR is the default, "new" (which replaces it) creating a file of its own.
OLD_TOML = """title = "old"
vllm = ">=0.20"
default = "<0.33"
[[edits]]
file = "vllm/platforms/cpu.py"
apply = "fakepatches.old.mod:AddFlag"
revert = "fakepatches.old.mod:DropFlag"
"""
NEW_TOML = """title = "new"
vllm = ">=0.14"
replaces = "old"
[[edits]]
file = "vllm/new_module.py"
create = true
apply = "fakepatches.new.mod:AddFlag"
revert = "fakepatches.new.mod:DropFlag"
"""
CODEMODS = """
import libcst as cst
from patcher.codemod import TreeCodemod

FLAG = "FLAG = 1\\n"


class AddFlag(TreeCodemod):
    DESCRIPTION = "Add FLAG."

    def transform_module_impl(self, tree):
        if any(tree.code_for_node(s) == FLAG for s in tree.body):
            return tree
        body = [*tree.body, cst.parse_statement(FLAG)]
        return tree.with_changes(body=body, has_trailing_newline=True)


class DropFlag(TreeCodemod):
    DESCRIPTION = "Drop FLAG."

    def transform_module_impl(self, tree):
        body = [s for s in tree.body if tree.code_for_node(s) != FLAG]
        return tree.with_changes(body=body)
"""


@pytest.fixture
def fake_patches(tmp_path, monkeypatch):
    root = tmp_path / "pkgs" / "fakepatches"
    for name, toml in (("old", OLD_TOML), ("new", NEW_TOML)):
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text("")
        (root / name / "patch.toml").write_text(toml)
        (root / name / "mod.py").write_text(CODEMODS)
    (root / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(root.parent))
    monkeypatch.setattr(patchset, "PATCHES_PACKAGE", "fakepatches")
    yield {p.name: p for p in patchset.all_patches()}
    for name in [m for m in sys.modules if m.startswith("fakepatches")]:
        del sys.modules[name]


@pytest.mark.parametrize(
    "version,chosen",
    [
        ("0.19.0", ["new"]),
        ("0.25.0", ["old"]),
        ("0.33.0", ["new"]),
        (None, ["old"]),
    ],
)
def test_default_and_replaces_choose_one_patch(fake_patches, version, chosen):
    assert [
        p.name for p in patchset.defaults(version and Version(version))
    ] == chosen


def version_tree(root: Path, version: str) -> Path:
    tree = make_tree(root)
    (tree / "vllm/_version.py").write_text(f'__version__ = "{version}"\n')
    return tree


def test_list_says_where_each_applies_and_why(fake_patches, tmp_path, capsys):
    tree = version_tree(tmp_path / "tree", "0.33.0")
    assert main(["list", "--json", "--vllm", str(tree)]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["old"]["applies"] and not rows["old"]["is_default"]
    assert "outside its default <0.33" in rows["old"]["why"]
    assert rows["new"]["is_default"] and rows["new"]["default"] is None
    assert "old, which it replaces, is not" in rows["new"]["why"]


def test_a_created_file_comes_and_goes(fake_patches, tmp_path, capsys):
    tree = version_tree(tmp_path / "tree", "0.33.0")
    before = snapshot(tree)
    assert main(["diff", "--vllm", str(tree)]) == 0
    assert "new file mode 100644\n--- /dev/null\n+++ b/vllm/new_module.py" in (
        capsys.readouterr().out
    )
    assert main(["apply", "--vllm", str(tree)]) == 0
    assert (tree / "vllm/new_module.py").read_text() == "FLAG = 1\n"
    assert main(["check", "--vllm", str(tree)]) == 0
    assert main(["revert", "--vllm", str(tree)]) == 0
    assert snapshot(tree) == before


def test_exclusive_patches_refuse_each_other(fake_patches, tmp_path, capsys):
    tree = version_tree(tmp_path / "tree", "0.25.0")
    assert main(["apply", "--vllm", str(tree)]) == 0  # old, the default here
    applied = snapshot(tree)
    capsys.readouterr()
    assert main(["apply", "--patch", "new", "--vllm", str(tree)]) == 3
    err = capsys.readouterr().err
    assert "old is applied here (fully or in part), and new excludes it" in err
    assert "`vllm-patch revert --patch old`" in err and snapshot(tree) == applied
    assert main(["revert", "--vllm", str(tree)]) == 0
    assert main(["apply", "--patch", "new", "--vllm", str(tree)]) == 0

"""patches/*/rendered/: current with the codemods, and each applies with
`git apply` to the sources of the vLLM version it names."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name, parse_wheel_filename

from patcher import engine
from patcher.tree import open_tree
from vllm_patch.upstream import render
from vllm_patch.upstream.meta import pick_patch, upstream_of

pytestmark = pytest.mark.integration

PATCH = pick_patch("cpu_fused_norms")
RENDERED = PATCH.folder / "rendered"


def spec_of(wheel: Path) -> str:
    """The ``rendered_for`` entry naming this wheel."""
    name, version, _, _ = parse_wheel_filename(wheel.name)
    for spec in upstream_of(PATCH).rendered_for:
        package, _, ver = spec.partition("==")
        if canonicalize_name(package) == name and ver == str(version):
            return spec
    pytest.fail(f"{wheel.name} is not in [upstream] rendered_for")


def git(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)


def test_every_listed_wheel_has_a_file_and_nothing_else():
    listed = {render.file_name(s) for s in upstream_of(PATCH).rendered_for}
    assert {p.name for p in RENDERED.glob("*.patch")} == listed


def test_rendered_file_is_current(real_wheel):
    name = render.file_name(spec_of(real_wheel))
    assert (RENDERED / name).read_text() == render.render_one(
        PATCH, spec_of(real_wheel)
    ), f"{name} is stale: run `nox -s render`"


def test_rendered_file_applies_with_git_apply(real_wheel, tmp_path):
    plan = engine.plan(open_tree(real_wheel), PATCH)
    changes = plan.file_changes()
    with zipfile.ZipFile(real_wheel) as zf:
        zf.extractall(tmp_path, list(changes))
    assert git("init", "-q", cwd=tmp_path).returncode == 0
    patch_file = RENDERED / render.file_name(spec_of(real_wheel))

    checked = git("apply", "--check", str(patch_file), cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert git("apply", str(patch_file), cwd=tmp_path).returncode == 0
    for rel, (_, after) in changes.items():
        assert (tmp_path / rel).read_text() == after


def test_check_reports_stale_missing_and_extra_files(tmp_path):
    wanted = render.rendered(PATCH)
    assert render.sync(tmp_path, wanted, check=False)  # writes every file
    assert render.sync(tmp_path, wanted, check=True) == []
    names = sorted(p.name for p in tmp_path.glob("*.patch"))
    (tmp_path / names[0]).write_text("stale\n")
    (tmp_path / names[1]).unlink()
    (tmp_path / "vllm-0.0.1.patch").write_text("extra\n")

    assert render.sync(tmp_path, wanted, check=True) == sorted(
        [names[0], names[1], "vllm-0.0.1.patch"]
    )
    render.sync(tmp_path, wanted, check=False)
    assert sorted(p.name for p in tmp_path.glob("*.patch")) == names
    assert render.sync(tmp_path, wanted, check=True) == []

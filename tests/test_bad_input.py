"""Every bad input an attacker tried: a documented exit code and a message
naming the file, never a traceback, not one byte changed; under ``--json``, one
JSON document. Then damaged backups (revert still works) and the bytes a patch
must keep (BOM, CRLF, symlinks)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import git
import pytest
from conftest import CPU, VLLM_C, WHEEL, make_tree, snapshot, wheel

from patcher.backup import BACKUP_DIR
from patcher.errors import ExitCode
from vllm_patch.cli import main

MANIFEST = f"{BACKUP_DIR}/cpu_fused_norms/manifest.json"


@pytest.fixture(autouse=True)
def no_hang():
    """A command that blocks (on a FIFO) fails the test instead of hanging it."""

    def hung(*_):
        pytest.fail("the command blocked")  # not an OSError: nothing catches it

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture(autouse=True)
def writable_again(tmp_path):
    """Undo the read-only root cases' chmod, so the tree can be cleaned up."""
    yield
    if (tmp_path / "tree").is_dir():
        os.chmod(tmp_path / "tree", 0o755)


def corrupt_member(root: Path) -> Path:
    path = wheel(root)
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(VLLM_C)
    data = bytearray(path.read_bytes())
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    for i in range(start + 10, start + 40):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    return path


def truncated(root: Path) -> Path:
    path = wheel(root)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def text_file(root: Path, name: str = WHEEL) -> Path:
    (root / name).write_text("not a zip\n")
    return root / name


def folder_named_whl(root: Path) -> Path:
    make_tree(root / WHEEL)  # even with a vllm/ inside
    return root / WHEEL


def fifo(root: Path, name: str = WHEEL) -> Path:
    os.mkfifo(root / name)
    return root / name


def tree_with(
    kind: str, change: Callable[[Path], object]
) -> Callable[[Path], Path]:
    def setup(root: Path) -> Path:
        tree = make_tree(root / "tree", kind)
        change(tree)
        return tree

    return setup


def write(rel: str, text: str) -> Callable[[Path], None]:
    return lambda tree: (tree / rel).write_text(text)


def replace_with_fifo(rel: str) -> Callable[[Path], None]:
    def change(tree: Path) -> None:
        (tree / rel).unlink()
        os.mkfifo(tree / rel)

    return change


def syntax_error_on_line_3(tree: Path) -> None:
    lines = (tree / VLLM_C).read_text().splitlines(keepends=True)
    lines.insert(2, "def broken(:\n")
    (tree / VLLM_C).write_text("".join(lines))


def no_vllm_installed(monkeypatch) -> None:
    """This interpreter without its site-packages (where vLLM is installed);
    everything the CLI needs is imported already."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "-packages" not in p])
    sys.path_importer_cache.clear()


USAGE, CANNOT = ExitCode.USAGE, ExitCode.CANNOT_APPLY
ALL = ("check", "diff", "apply", "revert")
READ = ("check", "diff")
WRITE = ("apply", "revert")
# id, what to make under tmp_path (returns the --vllm PATH, or None for the
# installed vLLM), the verbs it is tried with, the exit code, the message parts.
CASES: list[tuple[str, Callable, tuple[str, ...], int, list[str]]] = [
    # 2. bad wheels
    ("not-a-zip", text_file, READ, CANNOT, ["not a readable wheel", "not a zip"]),
    ("truncated", truncated, READ, CANNOT, ["not a readable wheel", "not a zip"]),
    (
        "corrupt-member",
        corrupt_member,
        READ,
        CANNOT,
        [f"member {VLLM_C} is damaged"],
    ),
    ("folder-named-whl", folder_named_whl, READ, CANNOT, ["a directory"]),
    ("fifo-named-whl", fifo, READ, CANNOT, ["not a readable wheel", "FIFO"]),
    (
        "unrelated-wheel",
        lambda r: wheel(r, {"x/__init__.py": b""}),
        READ,
        CANNOT,
        ["not a vLLM tree", "a wheel without it"],
    ),
    ("good-wheel", wheel, WRITE, USAGE, ["cannot", "a .whl (read-only)"]),
    ("not-a-zip", text_file, WRITE, USAGE, ["a .whl (read-only)"]),
    ("truncated", truncated, WRITE, USAGE, ["a .whl (read-only)"]),
    ("folder-named-whl", folder_named_whl, WRITE, USAGE, ["a .whl (read-only)"]),
    ("fifo-named-whl", fifo, WRITE, USAGE, ["a .whl (read-only)"]),
    # 6. early errors (each also as JSON, below)
    ("missing-path", lambda r: r / "nowhere", ALL, CANNOT, ["no such file"]),
    (
        "no-vllm-dir",
        lambda r: r,
        ALL,
        CANNOT,
        ["not a vLLM tree", "vllm/__init__.py"],
    ),
    (
        "non-wheel-file",
        lambda r: text_file(r, "setup.cfg"),
        ALL,
        CANNOT,
        ["not a vLLM tree", "a regular file that is not a wheel"],
    ),
    (
        "fifo-tree",
        lambda r: fifo(r, "pipe"),
        ALL,
        CANNOT,
        ["not a vLLM tree", "FIFO"],
    ),
    # 7. smaller ones
    (
        "syntax-error-line",
        tree_with("directory", syntax_error_on_line_3),
        ("check", "diff", "apply"),
        CANNOT,
        ["syntax error", "line 3, column 12: invalid syntax"],
    ),
    (
        "nul-byte",
        tree_with("directory", write(VLLM_C, "import os\nx = 1\n  \0\n")),
        ("check", "diff", "apply"),
        CANNOT,
        ["syntax error", "line 3, column 3: a NUL byte"],
    ),
    (
        "fifo-source",
        tree_with("directory", replace_with_fifo(VLLM_C)),
        ALL,
        CANNOT,
        [VLLM_C, "not a regular file", "FIFO"],
    ),
    (
        "folder-source",
        tree_with("directory", lambda t: ((t / CPU).unlink(), (t / CPU).mkdir())),
        ALL,
        CANNOT,
        [CPU, "not a regular file", "a directory"],
    ),
    (
        "annotated-version",
        tree_with(
            "directory", write("vllm/_version.py", "__version__: str = '0.12.0'\n")
        ),
        ("check", "diff", "apply"),
        CANNOT,
        ["outside the patch's range", "0.12.0"],
    ),
    (
        "version-only",
        tree_with("installed", write("vllm/_version.py", "version = '0.12.0'\n")),
        ("check", "diff", "apply"),
        CANNOT,
        ["outside the patch's range", "0.12.0"],
    ),
    *[
        (
            f"read-only-root-{kind}",
            tree_with(kind, lambda t: os.chmod(t, 0o555)),
            ("apply",),
            CANNOT,
            ["folder is read-only", "dr-xr-xr-x"],
        )
        for kind in ("checkout", "installed", "directory")
    ],
    *[
        (
            f"read-only-folder-{kind}",
            tree_with(kind, lambda t: os.chmod((t / VLLM_C).parent, 0o555)),
            ("apply",),
            CANNOT,
            ["vllm/kernels: folder is read-only", "dr-xr-xr-x"],
        )
        for kind in ("checkout", "installed", "directory")
    ],
    (
        "damaged-backup-apply-folder-in-the-way",
        tree_with(
            "installed",
            lambda t: (
                (t / MANIFEST).parent.mkdir(parents=True),
                (t / MANIFEST).write_text("[]"),
                (t / BACKUP_DIR / "cpu_fused_norms" / VLLM_C).mkdir(parents=True),
            ),
        ),
        ("apply",),
        CANNOT,
        ["place of a backup copy is taken", "delete it"],
    ),
]
RUNS = [
    (case, verb, as_json)
    for case in CASES
    for verb in case[2]
    for as_json in ([False, True] if verb in READ else [False])
]


@pytest.mark.parametrize(
    "case,verb,as_json",
    RUNS,
    ids=[f"{verb}{'-json' * j}-{case[0]}" for case, verb, j in RUNS],
)
def test_bad_input_exit_code_message_no_change(
    tmp_path, capsys, case, verb, as_json
) -> None:
    _, setup, _, code, parts = case
    target = setup(tmp_path)
    before = snapshot(tmp_path)
    argv = [verb, "--vllm", str(target)] + (["--json"] if as_json else [])
    assert main(argv) == code
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    if as_json:  # the error, or check's report with the error in it
        doc = json.loads(out.out)
        if isinstance(doc, dict):
            assert doc["error"]["code"] == code
        said = json.dumps(doc)
    else:
        said = out.out + out.err  # check reports on stdout, errors go to stderr
    for part in parts:
        assert part in said
    assert str(target.resolve()).replace("\\", "/") in said
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "argv,code,message",
    [
        (["check", "--json", "--patch", "nope"], USAGE, "unknown patch nope"),
        (["diff", "--json", "--bogus"], USAGE, "unrecognized arguments: --bogus"),
        (["check", "--json"], CANNOT, "no vLLM installed"),
    ],
    ids=["unknown-patch", "bad-argument", "no-vllm-installed"],
)
def test_early_errors_are_one_json_document(
    tree, argv, code, message, monkeypatch, capsys
) -> None:
    if "no vLLM" in message:
        no_vllm_installed(monkeypatch)
    else:
        argv += ["--vllm", str(tree)]
    assert main(argv) == code
    out = capsys.readouterr()
    assert json.loads(out.out)["error"]["code"] == code
    assert message in out.err and "Traceback" not in out.err


# 3. A damaged backup: revert says so and reverts by the inverse edit, which on
# the fixture gives the original bytes back; the backup is gone afterwards.
def _rm(rel: str) -> Callable[[Path], None]:
    return lambda tree: (tree / BACKUP_DIR / "cpu_fused_norms" / rel).unlink()


def _copy_is_a_folder(tree: Path) -> None:
    copy = tree / BACKUP_DIR / "cpu_fused_norms" / CPU
    copy.unlink()
    (copy / "x").mkdir(parents=True)


def _no_hash(tree: Path) -> None:
    manifest = json.loads((tree / MANIFEST).read_text())
    del manifest["files"][VLLM_C]["original_sha256"]
    (tree / MANIFEST).write_text(json.dumps(manifest))


DAMAGE = [
    ("copy-deleted", _rm(CPU), "file not found"),
    ("manifest-deleted", _rm("manifest.json"), "file not found"),
    ("manifest-empty", write(MANIFEST, ""), "Expecting value"),
    ("manifest-invalid", write(MANIFEST, "{files: "), "Expecting property name"),
    ("manifest-{}", write(MANIFEST, "{}"), 'no "files" table'),
    ("manifest-[]", write(MANIFEST, "[]"), 'no "files" table'),
    ("entry-without-hash", _no_hash, "has no valid original_sha256"),
    ("copy-is-a-folder", _copy_is_a_folder, "not a regular file"),
    ("copy-edited", write(f"{BACKUP_DIR}/cpu_fused_norms/{CPU}", "x"), "changed"),
]


@pytest.mark.parametrize(
    "damage,message", [d[1:] for d in DAMAGE], ids=[d[0] for d in DAMAGE]
)
def test_damaged_backup_reverts_by_the_inverse_edit(
    installed, damage, message, capsys
) -> None:
    original = snapshot(installed)
    assert main(["apply", "--vllm", str(installed)]) == 0
    damage(installed)
    capsys.readouterr()
    assert main(["revert", "--vllm", str(installed)]) == 0
    err = capsys.readouterr().err
    assert "damaged backup" in err and message in err and "Traceback" not in err
    assert snapshot(installed) == original
    # and apply works again, with a whole new backup
    assert main(["apply", "--vllm", str(installed)]) == 0
    assert json.loads((installed / MANIFEST).read_text())["files"].keys() == {
        VLLM_C,
        CPU,
    }


def test_damaged_backup_and_unknown_file_says_what_to_delete(installed, capsys):
    assert main(["apply", "--vllm", str(installed)]) == 0
    _rm(VLLM_C)(installed)
    (installed / VLLM_C).write_text("X = 1\n")
    before = snapshot(installed)
    assert main(["revert", "--vllm", str(installed)]) == CANNOT
    err = capsys.readouterr().err
    assert "the backup is damaged" in err
    assert f"delete {installed / BACKUP_DIR / 'cpu_fused_norms'}" in err
    assert snapshot(installed) == before


def test_apply_over_a_damaged_backup_starts_a_new_one(installed, capsys) -> None:
    (installed / MANIFEST).parent.mkdir(parents=True)
    (installed / MANIFEST).write_text("[]")
    original = snapshot(installed)
    del original[MANIFEST]
    assert main(["apply", "--vllm", str(installed)]) == 0
    assert "damaged backup" in capsys.readouterr().err
    assert main(["revert", "--vllm", str(installed)]) == 0
    now = snapshot(installed)
    assert {k: v for k, v in now.items() if BACKUP_DIR not in k} == {
        k: v for k, v in original.items() if BACKUP_DIR not in k
    }
    assert not (installed / BACKUP_DIR).exists()


# 4 and 7. Every byte kept: BOM, CRLF, symlinks; on each kind of tree.
def _bom(tree: Path) -> None:
    for rel in (VLLM_C, CPU):
        (tree / rel).write_bytes(b"\xef\xbb\xbf" + (tree / rel).read_bytes())


def _crlf_bom(tree: Path) -> None:
    _bom(tree)
    for rel in (VLLM_C, CPU):
        (tree / rel).write_bytes((tree / rel).read_bytes().replace(b"\n", b"\r\n"))


def _symlinked(tree: Path) -> None:
    real = tree / "elsewhere" / "vllm_c_real.py"
    real.parent.mkdir()
    shutil.move(tree / VLLM_C, real)
    (tree / VLLM_C).symlink_to(os.path.relpath(real, (tree / VLLM_C).parent))


KEEP = [("bom", _bom), ("crlf-bom", _crlf_bom), ("symlinked-source", _symlinked)]


@pytest.mark.parametrize("kind", ["checkout", "installed"])
@pytest.mark.parametrize("change", [k[1] for k in KEEP], ids=[k[0] for k in KEEP])
def test_apply_and_revert_keep_every_byte(tmp_path, kind, change, capsys) -> None:
    tree = make_tree(tmp_path / "tree", kind)
    change(tree)
    if kind == "checkout":
        repo = git.Repo(tree)
        repo.git.add(A=True)
        repo.index.commit("changed", author=git.Actor("t", "t@example.com"))
    original = snapshot(tree)
    assert main(["apply", "--vllm", str(tree)]) == 0
    patched = snapshot(tree)
    for rel in (VLLM_C, CPU):
        if original[rel].startswith(b"\xef\xbb\xbf"):
            assert patched[rel].startswith(b"\xef\xbb\xbf")
        if b"\r\n" in original[rel]:
            assert patched[rel].count(b"\n") == patched[rel].count(b"\r\n")
    if original[VLLM_C].startswith(
        b"symlink to"
    ):  # the link kept, its target edited
        assert patched[VLLM_C] == original[VLLM_C]
        assert (
            patched["elsewhere/vllm_c_real.py"]
            != original["elsewhere/vllm_c_real.py"]
        )
    assert main(["check", "--vllm", str(tree)]) == 0
    assert main(["revert", "--vllm", str(tree)]) == 0
    assert snapshot(tree) == original
    if kind == "checkout":
        assert not git.Repo(tree).is_dirty(untracked_files=True)

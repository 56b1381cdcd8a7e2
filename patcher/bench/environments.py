"""Where the bench runs: the installed vLLM, and patched copies of it.

An upstream provider that the installed tree gates off (say ``"vllm_c"`` on
CPU) can still be measured: hard-link the installed ``vllm/`` package and its
dist-info into a temporary folder, apply the patch there with the engine (its
writes replace files, so the links to the installed files are never written
through), and run the measurement in a child interpreter with ``PYTHONPATH``
pointing at the copy. Each child gets one environment and one thread count.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from patcher import engine
from patcher.patchset import Patch, all_patches
from patcher.tree import VllmTree, linked_copy

_PROJECT_ROOT = Path(__file__).resolve().parent.parent.parent


@dataclass(frozen=True)
class BenchEnv:
    label: str
    """``installed`` or ``patched copy (<patch>)``: goes into every row."""
    python: str = sys.executable
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the child (``PYTHONPATH`` of a copy)."""


def provider_specs(patches: list[Patch] | None = None) -> list[dict[str, Any]]:
    """The out-of-tree providers the patches declare in their ``[provider]`` table
    (``module``, and the ``reference`` provider module the bench times it against),
    with the identity each provider module declares (``PROVIDER``, ``OPS``,
    ``OPT_IN_ENV``, ``UPSTREAM_PROVIDER``): the module is its one home."""
    out = []
    for patch in all_patches() if patches is None else patches:
        table = patch.meta.get("provider")
        if not (isinstance(table, dict) and table.get("module")):
            continue
        module = importlib.import_module(table["module"])
        out.append(
            {
                **table,
                "patch": patch.name,
                "name": module.PROVIDER,
                "ops": list(getattr(module, "OPS", ())),
                "opt_in_env": getattr(module, "OPT_IN_ENV", None),
                "upstream": getattr(module, "UPSTREAM_PROVIDER", None),
            }
        )
    return out


@contextlib.contextmanager
def patched_copy(
    tree: VllmTree, patch: Patch, parent: Path | None = None
) -> Iterator[Path]:
    """A temporary copy of the installed vLLM with ``patch`` applied; removed after."""
    folder = Path(tempfile.mkdtemp(prefix="vllm-patch-bench-copy-", dir=parent))
    try:
        engine.apply(linked_copy(tree, folder), patch)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def patches_to_copy(tree: VllmTree) -> tuple[list[Patch], list[str]]:
    """Patches that apply to the installed tree (so a patched copy differs from
    it), and notes on the others."""
    chosen, notes = [], []
    for patch in all_patches():
        try:
            status = engine.plan(tree, patch, "apply").status
        except Exception as exc:  # a tree the engine cannot read is a finding
            notes.append(f"patch {patch.name}: cannot plan: {exc}")
            continue
        if status == "applicable":
            chosen.append(patch)
        else:
            notes.append(f"patch {patch.name}: {status} to the installed tree")
    return chosen, notes


def child_env(bench_env: BenchEnv) -> dict[str, str]:
    env = dict(os.environ)
    env.update(bench_env.env)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(_PROJECT_ROOT)])
    return env


def run_module(
    module: str,
    spec: dict[str, Any],
    bench_env: BenchEnv,
    *,
    timeout: float = 3600,
    echo: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """``python -m module --spec JSON --result FILE`` in ``bench_env``; its result.

    The child's stderr (its progress lines) is passed to ``echo`` line by line.
    """
    with tempfile.TemporaryDirectory(prefix="vllm-patch-bench-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [bench_env.python, "-m", module, "--spec", json.dumps(spec)]
        cmd += ["--result", str(result)]
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(bench_env),
            cwd=tmp,
        )
        tail: list[str] = []
        assert proc.stderr is not None
        for line in proc.stderr:
            line = line.rstrip("\n")
            tail = (tail + [line])[-40:]
            if echo and line.startswith("  per-op "):
                echo(line.strip())
        rc = proc.wait(timeout=timeout)
        if rc != 0 or not result.is_file():
            raise RuntimeError(
                f"{module} in {bench_env.label} exited with {rc}:\n" + "\n".join(tail)
            )
        return json.loads(result.read_text("utf-8"))

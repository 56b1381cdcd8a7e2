"""The doctor's findings on each carried patch: its state in this vLLM, and for
a patch with an out-of-tree provider, the plugin entry point, the provider's
registration (from the child's results), its opt-in variable and whether this
vLLM still needs it. What a provider is called and which variable opts in to it
come from the patch's ``patch.toml`` and the provider module itself: nothing
here knows what a patch changes."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from importlib import metadata
from typing import Any

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


@dataclass(frozen=True)
class _Provider:
    """A provider that registered in the child, as it describes itself."""

    patch: str
    name: str
    upstream: str
    opt_in_env: str | None
    status: dict[str, Any]

    @classmethod
    def of(cls, patch: str, module: str, result: dict[str, Any]) -> _Provider:
        attrs = result.get("attributes") or {}
        return cls(
            patch=patch,
            name=attrs.get("PROVIDER") or module,
            upstream=attrs.get("UPSTREAM_PROVIDER") or "the upstream provider",
            opt_in_env=attrs.get("OPT_IN_ENV"),
            status=result.get("status") or {},
        )


def patch_findings(tree: VllmTree, patch: Patch, results, python) -> list[Finding]:
    out = [_plan_finding(tree, patch)]
    module = provider_module(patch)
    if not module:
        return out
    out.append(_entry_point_finding(patch.name, module, python))
    result = results[("provider", module)]
    if not result["ok"]:
        out.append(
            Finding(
                f"{patch.name}:provider",
                "fix",
                f"provider {module} does not register: {result['error']}",
                traceback_hint(python, module),
            )
        )
        return out
    provider = _Provider.of(patch.name, module, result)
    out.append(_registered_finding(provider, python))
    out.append(
        opt_in_finding(patch.name, provider.opt_in_env, provider.name, provider.status)
    )
    out += plugin_filter_findings(
        patch.name, _entry_points_of(module), provider.name, provider.status
    )
    out.append(_redundant_finding(provider))
    return out


def _plan_finding(tree: VllmTree, patch: Patch) -> Finding:
    plan = engine.plan(tree, patch)
    state = {
        PlanStatus.APPLIED: ("ok", "applied to this vLLM"),
        PlanStatus.APPLICABLE: ("info", "not applied (`vllm-patch apply` applies it)"),
        PlanStatus.PARTLY_APPLIED: (
            "fix",
            "partly applied (`vllm-patch apply` completes it, `revert` undoes it)",
        ),
    }.get(plan.status, ("info", f"cannot be applied here: {_first_line(plan)}"))
    return Finding(f"{patch.name}:patch", state[0], f"patch {patch.name}: {state[1]}")


def _first_line(plan) -> str:
    return str(plan.errors[0]).splitlines()[0] if plan.errors else plan.status


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


def _entry_point_finding(patch: str, module: str, python: str) -> Finding:
    entry = _entry_points_of(module)
    if not entry:
        return Finding(
            f"{patch}:entry_point",
            "fix",
            f"no entry point names {module}: vLLM will not load the provider",
            _install_project(python),
        )
    ep = entry[0]
    owner = f" ({ep.dist.name} {ep.dist.version})" if ep.dist else ""
    return Finding(
        f"{patch}:entry_point",
        "ok",
        f"plugin entry point {ep.group}: {ep.name} = {ep.value}{owner}",
    )


def _registered_finding(p: _Provider, python: str) -> Finding:
    """The ops the provider supports here, or the first error it recorded."""
    errors = p.status.get("errors") or []
    if errors:
        return Finding(
            f"{p.patch}:provider",
            "fix",
            f"provider {p.name}: {errors[0]}",
            f"{python} -m compat_matrix.probe shows each check",
        )
    supported = [op for op, yes in (p.status.get("supported") or {}).items() if yes]
    reasons = p.status.get("unsupported_reasons") or {}
    return Finding(
        f"{p.patch}:provider",
        "ok" if supported else "info",
        f"provider {p.name!r} registers; supported here for "
        f"{', '.join(supported) or 'no op'}"
        + "".join(f"; {op}: {why}" for op, why in reasons.items()),
    )


def _redundant_finding(p: _Provider) -> Finding:
    """Whether this vLLM already enables the upstream provider on CPU."""
    check = f"{p.patch}:redundant"
    if p.status.get("redundant"):
        return Finding(
            check,
            "info",
            f"this vLLM already enables {p.upstream} on CPU: the provider "
            f"{p.name!r} can go (it stands down by itself meanwhile)",
        )
    if p.status.get("redundant_error"):
        return Finding(
            check,
            "info",
            "could not tell whether the provider is redundant: "
            f"{p.status['redundant_error']}",
        )
    return Finding(
        check,
        "ok",
        f"the provider {p.name!r} is still useful: this vLLM does not enable "
        f"{p.upstream} on CPU",
    )


def opt_in_finding(patch: str, var: str | None, name: str, status: dict) -> Finding:
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


def plugin_filter_findings(
    patch: str, entry: list[metadata.EntryPoint], name: str, status: dict
) -> list[Finding]:
    """Whether vLLM's plugin filter (``VLLM_PLUGINS``) lets the provider's
    plugin load (``vllm_patch.runtime.plugins``)."""
    if FILTER_ENV not in os.environ or not entry:
        return []
    plugin = entry[0].name
    check = f"{patch}:vllm_plugins"
    if not left_out(plugin):
        value = os.environ[FILTER_ENV]
        return [Finding(check, "ok", f"{FILTER_ENV}={value!r} names {plugin!r}")]
    status_word = "fix" if status.get("opt_in") else "info"
    message = left_out_message(plugin, name)
    return [Finding(check, status_word, message, left_out_fix(plugin))]

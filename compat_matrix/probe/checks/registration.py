"""Does the provider get in: vLLM's IR is there, the provider registers (twice
harmlessly), and vLLM's own plugin loader finds and calls it in a new process.
On a vLLM from before IR the provider has nothing to register into: there the
same checks prove that it stands down with one INFO line and nothing else.
"""

from __future__ import annotations

import importlib
import inspect
import os
from typing import Any

from compat_matrix.probe import child_tasks
from compat_matrix.probe.framework import Fail, Probe, Skip, need_ir
from compat_matrix.probe.provider_module import provider_log, provider_status
from compat_matrix.probe.vllm_ir import NORM_OPS
from vllm_patch.runtime.child import Child

PLUGIN_GROUP = "vllm.general_plugins"
REGISTER_KEYWORDS = ("supported", "supports_args", "inplace")


def pre_ir_release() -> str | None:
    """Why this vLLM has no IR when it is a release from before IR; None when it
    has ``vllm.ir`` (or is newer, where a missing ``vllm.ir`` is a failure)."""
    import importlib.util

    from packaging.version import InvalidVersion, Version

    from compat_matrix.versions import FIRST_IR

    try:
        if importlib.util.find_spec("vllm.ir") is not None:
            return None
        import vllm

        version = Version(str(vllm.__version__))
    except (ImportError, AttributeError, InvalidVersion):
        return None  # ir_present says what is wrong
    if version >= FIRST_IR:
        return None
    return f"vLLM {version} predates vLLM IR (first in {FIRST_IR})"


def check_ir_present(p: Probe) -> tuple[str, dict]:
    p.pre_ir = pre_ir_release()
    if p.pre_ir:
        raise Skip(
            f"{p.pre_ir}: the provider does not apply; the registration checks "
            "and e2e check that the plugin stands down harmlessly"
        )
    try:
        from vllm import ir  # noqa: F401
        from vllm.ir.op import IrOp
    except Exception as exc:
        raise Fail(f"vllm.ir does not import: {type(exc).__name__}: {exc}") from None
    ops = sorted(IrOp.registry)
    params = inspect.signature(IrOp.register_impl).parameters
    keywords = {k: k in params for k in REGISTER_KEYWORDS}
    details = {"ops": ops, "register_impl_keywords": keywords}
    if not (keywords["supported"] and keywords["supports_args"]):
        raise Fail(
            "IrOp.register_impl takes neither supported= nor supports_args=", details
        )
    p.ir_ok = True
    notes = [f"no {op}" for op in NORM_OPS if op not in IrOp.registry]
    if not keywords["inplace"]:
        notes.append("register_impl has no inplace=")
    note = f" ({'; '.join(notes)})" if notes else ""
    return f"vllm.ir imports; ops: {', '.join(ops)}{note}", details


def stand_down_problems(log: list[dict], status: dict | None) -> list[str]:
    """What is wrong with how the plugin behaved on a vLLM without IR: it must
    say once, at INFO, that it does not apply, and do nothing else."""
    status = status or {}
    problems = []
    if not status.get("not_applicable"):
        problems.append("the provider did not report standing down")
    if status.get("errors"):
        problems.append(f"the provider recorded errors: {status['errors'][0]}")
    loud = [r for r in log if r["level"] != "INFO" or r["traceback"]]
    for r in loud[:1]:
        problems.append(
            f"it logged {r['level']}{' with a traceback' if r['traceback'] else ''}"
            f": {r['message']}"
        )
    if len(log) != 1:
        problems.append(f"it logged {len(log)} lines, expected one INFO line")
    return problems


def _stands_down(p: Probe) -> tuple[str, dict]:
    module = importlib.import_module(p.module_name)
    with provider_log(p.module_name) as log:
        module.register()
        module.register()  # vLLM may call a plugin again in the same process
    status = provider_status(module)
    details = {"status": status, "log": log}
    problems = stand_down_problems(log, status)
    if problems:
        raise Fail(problems[0], details)
    p.module = module
    return (
        f"not applicable, stands down: {log[0]['message']!r} (one INFO line, "
        "no warning; a second call logs nothing)",
        details,
    )


def check_provider_registers(p: Probe) -> tuple[str, dict]:
    if p.pre_ir:
        return _stands_down(p)
    need_ir(p)
    from vllm.ir.op import IrOp

    try:
        module = importlib.import_module(p.module_name)
    except Exception as exc:
        raise Fail(
            f"{p.module_name} does not import: {type(exc).__name__}: {exc}"
        ) from None
    module.register()
    first = {name: op.impls.get(p.name) for name, op in IrOp.registry.items()}
    module.register()  # vLLM may call a plugin again in the same process
    second = {name: op.impls.get(p.name) for name, op in IrOp.registry.items()}
    registered = [op for op, impl in first.items() if impl is not None]
    status = provider_status(module)
    skipped = (status or {}).get("skipped", {})
    details = {
        "registered": registered,
        "skipped": skipped,
        "absent_in_this_vllm": [op for op in module.OPS if op not in IrOp.registry],
        "status": status,
    }
    if not registered:
        raise Fail(
            f"no IR op has a {p.name!r} impl after {p.module_name}.register()", details
        )
    problem = _registration_problem(module, first, second, registered, status or {})
    if problem:
        raise Fail(problem, details)
    p.module, p.ops = module, registered
    reason = (
        f"{p.name!r} registered for {', '.join(registered)}; a second call is a no-op"
    )
    if skipped:
        reason += "; skipped " + "; ".join(
            f"{op}: {why}" for op, why in skipped.items()
        )
    return reason, details


def _registration_problem(module, first, second, registered, status) -> str | None:
    """The first thing wrong with a registration that registered something:
    a second call that replaced an impl, an op left out without a reason, or
    an error the provider recorded."""
    from vllm.ir.op import IrOp

    replaced = [op for op in registered if second[op] is not first[op]]
    if replaced:
        return f"a second register() replaced the impl of {', '.join(replaced)}"
    unexplained = [
        op
        for op in module.OPS
        if op in IrOp.registry
        and op not in registered
        and op not in status.get("skipped", {})
    ]
    if unexplained:
        return f"not registered, no reason given: {', '.join(unexplained)}"
    errors = status.get("errors") or []
    if errors:
        return f"the provider recorded errors: {errors[0]}"
    return None


def _our_entry_points(p: Probe) -> tuple[list, list]:
    from importlib.metadata import entry_points

    found = list(entry_points(group=PLUGIN_GROUP))
    return found, [
        ep for ep in found if ep.value.split(":")[0].strip() == p.module_name
    ]


def start_plugin_child(p: Probe) -> Child | None:
    """vLLM's plugin loader in a fork of this process, started before anything
    here registers with vLLM, so that it runs while the other checks do."""
    if not _our_entry_points(p)[1]:
        return None
    import vllm.plugins  # noqa: F401 - imported once, here, for the fork
    from vllm.platforms import current_platform

    current_platform.is_cpu()  # resolves the platform before the fork
    return child_tasks.start_task(
        "plugin_loader",
        {"module": p.module_name, "name": p.name},
        drop_env=("VLLM_PLUGINS",),
        fork=True,
    )


def check_plugin_entry_point(p: Probe) -> tuple[str, dict]:
    if not p.pre_ir:
        need_ir(p)
    found, ours = _our_entry_points(p)
    details: dict[str, Any] = {
        "discovered": [
            {"name": ep.name, "value": ep.value, "distribution": _ep_dist(ep)}
            for ep in found
        ]
    }
    if not ours:
        raise Skip(
            f"no {PLUGIN_GROUP} entry point targets {p.module_name} here "
            "(is the package that declares it installed in this environment?)",
            details,
        )
    ep = ours[0]
    plugins_filter = os.environ.get("VLLM_PLUGINS")
    if plugins_filter is not None:
        details["VLLM_PLUGINS"] = plugins_filter  # the child runs without the filter
    result = _plugin_loader_result(p, details)
    problems = _reload_problems(result)
    registered = [op for op, yes in result["registered"].items() if yes]
    loaded = f"entry point {ep.name} = {ep.value} ({_ep_dist(ep)}); vLLM's "
    if p.pre_ir:
        problems = (
            stand_down_problems(result.get("provider_log", []), result.get("status"))
            + problems
        )
        if problems:
            raise Fail(problems[0], details)
        return (
            loaded + "load_general_plugins() called it (and again after a forced "
            "reload): it stood down with one INFO line, no warning, no traceback",
            details,
        )
    if not registered:
        problems.insert(0, f"vLLM's load_general_plugins() did not register {p.name!r}")
    errors = (result.get("status") or {}).get("errors") or []
    if errors:
        problems.append(f"the provider recorded errors: {errors[0]}")
    if problems:
        raise Fail(problems[0], details)
    return (
        loaded + f"load_general_plugins() registered {p.name!r} for "
        f"{', '.join(registered)}; calling the plugin again was harmless",
        details,
    )


def _plugin_loader_result(p: Probe, details: dict[str, Any]) -> dict[str, Any]:
    """What vLLM's plugin loader did in its own process (started ahead, or now
    when the probe runs ``--only`` some checks)."""
    started = p.started.pop("plugin_entry_point", None)
    if started is None:  # not started ahead (--only): a fresh interpreter now
        started = child_tasks.start_task(
            "plugin_loader",
            {"module": p.module_name, "name": p.name},
            drop_env=("VLLM_PLUGINS",),
        )
    details["child"] = child = child_tasks.finish_task(started)
    if not child.get("ok"):
        raise Fail(
            f"load_general_plugins() in a new process failed: {child['error']}",
            details,
        )
    return child["result"]


def _reload_problems(result: dict[str, Any]) -> list[str]:
    """What went wrong when vLLM loaded the plugin a second time."""
    problems = []
    if result.get("error_after_reload"):
        problems.append(
            f"calling the plugin again failed: {result['error_after_reload']}"
        )
    calls = result.get("provider_calls")
    if calls is not None and calls < 2:
        problems.append(
            f"the forced second plugin load did not call the plugin ({calls})"
        )
    return problems


def _ep_dist(ep) -> str | None:
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else None

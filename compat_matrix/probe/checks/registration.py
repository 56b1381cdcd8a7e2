"""Does the provider get in: vLLM's IR is there, the provider registers (twice
harmlessly), and vLLM's own plugin loader finds and calls it in a fresh process.
"""

from __future__ import annotations

import importlib
import inspect
import os
from typing import Any

from compat_matrix.probe.children import run_child
from compat_matrix.probe.framework import Fail, Probe, Skip, need_ir
from compat_matrix.probe.provider_module import provider_status
from compat_matrix.probe.vllm_ir import NORM_OPS

PLUGIN_GROUP = "vllm.general_plugins"
REGISTER_KEYWORDS = ("supported", "supports_args", "inplace")


def check_ir_present(p: Probe) -> tuple[str, dict]:
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


def check_provider_registers(p: Probe) -> tuple[str, dict]:
    need_ir(p)
    from vllm.ir.op import IrOp

    try:
        module = importlib.import_module(p.module_name)
    except Exception as exc:
        raise Fail(
            f"{p.module_name} does not import: {type(exc).__name__}: {exc}"
        ) from None
    register = getattr(module, p.attr, None)
    if not callable(register):
        raise Fail(f"{p.module_name} has no callable {p.attr}")
    register()
    first = {name: op.impls.get(p.name) for name, op in IrOp.registry.items()}
    register()  # vLLM may call a plugin again in the same process
    second = {name: op.impls.get(p.name) for name, op in IrOp.registry.items()}
    registered = [op for op, impl in first.items() if impl is not None]
    status = provider_status(module)
    skipped = (status or {}).get("skipped", {})
    expected = list(getattr(module, "OPS", registered))
    details = {
        "registered": registered,
        "skipped": skipped,
        "absent_in_this_vllm": [op for op in expected if op not in IrOp.registry],
        "status": status,
    }
    if not registered:
        raise Fail(
            f"no IR op has a {p.name!r} impl after {p.module_name}:{p.attr}()", details
        )
    replaced = [op for op in registered if second[op] is not first[op]]
    unexplained = [
        op
        for op in expected
        if op in IrOp.registry and op not in registered and op not in skipped
    ]
    errors = (status or {}).get("errors") or []
    if replaced:
        raise Fail(
            f"a second {p.attr}() replaced the impl of {', '.join(replaced)}", details
        )
    if unexplained:
        raise Fail(
            f"not registered, no reason given: {', '.join(unexplained)}", details
        )
    if errors:
        raise Fail(f"the provider recorded errors: {errors[0]}", details)
    p.module, p.ops = module, registered
    reason = (
        f"{p.name!r} registered for {', '.join(registered)}; a second call is a no-op"
    )
    if skipped:
        reason += "; skipped " + "; ".join(
            f"{op}: {why}" for op, why in skipped.items()
        )
    return reason, details


def check_plugin_entry_point(p: Probe) -> tuple[str, dict]:
    need_ir(p)
    from importlib.metadata import entry_points

    found = list(entry_points(group=PLUGIN_GROUP))
    ours = [ep for ep in found if ep.value.split(":")[0].strip() == p.module_name]
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
    child = run_child(
        "plugin", {"module": p.module_name, "name": p.name}, drop_env=("VLLM_PLUGINS",)
    )
    details["child"] = child
    if not child.get("ok"):
        raise Fail(
            f"load_general_plugins() in a fresh process failed: {child['error']}",
            details,
        )
    result = child["result"]
    registered = [op for op, yes in result["registered"].items() if yes]
    if not registered:
        raise Fail(
            f"vLLM's load_general_plugins() did not register {p.name!r}", details
        )
    if result.get("error_after_reload"):
        raise Fail(
            f"calling the plugin again failed: {result['error_after_reload']}", details
        )
    calls = result.get("provider_calls")
    if calls is not None and calls < 2:
        raise Fail(
            f"the forced second plugin load did not call the plugin ({calls})", details
        )
    errors = (result.get("status") or {}).get("errors") or []
    if errors:
        raise Fail(f"the provider recorded errors: {errors[0]}", details)
    return (
        f"entry point {ep.name} = {ep.value} ({_ep_dist(ep)}); vLLM's "
        f"load_general_plugins() registered {p.name!r} for {', '.join(registered)}; "
        f"calling the plugin again was harmless",
        details,
    )


def _ep_dist(ep) -> str | None:
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else None

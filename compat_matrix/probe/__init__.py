"""Probe one vLLM environment: does the CPU fused-norm provider work here, and
does the upstream patch?

    python -m compat_matrix.probe [--provider MODULE[:ATTR]] [--provider-name NAME]
                                  [--e2e] [--json FILE]

Run it with the interpreter of the environment to probe. It prints one JSON
document (schema 1) on stdout; whatever vLLM logs goes to stderr. Each check
passes, fails, or is skipped with a one-line reason when this environment cannot
run it (no vLLM IR, no loadable ``_C``, an op this version lacks); a failing
check does not stop the others. Exit status 0 when no check failed, else 1.

The probe changes this process (it registers the provider and wraps the
platform's default priority), never the installed vLLM: the upstream patch is
applied to a hard-linked copy, which the patch engine edits by rename only.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import inspect
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = 1
DEFAULT_PROVIDER = "patches.cpu_fused_norms.provider:register"
DEFAULT_PROVIDER_NAME = "vllm_c_cpu"
PATCH_NAME = "cpu_fused_norms"
PLUGIN_GROUP = "vllm.general_plugins"
UPSTREAM_PROVIDER = "vllm_c"
NORM_OPS = ("rms_norm", "fused_add_rms_norm")
REGISTER_KEYWORDS = ("supported", "supports_args", "inplace")
PRIORITY_METHOD = "get_default_ir_op_priority"
DTYPE_NAMES = ("float32", "bfloat16")
SHAPES = ((1, 2048), (16, 4096), (2, 8, 2048))
WEIGHTLESS_SHAPE = (16, 4096)  # the shape that also runs with weight=None
DISPATCH_SHAPE = (16, 2048)
CHILD_TIMEOUT = 300
E2E_TIMEOUT = 600
# A small model: the point is that the engine runs the provider, not speed.
E2E_MODEL = dict(
    hidden_size=256,
    num_layers=2,
    intermediate_size=512,
    num_heads=4,
    num_kv_heads=2,
    vocab_size=1024,
)
E2E_TOKENS = 8
# CPU features that decide which vLLM CPU kernels exist and how fast they are.
KERNEL_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
    "bf16",
    "vsx",
)

PROJECT_ROOT = Path(__file__).resolve().parents[2]


# --- outcomes ---


class CheckOutcome(Exception):
    status = "fail"

    def __init__(self, reason: str, details: dict | None = None):
        super().__init__(reason)
        self.reason = reason
        self.details = details or {}


class Skip(CheckOutcome):
    status = "skip"


class Fail(CheckOutcome):
    status = "fail"


@dataclass
class Probe:
    module_name: str
    attr: str
    name: str
    e2e: bool = False
    ir_ok: bool = False
    module: Any = None
    ops: list[str] = field(default_factory=list)
    """Ops the provider registered an impl for, in this process."""
    kernels_unavailable: str | None = "not checked"
    """Why this environment cannot run the provider's kernels; None when it can."""


# --- the environment ---


def python_info() -> str:
    return platform.python_version()


def vllm_info() -> dict[str, Any]:
    info: dict[str, Any] = {"version": None, "distribution": None, "location": None}
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return info
    package = Path(next(iter(spec.submodule_search_locations)))
    info["location"] = str(package)
    name, version = _distribution_of(package)
    info["distribution"], info["version"] = name, version
    try:
        import vllm

        info["version"] = str(getattr(vllm, "__version__", None) or version)
    except Exception as exc:  # the version from the metadata is still worth having
        info["import_error"] = f"{type(exc).__name__}: {exc}"
    return info


def _distribution_of(package: Path) -> tuple[str | None, str | None]:
    """The installed distribution whose files include this ``vllm/`` package."""
    for dist_info in sorted(package.parent.glob("vllm*.dist-info")):
        record = dist_info / "RECORD"
        if record.is_file() and "vllm/__init__.py" not in record.read_text("utf-8"):
            continue
        meta = dist_info / "METADATA"
        if not meta.is_file():
            continue
        fields = dict(
            line.split(": ", 1)
            for line in meta.read_text("utf-8").splitlines()
            if line[:8] in ("Name: vl", "Version:")
        )
        return fields.get("Name"), fields.get("Version")
    return None, None


def torch_info() -> dict[str, Any]:
    try:
        import torch

        return {"version": torch.__version__}
    except Exception as exc:
        return {"version": None, "import_error": f"{type(exc).__name__}: {exc}"}


def cpu_info() -> dict[str, Any]:
    model, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name" and model is None:
                model = value
            elif key in ("flags", "Features") and not flags:  # x86, Arm
                flags = set(value.split())
    except OSError:
        pass
    return {
        "model": model or platform.processor() or platform.machine(),
        "flags": [f for f in KERNEL_FLAGS if f in flags],
    }


# --- checks ---


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
    _need_ir(p)
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
    status = _provider_status(module)
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
    _need_ir(p)
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


def check_kernels_supported(p: Probe) -> tuple[str, dict]:
    _need_provider(p)
    from vllm.ir.op import IrOp

    supported = {op: bool(IrOp.registry[op].impls[p.name].supported) for op in p.ops}
    env = kernel_environment()
    status = _provider_status(p.module) or {}
    details = {
        "supported": supported,
        "environment": env,
        "provider_reasons": status.get("unsupported_reasons", {}),
    }
    missing = _kernels_missing(env, p.ops)
    if all(supported.values()):
        if missing and p.module_name == DEFAULT_PROVIDER.split(":")[0]:
            raise Fail(f"{p.name!r} claims support, but {missing}", details)
        p.kernels_unavailable = None
        return (
            f"{p.name!r} supported for {', '.join(p.ops)} ({env['platform']})",
            details,
        )
    off = [op for op, yes in supported.items() if not yes]
    why = "; ".join(details["provider_reasons"].get(op, "") for op in off).strip("; ")
    p.kernels_unavailable = missing or why or "unsupported"
    if missing:  # this environment cannot run the kernels: not the provider's fault
        raise Skip(f"{p.name!r} unsupported for {', '.join(off)}: {missing}", details)
    raise Fail(
        f"{p.name!r} reports unsupported for {', '.join(off)} although the platform "
        f"is CPU and the _C kernels are present{': ' + why if why else ''}",
        details,
    )


def kernel_environment() -> dict[str, Any]:
    """The platform and the C kernels, described independently of any provider."""
    import torch
    from vllm.platforms import current_platform

    env: dict[str, Any] = {
        "platform": type(current_platform).__name__,
        "is_cpu": bool(current_platform.is_cpu()),
    }
    try:
        current_platform.import_kernels()  # logs and swallows its own ImportError
    except Exception as exc:
        env["import_kernels_error"] = f"{type(exc).__name__}: {exc}"
    env["c_ops"] = {op: _has_c_op(torch, op) for op in NORM_OPS}
    if not all(env["c_ops"].values()):
        try:
            import vllm._C  # noqa: F401

            env["c_import_error"] = None
        except ImportError as exc:
            env["c_import_error"] = str(exc)
    return env


def _has_c_op(torch, op: str) -> bool:
    try:
        return hasattr(torch.ops._C, op)
    except Exception:
        return False


def _kernels_missing(env: dict, ops: list[str]) -> str | None:
    if not env["is_cpu"]:
        return f"platform is {env['platform']}, not CPU"
    absent = [op for op in ops if op in env["c_ops"] and not env["c_ops"][op]]
    if not absent:
        return None
    if env.get("c_import_error"):
        return f"vllm._C does not load: {env['c_import_error']}"
    return f"vllm._C has no {', '.join(absent)}"


def check_numerics(p: Probe) -> tuple[str, dict]:
    _need_kernels(p)
    from vllm.ir.op import IrOp

    cases, routing = [], {}
    for op_name in p.ops:
        op = IrOp.registry[op_name]
        cases += compare_impl(op, p.name)
        routing[op_name] = noncontiguous_dispatch(op, p.name)
    details = {"cases": cases, "non_contiguous": routing}
    bad = [c for c in cases if not c["ok"]]
    if bad:
        first = bad[0]
        raise Fail(
            f"{len(bad)}/{len(cases)} cases off; first: {first['op']} {first['dtype']} "
            f"{first['shape']}: {first.get('error') or first['max_abs_diff']}",
            details,
        )
    misrouted = [op for op, r in routing.items() if not r["ok"]]
    if misrouted:
        raise Fail(
            f"non-contiguous input not routed to native: {', '.join(misrouted)}",
            details,
        )
    inplace = [c["op"] for c in cases if c.get("inplace")]
    return (
        f"{len(cases)} cases within op.get_tolerance ({', '.join(DTYPE_NAMES)}; "
        f"shapes {', '.join(str(list(s)) for s in SHAPES)}; weight None)"
        + ("; in place: both tensors updated" if inplace else "")
        + "; non-contiguous input goes to native",
        details,
    )


def check_dispatch(p: Probe) -> tuple[str, dict]:
    _need_kernels(p)
    from vllm.ir.op import IrOp

    results = {op: dispatch_evidence(IrOp.registry[op], p.name) for op in p.ops}
    bad = [op for op, r in results.items() if not r["ok"]]
    if bad:
        raise Fail(
            f"{p.name!r} did not run under set_priority for {', '.join(bad)}", results
        )
    kernels = sorted({k for r in results.values() for k in r["kernels"]})
    return (
        f"under set_priority([{p.name!r}, 'native']) every call ran {p.name!r} "
        f"(kernels: {', '.join(kernels) or 'none recorded'}); "
        "under ['native'] none did",
        results,
    )


def check_kernel_config(p: Probe) -> tuple[str, dict]:
    _need_provider(p)
    try:
        from vllm.config.kernel import IrOpPriorityConfig
    except Exception as exc:
        raise Skip(
            f"vLLM's config does not import here: {type(exc).__name__}: {exc}"
        ) from None
    fields = [f.name for f in dataclasses.fields(IrOpPriorityConfig)]
    ops = [op for op in p.ops if op in fields]
    if not ops:
        raise Skip(f"IrOpPriorityConfig has no field for {', '.join(p.ops)}")
    supported = {op: op not in _unsupported_ops(p) for op in ops}
    redundant = upstream_enabled_ops(ops)
    opt_in_env = getattr(p.module, "OPT_IN_ENV", None)
    details: dict[str, Any] = {
        "ops": ops,
        "redundant": bool(redundant),
        "redundant_ops": redundant,
    }
    problems: list[str] = []

    def expect(label: str, got: dict, want_first: dict[str, str]) -> None:
        details[label] = {"final": got, "expected_first": want_first}
        for op, first in want_first.items():
            if not got.get(op) or got[op][0] != first:
                problems.append(
                    f"{label}: {op} starts {got.get(op)}, expected {first!r} first"
                )

    with _env(opt_in_env, None):
        user = {op: [p.name] for op in ops}
        expect(
            "user_priority",
            final_priority(user, compiled=False),
            {op: p.name for op in ops},
        )
        plain = final_priority(None, compiled=False)
        details["no_opt_in_eager"] = {"final": plain}
    if opt_in_env:
        with _env(opt_in_env, "1"):
            eager_want = {
                op: (p.name if supported[op] and op not in redundant else plain[op][0])
                for op in ops
            }
            expect("opt_in_eager", final_priority(None, compiled=False), eager_want)
            expect(
                "opt_in_inductor",
                final_priority(None, compiled=True),
                {op: "native" for op in ops},
            )
            users_native = {op: ["native"] for op in ops}
            expect(
                "opt_in_user_native",
                final_priority(users_native, compiled=False),
                {op: "native" for op in ops},
            )
        if not redundant:
            for op in ops:
                if plain[op][0] == p.name:
                    problems.append(
                        f"without {opt_in_env} the default already ranks {p.name!r}"
                    )
    else:
        details["opt_in"] = (
            "the provider module has no OPT_IN_ENV: default ranking not probed"
        )
    if problems:
        raise Fail(problems[0], details)
    if redundant:
        return (
            f"redundant: this vLLM enables {UPSTREAM_PROVIDER!r} on CPU for "
            f"{', '.join(redundant)}, so the provider stands down from the default "
            "ranking and can be removed; ir_op_priority naming it still puts it first",
            details,
        )
    ranked = [op for op in ops if supported[op]]
    how = (
        f"with {opt_in_env}=1 {p.name!r} is first for eager ({', '.join(ranked)}) and "
        "native for Inductor; a user's ['native'] wins"
        if opt_in_env and ranked
        else f"default ranking stays {plain[ops[0]][0]!r} ({p.name!r} unsupported here)"
        if opt_in_env
        else "default ranking not probed"
    )
    return f"ir_op_priority naming {p.name!r} ends with it first; {how}", details


def _unsupported_ops(p: Probe) -> list[str]:
    from vllm.ir.op import IrOp

    return [op for op in p.ops if not IrOp.registry[op].impls[p.name].supported]


def final_priority(
    user: dict[str, list[str]] | None, *, compiled: bool
) -> dict[str, list]:
    """The IR op priority vLLM's own config path ends with (``VllmConfig`` runs
    ``KernelConfig.set_platform_defaults``), as the engine builds it."""
    config = vllm_config(user, compiled=compiled)
    got = dataclasses.asdict(config.kernel_config.ir_op_priority)
    got["_compiling_with_inductor"] = compiling_with_inductor(config)
    if got["_compiling_with_inductor"] != compiled:
        raise Fail(
            f"could not build a {'compiled' if compiled else 'eager'} config: {got}"
        )
    return got


def vllm_config(user: dict[str, list[str]] | None, *, compiled: bool):
    from vllm.config import CompilationConfig, KernelConfig, VllmConfig
    from vllm.config.compilation import CompilationMode
    from vllm.config.kernel import IrOpPriorityConfig

    if compiled:
        compilation = CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE, backend="inductor"
        )
    else:
        compilation = CompilationConfig(mode=CompilationMode.NONE)
    kernel = KernelConfig(ir_op_priority=IrOpPriorityConfig(**(user or {})))
    return VllmConfig(kernel_config=kernel, compilation_config=compilation)


def compiling_with_inductor(config) -> bool:
    cc = config.compilation_config
    mode = getattr(cc, "mode", None)
    return cc.backend == "inductor" and getattr(mode, "value", mode) not in (0, None)


def upstream_enabled_ops(ops) -> list[str]:
    """Ops whose own ``"vllm_c"`` impl this vLLM supports on this platform."""
    from vllm.ir.op import IrOp
    from vllm.platforms import current_platform

    importer = getattr(current_platform, "import_ir_kernels", None)
    if importer is not None:
        importer()
    else:
        import vllm.kernels  # noqa: F401
    out = []
    for op in ops:
        impl = (
            IrOp.registry[op].impls.get(UPSTREAM_PROVIDER)
            if op in IrOp.registry
            else None
        )
        if impl is not None and impl.supported:
            out.append(op)
    return out


def check_upstream_patch(p: Probe) -> tuple[str, dict]:
    _need_ir(p)
    try:
        from patcher import engine
        from patcher.patchset import select
        from patcher.tree import open_tree
    except Exception as exc:
        raise Skip(
            f"the patch engine does not import here: {type(exc).__name__}: {exc}"
        ) from None
    original = open_tree(None)
    patch = select([PATCH_NAME])[0]
    files = sorted({e.file for e in patch.edits})
    details: dict[str, Any] = {"original": str(original.location), "files": files}
    if engine.plan(original, patch, "apply").status == "applied":
        raise Skip(
            "this vLLM already has the change (upstream, or patched in place): "
            "nothing to apply",
            details,
        )
    originals_before = {f: _sha256(original.path(f)) for f in files}
    with tempfile.TemporaryDirectory(prefix="vllm-patch-probe-") as tmp:
        with patched_copy(original, Path(tmp), engine, patch, details) as copy:
            child = run_child(
                "upstream",
                {"provider": f"{p.module_name}:{p.attr}", "name": p.name},
                pythonpath=[copy],
            )
            details["child"] = child
    details["originals_untouched"] = originals_before == {
        f: _sha256(original.path(f)) for f in files
    }
    problems, unchecked = [], []
    if not details["originals_untouched"]:
        problems.append("the installed vLLM's files changed")
    if not details.get("restored"):
        problems.append(
            f"revert did not restore the copy byte-identically: {details.get('hashes')}"
        )
    if not child.get("ok"):
        problems.append(f"the patched copy's child failed: {child['error']}")
    else:
        found, unchecked = upstream_child_problems(
            child["result"], p, str(details["copy"])
        )
        problems += found + strided_problems(child["result"].get("strided_inputs", {}))
    details["problems"], details["unchecked"] = problems, unchecked
    if problems:
        raise Fail(problems[0], details)
    if unchecked:
        raise Skip(
            "the patch applies to a copy and reverts byte-identically; "
            + "; ".join(unchecked),
            details,
        )
    r = child["result"]
    return (
        f"applied to a hard-linked copy ({', '.join(files)}): {UPSTREAM_PROVIDER!r} "
        f"supported on CPU for {', '.join(r['ops'])}, numerics within tolerance, "
        f"{r['platform_class']}.{PRIORITY_METHOD} gives {UPSTREAM_PROVIDER!r} first "
        "eager and native for Inductor, the provider stands down; "
        "revert byte-identical",
        details,
    )


@contextmanager
def patched_copy(original, tmp: Path, engine, patch, details: dict) -> Iterator[Path]:
    """A hard-linked copy of ``original`` with ``patch`` applied; reverted (and
    checked byte-identical against the copy before the patch) on exit."""
    from patcher.tree import linked_copy

    tree = linked_copy(original, tmp / "tree")
    copy = tree.location
    details["copy"] = str(copy)
    files = sorted({e.file for e in patch.edits})
    before = {f: _sha256(tree.path(f)) for f in files}
    try:
        outcome = engine.apply(tree, patch)
    except Exception as exc:  # PatchError: names the file, what it looked for and found
        raise Fail(f"the patch engine refused to apply: {exc}", details) from None
    applied = {f: _sha256(tree.path(f)) for f in files}
    details["apply"] = str(outcome)
    if applied == before:
        raise Fail(f"apply changed nothing on a pristine copy: {outcome}", details)
    try:
        yield copy
    finally:
        details["revert"] = str(engine.revert(tree, patch))
        after = {f: _sha256(tree.path(f)) for f in files}
        details["hashes"] = {"before": before, "applied": applied, "reverted": after}
        details["restored"] = after == before


def strided_problems(strided: dict) -> list[str]:
    """Wrong answers for non-contiguous inputs under the patched ``vllm_c``: the
    CPU kernels assume contiguous rows, so the patch must send such inputs to
    native (its supports_args guard)."""
    out = []
    for op, result in strided.items():
        for layout in ("transposed", "row_strided"):
            case = result.get(layout) or {}
            if case and not case["right"]:
                worst = max(case["max_abs_diff"])
                out.append(
                    f"{UPSTREAM_PROVIDER!r} {op} is wrong for {layout} inputs "
                    f"(dispatched to {case['dispatched_to']!r}, max abs diff {worst:g})"
                )
    return out


def upstream_child_problems(
    r: dict, p: Probe, copy: str
) -> tuple[list[str], list[str]]:
    """What is wrong with the patched copy, and what could not be checked here."""
    problems, unchecked = [], []
    if not r["vllm_file"].startswith(copy):
        problems.append(f"the child imported vLLM from {r['vllm_file']}, not the copy")
    if not r["ops"]:
        problems.append(f"no {UPSTREAM_PROVIDER!r} norm impl in the patched copy")
    for op in r["ops"]:
        if not r["supported"][op]:
            problems.append(
                f"{UPSTREAM_PROVIDER!r} not supported on CPU for {op} after the patch"
            )
    if p.kernels_unavailable:
        unchecked.append(f"kernels not run: {p.kernels_unavailable}")
    else:
        bad = [c for c in r.get("numerics", []) if not c["ok"]]
        if bad or not r.get("numerics"):
            problems.append(
                f"{UPSTREAM_PROVIDER!r} numerics off: {bad[:1] or 'none run'}"
            )
    if r.get("config_error"):
        unchecked.append(
            f"priority not checked, vLLM's config does not build: {r['config_error']}"
        )
        return problems, unchecked
    for op in r["ops"]:
        eager, inductor = r["platform_eager"].get(op), r["platform_inductor"].get(op)
        if not eager or eager[0] != UPSTREAM_PROVIDER:
            problems.append(f"{PRIORITY_METHOD} eager gives {eager} for {op}")
        if not inductor or inductor[0] != "native":
            problems.append(f"{PRIORITY_METHOD} Inductor gives {inductor} for {op}")
    stand = r.get("provider_with_opt_in")
    if stand is not None:
        for op in r["ops"]:
            final = stand["final"].get(op) or [None]
            if final[0] != UPSTREAM_PROVIDER or p.name in final:
                problems.append(f"with opt-in on the patched copy {op} got {final}")
        if not stand["status"].get("redundant"):
            problems.append(
                "the provider did not report itself redundant on the patched copy"
            )
    return problems, unchecked


def check_e2e(p: Probe) -> tuple[str, dict]:
    if not p.e2e:
        raise Skip("not requested (--e2e)")
    _need_kernels(p)
    try:
        from patcher import engine
        from patcher.cache import cache_dir
        from patcher.e2e import make_random_llama, run_generate
        from patcher.patchset import select
        from patcher.tree import open_tree
    except Exception as exc:
        raise Skip(
            f"patcher.e2e does not import here: {type(exc).__name__}: {exc}"
        ) from None
    try:
        model = make_random_llama(cache_dir() / "models", **E2E_MODEL)
    except ImportError as exc:
        raise Skip(f"cannot build the random Llama: {exc}") from None
    details: dict[str, Any] = {"model": str(model), "model_config": E2E_MODEL}
    run = dict(compiled=False, prompt_len=8, max_tokens=E2E_TOKENS, timeout=E2E_TIMEOUT)
    priority = {op: [p.name, "native"] for op in p.ops}
    details["provider_run"] = provider_run = run_generate(
        model, ir_op_priority=priority, **run
    )
    patch = select([PATCH_NAME])[0]
    with tempfile.TemporaryDirectory(prefix="vllm-patch-e2e-copy-") as tmp:
        with patched_copy(open_tree(None), Path(tmp), engine, patch, details) as copy:
            env = {"PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
            details["upstream_run"] = upstream_run = run_generate(
                model, ir_op_priority=None, env=env, **run
            )
    problems = []
    for label, result, want in (
        ("provider", provider_run, p.name),
        ("patched vllm_c", upstream_run, UPSTREAM_PROVIDER),
    ):
        result["final_priority_parsed"] = parsed = parse_priority(
            result["final_priority"]
        )
        if result["ok"]:
            result.pop("log_tail", None)  # kept only to explain a failure
        else:
            problems.append(f"{label} run failed: {result['error']}")
            continue
        wrong = [op for op in p.ops if (parsed.get(op) or [None])[0] != want]
        if wrong:
            problems.append(f"{label} run: final priority {result['final_priority']}")
        outputs = result["output_token_ids"]
        if not outputs or any(len(o) != E2E_TOKENS for o in outputs):
            problems.append(f"{label} run produced {outputs}")
    if not details.get("restored"):
        problems.append("revert did not restore the e2e copy")
    if problems:
        raise Fail(problems[0], details)
    same = provider_run["output_token_ids"] == upstream_run["output_token_ids"]
    details["same_tokens"] = same
    return (
        f"eager LLM.generate ran with {p.name!r} first "
        f"({provider_run['seconds']} s) and with the patched {UPSTREAM_PROVIDER!r} "
        f"first ({upstream_run['seconds']} s); "
        f"{E2E_TOKENS} tokens each, {'identical' if same else 'different'} token ids",
        details,
    )


def parse_priority(logged: str | None) -> dict[str, list[str]]:
    """``IrOpPriorityConfig(rms_norm=['a', 'b'], ...)`` -> {op: [providers]}."""
    if not logged:
        return {}
    return {
        op: re.findall(r"'([^']*)'", providers)
        for op, providers in re.findall(r"(\w+)=\[([^\]]*)\]", logged)
    }


CHECKS: list[tuple[str, Callable[[Probe], tuple[str, dict]]]] = [
    ("ir_present", check_ir_present),
    ("provider_registers", check_provider_registers),
    ("plugin_entry_point", check_plugin_entry_point),
    ("kernels_supported", check_kernels_supported),
    ("numerics", check_numerics),
    ("dispatch", check_dispatch),
    ("kernel_config", check_kernel_config),
    ("upstream_patch", check_upstream_patch),
    ("e2e", check_e2e),
]


# Cheap, in-process, and what the other checks build on: they run even when
# --only leaves them out.
PREREQUISITES = ("ir_present", "provider_registers", "kernels_supported")


def _need_ir(p: Probe) -> None:
    if not p.ir_ok:
        raise Skip("vllm.ir unavailable (see ir_present)")


def _need_provider(p: Probe) -> None:
    _need_ir(p)
    if not p.ops:
        raise Skip("the provider did not register (see provider_registers)")


def _need_kernels(p: Probe) -> None:
    _need_provider(p)
    if p.kernels_unavailable:
        raise Skip(f"kernels not usable here: {p.kernels_unavailable}")


def _provider_status(module) -> dict | None:
    status = getattr(module, "status", None)
    try:
        return status() if callable(status) else None
    except Exception as exc:
        return {"errors": [f"status() raised {type(exc).__name__}: {exc}"]}


@contextmanager
def _env(name: str | None, value: str | None) -> Iterator[None]:
    if not name:
        yield
        return
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# --- numerics and dispatch, shared with the patched-copy child ---


def _activation_indices(op) -> list[int]:
    found = getattr(op, "activation_indices", None)
    if found is not None:
        return list(found)
    params = inspect.signature(op.impls["native"].impl_fn).parameters
    return [i for i, name in enumerate(params) if name.startswith("x")]


def _weight_index(op) -> int | None:
    params = list(inspect.signature(op.impls["native"].impl_fn).parameters)
    return params.index("weight") if "weight" in params else None


def op_inputs(op, shape, dtype, *, weighted: bool = True) -> list:
    """The op's own generated inputs for ``shape`` (leading dims flattened into
    tokens, then restored on the activations)."""
    import torch

    torch.manual_seed(0)
    tokens = 1
    for d in shape[:-1]:
        tokens *= d
    args = list(
        op.generate_inputs(num_tokens=tokens, hidden_size=shape[-1], dtype=dtype)
    )
    for i in _activation_indices(op):
        args[i] = args[i].reshape(shape)
    w = _weight_index(op)
    if not weighted and w is not None:
        args[w] = None
    return args


def _clone(args: list) -> list:
    import torch

    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def compare_impl(op, provider: str) -> list[dict]:
    """Provider vs native within ``op.get_tolerance(dtype)``; for in-place impls
    also that the returned tensors are the caller's, updated."""
    import torch

    cases = []
    for dtype_name in DTYPE_NAMES:
        dtype = getattr(torch, dtype_name)
        for shape in SHAPES:
            variants = (True, False) if shape == WEIGHTLESS_SHAPE else (True,)
            for weighted in variants:
                case = {
                    "op": op.name,
                    "dtype": dtype_name,
                    "shape": list(shape),
                    "weight": weighted,
                }
                try:
                    case.update(_compare_case(op, provider, shape, dtype, weighted))
                except Exception as exc:
                    case.update(ok=False, error=f"{type(exc).__name__}: {exc}")
                cases.append(case)
    return cases


def _compare_case(op, provider: str, shape, dtype, weighted: bool) -> dict:
    import torch

    impl, native = op.impls[provider], op.impls["native"]
    args = op_inputs(op, shape, dtype, weighted=weighted)
    expected = _as_tuple(native.impl_fn(*_clone(args)))
    given = _clone(args)
    actual = _as_tuple(impl.impl_fn(*given))
    tol = op.get_tolerance(dtype)
    out: dict[str, Any] = {"atol": tol["atol"], "rtol": tol["rtol"], "max_abs_diff": []}
    ok = len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=False):  # lengths checked above
        ok = ok and a.shape == e.shape and a.dtype == e.dtype
        out["max_abs_diff"].append(float((a.float() - e.float()).abs().max()))
        try:
            torch.testing.assert_close(a, e, atol=tol["atol"], rtol=tol["rtol"])
        except AssertionError as exc:
            ok = False
            out.setdefault("error", str(exc).splitlines()[0])
    if getattr(impl, "inplace", False):
        # The outputs are the activations, updated in place (x, then x_residual).
        same = [
            actual[k].data_ptr() == given[i].data_ptr()
            and given[i].shape == tuple(shape)
            for k, i in enumerate(_activation_indices(op))
        ]
        out["inplace"] = {"outputs_are_inputs": all(same)}
        ok = ok and all(same)
    out["ok"] = bool(ok)
    return out


def _as_tuple(result) -> tuple:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _strided_layouts(tensor) -> dict:
    """The same values in layouts vLLM can hand a norm: transposed strides, and a
    view into a wider row (as q/k/v splits of a fused projection give)."""
    import torch

    wide = torch.cat([torch.zeros_like(tensor), tensor], dim=-1)
    return {
        "transposed": tensor.t().contiguous().t(),
        "row_strided": wide[..., tensor.shape[-1] :],
    }


def noncontiguous_dispatch(op, provider: str) -> dict:
    """Under ``[provider, "native"]``: where non-contiguous activations go, and
    whether the op's answer for them is still right (the CPU kernels assume
    contiguous rows and return wrong values otherwise)."""
    import torch

    args = op_inputs(op, DISPATCH_SHAPE, torch.bfloat16)
    expected = _as_tuple(op.impls["native"].impl_fn(*_clone(args)))
    tol = op.get_tolerance(torch.bfloat16)
    out: dict[str, Any] = {}
    with op.set_priority([provider, "native"]):
        out["contiguous"] = op.dispatch(*args).provider
        layouts: dict[str, list] = {}
        for i in _activation_indices(op):
            for name, view in _strided_layouts(args[i]).items():
                layouts.setdefault(name, list(args))[i] = view
        for name, strided in layouts.items():
            impl = op.dispatch(*strided)
            got = _as_tuple(impl.func_impl_fn(*strided))
            diffs = [
                float((g.float() - e.float()).abs().max())
                for g, e in zip(got, expected, strict=False)
            ]
            right = all(
                torch.allclose(g.float(), e.float(), atol=tol["atol"], rtol=tol["rtol"])
                for g, e in zip(got, expected, strict=False)
            )
            out[name] = {
                "dispatched_to": impl.provider,
                "max_abs_diff": diffs,
                "right": right,
            }
    out["ok"] = out["contiguous"] == provider and all(
        out[name]["dispatched_to"] == "native" and out[name]["right"]
        for name in layouts
    )
    return out


def dispatch_evidence(op, provider: str) -> dict:
    """Which impl ran: the provider's function is wrapped to count its calls while
    the op is called through vLLM's own entry points (the torch op, and the
    in-place overload where there is one), the values that come back must be the
    provider's own (numerics, not this, judges them against native), and the
    profiler names the kernels."""
    import torch

    impl = op.impls[provider]
    original = impl.impl_fn
    calls: list[str] = []

    def counted(*args, **kwargs):
        calls.append(provider)
        return original(*args, **kwargs)

    args = op_inputs(op, DISPATCH_SHAPE, torch.bfloat16)
    own = _as_tuple(original(*_clone(args)))
    entry_points = {"op": op}
    if getattr(op, "maybe_inplace", None) is not None and getattr(
        impl, "inplace", False
    ):
        entry_points["op.maybe_inplace"] = op.maybe_inplace
    result: dict[str, Any] = {"calls": {}, "kernels": [], "returns_provider_values": {}}
    impl.impl_fn = counted
    try:
        with op.set_priority([provider, "native"]):
            result["dispatched_to"] = op.dispatch(*args).provider
            for label, entry in entry_points.items():
                before = len(calls)
                with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU]
                ) as prof:
                    got = _as_tuple(entry(*_clone(args)))
                result["calls"][label] = len(calls) - before
                result["kernels"] += sorted(
                    {e.name for e in prof.events() if e.name.startswith("_C::")}
                )
                result["returns_provider_values"][label] = len(got) == len(own) and all(
                    torch.equal(g, o) for g, o in zip(got, own, strict=False)
                )
        before = len(calls)
        with op.set_priority(["native"]):
            op(*_clone(args))
        result["calls_under_native"] = len(calls) - before
    finally:
        impl.impl_fn = original
    result["kernels"] = sorted(set(result["kernels"]))
    result["ok"] = (
        result["dispatched_to"] == provider
        and all(n == 1 for n in result["calls"].values())
        and all(result["returns_provider_values"].values())
        and result["calls_under_native"] == 0
    )
    return result


# --- child processes: a fresh interpreter, as vLLM's own processes are ---


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
    out["status"] = _provider_status(module) if module is not None else None
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
    if all(_has_c_op(torch, o) for o in ops):
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
        with _env(opt_in_env, "1"):
            config = vllm_config(None, compiled=False)
        out["provider_with_opt_in"] = {
            "final": dataclasses.asdict(config.kernel_config.ir_op_priority),
            "status": _provider_status(module) or {},
        }
    return out


CHILDREN = {"plugin": _child_plugin, "upstream": _child_upstream}


def _child_main(task: str, args: dict, result_file: Path) -> int:
    try:
        result = CHILDREN[task](args)
    except Exception as exc:
        traceback.print_exc()
        result_file.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 1
    result_file.write_text(json.dumps({"result": result}, default=str))
    return 0


# --- the whole probe ---


def run_probe(
    provider: str = DEFAULT_PROVIDER,
    name: str | None = None,
    *,
    e2e: bool = False,
    only: list[str] | None = None,
) -> dict:
    module_name, _, attr = provider.partition(":")
    p = Probe(module_name, attr or "register", name or DEFAULT_PROVIDER_NAME, e2e=e2e)
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "python": python_info(),
        "vllm": vllm_info(),
        "torch": torch_info(),
        "cpu": cpu_info(),
        "provider": {"module": module_name, "name": p.name},
        "checks": [],
    }
    for check_name, check in CHECKS:
        started = time.perf_counter()
        try:
            if only and check_name not in only and check_name not in PREREQUISITES:
                raise Skip(f"not selected (--only {','.join(only)})")
            reason, details = check(p)
            status = "pass"
        except CheckOutcome as outcome:
            status, reason, details = outcome.status, outcome.reason, outcome.details
        except Exception as exc:  # one broken check must not stop the others
            status, reason = "fail", f"crashed: {type(exc).__name__}: {exc}"
            details = {"traceback": traceback.format_exc().splitlines()[-12:]}
        doc["checks"].append(
            {
                "name": check_name,
                "status": status,
                "reason": " ".join(str(reason).split()),
                "seconds": round(time.perf_counter() - started, 2),
                "details": details,
            }
        )
    doc["ok"] = all(c["status"] != "fail" for c in doc["checks"])
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m compat_matrix.probe", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--provider",
        default=DEFAULT_PROVIDER,
        metavar="MODULE[:ATTR]",
        help="the provider module and its register function (default: %(default)s)",
    )
    parser.add_argument(
        "--provider-name",
        default=None,
        metavar="NAME",
        help=f"the IR provider name it registers (default: {DEFAULT_PROVIDER_NAME})",
    )
    parser.add_argument(
        "--e2e", action="store_true", help="also run vLLM end to end (about a minute)"
    )
    parser.add_argument(
        "--json", type=Path, metavar="FILE", help="also write the document to FILE"
    )
    parser.add_argument(
        "--only",
        metavar="CHECK[,CHECK]",
        type=lambda v: [c.strip() for c in v.split(",") if c.strip()],
        help="run only these checks (and the cheap ones they need); the rest skip",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-args", help=argparse.SUPPRESS)
    parser.add_argument("--child-result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    known = [name for name, _ in CHECKS]
    unknown = [c for c in args.only or [] if c not in known]
    if unknown:
        parser.error(f"unknown check {', '.join(unknown)}; checks: {', '.join(known)}")
    if args.child:
        return _child_main(args.child, json.loads(args.child_args), args.child_result)

    # stdout carries the JSON document only: point fd 1 (vLLM's log stream, C
    # code's printf) at stderr while the checks run.
    sys.stdout.flush()
    saved_stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        doc = run_probe(args.provider, args.provider_name, e2e=args.e2e, only=args.only)
    finally:
        sys.stdout.flush()
        os.dup2(saved_stdout, 1)
        os.close(saved_stdout)
    text = json.dumps(doc, indent=2, default=str)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

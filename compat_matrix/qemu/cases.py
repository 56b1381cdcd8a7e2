"""``python3 cases.py SIDE CASE...`` in the arm64 chroot: vLLM's eager ``RMSNorm``
called per CASE (``float32/rms_norm``, ...) under the profiler, a JSON line flushed
before and after each: when a kernel kills the process (SIGILL), the last one
names the case."""

from __future__ import annotations

import json
import sys
import time

import calls

START = time.monotonic()


def say(**line) -> None:
    print(json.dumps(line), flush=True)


def max_rel_error(a, exact) -> float:
    return float(((a.double() - exact).abs() / exact.abs().clamp(min=1e-30)).max())


def run_case(torch, norm, dtype: str, op: str) -> dict:
    """One call of ``norm``: its kernel calls, how far from native, and its and
    native's largest relative error against RMSNorm in float64."""
    torch.manual_seed(0)
    x = torch.randn(calls.NORM_TOKENS, calls.NORM_HIDDEN, dtype=getattr(torch, dtype))
    args = (x, torch.randn_like(x)) if op == "fused_add_rms_norm" else (x,)
    counted, got, native = calls.profiled(norm, *args)
    summed = sum(a.double() for a in args)
    scale = summed.pow(2).mean(-1, keepdim=True).add(norm.variance_epsilon).rsqrt()
    # (output, residual sum) in float64: map() pairs as many as the norm returns
    exact = (summed * scale * norm.weight.data.double(), summed)
    return {
        "calls": counted,
        "rtol_vs_native": max(map(calls.rtol_needed, got, native)),
        "max_rel_error": max(map(max_rel_error, got, exact)),
        "native_max_rel_error": max(map(max_rel_error, native, exact)),
    }


def main(side: str, cases: list[str]) -> None:
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
    config = calls.final_config("eager")
    setup = {"torch": torch.__version__, "vllm": vllm.__version__}
    setup["vllm_file"] = vllm.__file__
    setup["custom_ops"] = list(config.compilation_config.custom_ops)
    setup["provider_status"] = status
    setup["seconds"] = round(time.monotonic() - START, 1)
    say(setup=setup)
    with set_current_vllm_config(config):
        for case in cases:
            dtype, op = case.split("/")
            norm = calls.new_norm(getattr(torch, dtype))  # seeded: the same each time
            say(case=case, started=True)
            began = time.monotonic()
            try:
                result = run_case(torch, norm, dtype, op)
            except Exception as exc:  # an exception native does not raise: a failure
                result = {"error": f"{type(exc).__name__}: {exc}"}
            result["norm_class"] = type(norm).__qualname__
            result["seconds"] = round(time.monotonic() - began, 2)
            say(case=case, **result)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

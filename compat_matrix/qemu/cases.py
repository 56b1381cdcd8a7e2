"""The aarch64 cell's cases, run inside the arm64 chroot under qemu-user (this
file is copied there beside ``calls.py``; torch and vLLM are the chroot's).

``python3 cases.py SIDE CASE...`` (SIDE ``patched``: the patched copy of vLLM
first on ``PYTHONPATH``; ``provider``: vLLM as installed, the project's plugin
loaded by vLLM's own loader) calls vLLM's ``RMSNorm``, built under an eager
config as a model builds it, once per CASE (``float32/rms_norm``,
``bfloat16/fused_add_rms_norm``, ...) under torch's profiler, and compares it
with ``forward_native`` and a float64 reference. It prints one JSON line
before each case and one after, flushed: when a kernel takes the process down
(SIGILL on a CPU without an instruction the build uses) the last line names
the case that died."""

from __future__ import annotations

import json
import sys
import time

from calls import HIDDEN, KERNELS, TOKENS, final_config

START = time.monotonic()


def say(**line) -> None:
    print(json.dumps(line), flush=True)


def rtol_needed(a, b) -> float:
    """The smallest rtol (at atol 1e-3) at which ``a`` matches ``b``."""
    a, b = a.double(), b.double()
    excess = ((a - b).abs() - 1e-3).clamp(min=0)
    return float(excess.div(b.abs().clamp(min=1e-6)).max())


def max_rel_error(a, exact) -> float:
    """The largest elementwise relative error of ``a`` against ``exact``."""
    return float(((a.double() - exact).abs() / exact.abs().clamp(min=1e-30)).max())


def reference(x, residual, weight, eps):
    """RMSNorm in float64: (output,) or (output, residual sum)."""
    summed = x.double() + residual.double() if residual is not None else x.double()
    scale = summed.pow(2).mean(-1, keepdim=True).add(eps).rsqrt()
    out = summed * scale * weight.double()
    return (out,) if residual is None else (out, summed)


def run_case(torch, norm, dtype: str, op: str) -> dict:
    """One call of ``norm`` (with a residual for the fused add): the kernel
    calls it made, how far it is from native, and its and native's largest
    relative error against float64."""
    torch.manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, dtype=getattr(torch, dtype))
    residual = torch.randn_like(x) if op == "fused_add_rms_norm" else None
    args = (x,) if residual is None else (x, residual)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        got = norm(*(a.clone() for a in args))
    native = norm.forward_native(*(a.clone() for a in args))
    if residual is None:
        got, native = (got,), (native,)
    exact = reference(x, residual, norm.weight.data, norm.variance_epsilon)
    names = [e.name for e in p.events()]
    return {
        "calls": {k: names.count(k) for k in KERNELS},
        "rtol_vs_native": max(map(rtol_needed, got, native)),
        "max_rel_error": max(map(max_rel_error, got, exact)),
        "native_max_rel_error": max(map(max_rel_error, native, exact)),
    }


def main(side: str, cases: list[str]) -> None:
    import torch
    import vllm
    import vllm._custom_ops  # noqa: F401  (loads vllm._C as a model's layers do)
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    status = None
    if side == "provider":
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        from patches.cpu_fused_norms.provider import status as provider_status

        status = provider_status()
    config = final_config("eager")
    say(
        setup={
            "torch": torch.__version__,
            "vllm": vllm.__version__,
            "vllm_file": vllm.__file__,
            "custom_ops": list(config.compilation_config.custom_ops),
            "provider_status": status,
            "seconds": round(time.monotonic() - START, 1),
        }
    )
    norms = {}
    with set_current_vllm_config(config):
        for case in cases:
            dtype, op = case.split("/")
            if dtype not in norms:
                norms[dtype] = RMSNorm(HIDDEN, dtype=getattr(torch, dtype))
                with torch.no_grad():
                    norms[dtype].weight.normal_(1.0, 0.1)
            norm = norms[dtype]
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

"""A minimal CPU fused-norm IR provider, for the bench only: the yardstick of
the real provider's own per-call cost.

It does what vLLM's own ``"vllm_c"`` impls do on CPU once the upstream change
enables them (``vllm/kernels/vllm_c.py`` with the patch): ``supports_args``
checks ``variance_size``, the weight's dtype and contiguity, the impl allocates
with ``empty_like`` and calls the kernel. Nothing more: no dtype or hidden-size
check, no ``weight=None`` handling, no view for inputs that are not 2-D, so it
is unsafe outside the decode and prefill shapes the bench gives it. The bench
registers it beside the real provider and the patched ``"vllm_c"`` and times
all three through vLLM's IR dispatch in one process; it is never a plugin.
"""

from __future__ import annotations

import inspect

import torch

from patches.cpu_fused_norms import provider

PROVIDER = "vllm_c_cpu_minimal"


def rms_norm(x, weight, epsilon, variance_size=None):
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, weight, epsilon)
    return out


def fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None):
    torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)
    return x, x_residual


# vLLM IR takes an impl only with its op's native schema (names, types and
# defaults), which the provider's impls spell out: these carry theirs.
for _impl in (rms_norm, fused_add_rms_norm):
    _impl.__signature__ = inspect.signature(getattr(provider, _impl.__name__))

rms_norm_supports_args = lambda x, weight, epsilon, variance_size=None: (  # noqa: E731
    variance_size is None
    and (weight is None or weight.dtype == x.dtype)
    and x.is_contiguous()
)

fused_add_rms_norm_supports_args = (  # noqa: E731
    lambda x, x_residual, weight, epsilon, variance_size=None: (
        variance_size is None
        and (weight is None or weight.dtype == x.dtype)
        and x.is_contiguous()
        and x_residual.is_contiguous()
    )
)

_IMPLS = {
    "rms_norm": (rms_norm, rms_norm_supports_args, {}),
    "fused_add_rms_norm": (
        fused_add_rms_norm,
        fused_add_rms_norm_supports_args,
        {"inplace": True},
    ),
}


def register() -> None:
    """Register for every op this vLLM has (re-entrant)."""
    from vllm import ir

    support = provider.kernel_support()
    for op_name, (impl, supports_args, extra) in _IMPLS.items():
        op = getattr(ir.ops, op_name, None)
        if op is None or PROVIDER in op.impls:
            continue
        op.register_impl(
            PROVIDER,
            supported=support[op_name][0],
            supports_args=supports_args,
            **extra,
        )(impl)

"""A minimal CPU fused-norm IR provider, for the bench only: the yardstick of
a per-call cost through vLLM's IR dispatch.

It does what vLLM's own ``"vllm_c"`` impls do on CPU once the upstream change
enables them (``vllm/kernels/vllm_c.py`` with the patch): ``supports_args``
checks ``variance_size``, the weight's dtype and contiguity, the impl allocates
with ``empty_like`` and calls the kernel. Nothing more: no dtype or hidden-size
check, no ``weight=None`` handling, no view for inputs that are not 2-D, so it
is unsafe outside the decode and prefill shapes the bench gives it. The bench
registers it beside the patched ``"vllm_c"`` and times both through vLLM's IR
dispatch in one process; it is never a plugin.
"""

from __future__ import annotations

import torch
from torch import Tensor

PROVIDER = "vllm_c_cpu_minimal"


# vLLM IR takes an impl only with its op's native schema (names, types and
# defaults).
def rms_norm(
    x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
) -> Tensor:
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, weight, epsilon)
    return out


def fused_add_rms_norm(
    x: Tensor,
    x_residual: Tensor,
    weight: Tensor | None,
    epsilon: float,
    variance_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)
    return x, x_residual


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

    from vllm_patch.runtime.import_checks import load_vllm_kernels

    load_vllm_kernels()
    for op_name, (impl, supports_args, extra) in _IMPLS.items():
        op = getattr(ir.ops, op_name, None)
        if op is None or PROVIDER in op.impls:
            continue
        op.register_impl(
            PROVIDER,
            supported=hasattr(torch.ops._C, op_name),
            supports_args=supports_args,
            **extra,
        )(impl)

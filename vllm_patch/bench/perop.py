"""Microseconds per call of the two norms, every way vLLM can run them.

In a child per vLLM (the base one, the patched copy): vLLM's ``native``
implementation, the CPU ``kernel`` called directly, each other IR provider
through IR dispatch (``ir:<provider>``, as the eager forward calls the op), and
vLLM's ``RMSNorm`` layer with custom ops on (``layer:<class>``: the CustomOp
route, a ``CustomOp.register_oot`` replacement included). Each form is held to
native with the op's own tolerance first (``numerics.compare``), and timed
only if it passes: medians of short samples, interleaved."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

from patches.cpu_fused_norms.identity import OPS
from vllm_patch.bench.numerics import compare, copy_args, kernel_call
from vllm_patch.runtime.bench_result import NATIVE

TOKENS = (1, 16, 512)
HIDDEN = 2048
DTYPE = "bfloat16"
THREADS = 1
"""One thread: on a loaded machine, OpenMP teams waiting for a descheduled
thread inflate parallel kernels' times many-fold."""
SAMPLES = 51
SAMPLE_S = 0.0005


def _median_us(
    fns: dict[str, Callable], args: tuple, scopes: dict[str, Callable]
) -> dict[str, float]:
    """Median microseconds per call of each function, sampled in turn, inputs
    restored before each sample (the in-place ones write into them) and
    ``scopes[name]()`` (a dispatch priority) entered around each sample."""
    import torch

    works = {name: copy_args(args) for name in fns}
    calls, per_call = {}, {name: [] for name in fns}

    def sample(name: str, n: int) -> float:
        for w, a in zip(works[name], args, strict=True):
            if isinstance(w, torch.Tensor):
                w.copy_(a)
        with scopes.get(name, contextlib.nullcontext)():
            t0 = time.perf_counter()
            for _ in range(n):
                fns[name](*works[name])
            return time.perf_counter() - t0

    for name in fns:  # warm-up and calibration
        calls[name] = max(1, round(SAMPLE_S * 20 / sample(name, 20)))
    for _ in range(SAMPLES):
        for name in fns:
            per_call[name].append(sample(name, calls[name]) / calls[name])
    return {name: statistics.median(v) * 1e6 for name, v in per_call.items()}


def _layer(name: str, args: tuple, dtype):
    """vLLM's ``RMSNorm`` as an eager CPU engine builds it (custom ops on):
    its class name, a function of the op's inputs that calls it, and the IR
    priority the platform gives the op there."""
    import vllm.config as vc
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.platforms import current_platform

    eager = vc.CompilationConfig(mode=vc.CompilationMode.NONE, custom_ops=["all"])
    config = vc.VllmConfig(compilation_config=eager)
    ranked = getattr(current_platform.get_default_ir_op_priority(config), name)
    with vc.set_current_vllm_config(config):
        layer = RMSNorm(args[0].shape[-1], eps=args[-1]).to(dtype)
    layer.weight.data.copy_(args[-2])

    def call(x, *rest):
        return layer(x) if name == "rms_norm" else layer(x, rest[0])

    return type(layer).__name__, call, ranked


def _routes(op, name: str, args: tuple, dtype) -> tuple[dict, dict]:
    """Every way to run the op here, and the priority each IR route needs."""
    call = getattr(op, "maybe_inplace", op)  # what vLLM's layers call
    fns = {NATIVE: op.impls[NATIVE].impl_fn, "kernel": kernel_call(name)}
    scopes = {}
    for provider, impl in op.impls.items():
        if provider != NATIVE and impl.supported and impl.supports_args(*args):
            fns[f"ir:{provider}"] = call
            scopes[f"ir:{provider}"] = lambda p=provider: op.set_priority([p, NATIVE])
    cls, fns[f"layer:{cls}"], ranked = _layer(name, args, dtype)
    scopes[f"layer:{cls}"] = lambda: op.set_priority(ranked)
    return fns, scopes


def measure(env: str) -> list[dict[str, Any]]:
    """In a child: the rows of this vLLM (``env`` labels them)."""
    import torch
    from vllm import ir
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins

    current_platform.import_kernels()
    if hasattr(current_platform, "import_ir_kernels"):
        current_platform.import_ir_kernels()
    load_general_plugins()  # out-of-tree providers and layers, as vLLM loads them
    torch.set_num_threads(THREADS)
    unwrap = getattr(ir, "enable_torch_wrap", None)  # off in eager CPU engines
    dtype = getattr(torch, DTYPE)
    rows = []
    with unwrap(False) if unwrap else contextlib.nullcontext():
        for name in OPS:
            op = getattr(ir.ops, name)
            for tokens in TOKENS:
                torch.manual_seed(0)
                args = tuple(
                    op.generate_inputs(
                        num_tokens=tokens, hidden_size=HIDDEN, dtype=dtype
                    )
                )
                rows += _measure_shape(env, op, name, args, dtype)
    return rows


def _measure_shape(env, op, name, args, dtype) -> list[dict[str, Any]]:
    fns, scopes = _routes(op, name, args, dtype)
    expected = fns[NATIVE](*copy_args(args))
    tol = op.get_tolerance(dtype)
    base = {"env": env, "op": name, "dtype": DTYPE, "tokens": int(args[0].shape[0])}
    rows = []
    for route in [r for r in fns if r != NATIVE]:
        with scopes.get(route, contextlib.nullcontext)():
            found = compare(fns[route], args, expected, tol)
        if not found["ok"]:  # never timed
            rows.append({**base, "route": route, "wrong": found["error"]})
            del fns[route]
    timed = _median_us(fns, args, scopes)
    return rows + [
        {**base, "route": r, "median_us": us, "native_us": timed[NATIVE]}
        for r, us in timed.items()
    ]


def per_op(envs: dict[str, tuple[str, ...]], progress) -> dict[str, Any]:
    """:func:`measure` in each vLLM (label: its ``PYTHONPATH`` folders)."""
    from vllm_patch.runtime import child

    rows = []
    for env, pythonpath in envs.items():
        progress(f"per op: {env}")
        rows += child.run(
            "vllm_patch.bench.perop:measure", {"env": env}, pythonpath=pythonpath
        ).value()
    return {"hidden_size": HIDDEN, "dtype": DTYPE, "threads": THREADS, "rows": rows}

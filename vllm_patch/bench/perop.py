"""Microseconds per call of the two norms, every way vLLM can run them, and
where a layer call's time goes.

In a child per vLLM (base, the patched copy, the provider; ``ROUNDS`` children
each, alternating): ``native``, the CPU ``kernel`` (allocating its output, as an
impl does), each IR provider through IR dispatch (``ir:<provider>``, as the
eager forward calls the op), vLLM's ``RMSNorm`` layer with custom ops on
(``layer:<class>``, a ``register_oot`` replacement included), its forward
method called directly (``forward:<class>``: without ``nn.Module.__call__`` and
``CustomOp.forward``), a minimal ``forward_cpu`` and ``forward_native``: the
layer path's overhead. Each route is held to native with the op's own
tolerance first and timed only if it passes: a fast wrong answer is no figure.
Every route runs at ``DTYPE`` and ``HIDDEN`` for each of ``TOKENS``; the layer
path alone (with native and the bare kernel) also at one token in each of
``OVERHEAD_DTYPES`` and ``OVERHEAD_HIDDEN``, where a decode step's norm is a few
microseconds of kernel and a check per call is a share of it.

Each sample is a short loop timed by the calling thread's CPU time, which on a
loaded machine leaves out the time the thread waits for a core. ``native`` is
the same code in every vLLM: its samples from all make one shared baseline."""

import contextlib
import itertools
import statistics
import time
from collections.abc import Callable
from typing import Annotated, Any

from patches.cpu_fused_norms.identity import OPS, OPT_IN_ENV
from vllm_patch.bench import numerics
from vllm_patch.bench.record import (
    ALLOC,
    FORWARD_NATIVE,
    MINIMAL,
    NATIVE,
    ChildLoad,
    PerOp,
    PerOpRow,
    Rows,
    record,
    typed,
)

TOKENS = (1, 16, 512)
HIDDEN = 2048
DTYPE = "bfloat16"
# The layer path's overhead at one token: models' two dtypes (bfloat16 runs
# native where the build truncates) and two hidden sizes (Llama 3.2 1B's, 8B's).
OVERHEAD_DTYPES = ("bfloat16", "float32")
OVERHEAD_HIDDEN = (2048, 4096)
THREADS = 1  # what vLLM gives its worker on a 2-core machine
ROUNDS = 2  # children per vLLM, alternating, so that load drift hits each
# glibc keeps freed memory, as vLLM's tcmalloc does: by default a tensor of 128
# KiB or more is a fresh mapping faulting in, which moved 512-token medians twofold.
CACHING_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(2**26)}
CACHING_MALLOC["MALLOC_TRIM_THRESHOLD_"] = str(2**27)
SAMPLES = 61
SAMPLE_S = 0.001
WARMUP_S = 0.05


def _sample_us(
    fns: dict[str, Callable], args: tuple, scopes: dict
) -> dict[str, dict]:
    """Per function, µs per call per sample (``cpu``, ``wall``), in its scope."""
    import torch

    works = {name: numerics.copy_args(args) for name in fns}
    calls = {}
    found = {name: {"cpu": [], "wall": []} for name in fns}

    def sample(name: str, n: int) -> tuple[float, float]:
        for w, a in zip(works[name], args, strict=True):
            if isinstance(w, torch.Tensor):
                w.copy_(a)
        with scopes.get(name, contextlib.nullcontext)():
            cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
            for _ in range(n):
                fns[name](*works[name])
            return time.thread_time_ns() - cpu, time.perf_counter_ns() - wall

    for name in fns:  # warm-up, then calibration on the warm code
        n = 1
        while sample(name, n)[0] < WARMUP_S * 1e9:
            n *= 2
        calls[name] = max(1, round(SAMPLE_S * 1e9 * n / sample(name, n)[0]))
    for _ in range(SAMPLES):
        for name, n in calls.items():
            cpu, wall = sample(name, n)
            found[name]["cpu"].append(cpu / n / 1e3)
            found[name]["wall"].append(wall / n / 1e3)
    return found


def _routes(op, name: str, args: tuple, dtype) -> tuple[dict, dict]:
    """Every route to the op here (as an eager CPU engine builds it), its scope."""
    import vllm.config as vc
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.platforms import current_platform

    call = getattr(op, "maybe_inplace", op)  # what vLLM's layers call
    fns = {NATIVE: op.impls[NATIVE].impl_fn, "kernel": numerics.kernel_call(name)}
    scopes = {}
    for provider, impl in op.impls.items():
        if provider != NATIVE and impl.supported and impl.supports_args(*args):
            fns[f"ir:{provider}"] = call
            scopes[f"ir:{provider}"] = lambda p=provider: op.set_priority(
                [p, NATIVE]
            )
    eager = vc.CompilationConfig(mode=vc.CompilationMode.NONE, custom_ops=["all"])
    config = vc.VllmConfig(compilation_config=eager)
    ranked = getattr(current_platform.get_default_ir_op_priority(config), name)
    with vc.set_current_vllm_config(config):
        layer = RMSNorm(args[0].shape[-1], eps=args[-1]).to(dtype)
    layer.weight.data.copy_(args[-2])
    with vc.set_current_vllm_config(config):
        minimal = minimal_layer(RMSNorm)(args[0].shape[-1], eps=args[-1]).to(dtype)
    minimal.weight.data.copy_(args[-2])
    cls = type(layer).__name__  # called with x [, residual]: it holds the rest
    fns[f"layer:{cls}"] = lambda x, *rest: layer(x, *rest[:-2])
    fns[f"forward:{cls}"] = lambda x, *rest: layer._forward_method(x, *rest[:-2])
    fns[MINIMAL] = lambda x, *rest: minimal.forward_cpu(x, *rest[:-2])
    fns[FORWARD_NATIVE] = lambda x, *rest: layer.forward_native(x, *rest[:-2])
    for route in (f"layer:{cls}", f"forward:{cls}", FORWARD_NATIVE):
        scopes[route] = lambda: op.set_priority(ranked)
    return fns, scopes


def minimal_layer(rms_norm: type) -> type:
    """``rms_norm`` with the least ``forward_cpu`` there is: allocate, call the
    kernel, no check, the weight as the parameter it is (``.data`` would add an
    alias per call). The layer path's overhead is ``forward:<class>`` minus
    this."""
    import torch

    class MinimalRMSNorm(rms_norm):
        def forward_cpu(self, x, residual=None):
            eps = self.variance_epsilon
            if residual is None:
                out = torch.empty_like(x)
                torch.ops._C.rms_norm(out, x, self.weight, eps)
                return out
            torch.ops._C.fused_add_rms_norm(x, residual, self.weight, eps)
            return x, residual

    return MinimalRMSNorm


def measure(env: str, threads: int = THREADS) -> list[dict[str, Any]]:
    """In a child: this vLLM's rows (``env`` labels them)."""
    import torch

    # Before vLLM loads its kernels: the IR form decides when vllm_c.py is
    # imported, from the thread count, as a worker does under vLLM's binding
    # (its OMP_NUM_THREADS set before it starts).
    torch.set_num_threads(threads)
    from vllm import ir
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins

    current_platform.import_kernels()
    if hasattr(current_platform, "import_ir_kernels"):
        current_platform.import_ir_kernels()
    load_general_plugins()  # out-of-tree providers and layers, as vLLM loads them
    unwrap = getattr(ir, "enable_torch_wrap", None)  # off in eager CPU engines
    rows = []
    with unwrap(False) if unwrap else contextlib.nullcontext():
        for name in OPS:
            op = getattr(ir.ops, name)
            for cell in cells():
                rows += _measure_shape(env, op, name, *cell)
    return rows


def cells() -> list[tuple[str, int, int, bool]]:
    """(dtype, hidden size, tokens, every route or the layer path's alone)."""
    every = [(DTYPE, HIDDEN, tokens, True) for tokens in TOKENS]
    layer_path = [  # (DTYPE, HIDDEN) at one token is one of every route's
        (dtype, hidden, 1, False)
        for dtype in OVERHEAD_DTYPES
        for hidden in OVERHEAD_HIDDEN
        if (dtype, hidden) != (DTYPE, HIDDEN)
    ]
    return every + layer_path


def _layer_path(route: str) -> bool:
    """The routes of the layer path's overhead, and native for its figure."""
    prefixes = ("layer:", "forward:", MINIMAL, FORWARD_NATIVE, NATIVE)
    return route.startswith(prefixes)


def _measure_shape(
    env: str, op, name: str, dtype_name: str, hidden: int, tokens: int, every: bool
) -> list[dict[str, Any]]:
    """Each route held to native, the right ones timed with the kernel's parts."""
    import torch

    dtype = getattr(torch, dtype_name)
    args = numerics.op_inputs(op, tokens, hidden, dtype)
    fns, scopes = _routes(op, name, args, dtype)
    if not every:
        fns = {route: fn for route, fn in fns.items() if _layer_path(route)}
    expected = numerics.expected_of(op, args)
    tol = op.get_tolerance(dtype)
    base = {"env": env, "op": name, "dtype": dtype_name, "hidden_size": hidden}
    base["tokens"] = tokens
    rows = []
    for route in [r for r in fns if r != NATIVE]:
        with scopes.get(route, contextlib.nullcontext)():
            wrong = numerics.mismatch(fns[route], args, expected, tol)
        if wrong:  # never timed
            rows.append({**base, "route": route, "wrong": wrong})
            del fns[route]
    layer = next((r for r in fns if r.startswith("layer:")), None)  # if right
    if layer:  # does a layer call run the op's CPU kernel?
        cpu = [torch.profiler.ProfilerActivity.CPU]
        with scopes[layer](), torch.profiler.profile(activities=cpu) as p:
            fns[layer](*numerics.copy_args(args))
        runs = (
            "kernel" if any(e.name == f"_C::{name}" for e in p.events()) else NATIVE
        )
    kernel = getattr(torch.ops._C, name).default
    if name == "fused_add_rms_norm":
        fns["kernel:bare"] = kernel
    else:
        out = torch.empty_like(args[0])
        fns["kernel:bare"] = lambda x, w, eps: kernel(out, x, w, eps)
        if every:
            fns[ALLOC] = lambda x, w, eps: torch.empty_like(x)
    return rows + [
        {**base, "route": r, **us, **({"impl": runs} if r == layer else {})}
        for r, us in _sample_us(fns, args, scopes).items()
    ]


@record
class Sampled:
    """A route's row as :func:`measure` prints it in its child: its samples (µs)."""

    env: str
    op: str
    dtype: str
    hidden_size: int
    tokens: int
    route: str
    wrong: str | None = None
    impl: str | None = None
    cpu: tuple[float, ...] = ()
    wall: tuple[float, ...] = ()


Printed = Annotated[tuple[Sampled, ...], Rows]  # a child's rows, read back checked


def per_op(
    envs: dict[str, tuple], progress, threads: int = THREADS, opted_in=()
) -> PerOp:
    """:func:`measure` ``ROUNDS`` times per vLLM of ``envs`` (those named in
    ``opted_in`` with the out-of-tree provider on); native's pooled."""
    from vllm_patch.runtime import child, machine

    first: dict[tuple, Sampled] = {}  # per row: its first child's, and samples
    cpu: dict[tuple, list[float]] = {}
    wall: dict[tuple, list[float]] = {}
    native: dict[tuple, list[float]] = {}
    load = []
    for r, (env, pythonpath) in itertools.product(range(ROUNDS), envs.items()):
        progress(f"per op: {env} ({r + 1}/{ROUNDS}), {threads} thread(s)")
        before = machine.cpu_snapshot()
        asked = {"env": env, "threads": threads}
        opt_in = {OPT_IN_ENV: "1"} if env in opted_in else {}
        how = {"pythonpath": pythonpath, "env": CACHING_MALLOC | opt_in}
        how["drop_env"] = [OPT_IN_ENV]
        printed = child.run(f"{__name__}:measure", asked, **how).value()
        for s in typed(Printed, printed, f"{env}'s per-op rows"):
            cell = (s.op, s.dtype, s.hidden_size, s.tokens)
            key = ("both" if s.route == NATIVE else env, *cell, s.route)
            first.setdefault(key, s)
            cpu.setdefault(key, []).extend(s.cpu)
            wall.setdefault(key, []).extend(s.wall)
            if s.route == NATIVE:
                native[cell] = cpu[key]
        load.append(
            ChildLoad(
                env=env,
                load_average=machine.load_average()[0],
                other_share=machine.other_share(before),
            )
        )
    rows = []
    for key, s in first.items():
        cell = (s.op, s.dtype, s.hidden_size, s.tokens)
        timed = figures(cpu[key], wall[key], native[cell]) if cpu[key] else {}
        rows.append(
            PerOpRow(
                env=key[0],
                op=s.op,
                dtype=s.dtype,
                hidden_size=s.hidden_size,
                tokens=s.tokens,
                route=s.route,
                wrong=s.wrong,
                impl=s.impl,
                **timed,
            )
        )
    return PerOp(
        hidden_size=HIDDEN,
        dtype=DTYPE,
        threads=threads,
        clock="thread CPU time",
        rounds=ROUNDS,
        load=tuple(load),
        rows=tuple(rows),
    )


def figures(cpu: list, wall: list, native: list) -> dict[str, float]:
    """A route's samples (µs): median, p10, p90, wall median, native's median."""
    deciles = statistics.quantiles(cpu, n=10, method="inclusive")
    found = {
        "median_us": statistics.median(cpu),
        "p10_us": deciles[0],
        "p90_us": deciles[-1],
        "wall_median_us": statistics.median(wall),
        "native_us": statistics.median(native),
    }
    return {k: round(v, 3) for k, v in found.items()}

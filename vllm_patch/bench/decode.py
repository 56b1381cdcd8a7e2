"""``bench --decode`` (docs/bench.md): a live engine per variant, a child running
this module; in a round they take turns step by step, so their k-th steps share
the load. A ratio: the trimmed mean of per-round log ratios, bootstrapped.

Why so: on a 2-core machine the matmuls take over 90 % of a decode step and
other processes move it by more than the change does; sequential runs minutes
apart drift with the load, while steps of live engines seconds apart share it.
The engine runs in the child's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
so that its CPU time, the hooks on ``RMSNorm`` and the thread layout are those
of the process that runs the model."""

import contextlib
import dataclasses
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from patches.cpu_fused_norms.identity import OPS, OPT_IN_ENV
from vllm_patch.bench import record
from vllm_patch.bench.record import HALF_WIDTH, Span
from vllm_patch.runtime import child, machine

CLOCKS = ("cpu", "wall")  # the headline's first: CPU time moves less with load
COMPARISONS = {
    "patched/base": ("patched", "base"),
    "base/base": ("base2", "base"),  # the A/A control
    "provider/base": ("provider", "base"),
}
COMPILED = {"+rms_norm/default": ("compiled+rms_norm", "compiled")}
SAVINGS = ("patched", "provider")
MIN_ROUNDS = 3  # measured whatever the budget: fewer give no interval
SHARE = {"eager": 0.7, "compiled": 0.3}  # of the budget: eager has four engines
ONLY_NORMS = ("none", "+rms_norm")  # custom ops: the kernels under Inductor
PROMPT = list(range(10, 18))
STEP_KEYS = ("norm_wall", "norm_cpu", "norm_calls", "step_wall", "step_cpu")
GREEDY = {"temperature": 0.0, "ignore_eos": True, "detokenize": False}
# Per mode its engines: their vLLM ("patched": the patched copy first on its
# path), the out-of-tree provider's opt-in, the custom ops.
PHASES = {
    "eager": {
        "base": {},
        "base2": {},  # the installed vLLM again: the A/A control
        "patched": {"vllm": "patched"},
        "provider": {"provider": True},
    },
    "compiled": {
        "compiled": {},  # native norms under Inductor
        "compiled+rms_norm": {"provider": True, "custom_ops": ONLY_NORMS},
    },
}
NAMES = [name for phase in PHASES.values() for name in phase]
AUTO = "auto"  # a layout: vLLM's own thread binding (VLLM_CPU_OMP_THREADS_BIND)
USABLE = frozenset(os.sched_getaffinity(0))
NORM_RANGE = "vllm_patch.RMSNorm"  # the profiler range around each norm module
KERNELS = tuple(f"_C::{op}" for op in OPS)  # the profiler's names of the kernels
# A decode step under torch's profiler: where a loss comes from. At 2 threads
# the kernels open an OpenMP parallel region on every call, even for one row,
# while native's small ATen ops stay under ATen's grain size and run inline.
SPLIT = ("norm kernels", "rest of RMSNorm", "matmul after a norm", "other ops")
# The projection that reads a norm's output: vLLM's CPU linears are ATen's
# linear/addmm/mm or oneDNN's matmul ops.
MATMUL = re.compile(r"linear|mm|gemm|matmul")
TRIM = 0.1  # the share of the rounds left out at each end
RESAMPLES = 2000
Figures = Sequence[float | None]


def trimmed_mean(values: Sequence[float]) -> float:
    ordered = sorted(values)
    cut = int(len(ordered) * TRIM)
    kept = ordered[cut : len(ordered) - cut] or ordered
    return sum(kept) / len(kept)


def bootstrap(values: Sequence[float]) -> tuple[float, float, float]:
    """(trimmed mean, low, high): a seeded 95 % percentile bootstrap."""
    if not values:
        raise ValueError("no values to estimate from")
    rng = random.Random(0)
    found = sorted(
        trimmed_mean(rng.choices(values, k=len(values))) for _ in range(RESAMPLES)
    )
    low, high = (found[int(q * (RESAMPLES - 1))] for q in (0.025, 0.975))
    return trimmed_mean(values), low, high


def level(values: Figures) -> record.Ms:
    """A level: the trimmed mean, ``ci95``, ``n``."""
    kept = [v for v in values if v is not None]
    mid, low, high = (round(v, 4) for v in bootstrap(kept))
    return record.Ms(ms=mid, ci95=Span(low, high), n=len(kept))


def ratio(numerator: Figures, denominator: Figures) -> record.Ratio:
    """numerator / denominator per round where both are positive and finite; the
    rounds left out (counted from 1) under ``dropped``."""
    logs = []
    dropped = []
    for n, pair in enumerate(zip(numerator, denominator, strict=True), 1):
        if all(v is not None and 0 < v < math.inf for v in pair):
            logs.append(math.log(pair[0] / pair[1]))
        else:
            dropped.append(n)
    mid, low, high = (round(math.exp(v), 4) for v in bootstrap(logs))
    return record.Ratio(
        ratio=mid, ci95=Span(low, high), n=len(logs), dropped=tuple(dropped) or None
    )


def verdict(found: record.Estimate, control: record.Estimate | None) -> str:
    """``helps``, ``neutral`` or ``loses``: the interval against 1.0, trusted
    only when the A/A control's interval holds 1.0."""
    if control is not None and not control.ci95.low <= 1.0 <= control.ci95.high:
        return "unresolved"  # the control moved: the machine, not the change
    low, high = found.ci95
    return "helps" if high < 1.0 else "loses" if low > 1.0 else "neutral"


def precise(found: record.Estimate) -> bool:
    """Is the interval's half-width at most ``HALF_WIDTH`` of the estimate?"""
    low, high = found.ci95
    return (high - low) / 2 <= HALF_WIDTH * found.value


class Engine(contextlib.AbstractContextManager):
    """An engine's process (:func:`main`): started, asked, stopped on exit."""

    def __init__(self, name: str, mode: str, config: dict, paths: dict) -> None:
        spec = PHASES[mode][name]
        self.name = name
        self.log = tempfile.TemporaryFile("w+")
        opt_in = {OPT_IN_ENV: "1"} if spec.get("provider") else {}
        path = paths[spec.get("vllm", "base")]
        env = child.child_env(opt_in, pythonpath=path, drop_env=[OPT_IN_ENV])
        config = {**config, "enforce_eager": mode != "compiled"}
        if spec.get("custom_ops"):
            config["compilation_config"] = {"custom_ops": spec["custom_ops"]}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__, json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            text=True,
            start_new_session=True,
        )

    def ask(self, command: dict[str, Any] | None = None) -> dict[str, Any]:
        if command is not None:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            raise RuntimeError(
                f"engine {self.name} ended:\n{self.log.read()[-2000:]}"
            )
        return json.loads(line)

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(OSError):  # its end of input; or a broken pipe
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(60)
        child.kill_group(self.proc)
        self.log.close()


def interleaved(order: list[Engine], layout: str, tokens: int) -> tuple[dict, dict]:
    """Per engine, a step of each in turn: each figure's median over decode
    steps; and each engine's layout as it read it back."""
    found: dict[str, dict[str, list[int]]] = {e.name: {} for e in order}
    layouts = {}
    for e in order:
        added = e.ask({"layout": layout, "tokens": tokens})["layout"]
        layouts[e.name] = record.typed(record.Layout, added, f"{e.name}.layout")
    running = list(order)
    while running:
        for e in list(running):
            answer = e.ask({"step": True})
            for key, value in answer.items():
                found[e.name].setdefault(key, []).append(value)
            if answer["finished"]:
                running.remove(e)
        running = running[1:] + running[:1]
    medians = {}
    for name, steps in found.items():
        cpu = steps["step_cpu"]
        assert len(cpu) > 2, "no decode steps"
        mid = {k: statistics.median(steps[k][1:]) for k in STEP_KEYS}
        ms = {k: round(v / 1e6, 4) for k, v in mid.items() if k != "norm_calls"}
        medians[name] = record.Step(
            **ms,
            norm_calls=float(mid["norm_calls"]),
            cpu_ms=tuple(round(t / 1e6, 2) for t in cpu),
        )
    return medians, layouts


def measure_phase(started: list[Engine], args, deadline: float, progress) -> list:
    """Round 0 (dropped), then ``args.rounds`` or, past ``MIN_ROUNDS``, up to the
    deadline."""
    out = []
    pids = [e.proc.pid for e in started]
    began = time.monotonic()
    for r in range(args.rounds + 1):
        late = time.monotonic() + (time.monotonic() - began) / max(r, 1) > deadline
        if r > MIN_ROUNDS and late:
            progress(f"decode: time budget reached after {r - 1} rounds")
            break
        for layout in args.threads:
            k = r % len(started)
            before = machine.cpu_snapshot(pids)
            steps, layouts = interleaved(
                started[k:] + started[:k], layout, args.tokens
            )
            share = machine.other_share(before, pids)
            busy = (share or 0) > machine.BUSY_SHARE
            if r:
                out.append(
                    record.Round(
                        round=r,
                        threads=layout,
                        order=tuple(steps),
                        steps=steps,
                        layouts=layouts,
                        other_share=share,
                        busy=busy,
                    )
                )
            progress(
                f"decode: round {r}/{args.rounds}{' (warm-up)' if not r else ''}, "
                f"{layout_shown(layout, layouts)}, others {share}: "
                + ", ".join(f"{v} {s.step_cpu:.1f} ms" for v, s in steps.items())
            )
    return out


def layout_shown(layout: str, layouts: dict[str, record.Layout]) -> str:
    """``auto (1 thread(s) on CPUs 0)``: the layout as the first engine read it."""
    seen = next(iter(layouts.values()))
    cpus = ",".join(map(str, seen.cpus))
    return f"{layout}: {seen.threads} thread(s) on CPUs {cpus}"


def profile_phase(started: list[Engine], args, progress) -> dict[str, dict]:
    """Per layout and engine, one generation's decode steps under the profiler."""
    found: dict[str, dict] = {}
    for layout in args.threads:
        for e in started:
            e.ask({"layout": layout, "tokens": args.tokens})
            printed = e.ask({"profile": True})
            where = f"profile_ms.{e.name}"
            found.setdefault(layout, {})[e.name] = record.typed(
                dict[str, float], printed, where
            )
        progress(f"decode: profiled {layout}: {found[layout]}")
    return found


def column(rows: list[record.Round], variant: str, key: str) -> list:
    return [
        getattr(r.steps[variant], key) if variant in r.steps else None for r in rows
    ]


def compared(rows: list[record.Round], a: str, b: str) -> dict[str, record.Ratio]:
    """``a`` / ``b`` per round, by ``CLOCKS``."""
    return {
        c: ratio(column(rows, a, f"step_{c}"), column(rows, b, f"step_{c}"))
        for c in CLOCKS
    }


def block(
    rows: list[record.Round], pairs: dict[str, tuple[str, str]]
) -> record.DecodeBlock:
    """One thread count's comparisons, levels per engine and savings in the
    norms."""
    seen = {v for r in rows for v in r.steps}
    names = [v for v in NAMES if v in seen]

    def levels(key: str) -> dict[str, record.Ms]:
        return {v: level(column(rows, v, key)) for v in names}

    by_clock = {
        label: compared(rows, a, b)
        for label, (a, b) in pairs.items()
        if a in names and b in names
    }
    control = by_clock.get("base/base", {}).get(CLOCKS[0])
    loaded = sum(r.busy for r in rows) > len(rows) / 2
    comps = {}
    for label, found in by_clock.items():
        headline = found[CLOCKS[0]]
        judged = None
        if label != "base/base":
            # most rounds busy: the load, not the change, may be what moved
            judged = "busy" if loaded else verdict(headline, control)
        comps[label] = record.Comparison(
            cpu=found["cpu"],
            wall=found["wall"],
            ratio=headline.ratio,
            ci95=headline.ci95,
            n=headline.n,
            dropped=headline.dropped,
            precise=precise(headline),
            verdict=judged,
        )
    out = record.DecodeBlock(
        comparisons=comps,
        step_ms=levels("step_cpu"),
        layout=next(iter(rows[0].layouts.values()), None),
        step_wall_ms=levels("step_wall"),
        rounds=len(rows),
        busy_rounds=sum(r.busy for r in rows),
    )
    if not any(r.steps[names[0]].norm_calls for r in rows):  # compiled: no hooks
        return out
    savings = {v: saving(rows, v) for v in SAVINGS if v in names}
    saved = savings.get("patched")
    return dataclasses.replace(
        out,
        norm_ms=levels("norm_cpu"),
        norm_wall_ms=levels("norm_wall"),
        norm_calls_per_step=rows[0].steps[names[0]].norm_calls,
        savings=savings,
        saving_ms=saved and saved.saving_ms,
        saving_share=saved and saved.share,
        consistent=saved and consistent(comps["patched/base"], saved),
    )


def consistent(found: record.Comparison, saved: record.Saving) -> record.Consistent:
    """Does the end-to-end interval meet the one the saving implies?"""
    low, high = saved.expected_ratio
    contradicts = found.ci95.high < low or found.ci95.low > high
    return record.Consistent(
        contradicts=contradicts, expected_ratio=Span(low, high)
    )


def saving(rows: list[record.Round], variant: str) -> record.Saving:
    """base's minus ``variant``'s norm CPU time per step, and the ratio that
    saving implies."""
    base = column(rows, "base", "norm_cpu")
    mine = column(rows, variant, "norm_cpu")
    pairs = zip(base, mine, strict=True)
    steps = zip(base, mine, column(rows, "base", "step_cpu"), strict=True)
    share = level([None if None in t else (t[0] - t[1]) / t[2] for t in steps])
    low, high = share.ci95
    return record.Saving(
        saving_ms=level([a - b for a, b in pairs if None not in (a, b)]),
        share=record.Share(share=share.ms, ci95=share.ci95),
        expected_ratio=Span(round(1 - high, 4), round(1 - low, 4)),
    )


def summary(
    found: dict[str, list], layouts: list, about: dict, meta: dict
) -> record.Decode:
    """The ``decode`` section, the first layout's block at its top level
    (``meta``: its ``model``, ``dtype`` and ``tokens``)."""

    def per_layout(
        rows: list[record.Round], pairs: dict
    ) -> dict[str, record.DecodeBlock]:
        return {
            str(n): block([r for r in rows if r.threads == n], pairs)
            for n in layouts
            if any(r.threads == n for r in rows)
        }

    by_layout = per_layout(found["eager"], COMPARISONS)
    for n, profile in found.get("profile", {}).items():
        if n in by_layout:
            by_layout[n] = dataclasses.replace(by_layout[n], profile_ms=profile)
    builds = sorted({b for a in about.values() for b in a.kernel_build})
    notes = []
    provider = about.get("provider")
    if provider is not None and provider.norm_classes == about["base"].norm_classes:
        notes.append(
            "the provider engine built vLLM's own RMSNorm: "
            "the plugin's entry point is not installed here, "
            "so provider/base compares base with itself"
        )
    return record.Decode(
        notes=tuple(notes),
        **meta,
        threads=layouts[0],
        thread_counts=tuple(layouts),
        kernel_build=", ".join(builds),
        clock=CLOCKS[0],
        headline=by_layout.get(str(layouts[0])),
        by_threads=by_layout,
        compiled=per_layout(found["compiled"], COMPILED),
        engines=about,
        raw=(*found["eager"], *found["compiled"]),
    )


def run(args, model: str, meta: record.Model, paths: dict, progress) -> list:
    """Per dtype its share of ``args.budget``: a section each, the first the
    headline's."""
    end = time.monotonic() + args.budget * 60
    found = []
    for n, dtype in enumerate(args.dtype):
        budget = (end - time.monotonic()) / (len(args.dtype) - n)
        found.append(run_dtype(args, dtype, budget, model, meta, paths, progress))
    return found


def run_dtype(args, dtype: str, budget: float, model: str, meta, paths, progress):
    """Each mode's engines in its ``SHARE`` of ``budget`` seconds: the section."""
    config = {"model": model, "dtype": dtype, "seed": 0, "max_num_seqs": 1}
    config["max_model_len"] = len(PROMPT) + args.tokens + 8
    config["enable_prefix_caching"] = False
    config["skip_tokenizer_init"] = True  # token ids in, token ids out
    # vLLM reserves a share of RAM for the KV cache unless given bytes; on a
    # shared machine that share may not be free.
    config["kv_cache_memory_bytes"] = 2**28
    config["layout"] = args.threads[0]
    found: dict[str, Any] = {"eager": [], "compiled": []}
    about = {}
    end = time.monotonic() + budget
    left = sum(SHARE[m] for m in args.modes)
    for mode in args.modes:
        deadline = time.monotonic() + SHARE[mode] / left * (end - time.monotonic())
        left -= SHARE[mode]
        with contextlib.ExitStack() as stack:
            started = []
            for name in PHASES[mode]:
                progress(f"decode: starting engine {name} ({mode}, {dtype})")
                started.append(
                    stack.enter_context(Engine(name, mode, config, paths))
                )
            for e in started:
                ready = e.ask()["ready"]
                progress(f"decode: engine {e.name} ready: {ready}")
                where = f"engines.{e.name}"
                about[e.name] = record.typed(record.EngineFacts, ready, where)
            found[mode] = measure_phase(started, args, deadline, progress)
            if mode == "eager":
                found["profile"] = profile_phase(started, args, progress)
    meta = {"model": meta, "dtype": dtype, "tokens": args.tokens}
    return summary(found, args.threads, about, meta)


# --- the engine's side: ``python -m vllm_patch.bench.decode CONFIG_JSON`` ------


def start(config: dict[str, Any], totals: list[int], hooks: dict) -> tuple:
    """``LLM(**config)`` (eager: every ``RMSNorm`` timed into ``totals``, and a
    profiler range while ``hooks["profiling"]``), and its word."""
    import torch
    from vllm import LLM
    from vllm.model_executor.layers.layernorm import RMSNorm

    from vllm_patch.runtime import cpu_library

    llm = LLM(**config)
    started = [0, 0]
    ranges = []

    def before(module, args) -> None:
        if hooks["profiling"]:
            ranges.append(torch.profiler.record_function(NORM_RANGE).__enter__())
        started[:] = time.perf_counter_ns(), time.process_time_ns()

    def after(module, args, output) -> None:
        totals[0] += time.perf_counter_ns() - started[0]
        totals[1] += time.process_time_ns() - started[1]
        totals[2] += 1
        if ranges:
            ranges.pop().__exit__(None, None, None)

    def hook(model) -> list[str]:
        norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
        for m in norms:
            m.register_forward_pre_hook(before)
            m.register_forward_hook(after)
        return sorted({type(m).__name__ for m in norms})

    hooked = llm.apply_model(hook)[0] if config["enforce_eager"] else []
    custom_ops = llm.llm_engine.vllm_config.compilation_config.custom_ops
    about = {
        "pid": os.getpid(),
        "kernel_build": cpu_library.loaded(),
        "custom_ops": list(custom_ops),
        "norm_classes": hooked,
    }
    return llm, about


def step(llm, totals: list[int]) -> dict[str, Any]:
    """One engine step's ``STEP_KEYS`` (ns; the norms' calls), ``finished``."""
    before = [*totals, time.perf_counter_ns(), time.process_time_ns()]
    outputs = llm.llm_engine.step()
    after = [*totals, time.perf_counter_ns(), time.process_time_ns()]
    out = {k: a - b for k, a, b in zip(STEP_KEYS, after, before, strict=True)}
    out["finished"] = not llm.llm_engine.has_unfinished_requests()
    assert not out["finished"] or any(o.finished for o in outputs)
    return out


def vllm_binding() -> list[int]:
    """The CPUs vLLM's default binding gives the worker of local rank 0."""
    from vllm.config import VllmConfig
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    # VLLM_CPU_OMP_THREADS_BIND=auto (0.32.0, vllm/utils/ompmultiprocessing.py):
    # on x86, Arm and RISC-V a core per local rank stays for the engine process;
    # the worker gets OMP_NUM_THREADS = its CPUs, OMP_PLACES and OMP_PROC_BIND.
    # One worker here, as in the engine's own (default) parallel config.
    manager = OMPProcessManager(VllmConfig())
    return list(manager.cpu_lists[0]) if manager.cpu_lists else sorted(USABLE)


def bind(cpus) -> None:
    """Every thread of this process (the OpenMP team's too) onto ``cpus``."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended
            os.sched_setaffinity(int(task), cpus)


def apply_layout(layout: str, set_threads) -> dict[str, Any]:
    """``layout`` (``auto``: vLLM's own binding, else a thread count on every
    usable CPU), read back from this process as the worker sees it."""
    import torch

    cpus = vllm_binding() if layout == AUTO else sorted(USABLE)
    threads = len(cpus) if layout == AUTO else int(layout)
    bind(cpus)
    set_threads(threads)
    found = sorted(os.sched_getaffinity(0))
    return {"threads": torch.get_num_threads(), "cpus": found}


def profiled(llm, totals: list[int], hooks: dict) -> dict[str, float]:
    """The decode steps of the request just added under torch's profiler: per
    ``SPLIT`` part, CPU milliseconds per decode step."""
    import torch

    step(llm, totals)  # the prefill, not profiled
    steps = 0
    hooks["profiling"] = True
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU]
    ) as p:
        while not step(llm, totals)["finished"]:
            steps += 1
        steps += 1
    hooks["profiling"] = False
    return {k: round(v / 1e3 / steps, 4) for k, v in split(p.events()).items()}


def split(events) -> dict[str, float]:
    """Microseconds by ``SPLIT`` part: inside RMSNorm its kernels (their OpenMP
    region) and the rest; the first matmul after each norm; every other op."""
    found = dict.fromkeys(SPLIT, 0.0)
    ops = sorted(
        (e for e in events if outermost(e.cpu_parent)),
        key=lambda e: e.time_range.start,
    )
    norm_end = None
    for e in ops:
        if e.name == NORM_RANGE:
            kernel = sum(
                c.cpu_time_total for c in e.cpu_children if c.name in KERNELS
            )
            found["norm kernels"] += kernel
            found["rest of RMSNorm"] += e.cpu_time_total - kernel
            norm_end = e.time_range.end
        elif e.is_user_annotation:
            continue
        elif norm_end is not None and MATMUL.search(e.name):
            found["matmul after a norm"] += e.cpu_time_total
            norm_end = None
        else:
            found["other ops"] += e.cpu_time_total
    return found


def outermost(parent) -> bool:
    """Is an event with this parent an outermost op (or a range) of the step?"""
    return parent is None or parent.is_user_annotation and parent.name != NORM_RANGE


def main(config_text: str) -> int:
    """{"ready": ...}, then per stdin line an answer: {"layout": L, "tokens": N}
    adds a request in that layout, {"step": true} times one engine step,
    {"profile": true} runs the request just added under the profiler."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)  # a line is an answer
    os.dup2(2, 1)  # vLLM and everything else print to stderr
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    import torch

    # vLLM's CPU worker replaces torch.set_num_threads with a no-op once it
    # starts (it binds threads itself in its own processes, not in this one).
    set_threads = torch.set_num_threads
    from vllm import SamplingParams

    totals = [0, 0, 0]
    hooks = {"profiling": False}
    config = json.loads(config_text)
    # Built in the first layout, as a worker is built in its own: whatever the
    # layers decide in __init__ from threads and CPUs holds for every layout.
    built = apply_layout(config.pop("layout"), set_threads)
    llm, about = start(config, totals, hooks)
    about["built_in"] = built
    print(json.dumps({"ready": about}), file=answers)
    for n, line in enumerate(sys.stdin):
        command = json.loads(line)
        if command.get("step"):
            print(json.dumps(step(llm, totals)), file=answers)
            continue
        if command.get("profile"):
            print(json.dumps(profiled(llm, totals, hooks)), file=answers)
            continue
        layout = apply_layout(command["layout"], set_threads)
        params = SamplingParams(max_tokens=command["tokens"], **GREEDY)
        llm.llm_engine.add_request(str(n), {"prompt_token_ids": PROMPT}, params)
        print(json.dumps({"added": str(n), "layout": layout}), file=answers)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

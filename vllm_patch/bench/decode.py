"""``bench --decode`` (docs/bench.md): a live engine per variant, a child running
this module; in a round they take turns step by step, so their k-th steps share
the load. A ratio: the trimmed mean of per-round log ratios, bootstrapped."""

import contextlib
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from patches.cpu_fused_norms.identity import OPT_IN_ENV
from vllm_patch.runtime import child, machine

CLOCKS = ("cpu", "wall")  # the headline's first: CPU time moves less with load
COMPARISONS = {"patched/base": ("patched", "base"), "base/base": ("base2", "base")}
COMPARISONS["provider/base"] = ("provider", "base")
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


def level(values: Figures, key: str = "ms", back=float) -> dict[str, object]:
    """A level: ``key`` (the trimmed mean), ``ci95``, ``n``, mapped by ``back``."""
    kept = [v for v in values if v is not None]
    mid, lo, hi = (round(back(v), 4) for v in bootstrap(kept))
    return {key: mid, "ci95": [lo, hi], "n": len(kept)}


def ratio(numerator: Figures, denominator: Figures) -> dict[str, object]:
    """numerator / denominator per round where both are positive."""
    pairs = zip(numerator, denominator, strict=True)
    logs = [math.log(a / b) for a, b in pairs if (a or 0) > 0 and (b or 0) > 0]
    return level(logs, "ratio", math.exp)


class Engine(contextlib.AbstractContextManager):
    """An engine's process (:func:`main`): started, asked, stopped on exit."""

    def __init__(self, name: str, mode: str, config: dict, paths: dict) -> None:
        spec, self.name = PHASES[mode][name], name
        self.log = tempfile.TemporaryFile("w+")
        opt_in = {OPT_IN_ENV: "1"} if spec.get("provider") else {}
        path = paths[spec.get("vllm", "base")]
        env = child.child_env(opt_in, pythonpath=path, drop_env=[OPT_IN_ENV])
        config = {**config, "enforce_eager": mode != "compiled"}
        if spec.get("custom_ops"):
            config["compilation_config"] = {"custom_ops": spec["custom_ops"]}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__, json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            env=env, text=True, start_new_session=True,
        )  # fmt: skip

    def ask(self, command: dict[str, Any] | None = None) -> dict[str, Any]:
        if command is not None:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            raise RuntimeError(f"engine {self.name} ended:\n{self.log.read()[-2000:]}")
        return json.loads(line)

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(OSError):  # its end of input; or a broken pipe
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(60)
        child.kill_group(self.proc)
        self.log.close()


def interleaved(order: list[Engine], threads: int, tokens: int) -> dict:
    """Per engine, a step of each in turn: each figure's median over decode steps."""
    for e in order:
        e.ask({"threads": threads, "tokens": tokens})
    found: dict[str, dict[str, list[int]]] = {e.name: {} for e in order}
    running = list(order)
    while running:
        for e in list(running):
            answer = e.ask({"step": True})
            for key, value in answer.items():
                found[e.name].setdefault(key, []).append(value)
            if answer["finished"]:
                running.remove(e)
        running = running[1:] + running[:1]
    for name, steps in found.items():
        cpu = steps["step_cpu"]
        assert len(cpu) > 2, "no decode steps"
        mid = {k: statistics.median(v[1:]) for k, v in steps.items() if k != "finished"}
        out = {k: round(v / 1e6, 4) for k, v in mid.items() if k != "norm_calls"}
        out["norm_calls"] = float(mid["norm_calls"])
        found[name] = out | {"cpu_ms": [round(t / 1e6, 2) for t in cpu]}
    return found


def measure_phase(started: list[Engine], args, deadline: float, progress) -> list:
    """Round 0 (dropped), then ``args.rounds`` or, past ``MIN_ROUNDS``, to deadline."""
    out, pids, began = [], [e.proc.pid for e in started], time.monotonic()
    for r in range(args.rounds + 1):
        late = time.monotonic() + (time.monotonic() - began) / max(r, 1) > deadline
        if r > MIN_ROUNDS and late:
            progress(f"decode: time budget reached after {r - 1} rounds")
            break
        for n in args.threads:
            k = r % len(started)
            before = machine.cpu_snapshot(pids)
            steps = interleaved(started[k:] + started[:k], n, args.tokens)
            share = machine.other_share(before, pids)
            row = {"round": r, "threads": n, "order": list(steps), "steps": steps}
            row |= {"other_share": share, "busy": (share or 0) > machine.BUSY_SHARE}
            if r:
                out.append(row)
            progress(
                f"decode: round {r}/{args.rounds}{' (warm-up)' if not r else ''}, "
                f"{n} thread(s), others {share}: "
                + ", ".join(f"{v} {s['step_cpu']:.1f} ms" for v, s in steps.items())
            )
    return out


def column(rows: list[dict], variant: str, key: str) -> list:
    return [r["steps"].get(variant, {}).get(key) for r in rows]


def block(rows: list[dict], pairs: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """One thread count's comparisons, levels per engine and savings in the norms."""
    seen = {v for r in rows for v in r["steps"]}
    names = [v for v in NAMES if v in seen]

    def levels(key: str) -> dict[str, Any]:
        return {v: level(column(rows, v, key)) for v in names}

    comps = {}
    for label, (a, b) in pairs.items():
        if a in names and b in names:
            by = {c: [column(rows, v, f"step_{c}") for v in (a, b)] for c in CLOCKS}
            comps[label] = {c: ratio(*by[c]) for c in CLOCKS}
            comps[label].update(comps[label][CLOCKS[0]])
    out = {"comparisons": comps, "step_ms": levels("step_cpu")}
    out |= {"step_wall_ms": levels("step_wall"), "rounds": len(rows)}
    out["busy_rounds"] = sum(r["busy"] for r in rows)
    if any(r["steps"][names[0]]["norm_calls"] for r in rows):  # eager: attributed
        out |= {"norm_ms": levels("norm_cpu"), "norm_wall_ms": levels("norm_wall")}
        out["norm_calls_per_step"] = rows[0]["steps"][names[0]]["norm_calls"]
        out["savings"] = {v: saving(rows, v) for v in SAVINGS if v in names}
        if saved := out["savings"].get("patched"):
            out["saving_ms"], out["saving_share"] = saved["saving_ms"], saved["share"]
            ci, (lo, hi) = comps["patched/base"]["ci95"], saved["expected_ratio"]
            # the end-to-end interval against the one the saving implies
            contradicts = ci[1] < lo or ci[0] > hi
            out["consistent"] = {"contradicts": contradicts, "expected_ratio": [lo, hi]}
    return out


def saving(rows: list[dict], variant: str) -> dict[str, Any]:
    """base's minus ``variant``'s norm CPU time per step, and the ratio it implies."""
    base, mine = column(rows, "base", "norm_cpu"), column(rows, variant, "norm_cpu")
    pairs = zip(base, mine, strict=True)
    steps = zip(base, mine, column(rows, "base", "step_cpu"), strict=True)
    share = level([None if None in t else (t[0] - t[1]) / t[2] for t in steps])
    lo, hi = share["ci95"]
    return {
        "saving_ms": level([a - b for a, b in pairs if None not in (a, b)]),
        "share": {"share": share["ms"], "ci95": share["ci95"]},
        "expected_ratio": [round(1 - hi, 4), round(1 - lo, 4)],
    }


def summary(rows: list, threads: list, compiled_rows: list, about: dict, meta: dict):
    """The ``decode`` section, the first thread count's block at its top level."""

    def per_count(found: list[dict], pairs: dict) -> dict[str, Any]:
        return {
            str(n): block([r for r in found if r["threads"] == n], pairs)
            for n in threads
            if any(r["threads"] == n for r in found)
        }

    by_threads = per_count(rows, COMPARISONS)
    builds = sorted({b for a in about.values() for b in a["kernel_build"]})
    return {
        **meta,
        "threads": threads[0],
        "thread_counts": threads,
        "kernel_build": ", ".join(builds),
        "clock": CLOCKS[0],
        **by_threads.get(str(threads[0]), {}),
        "by_threads": by_threads,
        "compiled": per_count(compiled_rows, COMPILED),
        "engines": about,
        "raw": rows + compiled_rows,
    }


def default_dtype(flags: list[str]) -> str:
    """bfloat16 with AVX512-BF16; else float32 (bfloat16 kernels would truncate)."""
    return "bfloat16" if "avx512_bf16" in flags else "float32"


def run(args, model: str, meta: dict[str, Any], paths: dict, progress) -> dict:
    """Each mode's engines in its ``SHARE`` of ``args.budget``: the section."""
    dtype = args.dtype or default_dtype(machine.cpu()["flags"])
    config = {"model": model, "dtype": dtype, "seed": 0, "max_num_seqs": 1}
    config |= {"max_model_len": len(PROMPT) + args.tokens + 8}
    config |= {"enable_prefix_caching": False, "skip_tokenizer_init": True}
    config["kv_cache_memory_bytes"] = 2**28  # not all memory may be free
    found: dict[str, list[dict]] = {"eager": [], "compiled": []}
    about = {}
    end = time.monotonic() + args.budget * 60
    left = sum(SHARE[m] for m in args.modes)
    for mode in args.modes:
        deadline = time.monotonic() + SHARE[mode] / left * (end - time.monotonic())
        left -= SHARE[mode]
        with contextlib.ExitStack() as stack:
            started = []
            for name in PHASES[mode]:
                progress(f"decode: starting engine {name} ({mode})")
                started.append(stack.enter_context(Engine(name, mode, config, paths)))
            for e in started:
                about[e.name] = e.ask()["ready"]
                progress(f"decode: engine {e.name} ready: {about[e.name]}")
            found[mode] = measure_phase(started, args, deadline, progress)
    meta = {"model": meta, "dtype": dtype, "tokens": args.tokens}
    return summary(found["eager"], args.threads, found["compiled"], about, meta)


# --- the engine's side: ``python -m vllm_patch.bench.decode CONFIG_JSON`` ------


def start(config: dict[str, Any], totals: list[int]) -> tuple[Any, dict[str, Any]]:
    """``LLM(**config)`` (eager: every ``RMSNorm`` timed into ``totals``), its word."""
    from vllm import LLM
    from vllm.model_executor.layers.layernorm import RMSNorm

    from vllm_patch.runtime import cpu_library

    llm = LLM(**config)
    started = [0, 0]

    def before(module, args) -> None:
        started[:] = time.perf_counter_ns(), time.process_time_ns()

    def after(module, args, output) -> None:
        totals[0] += time.perf_counter_ns() - started[0]
        totals[1] += time.process_time_ns() - started[1]
        totals[2] += 1

    def hook(model) -> list[str]:
        norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
        for m in norms:
            m.register_forward_pre_hook(before)
            m.register_forward_hook(after)
        return sorted({type(m).__name__ for m in norms})

    hooked = llm.apply_model(hook)[0] if config["enforce_eager"] else []
    about = {"pid": os.getpid(), "kernel_build": cpu_library.loaded()}
    about["custom_ops"] = list(llm.llm_engine.vllm_config.compilation_config.custom_ops)
    return llm, about | {"norm_classes": hooked}


def step(llm, totals: list[int]) -> dict[str, Any]:
    """One engine step's ``STEP_KEYS`` (ns; the norms' calls), ``finished``."""
    before = [*totals, time.perf_counter_ns(), time.process_time_ns()]
    outputs = llm.llm_engine.step()
    after = [*totals, time.perf_counter_ns(), time.process_time_ns()]
    out = {k: a - b for k, a, b in zip(STEP_KEYS, after, before, strict=True)}
    out["finished"] = not llm.llm_engine.has_unfinished_requests()
    assert not out["finished"] or any(o.finished for o in outputs)
    return out


def main(config_text: str) -> int:
    """{"ready": ...}, then per stdin line an answer: {"threads": N, "tokens": L}
    adds a request, {"step": true} times one engine step."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)  # a line is an answer
    os.dup2(2, 1)  # vLLM and everything else print to stderr
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    import torch

    # vLLM's CPU worker replaces torch.set_num_threads with a no-op once it
    # starts (it binds threads itself in its own processes, not in this one).
    set_threads = torch.set_num_threads
    from vllm import SamplingParams

    totals = [0, 0, 0]
    llm, about = start(json.loads(config_text), totals)
    print(json.dumps({"ready": about}), file=answers)
    for n, line in enumerate(sys.stdin):
        command = json.loads(line)
        if command.get("step"):
            print(json.dumps(step(llm, totals)), file=answers)
            continue
        set_threads(command["threads"])
        params = SamplingParams(max_tokens=command["tokens"], **GREEDY)
        llm.llm_engine.add_request(str(n), {"prompt_token_ids": PROMPT}, params)
        print(json.dumps({"added": str(n)}), file=answers)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

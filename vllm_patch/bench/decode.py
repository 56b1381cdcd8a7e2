"""``bench --decode``: what the change does to one decode step, resolved on a
noisy machine.

One engine per variant (``decode_engine``, each in its own process, kept
alive): the installed vLLM twice (``base`` and ``base2``: the A/A control), the
patched copy (``patched``) and the installed vLLM with the out-of-tree
provider's opt-in (``provider``); compiled, the installed vLLM as it compiles
by default (``compiled``: native norms under Inductor) and the provider with
``custom_ops: ["none", "+rms_norm"]`` (``compiled+rms_norm``: the kernels under
Inductor). In a round every engine generates ``tokens`` tokens, one engine
step at a time and the engines in turn (the order rotates every step and
round): engine A's k-th step runs seconds from engine B's, under the same
load. A decode step's figure is the median over the steps after the first
(the prefill), in wall time and in the engine's CPU time, and (eager) the time
inside ``RMSNorm`` in the same steps: a burst of load during one step moves
the median little. Each round records the share of the machine's CPU time
other processes used (busy above ``machine.BUSY_SHARE``). Round 0 warms up and
is not counted; rounds stop at ``rounds`` or when the next would end past the
phase's share of the time budget. Then paired ratios, levels and the norm
saving with bootstrap intervals (``stats``) per thread count.

The ``decode`` section of ``evidence.json`` (:func:`summary`; ``docs/bench.md``
shows an example): the headline thread count's figures at the top level
(``comparisons``, ``norm_ms``, ``saving_ms``, ``step_ms``, ...), every thread
count's under ``by_threads``, the compiled pair under ``compiled``, each
round's raw figures under ``raw``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from patches.cpu_fused_norms.identity import OPT_IN_ENV
from vllm_patch.bench import stats
from vllm_patch.runtime import child, machine
from vllm_patch.runtime.bench_result import MODES

CLOCKS = ("cpu", "wall")
"""The headline clock first: the engine's CPU time moves less with the load."""
COMPARISONS = {
    "patched/base": ("patched", "base"),
    "base/base": ("base2", "base"),
    "provider/base": ("provider", "base"),
}
COMPILED = {"+rms_norm/default": ("compiled+rms_norm", "compiled")}
SAVINGS = ("patched", "provider")
SHARE = {"eager": 0.7, "compiled": 0.3}
"""Each phase's share of the time budget (the eager one has four engines)."""


@dataclass
class Variant:
    name: str
    mode: str = "eager"
    vllm: str = "base"
    env: dict[str, str] = field(default_factory=dict)
    custom_ops: list[str] | None = None


def variants(modes: list[str]) -> list[list[Variant]]:
    """The engines of each phase (eager, then compiled): one phase runs at a time."""
    provider = {OPT_IN_ENV: "1"}
    phases = {
        "eager": [
            Variant("base"),
            Variant("base2"),
            Variant("patched", vllm="patched"),
            Variant("provider", env=provider),
        ],
        "compiled": [
            Variant("compiled", "compiled"),
            Variant(
                "compiled+rms_norm", "compiled", env=provider,
                custom_ops=["none", "+rms_norm"],
            ),
        ],
    }  # fmt: skip
    return [phases[m] for m in modes]


class Engine:
    """A ``decode_engine`` process: started, asked, stopped."""

    def __init__(self, variant: Variant, config: dict, env: dict, log) -> None:
        self.variant = variant
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_patch.bench.decode_engine",
             json.dumps({**config, "mode": variant.mode,
                         "custom_ops": variant.custom_ops})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
            env=env, text=True, start_new_session=True,
        )  # fmt: skip
        self.log = log
        self.about: dict[str, Any] = {}

    def answer(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            self.log.flush()
            self.log.seek(0)
            tail = self.log.read()[-2000:]
            raise RuntimeError(f"engine {self.variant.name} ended:\n{tail}")
        return json.loads(line)

    def ask(self, command: dict[str, Any]) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def stop(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            self.proc.stdin.write(json.dumps({"stop": True}) + "\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
            self.proc.wait()


@contextlib.contextmanager
def engines(
    phase: list[Variant], config: dict, paths: dict[str, tuple[str, ...]], progress
) -> Iterator[list[Engine]]:
    """The phase's engines, started together and ready; stopped on exit."""
    drop = [OPT_IN_ENV]
    started: list[Engine] = []
    try:
        for v in phase:
            env = child.child_env(v.env, pythonpath=paths[v.vllm], drop_env=drop)
            log = tempfile.TemporaryFile("w+")
            started.append(Engine(v, config, env, log))
            progress(f"decode: starting engine {v.name} ({v.mode})")
        for e in started:
            e.about = e.answer()["ready"]
            progress(f"decode: engine {e.variant.name} ready: {e.about}")
        yield started
    finally:
        for e in started:
            e.stop()
            e.log.close()


def per_step(found: dict[str, list[int]], key: str) -> float:
    """The median of ``key`` over the decode steps (all but the first), in
    milliseconds (calls as they are)."""
    decode = sorted(found[key][1:])
    n = len(decode)
    mid = (decode[(n - 1) // 2] + decode[n // 2]) / 2
    return mid if key == "norm_calls" else mid / 1e6


def interleaved(
    order: list[Engine], threads: int, tokens: int
) -> dict[Engine, dict[str, list[int]]]:
    """Each engine's ``tokens``-token generation at ``threads`` threads, one
    step of each in turn (the order rotating every step): per engine, each
    figure's list over the steps."""
    for e in order:
        e.ask({"threads": threads, "tokens": tokens})
    found: dict[Engine, dict[str, list[int]]] = {e: {} for e in order}
    running = list(order)
    while running:
        for e in list(running):
            answer = e.ask({"step": True})
            for key, value in answer.items():
                found[e].setdefault(key, []).append(value)
            if answer["finished"]:
                running.remove(e)
        running = running[1:] + running[:1]
    return found


def measure_phase(
    started: list[Engine],
    *,
    rounds: int,
    threads: list[int],
    tokens: int,
    deadline: float,
    progress,
) -> list[dict[str, Any]]:
    """Round 0 (warm-up, dropped) then up to ``rounds`` rounds, none expected
    to end after ``deadline`` (``time.monotonic``); per round and thread count,
    every engine in turn (rotating), with the other processes' CPU share."""
    out = []
    pids = [e.proc.pid for e in started]
    began = time.monotonic()
    for r in range(rounds + 1):
        if r > 1 and time.monotonic() + (time.monotonic() - began) / r > deadline:
            progress(f"decode: time budget reached after {r - 1} rounds")
            break
        for n in threads:
            k = r % len(started)
            order = started[k:] + started[:k]
            before = machine.cpu_snapshot(pids)
            row: dict[str, Any] = {"round": r, "threads": n, "order": [], "steps": {}}
            for e, found in interleaved(order, n, tokens).items():
                assert len(found["cpu"]) > 2, "no decode steps"
                row["order"].append(e.variant.name)
                row["steps"][e.variant.name] = {
                    **{f"step_{c}": round(per_step(found, c), 4) for c in CLOCKS},
                    **{f"norm_{c}": round(per_step(found, f"norm_{c}"), 4)
                       for c in CLOCKS},
                    "norm_calls": per_step(found, "norm_calls"),
                    "cpu_ms": [round(t / 1e6, 2) for t in found["cpu"]],
                }  # fmt: skip
            share = machine.other_load(
                before, machine.cpu_snapshot(pids), machine.usable_cpus()
            )
            row["other_share"] = share
            row["busy"] = share is not None and share > machine.BUSY_SHARE
            if r:
                out.append(row)
            progress(
                f"decode: round {r}/{rounds}{' (warm-up)' if not r else ''}, "
                f"{n} thread(s), others {share}: "
                + ", ".join(
                    f"{v} {s['step_cpu']:.1f} ms" for v, s in row["steps"].items()
                )
            )
    return out


def column(rows: list[dict], variant: str, key: str) -> list[float | None]:
    return [r["steps"].get(variant, {}).get(key) for r in rows]


def block(rows: list[dict], pairs: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """The figures of one thread count's rounds: ``comparisons`` (per clock),
    ``step_ms`` and ``norm_ms`` per engine, ``saving_ms`` and ``saving_share``
    of the patched (and provider) engine against base."""
    seen = {v for r in rows for v in r["steps"]}
    names = [v.name for phase in variants(list(MODES)) for v in phase if v.name in seen]
    comps = {}
    for label, (a, b) in pairs.items():
        if a in names and b in names:
            comps[label] = {
                clock: stats.ratio(column(rows, a, f"step_{clock}"),
                                   column(rows, b, f"step_{clock}"))
                for clock in CLOCKS
            }  # fmt: skip
            comps[label].update(comps[label][CLOCKS[0]])
    out: dict[str, Any] = {
        "comparisons": comps,
        "step_ms": {v: stats.level(column(rows, v, "step_cpu")) for v in names},
        "step_wall_ms": {v: stats.level(column(rows, v, "step_wall")) for v in names},
        "busy_rounds": sum(r["busy"] for r in rows),
        "rounds": len(rows),
    }
    if any(r["steps"][names[0]]["norm_calls"] for r in rows):  # eager: attributed
        out["norm_ms"] = {v: stats.level(column(rows, v, "norm_cpu")) for v in names}
        out["norm_wall_ms"] = {
            v: stats.level(column(rows, v, "norm_wall")) for v in names
        }
        out["norm_calls_per_step"] = rows[0]["steps"][names[0]]["norm_calls"]
        out["savings"] = {
            v: saving(rows, v) for v in SAVINGS if v in names and "base" in names
        }
        if "patched" in out["savings"]:
            out["saving_ms"] = out["savings"]["patched"]["saving_ms"]
            out["saving_share"] = out["savings"]["patched"]["share"]
            out["consistent"] = consistent(out["savings"]["patched"], comps)
    return out


def saving(rows: list[dict], variant: str) -> dict[str, Any]:
    """base's minus ``variant``'s CPU time inside the norms per step, and that
    as a share of base's step; ``expected_ratio``: the step ratio it implies."""
    ms = stats.difference(
        column(rows, "base", "norm_cpu"), column(rows, variant, "norm_cpu")
    )
    share = stats.level(
        [
            None if None in (b, v, s) else (b - v) / s
            for b, v, s in zip(
                column(rows, "base", "norm_cpu"),
                column(rows, variant, "norm_cpu"),
                column(rows, "base", "step_cpu"),
                strict=True,
            )
        ]
    )
    share = {"share": share["ms"], "ci95": share["ci95"]}
    expected = [round(1 - share["ci95"][1], 4), round(1 - share["ci95"][0], 4)]
    return {"saving_ms": ms, "share": share, "expected_ratio": expected}


def consistent(saved: dict[str, Any], comps: dict[str, Any]) -> dict[str, Any]:
    """Whether the end-to-end ratio's interval meets the interval the
    attributed saving implies (1 - share): ``contradicts`` when they are
    disjoint."""
    ci = comps["patched/base"]["ci95"]
    lo, hi = saved["expected_ratio"]
    return {"contradicts": ci[1] < lo or ci[0] > hi, "expected_ratio": [lo, hi]}


def summary(
    rows: list[dict],
    *,
    threads: list[int],
    compiled_rows: list[dict],
    about: dict[str, dict],
    meta: dict[str, Any],
) -> dict[str, Any]:
    """The ``decode`` section: ``meta`` (model, dtype, tokens, ...), the first
    thread count's block at the top level, every one under ``by_threads``."""
    by_threads = {
        str(n): block([r for r in rows if r["threads"] == n], COMPARISONS)
        for n in threads
        if any(r["threads"] == n for r in rows)
    }
    compiled = {
        str(n): block([r for r in compiled_rows if r["threads"] == n], COMPILED)
        for n in threads
        if any(r["threads"] == n for r in compiled_rows)
    }
    builds = sorted({b for a in about.values() for b in a["kernel_build"]})
    head = by_threads.get(str(threads[0]), {})
    return {
        **meta,
        "threads": threads[0],
        "thread_counts": threads,
        "kernel_build": ", ".join(builds),
        "clock": CLOCKS[0],
        **head,
        "by_threads": by_threads,
        "compiled": compiled,
        "engines": about,
        "raw": rows + compiled_rows,
    }


def default_dtype(flags: list[str]) -> str:
    """float32 where the carried form keeps the bfloat16 fused add native (no
    AVX512-BF16: the kernels would truncate), else bfloat16."""
    return "bfloat16" if "avx512_bf16" in flags else "float32"


def run(
    *,
    model: str,
    model_meta: dict[str, Any],
    paths: dict[str, tuple[str, ...]],
    dtype: str,
    modes: list[str],
    rounds: int,
    threads: list[int],
    tokens: int,
    budget_s: float,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Every phase's engines, measured in turn within ``budget_s`` seconds
    (each phase's rounds within its share, ``SHARE``); the ``decode`` section."""
    config = {"model": model, "dtype": dtype, "max_tokens": tokens}
    found: dict[str, list[dict]] = {"eager": [], "compiled": []}
    about = {}
    end = time.monotonic() + budget_s
    share = {m: SHARE[m] / sum(SHARE[x] for x in modes) for m in modes}
    for mode, phase in zip(modes, variants(modes), strict=True):
        deadline = time.monotonic() + share[mode] * (end - time.monotonic())
        with engines(phase, config, paths, progress) as started:
            about.update({e.variant.name: e.about for e in started})
            found[mode] = measure_phase(
                started, rounds=rounds, threads=threads, tokens=tokens,
                deadline=deadline, progress=progress,
            )  # fmt: skip
        share = {m: share[m] / (1 - share[mode]) for m in share if m != mode}
    meta = {"model": model_meta, "dtype": dtype, "tokens": tokens}
    return summary(
        found["eager"], threads=threads, compiled_rows=found["compiled"],
        about=about, meta=meta,
    )  # fmt: skip

"""An evidence folder (``vllm-patch bench --out DIR``) read as data: its words,
its figures' spread and their Markdown, for the bench's own ``evidence.md`` and
for a pull request description, which quotes a folder without running the bench.

``DIR/evidence.json`` holds ``schema``, ``machine`` (``runtime.machine.facts``),
``vllm`` (``base``, ``patched``, ``patch``), ``model`` (``path``,
``random_weights``, ``name``, ``description``), ``serving`` (``commands``, and per mode
and side every metric's value per repetition: ``configs``), ``accuracy``
(``tokens``, ``lm_eval``), ``numerics`` and ``perop`` (or None: not measured).
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

from vllm_patch.runtime.machine import summary
from vllm_patch.runtime.markdown import details, table

SCHEMA = 1
EVIDENCE = "evidence.json"
NATIVE = "native"
"""vLLM's own PyTorch implementation of an op: every ratio's baseline."""
MODES = ("eager", "compiled")
SIDES = ("base", "patched")
METRICS = (
    "request_throughput", "output_throughput",
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
)  # fmt: skip
"""``vllm bench serve --save-result``'s names for what the table shows."""
LABELS = {"request_throughput": "requests/s", "output_throughput": "output tok/s"}


def read(folder: Path) -> dict[str, Any]:
    """``folder``'s evidence document (the folder is the user's choice; the
    file in it a regular file, never a link)."""
    from patcher.errors import PatchError
    from patcher.files import read_text_at

    path = Path(os.path.realpath(folder)) / EVIDENCE
    what = "a vllm-patch bench evidence file"
    try:
        return json.loads(read_text_at(path, what))
    except (ValueError, RecursionError) as exc:  # bad, or nested too deep
        found = f"{type(exc).__name__}: {exc}"
        raise PatchError(
            "not JSON", path=str(path), looked_for=what, found=found
        ) from exc


def spread(values: list[float]) -> tuple[float, float, float] | None:
    """(median, min, max), None for no values."""
    if not values:
        return None
    return statistics.median(values), min(values), max(values)


def ratios(doc: dict[str, Any], mode: str, metric: str) -> list[float]:
    """patched / base per repetition (the two ran one after the other)."""
    sides = doc["serving"]["configs"].get(mode, {})
    base, patched = (sides.get(s, {}).get(metric, []) for s in SIDES)
    return [p / b for b, p in zip(base, patched, strict=False) if b]


def ratio_shown(doc: dict[str, Any], mode: str, metric: str) -> str:
    """patched / base of ``metric`` in ``mode``: ``median [min–max]`` of the
    repetitions' ratios, the one definition every report shows."""
    return shown(ratios(doc, mode, metric), ratio=True)


def label(metric: str) -> str:
    """``median_tpot_ms`` as ``TPOT median (ms)``."""
    if metric in LABELS:
        return LABELS[metric]
    stat, name, _ = metric.split("_")
    return f"{name.upper()} {stat.replace('p99', 'P99')} (ms)"


def _fmt(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def shown(values: list[float], ratio: bool = False) -> str:
    """``median [min–max]`` of ``values``; ``-`` for none."""
    found = spread(values)
    if found is None:
        return "-"
    fmt = (lambda v: f"{v:.3f}x") if ratio else _fmt
    med, lo, hi = found
    return fmt(med) if len(values) == 1 else f"{fmt(med)} [{fmt(lo)}–{fmt(hi)}]"


def serving_table(doc: dict[str, Any], mode: str) -> str:
    sides = doc["serving"]["configs"][mode]
    rows = [
        [
            label(m),
            *(shown(sides.get(s, {}).get(m, [])) for s in SIDES),
            ratio_shown(doc, mode, m),
        ]
        for m in METRICS
    ]
    return table(["metric", "base", "patched", "patched / base"], rows)


def machine_line(doc: dict[str, Any]) -> str:
    """The machine as every report names it, and the CPU flags the kernels use."""
    m = doc["machine"]
    flags = ", ".join(m.get("key_flags") or []) or "none of the listed"
    return f"{summary(m)}; kernel flags: {flags}"


def load_line(load: dict[str, Any]) -> str:
    share = load.get("other_processes_share")
    before, after = (load.get(k) or ["?"] for k in ("before", "after"))
    text = f"load average {before[0]} at the start, {after[0]} at the end"
    return text + (
        "" if share is None else f"; other processes used {share:.0%} of the CPU time"
    )


def kernels_lines(doc: dict[str, Any]) -> list[str]:
    """What each server logged about its kernel choice."""
    logged = doc["serving"].get("server_log") or {}
    return [
        f"- {mode}, {side}: `{line}`"
        for mode, sides in logged.items()
        for side in SIDES
        for line in sides.get(side) or []
    ]


def reps(doc: dict[str, Any], mode: str) -> int:
    sides = doc["serving"]["configs"][mode]
    return min((len(sides.get(s, {}).get(METRICS[0], [])) for s in SIDES), default=0)


def first_difference(first: dict[str, Any] | None) -> str:
    """Where the greedy tokens first part (``accuracy.compare``'s
    ``first_divergence``, counted from 0) in words, counted from 1."""
    if first is None:
        return "the same tokens for every prompt"
    mode = f" ({first['mode']})" if first.get("mode") else ""
    return (
        f"first different token: prompt {first['prompt'] + 1}, "
        f"position {first['position'] + 1}{mode}"
    )


def accuracy_markdown(doc: dict[str, Any]) -> list[str]:
    acc = doc.get("accuracy") or {}
    tokens = acc.get("tokens") or {}
    out = []
    for mode, found in (tokens.get("configs") or {}).items():
        where = first_difference(found["first_divergence"])
        out.append(
            f"- {mode}: {found['identical_prompts']} of {len(found['per_prompt'])} "
            f"prompts identical ({tokens['tokens']} greedy tokens each); {where}; "
            f"largest |Δ logprob| of the top token before that: "
            f"{found['max_abs_dlogprob']:.3g}"
        )
    if tokens.get("note"):
        out.append(f"\n{tokens['note']}")
    lm = acc.get("lm_eval")
    if lm:
        rows = [
            [s, f"{lm[s]['exact_match']:.4f} ± {lm[s]['stderr']:.4f}"]
            for s in SIDES
            if s in lm
        ]
        filt = next((lm[s]["filter"] for s in SIDES if s in lm), "")
        out += [
            "",
            f"`lm_eval` {lm['task']} ({lm['mode']}, {filt}"
            + (f", --limit {lm['limit']}" if lm.get("limit") else "")
            + "):",
            "",
            table(["vLLM", "exact_match ± stderr"], rows),
        ]
    return out


def numerics_markdown(numerics: dict[str, Any], tolerance: dict[str, Any]) -> str:
    rows = []
    for build, ops in numerics.items():
        for op, dtypes in ops.items():
            for dtype, need in dtypes.items():
                rtol, atol = tolerance[op][dtype]
                ok = isinstance(need, float | int) and need <= rtol
                rows.append(
                    [build, op, dtype, need, rtol, atol, "yes" if ok else "**no**"]
                )
    header = ["kernel build", "op", "dtype", "rtol needed", "rtol allowed", "atol"]
    return table([*header, "within vLLM's tolerance"], rows)


def perop_markdown(perop: dict[str, Any], leave_out: tuple[str, ...] = ()) -> str:
    """Microseconds per call: a row per op and token count, a column per vLLM
    and route (but the routes ``leave_out``), with native's time over it."""
    kept = [r for r in perop["rows"] if r["route"] not in leave_out]
    columns = list(dict.fromkeys((r["env"], r["route"]) for r in kept))
    cells: dict[tuple, dict] = {}
    for r in kept:
        text = (
            "outside the tolerance"
            if r.get("wrong")
            else (
                f"{r['median_us']:.1f} [{r['p10_us']:.1f}–{r['p90_us']:.1f}]"
                + (
                    ""
                    if r["route"] == NATIVE
                    else f" ({r['native_us'] / r['median_us']:.2f}x)"
                )
            )
        )
        cells.setdefault((r["op"], r["tokens"]), {})[(r["env"], r["route"])] = text
    rows = [
        [f"`{op}`", tokens, *(found.get(c) for c in columns)]
        for (op, tokens), found in cells.items()
    ]
    return table(["op", "tokens", *(f"{e}: {r}" for e, r in columns)], rows)


def serving_markdown(serving: dict[str, Any], doc: dict[str, Any]) -> list[str]:
    out = []
    for mode in MODES:
        if mode not in serving.get("configs", {}):
            continue
        out += [
            "",
            f"## Serving, {mode}: median [min–max] of {reps(doc, mode)} repetitions",
            "",
            serving_table(doc, mode),
        ]
    if serving.get("commands"):
        body = "\n".join(["```", *serving["commands"], "```"])
        sizes = serving["sizes"]
        summary = (
            f"Commands ({sizes['num_prompts']} requests of {sizes['input_len']} "
            f"tokens in, {sizes['output_len']} out, {sizes['max_concurrency']} at a "
            "time; a fresh server per repetition)"
        )
        out += ["", details(summary, body)]
    if serving.get("server_log"):
        out += [
            "",
            "What the servers logged about their kernels:",
            "",
            *kernels_lines(doc),
        ]
    return out


def evidence_markdown(doc: dict[str, Any]) -> str:
    """``evidence.md``: what the run measured, and only that."""
    v, model = doc["vllm"], doc["model"]
    out = [
        "# vllm-patch bench evidence",
        "",
        f"- Machine: {machine_line(doc)}",
        f"- vLLM: base {v['base']}; patched: {v['patched']} with `{v['patch']}`",
        f"- Load: {load_line(doc['load'])}",
    ]
    if model:
        out.insert(4, f"- Model: {model['description']}")
    if doc.get("interrupted"):
        out.append("- **Interrupted**: this is what was measured before that.")
    for failure in doc.get("failed") or []:
        out.append(f"- **Failed:** {failure}")
    if doc.get("decode"):
        from vllm_patch.bench.decode import markdown

        out += ["", *markdown(doc["decode"])]
    out += serving_markdown(doc.get("serving") or {}, doc)
    acc = accuracy_markdown(doc)
    if acc:
        out += ["", "## Accuracy", "", *acc]
    if doc.get("numerics"):
        out += [
            "",
            "## Numerics per x86 kernel build",
            "",
            numerics_markdown(doc["numerics"], doc["tolerance"]),
        ]
    if doc.get("perop"):
        p = doc["perop"]
        from vllm_patch.bench.perop import SPLIT, split

        loads = ", ".join(
            f"{x['env']} {x['load_average']} ({x['other_share']:.0%})"
            for x in p["load"]
        )
        out += [
            "",
            f"## Per op: microseconds per call, median [p10–p90] of the "
            f"{p['clock']} (native / this), {p['dtype']}, hidden "
            f"{p['hidden_size']}, {p['threads']} thread",
            "",
            perop_markdown(p),
            "",
            f"Load average per child (other processes' share of the CPU): {loads}. "
            "`native` is one baseline: its samples in both vLLMs.",
            "",
            "Where a layer call's time goes (1 token, medians, microseconds):",
            "",
            table(["vLLM", "op", "layer (runs)", *SPLIT], split(p)),
        ]
    return "\n".join(out) + "\n"

"""The section writers of an evidence folder's figures: ``evidence.md`` and a
pull request description's evidence parts are both written by these, from the
records of ``evidence_record`` alone. Every string read from the folder is
rendered as data (``markdown.text``/``code``/``fence``/``html``); ``limit`` cuts
tables and lists (a description has a size bound)."""

from __future__ import annotations

import statistics
from typing import Any

from vllm_patch.runtime import markdown as md
from vllm_patch.runtime.evidence_record import (
    METRICS,
    MODES,
    NATIVE,
    SIDES,
    Divergence,
    Evidence,
    Load,
    Machine,
    Numerics,
    PerOp,
    Serving,
)

__all__ = ["METRICS", "MODES", "NATIVE", "SIDES"]  # the format's names, for bench
LABELS = {"request_throughput": "requests/s", "output_throughput": "output tok/s"}
NOT_QUALITY = " (random weights: the builds' numerics, not model quality)"
ROWS = 500
"""The most rows of a table in ``evidence.md``."""


def spread(values: list[float]) -> tuple[float, float, float] | None:
    """(median, min, max), None for no values."""
    if not values:
        return None
    return statistics.median(values), min(values), max(values)


def ratios(serving: Serving, mode: str, metric: str) -> list[float]:
    """patched / base per repetition (the two ran one after the other)."""
    sides = serving.configs.get(mode, {})
    base, patched = (sides.get(s, {}).get(metric, ()) for s in SIDES)
    return [p / b for b, p in zip(base, patched, strict=False) if b]


def ratio_shown(serving: Serving, mode: str, metric: str) -> str:
    """patched / base of ``metric`` in ``mode``: ``median [min–max]`` of the
    repetitions' ratios, the one definition every report shows."""
    return spread_shown(ratios(serving, mode, metric), ratio=True)


def label(metric: str) -> str:
    """``median_tpot_ms`` as ``TPOT median (ms)``."""
    if metric in LABELS:
        return LABELS[metric]
    stat, name, _ = metric.split("_")
    return f"{name.upper()} {stat.replace('p99', 'P99')} (ms)"


def _fmt(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def spread_shown(values: list[float], ratio: bool = False) -> str:
    """``median [min–max]`` of ``values``; ``-`` for none."""
    found = spread(values)
    if found is None:
        return "-"
    fmt = (lambda v: f"{v:.3f}x") if ratio else _fmt
    med, lo, hi = found
    return fmt(med) if len(values) == 1 else f"{fmt(med)} [{fmt(lo)}–{fmt(hi)}]"


def serving_table(serving: Serving, mode: str) -> str:
    sides = serving.configs[mode]
    rows = [
        [
            label(m),
            *(spread_shown(list(sides.get(s, {}).get(m, ()))) for s in SIDES),
            ratio_shown(serving, mode, m),
        ]
        for m in METRICS
    ]
    return md.table(["metric", "base", "patched", "patched / base"], rows)


def reps(serving: Serving, mode: str) -> int:
    sides = serving.configs[mode]
    return min(len(sides.get(s, {}).get(METRICS[0], ())) for s in SIDES)


def serving_tables(serving: Serving, said: str) -> list[str]:
    """Per mode measured: ``said`` (``{mode}``, ``{reps}``) and its table."""
    return [
        f"{said.format(mode=mode, reps=reps(serving, mode))}\n\n"
        + serving_table(serving, mode)
        for mode in MODES
        if mode in serving.configs
    ]


def commands(serving: Serving, limit: int = ROWS) -> str:
    """The commands the run used, as a code block."""
    return md.fence(serving.commands[:limit], "bash")


def commands_summary(serving: Serving) -> str:
    s = serving.sizes
    return (
        "Commands"
        if s is None
        else f"Commands ({s.num_prompts} requests of {s.input_len} tokens in, "
        f"{s.output_len} out, {s.max_concurrency} at a time; a fresh server per "
        "repetition)"
    )


def machine_line(m: Machine) -> str:
    """The machine as every report names it, and the CPU flags the kernels use."""
    flags = ", ".join(m.key_flags[:32]) or "none of the listed"
    return md.text(f"{m.summary()}; kernel flags: {flags}", 400)


def load_line(load: Load) -> str:
    before, after = ("?" if v is None else f"{v:g}" for v in (load.before, load.after))
    text = f"load average {before} at the start, {after} at the end"
    share = load.other_share
    return text + (
        "" if share is None else f"; other processes used {share:.0%} of the CPU time"
    )


def kernels_lines(serving: Serving, limit: int = ROWS) -> list[str]:
    """What each server logged about its kernel choice."""
    return [
        f"- {mode}, {side}: {md.code(line)}"
        for mode, sides in serving.server_log.items()
        for side in SIDES
        for line in sides.get(side, ())[:limit]
    ]


def first_difference(first: Divergence | None) -> str:
    """Where the greedy tokens first part (counted from 0 in the evidence) in
    words, counted from 1."""
    if first is None:
        return "the same tokens for every prompt"
    mode = f" ({md.text(first.mode, 20)})" if first.mode else ""
    return (
        f"first different token: prompt {first.prompt + 1}, "
        f"position {first.position + 1}{mode}"
    )


def model_name(ev: Evidence) -> str:
    """The model in a few words (its description is for ``evidence.md``)."""
    model = ev.model
    return md.text((model and (model.name or model.description)) or "the model")


def throughput_claim(ev: Evidence) -> str | None:
    configs = ev.serving.configs if ev.serving else {}
    said = ", ".join(
        f"{ratio_shown(ev.serving, m, 'output_throughput')} {m}"
        for m in MODES
        if m in configs
    )
    return said and (
        f"- Output throughput with this change over the base, serving "
        f"{model_name(ev)}, median [min–max] of the repetitions: {said}."
    )


def tokens_claim(ev: Evidence) -> str | None:
    t = ev.tokens
    if t is None or t.max_dlogprob is None:
        return None
    note = NOT_QUALITY if ev.model and ev.model.random_weights else ""
    return (
        f"- Greedy completions of {t.prompts} prompts, {t.tokens} tokens, against "
        f"the base: {first_difference(t.first)}; largest |Δ logprob| "
        f"{t.max_dlogprob:.3g}{note}."
    )


def lm_eval_claim(ev: Evidence) -> str | None:
    lm = ev.lm_eval
    if lm is None or set(lm.scores) != set(SIDES):
        return None
    scores = [
        f"{lm.scores[s][0]:.3g} ± {lm.scores[s][1]:.3g} {said}"
        for s, said in zip(SIDES, ("base", "with this change"), strict=True)
    ]
    return f"- {md.text(lm.task, 60)} exact_match: {', '.join(scores)}."


def perop_claim(perop: PerOp, limit: int = ROWS) -> str | None:
    """The base's time per call of vLLM's norm layer over this change's."""
    layer: dict[str, dict[int, dict[str, float]]] = {}
    for r in perop.rows:
        if r.route.startswith("layer:") and r.median_us:
            layer.setdefault(r.op, {}).setdefault(r.tokens, {})[r.env] = r.median_us
    said = [
        f"{md.text(op, 60)} "
        + " / ".join(f"{t['base'] / t['patched']:.1f}x" for t in by.values())
        + f" at {' / '.join(map(str, by))} tokens"
        for op, by in layer.items()
        if all(set(t) >= set(SIDES) for t in by.values())
    ]
    return said and (
        f"- Per call of vLLM's norm layer ({md.text(perop.dtype, 20)}, hidden "
        f"{perop.hidden_size}, {perop.threads} thread), the base's time over "
        f"this change's: {'; '.join(said[:limit])}."
    )


def claims(ev: Evidence, limit: int = ROWS) -> list[str]:
    """What the figures say, a line each (what was not measured: no line)."""
    found = [
        throughput_claim(ev),
        ev.perop and perop_claim(ev.perop, limit),
        tokens_claim(ev),
        lm_eval_claim(ev),
    ]
    return [c for c in found if c]


def accuracy_lines(ev: Evidence, limit: int = ROWS) -> list[str]:
    out = []
    t = ev.tokens
    for mode, found in (t.configs if t else {}).items():
        out.append(
            f"- {mode}: {found.identical} of {found.prompts} prompts identical "
            f"({t.tokens} greedy tokens each); {first_difference(found.first)}; "
            f"largest |Δ logprob| of the top token before that: "
            f"{found.max_dlogprob:.3g}"
        )
    if t and t.note:
        out.append(f"\n{md.text(t.note, 1000)}")
    lm = ev.lm_eval
    if lm and lm.scores:
        rows = [[s, f"{em:.4f} ± {se:.4f}"] for s, (em, se) in lm.scores.items()]
        how = ", ".join(md.text(x, 60) for x in (lm.mode, lm.filter) if x) + (
            f", --limit {lm.limit}" if lm.limit else ""
        )
        out += [
            "",
            f"`lm_eval` {md.text(lm.task, 60)} ({how}):",
            "",
            md.table(["vLLM", "exact_match ± stderr"], rows, limit),
        ]
    return out


QWEN3_SIDES = {
    "base": "base: native",
    "patched": "patched",
    "unguarded": "unguarded: the kernels for every input, as before #31643",
}


def qwen3_eager_markdown(found: dict[str, Any]) -> list[str]:
    """The eager Qwen3 comparison: per side its kernel calls, its tokens
    against base's and how varied its text is; the first differing text."""
    found = escaped(found)
    sides, rows = found["sides"], []
    for side, name in QWEN3_SIDES.items():
        than = found.get(side)  # base against base: no row of its own
        shares = sides[side]["distinct_share"]
        first = than and than["first_divergence"]
        rows.append(
            [
                f"{name} ({found['patch']})" if side == "patched" else name,
                " + ".join(str(n) for n in sides[side]["kernel_calls"].values()),
                than and f"{than['identical_prompts']} of {len(than['per_prompt'])}",
                than and first_difference(first and Divergence(**first)),
                than and f"{than['max_abs_dlogprob']:.3g}",
                f"{sum(shares) / len(shares):.2f}",
            ]
        )
    header = [
        "RMSNorm on CPU",
        "kernel calls (rms_norm + fused add), one prefill and one decode step",
        "prompts with base's tokens",
        "first different token",
        "largest |Δ logprob| before it",
        "distinct tokens per completion",
    ]
    out = [
        "vLLM #31643 put `RMSNorm` on native on CPU after the kernels, reached "
        "with `--enforce-eager`, gave gibberish on Qwen3-0.6B. Qwen3's q_norm and "
        "k_norm run on strided per-head views of the qkv output, which the CPU "
        "kernels read as contiguous; the patched vLLM sends them to native, but "
        "for one token's row (a one-sequence decode step), which is contiguous. "
        f"Here: {found['model']['description']}; {len(found['prompts'])} "
        f"prompts, {found['max_tokens']} greedy tokens each, eager, one offline "
        "engine per side.",
        "",
        md.table(header, rows),
    ]
    first = (found.get("unguarded") or {}).get("first_divergence")
    if first:
        texts = {s: sides[s]["texts"][first["prompt"]] for s in ("base", "unguarded")}
        out += ["", f"Prompt {first['prompt'] + 1}'s completion:", ""]
        out += [f"- {s}: {' '.join(t.split()[:16])} …" for s, t in texts.items()]
    return out


def numerics_table(numerics: Numerics, limit: int = ROWS) -> str:
    rows = []
    for build, ops in numerics.needed.items():
        for op, dtypes in ops.items():
            for dtype, need in dtypes.items():
                rtol, atol = numerics.tolerance.get(op, {}).get(dtype, (None, None))
                ok = None if rtol is None or isinstance(need, str) else need <= rtol
                shown = md.text(need, 200) if isinstance(need, str) else need
                names = (md.text(x, 60) for x in (build, op, dtype))
                verdict = {True: "yes", False: "**no**", None: "-"}[ok]
                rows.append([*names, shown, rtol, atol, verdict])
    header = ["kernel build", "op", "dtype", "rtol needed", "rtol allowed", "atol"]
    return md.table([*header, "within vLLM's tolerance"], rows, limit)


def perop_table(
    perop: PerOp, leave_out: tuple[str, ...] = (), limit: int = ROWS
) -> str:
    """Microseconds per call: a row per op and token count, a column per vLLM
    and route (but the routes ``leave_out``), with native's time over it."""
    kept = [r for r in perop.rows if r.route not in leave_out]
    columns = list(dict.fromkeys((r.env, r.route) for r in kept))
    cells: dict[tuple, dict] = {}
    for r in kept:
        if r.wrong:
            text = "outside the tolerance"
        else:
            ratio = "" if r.route == NATIVE else f" ({r.native_us / r.median_us:.2f}x)"
            spread = "" if r.p10_us is None else f" [{r.p10_us:.1f}–{r.p90_us:.1f}]"
            text = f"{r.median_us:.1f}{spread}{ratio}"
        cells.setdefault((r.op, r.tokens), {})[(r.env, r.route)] = text
    rows = [
        [md.code(op, 60), tokens, *(found.get(c) for c in columns)]
        for (op, tokens), found in cells.items()
    ]
    header = [md.text(f"{e}: {r}", 60) for e, r in columns]
    return md.table(["op", "tokens", *header], rows, limit)


def perop_heading(perop: PerOp, escape=md.text) -> str:
    spread = (
        ""
        if perop.clock is None
        else f", median [p10–p90] of the {escape(perop.clock, 40)}"
    )
    return (
        f"Microseconds per call (native / this){spread}, {escape(perop.dtype, 20)}, "
        f"hidden {perop.hidden_size}, {perop.threads} thread"
    )


SPLIT = ("layer call", "CustomOp dispatch", "forward and IR dispatch",
         "IR dispatch alone", "allocation", "kernel or native ops")  # fmt: skip


def perop_split(perop: PerOp, tokens: int = 1) -> list[list]:
    """Where a layer call's time goes, per vLLM and op at ``tokens``: the layer
    call, CustomOp dispatch (layer call - its forward method), the forward
    method's own work with IR dispatch (forward - what it runs), IR dispatch
    alone (an ``ir:`` route - the kernel with its allocation), the allocation
    and the bare kernel (or native's ops). Medians, microseconds."""
    rows = [r for r in perop.rows if r.tokens == tokens and r.median_us is not None]
    us = {(r.env, r.op, r.route): r.median_us for r in rows}
    out = []
    for r in rows:
        env, op, cls = r.env, r.op, r.route.partition(":")[2]
        forward = us.get((env, op, f"forward:{cls}"))
        if not r.route.startswith("layer:") or forward is None:
            continue
        kernel = r.impl == "kernel"
        impl = us.get((env, op, "kernel") if kernel else ("both", op, NATIVE))
        ir = [v for (e, o, route), v in us.items() if (e, o) == (env, op)
              and route.startswith("ir:")]  # fmt: skip
        cells = [
            r.median_us,
            r.median_us - forward,
            None if impl is None else forward - impl,
            min(ir) - impl if ir and kernel and impl is not None else None,
            us.get((env, op, "alloc")) if kernel else None,
            us.get((env, op, "kernel:bare")) if kernel else impl,
        ]
        names = [md.text(env, 40), md.code(op, 60), md.text(f"{cls} ({r.impl})", 80)]
        out.append(names + [None if c is None else round(c, 1) for c in cells])
    return out


def perop_lines(perop: PerOp, limit: int = ROWS) -> list[str]:
    """The per-call section: the table, each child's load, where time goes."""
    out = [perop_table(perop, limit=limit)]
    if perop.load:
        loads = ", ".join(
            f"{md.text(x.env, 40)} {x.load_average} ({x.other_share:.0%})"
            for x in perop.load
        )
        out += [
            "",
            f"Load average per child (other processes' share of the CPU): {loads}. "
            "`native` is one baseline: its samples in both vLLMs.",
        ]
    split = perop_split(perop)
    if split:
        out += [
            "",
            "Where a layer call's time goes (1 token, medians, microseconds):",
            "",
            md.table(["vLLM", "op", "layer (runs)", *SPLIT], split, limit),
        ]
    return out


# --- the decode section (``bench --decode``), from its bounded tree ---


def escaped(tree: Any) -> Any:
    """A bounded tree (``evidence_record._tree``) with every string, keys
    included, as literal Markdown text."""
    if isinstance(tree, dict):
        return {md.text(k, 80): escaped(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [escaped(v) for v in tree]
    return md.text(tree, 200) if isinstance(tree, str) else tree


def excludes(ci95: list[float], value: float) -> bool:
    return ci95[0] > value or ci95[1] < value


def shown_ratio(found: dict[str, Any] | None) -> str:
    if not found:
        return "-"
    lo, hi = found["ci95"]
    return f"{found['ratio']:.3f}x [{lo:.3f}–{hi:.3f}]"


def shown_ms(found: dict[str, Any] | None) -> str:
    if not found:
        return "-"
    lo, hi = found["ci95"]
    return f"{found['ms']:.2f} [{lo:.2f}–{hi:.2f}]"


def verdict(found: dict[str, Any], label: str) -> str:
    """What an interval says against 1.0."""
    if not excludes(found["ci95"], 1.0):
        return "no difference resolved (the interval contains 1.0)"
    faster = found["ci95"][1] < 1.0
    return f"{label} {'faster' if faster else 'slower'}"


def decode_block_lines(b: dict[str, Any]) -> list[str]:
    from vllm_patch.runtime.machine import BUSY_SHARE

    comps = b["comparisons"]
    rows = [
        [
            label + (" (A/A control)" if label == "base/base" else ""),
            shown_ratio(c),
            shown_ratio(c.get("wall")),
            c["n"],
        ]
        for label, c in comps.items()
    ]
    out = [
        md.table(["decode step", "CPU time ratio [95% CI]", "wall ratio [95% CI]",
                  "pairs"], rows),
        "",
    ]  # fmt: skip
    header = ["engine", "step, CPU ms [95% CI]", "step, wall ms"]
    if "norm_ms" in b:
        header += ["inside RMSNorm, CPU ms", "inside RMSNorm, wall ms"]
    out.append(
        md.table(
            header,
            [
                [n, shown_ms(b["step_ms"][n]), shown_ms(b["step_wall_ms"][n])]
                + (
                    [shown_ms(b["norm_ms"][n]), shown_ms(b["norm_wall_ms"][n])]
                    if "norm_ms" in b
                    else []
                )
                for n in b["step_ms"]
            ],
        )
    )
    for side, s in (b.get("savings") or {}).items():
        share = s["share"]
        out += [
            "",
            f"- {side}: {shown_ms(s['saving_ms'])} ms of CPU time saved inside "
            f"RMSNorm per decode step ({b['norm_calls_per_step']:.0f} calls), "
            f"{share['share']:.1%} [{share['ci95'][0]:.1%}–{share['ci95'][1]:.1%}] "
            f"of base's step: a step ratio of {s['expected_ratio'][0]:.3f}–"
            f"{s['expected_ratio'][1]:.3f} expected.",
        ]
    if "consistent" in b:
        c = b["consistent"]
        out.append(
            "- The end-to-end patched/base ratio "
            + ("**contradicts**" if c["contradicts"] else "does not contradict")
            + " the attributed saving (its interval "
            + ("misses" if c["contradicts"] else "meets")
            + " the expected one)."
        )
    out.append(
        f"- {b['busy_rounds']} of {b['rounds']} rounds busy (other processes "
        f"used over {BUSY_SHARE:.0%} of the CPU time)."
    )
    return out


def decode_lines(decode: dict[str, Any]) -> list[str]:
    """The decode section, the headline first; every string in it escaped."""
    d = escaped(decode)
    model = d["model"].get("name") or d["model"].get("description")
    out = [
        f"## Decode step: {d['dtype']}, {d['threads']} thread(s), kernel build "
        f"{d['kernel_build']}",
        "",
        f"{model}; batch 1; each round, every engine (each kept alive in its "
        f"own process) generates {d['tokens']} tokens, the engines taking turns "
        "step by step; a round's figure is the median of its decode steps; "
        "ratios are trimmed means of per-round ratios with bootstrap 95% "
        "intervals; the CPU time is the engine process's.",
        "",
    ]
    if "comparisons" in d:
        out += decode_block_lines(d)
    for n, b in d["by_threads"].items():
        if str(n) != str(d["threads"]):
            out += ["", f"### {n} threads", "", *decode_block_lines(b)]
    for n, b in d["compiled"].items():
        c = b["comparisons"].get("+rms_norm/default")
        out += [
            "",
            f"### Compiled (Inductor), {n} thread(s): custom_ops "
            '["none", "+rms_norm"] (the kernels) against the default (native)',
            "",
            *decode_block_lines(b),
        ]
        if c:
            out.append(f"- Kernels under Inductor: {verdict(c, '+rms_norm')}.")
    return out


def evidence_markdown(ev: Evidence) -> str:
    """``evidence.md``: what the run measured, and only that."""
    out = ["# vllm-patch bench evidence", ""]
    if ev.machine:
        out.append(f"- Machine: {machine_line(ev.machine)}")
    if ev.vllm:
        v = ev.vllm
        out.append(
            f"- vLLM: base {md.text(v.base, 60)}; patched: {md.text(v.patched, 60)} "
            f"with {md.code(v.patch, 60)}"
        )
    if ev.model and ev.model.description:
        out.append(f"- Model: {md.text(ev.model.description, 400)}")
    if ev.load:
        out.append(f"- Load: {load_line(ev.load)}")
    if ev.interrupted:
        out.append("- **Interrupted**: this is what was measured before that.")
    out += [f"- **Failed:** {md.text(f, 1000)}" for f in ev.failed]
    found = claims(ev)
    if found:
        out += ["", "## In short", "", *found]
    if ev.decode:
        out += ["", *decode_lines(ev.decode)]
    serving = ev.serving
    if serving:
        said = "## Serving, {mode}: median [min–max] of {reps} repetitions"
        out += [line for t in serving_tables(serving, said) for line in ("", t)]
        if serving.commands:
            out += ["", md.details(commands_summary(serving), commands(serving))]
        if serving.server_log:
            out += ["", "What the servers logged about their kernels:", ""]
            out += kernels_lines(serving)
    acc = accuracy_lines(ev)
    if ev.qwen3_eager:
        acc += ["", *qwen3_eager_markdown(ev.qwen3_eager)]
    if acc:
        out += ["", "## Accuracy", "", *acc]
    if ev.numerics:
        heading = "## Numerics per x86 kernel build"
        out += ["", heading, "", numerics_table(ev.numerics)]
    if ev.perop:
        out += ["", f"## {perop_heading(ev.perop)}", "", *perop_lines(ev.perop)]
    return "\n".join(out) + "\n"

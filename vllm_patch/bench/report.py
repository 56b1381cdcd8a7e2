"""The section writers for ``evidence.md`` and the PR body: strings as data."""

import statistics
from collections.abc import Callable

from vllm_patch.bench import likelihood
from vllm_patch.bench import record as er
from vllm_patch.bench.record import (
    A_A,
    ALLOC,
    FORWARD_NATIVE,
    HALF_WIDTH,
    METRICS,
    MINIMAL,
    MODES,
    NATIVE,
    SIDES,
    UNGUARDED,
)
from vllm_patch.runtime import markdown as md
from vllm_patch.runtime.machine import BUSY_SHARE

LABELS = {"request_throughput": "requests/s", "output_throughput": "output tok/s"}
ROWS = 500  # the most rows of a table in evidence.md
VERDICTS = {
    "helps": "helps (interval below 1)",
    "neutral": "neutral (interval holds 1)",
    "loses": "**loses** (interval above 1)",
    "unresolved": "unresolved (the A/A interval misses 1)",
    "busy": "not judged: most rounds busy, measure on a quiet machine",
}
NOT_QUALITY = " (random weights: the builds' numerics, not model quality)"


def ratios(serving: er.Serving, mode: str, metric: str, over="patched") -> list:
    """``over`` / base per repetition (the servers ran one after the other)."""
    sides = serving.configs.get(mode, {})
    base, other = (sides.get(s, {}).get(metric, ()) for s in ("base", over))
    return [p / b for b, p in zip(base, other, strict=False) if b]


def spread_shown(values: list[float], ratio: bool = False) -> str:
    """``median [min–max]`` of ``values``; ``-`` for none."""
    if not values:
        return "-"
    med, lo, hi = (
        f"{v:.3f}x" if ratio else f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        for v in (statistics.median(values), min(values), max(values))
    )
    return med if len(values) == 1 else f"{med} [{lo}–{hi}]"


def interval_shown(found: er.Estimate | None, fmt: str = ".3f", unit="") -> str:
    if found is None:
        return "-"
    v, lo, hi = (format(x, fmt) for x in (found.value, *found.ci95))
    return f"{v}{unit} [{lo}–{hi}]"


OVER_BASE = {
    "patched": "patched / base",
    UNGUARDED: f"{UNGUARDED} / base (the thread guard off)",
    A_A: f"{A_A} / base (A/A)",
}


def serving_table(serving: er.Serving, mode: str) -> str:
    """Per metric each vLLM's figures, patched / base, unguarded / base where it
    ran and base2 / base (A/A)."""
    sides = serving.configs[mode]
    over = [s for s in OVER_BASE if s == "patched" or s in sides]
    rows = [
        [
            LABELS.get(m) or _label(*m.split("_")),
            *(spread_shown(list(sides.get(s, {}).get(m, ()))) for s in SIDES),
            *(spread_shown(ratios(serving, mode, m, o), ratio=True) for o in over),
        ]
        for m in METRICS
    ]
    heads = ["metric", "base", "patched", *(OVER_BASE[o] for o in over)]
    return md.table(heads, rows)


def _label(stat: str, name: str, unit: str) -> str:  # median_tpot_ms: TPOT median
    return f"{name.upper()} {stat.replace('p99', 'P99')} ({unit})"


def serving_tables(serving: er.Serving, said: str) -> list[str]:
    """Per mode measured: ``said`` (``{mode}``, ``{reps}``) and its table, and
    the repetitions a ratio left out (a vLLM ran more than the base)."""
    out = []
    for mode in (m for m in MODES if m in serving.configs):
        sides = serving.configs[mode]
        counts = {s: len(v.get(METRICS[0], ())) for s, v in sides.items()}
        reps = min(counts.get(s, 0) for s in SIDES)
        said_here = said.format(mode=mode, reps=reps)
        out.append(f"{said_here}\n\n{serving_table(serving, mode)}")
        base = counts.get("base", 0)
        unpaired = {s: n for s, n in counts.items() if n != base}
        if unpaired:
            found = ", ".join(f"{md.text(s, 20)} {n}" for s, n in unpaired.items())
            out.append(
                f"\nRepetitions: base {base}, {found}; a ratio pairs the first "
                f"{min(base, *unpaired.values())} in order and leaves the rest out."
            )
    return out


def first_difference(first: er.Divergence | None) -> str:
    """Where the greedy tokens first part, counted from 1."""
    if first is None:
        return "the same tokens for every prompt"
    mode = f" ({md.text(first.mode, 20)})" if first.mode else ""
    return (
        f"first different token: prompt {first.prompt + 1}, "
        f"position {first.position + 1}{mode}"
    )


def claims(ev: er.Evidence, limit: int = ROWS) -> list[str]:
    """What the figures say, a line each, the decode step (the headline) first."""
    found = [decode_claim(d) for d in [ev.decode, *ev.decode_dtypes] if d]
    found += [throughput_claim(ev), ev.perop and perop_claim(ev.perop, limit)]
    t = ev.accuracy.tokens
    lm = ev.accuracy.lm_eval
    if t and t.max_abs_dlogprob is not None:
        note = ev.model.random_weights and NOT_QUALITY
        found.append(
            f"- Greedy completions of {t.prompts} prompts, {t.tokens} tokens, "
            f"against the base: {first_difference(t.first_divergence)}; "
            f"largest |Δ logprob| {t.max_abs_dlogprob:.3g}{note or ''}."
        )
    if lm and set(lm.scores) == set(SIDES):
        b = lm.base
        p = lm.patched
        found.append(
            f"- {md.text(lm.task, 60)} exact_match: {b.exact_match:.3g} ± "
            f"{b.stderr:.3g} base, {p.exact_match:.3g} ± {p.stderr:.3g} with this "
            "change."
        )
    found.append(ev.qwen3_eager and qwen3_claim(ev.qwen3_eager))
    found += [likelihood_claim(c, ev.model) for c in ev.likelihood[:limit]]
    return [c for c in found if c]


def likelihood_claim(c: er.Likelihood, model: er.Model) -> str:
    """One dtype and build: patched - base per token, and the greedy tokens."""
    ll = c.likelihood
    greedy = c.greedy
    said = "; ".join(
        f"{md.text(side, 20)} − base {likelihood.shown(diff)} nats/token, greedy "
        f"{likelihood.greedy_shown(greedy, side)}"
        for side, diff in ll.difference.items()
    )
    return (
        f"- Log-likelihood of {md.text(ll.text, 200)} ({ll.tokens:,} tokens, "
        f"{md.text(model.named(), 80)}, {md.text(ll.dtype, 20)}, "
        f"{md.code(ll.build, 20)}), 95% interval over chunks: {said}."
    )


def decode_claim(d: er.Decode) -> str | None:
    """The headline layout's patched/base ratio, its control and its saving."""
    b = d.headline
    ratio = b and b.comparisons.get("patched/base")
    if not ratio:
        return None
    control = b.comparisons.get("base/base")
    saved = b.savings.get("patched")
    aa = control and f" (A/A control {interval_shown(control, unit='x')})"
    inside = saved and (
        f"; {interval_shown(saved.saving_ms, '.2f')} ms saved inside RMSNorm per "
        f"step, {saved.share.value:.1%} of it"
    )
    return (
        f"- A decode step ({md.text(d.dtype, 20)}, {layout_named(d.threads)}, "
        f"kernel build {md.code(d.kernel_build, 20)}, "
        f"{md.text(d.model.named(), 80)}), this change's CPU time over the "
        "base's, 95% interval: "
        f"{interval_shown(ratio, unit='x')}{aa or ''}{inside or ''}."
        f"{layouts_said(d)}"
    )


def layouts_said(d: er.Decode) -> str:
    """`` Per layout: ...``: each layout's patched/base and its verdict."""
    said = []
    for name, b in d.by_threads.items():
        found = b.comparisons.get("patched/base")
        if found and found.verdict:
            said.append(
                f"{layout_named(name)} {interval_shown(found, unit='x')}, "
                f"{found.verdict}"
            )
    return f" Per layout: {'; '.join(said)}." if len(said) > 1 else ""


def throughput_claim(ev: er.Evidence) -> str | None:
    configs = ev.serving.configs if ev.serving else {}
    shown = {
        (m, o): spread_shown(ratios(ev.serving, m, "output_throughput", o), True)
        for m in configs
        for o in OVER_BASE
    }
    beside = {A_A: "A/A", UNGUARDED: "the thread guard off"}

    def within(mode: str) -> str:
        said = [
            f"{beside[o]}: {shown[mode, o]}" for o in beside if o in configs[mode]
        ]
        return f" ({'; '.join(said)})" if said else ""

    said = ", ".join(
        f"{shown[m, 'patched']} {m}{within(m)}" for m in MODES if m in configs
    )
    return said and (
        f"- Output throughput with this change over the base, serving "
        f"{md.text(ev.model.named())}, median [min–max] of the repetitions: {said}."
    )


def perop_claim(perop: er.PerOp, limit: int = ROWS) -> str | None:
    """Per op and token count, the base's time per layer call over this change's."""
    layer: dict[tuple[str, int], dict[str, er.PerOpRow]] = {}
    for r in perop.every_route():
        if r.route.startswith("layer:") and r.median_us:
            layer.setdefault((r.op, r.tokens), {})[r.env] = r
    said = []
    native = {}
    for (op, tokens), by in layer.items():
        if set(SIDES) <= set(by) and by["patched"].impl == "native":
            native[md.code(op, 60)] = None
        elif set(SIDES) <= set(by):
            ratio = by["base"].median_us / by["patched"].median_us
            noun = "token" if tokens == 1 else "tokens"
            said.append(f"{md.code(op, 60)} at {tokens} {noun} {ratio:.1f}x")
    if not (said or native):
        return None
    kept = native and (
        f" {', '.join(native)} stayed native here, as the rule has it on this "
        "kernel build."
    )
    return (
        f"- A call through `RMSNorm` on CPU ({md.text(perop.dtype, 20)}, hidden "
        f"{perop.hidden_size}, {perop.threads} thread(s)), the base's time over "
        f"this change's: {'; '.join(said[:limit]) or 'no call reached the kernel'}."
        f"{kept or ''}"
    )


def qwen3_claim(q: er.Qwen3Eager) -> str:
    patched = q.patched
    unguarded = q.unguarded
    said = (
        "- Eager Qwen3-architecture model (#31643's configuration): with this "
        f"change {patched.identical_prompts} of {len(q.prompts)} prompts give the "
        "base's greedy tokens (largest |Δ logprob| "
        f"{patched.max_abs_dlogprob:.3g}), the kernels running "
        f"{sum(q.sides.patched.kernel_calls.values())} times"
    )
    if unguarded.first_divergence is None:
        return said + "; the kernels unguarded give the same tokens too."
    return (
        f"{said}; the kernels unguarded, as before #31643, match in "
        f"{unguarded.identical_prompts} of {len(q.prompts)}."
    )


def accuracy_lines(ev: er.Evidence, limit: int = ROWS) -> list[str]:
    out = []
    t = ev.accuracy.tokens
    for mode, found in (t.configs if t else {}).items():
        out.append(
            f"- {mode}: {found.identical_prompts} of {len(found.per_prompt)} "
            f"prompts identical ({t.tokens} greedy tokens each); "
            f"{first_difference(found.first_divergence)}; largest |Δ logprob| of "
            f"the top token before that: {found.max_abs_dlogprob:.3g}"
        )
    if t and t.note:
        out.append(f"\n{md.text(t.note, 1000)}")
    lm = ev.accuracy.lm_eval
    if lm and lm.scores:
        rows = [
            [s, f"{x.exact_match:.4f} ± {x.stderr:.4f}"]
            for s, x in lm.scores.items()
        ]
        first = next(iter(lm.scores.values())).filter
        how = ", ".join(md.text(x, 60) for x in (lm.mode, first) if x) + (
            f", --limit {lm.limit}" if lm.limit else ""
        )
        table = md.table(["vLLM", "exact_match ± stderr"], rows, limit)
        out.append(f"\n`lm_eval` {md.text(lm.task, 60)} ({how}):\n\n{table}")
    return out


QWEN3_LABELS = {
    "base": "base: native",
    "patched": "patched",
    "unguarded": "unguarded: the kernels for every input, as before #31643",
}
QWEN3_HEADER = (
    "RMSNorm on CPU",
    "kernel calls (rms_norm + fused add), one prefill and one decode step",
    "prompts with base's tokens",
    "first different token",
    "largest |Δ logprob| before it",
    "distinct tokens per completion",
)


def qwen3_eager_markdown(q: er.Qwen3Eager) -> list[str]:
    """Per side its kernel calls, tokens against base's and text's variety."""
    rows = []
    for side, name in QWEN3_LABELS.items():
        found = getattr(q.sides, side)
        than = getattr(q, side) if side != "base" else None
        shares = found.distinct_share
        rows.append(
            [
                f"{name} ({md.code(q.patch, 60)})" if side == "patched" else name,
                " + ".join(map(str, found.kernel_calls.values())),
                than and f"{than.identical_prompts} of {len(q.prompts)}",
                than and first_difference(than.first_divergence),
                than and f"{than.max_abs_dlogprob:.3g}",
                f"{sum(shares) / len(shares):.2f}",
            ]
        )
    out = [
        "vLLM #31643 put `RMSNorm` on native on CPU after the kernels, reached "
        "with `--enforce-eager`, gave gibberish on Qwen3-0.6B. Qwen3's q_norm and "
        "k_norm run on strided per-head views of the qkv output, which the CPU "
        "kernels read as contiguous; the patched vLLM sends them to native, but "
        "for one token's row (a one-sequence decode step), which is contiguous. "
        f"Here: {md.text(q.model.named(), 400)}; "
        f"{len(q.prompts)} prompts, {q.max_tokens} greedy tokens each, eager, one "
        f"offline engine per side.\n\n{md.table(QWEN3_HEADER, rows)}"
    ]
    first = q.unguarded.first_divergence
    texts = {s: getattr(q.sides, s).texts for s in ("base", "unguarded")}
    if first and all(first.prompt < len(t) for t in texts.values()):
        out += ["", f"Prompt {first.prompt + 1}'s completion:", ""]
        out += [
            f"- {s}: {md.code(' '.join(t[first.prompt].split()[:16]) + ' …')}"
            for s, t in texts.items()
        ]
    return out


def numerics_table(ev: er.Evidence, limit: int = ROWS) -> str:
    rows = []
    for build, ops in (ev.numerics or {}).items():
        for op, dtypes in ops.items():
            for dtype, need in dtypes.items():
                rtol, atol = ev.tolerance.get(op, {}).get(dtype, (None, None))
                ok = None if rtol is None or isinstance(need, str) else need <= rtol
                shown = md.text(need, 200) if isinstance(need, str) else need
                names = (md.text(x, 60) for x in (build, op, dtype))
                verdict = {True: "yes", False: "**no**", None: "-"}[ok]
                rows.append([*names, shown, rtol, atol, verdict])
    header = ["kernel build", "op", "dtype", "rtol needed", "rtol allowed", "atol"]
    return md.table([*header, "within vLLM's tolerance"], rows, limit)


def perop_table(
    perop: er.PerOp, shown: Callable[[er.PerOpRow], bool] = bool, limit: int = ROWS
) -> str:
    """Microseconds per call, a row per (op, tokens), a column per (vLLM, route)."""
    kept = [r for r in perop.every_route() if shown(r)]
    columns = list(dict.fromkeys((r.env, r.route) for r in kept))
    cells: dict[tuple, dict] = {}
    for r in kept:
        if r.wrong:
            text = "outside the tolerance"
        else:
            plain = r.route in (NATIVE, ALLOC)  # no ratio: native itself, or a part
            ratio = "" if plain else f" ({r.native_us / r.median_us:.2f}x)"
            low = r.p10_us
            high = r.p90_us
            spread = "" if None in (low, high) else f" [{low:.1f}–{high:.1f}]"
            ran = f", ran {md.text(r.impl, 20)}" if r.impl else ""
            text = f"{r.median_us:.1f}{spread}{ratio}{ran}"
        cells.setdefault((r.op, r.tokens), {})[(r.env, r.route)] = text
    rows = [
        [md.code(op, 60), tokens, *(found.get(c) for c in columns)]
        for (op, tokens), found in cells.items()
    ]
    header = [md.text(f"{e}: {r}", 60) for e, r in columns]
    return md.table(["op", "tokens", *header], rows, limit)


def perop_heading(perop: er.PerOp, escape=md.text) -> str:
    clock = perop.clock and f", median [p10–p90] of the {escape(perop.clock, 40)}"
    return (
        f"Microseconds per call (native / this){clock or ''}, "
        f"{escape(perop.dtype, 20)}, hidden {perop.hidden_size}, "
        f"{perop.threads} thread(s)"
    )


SPLIT = (
    "layer call",
    "CustomOp dispatch",
    "forward and IR dispatch",
    "IR dispatch alone",
    "allocation",
    "kernel or native ops",
)


def perop_split(perop: er.PerOp, tokens: int = 1) -> list[list]:
    """Per vLLM and op at ``tokens``, ``SPLIT``'s medians: CustomOp dispatch is the
    layer call - forward, forward's own work forward - what it runs, IR dispatch an
    ``ir:`` route - the kernel with its allocation."""
    rows = [
        r
        for r in perop.every_route()
        if r.tokens == tokens and r.median_us is not None
    ]
    us = {(r.env, r.op, r.route): r.median_us for r in rows}
    out = []
    for r in rows:
        env = r.env
        op = r.op
        cls = r.route.partition(":")[2]
        forward = us.get((env, op, f"forward:{cls}"))
        if not r.route.startswith("layer:") or forward is None:
            continue
        kernel = r.impl == "kernel"
        impl = us.get((env, op, "kernel") if kernel else ("both", op, NATIVE))
        ir = [
            v
            for (e, o, route), v in us.items()
            if (e, o) == (env, op) and route.startswith("ir:")
        ]
        cells = [
            r.median_us,
            r.median_us - forward,
            None if impl is None else forward - impl,
            min(ir) - impl if ir and kernel and impl is not None else None,
            us.get((env, op, ALLOC)) if kernel else None,
            us.get((env, op, "kernel:bare")) if kernel else impl,
        ]
        names = [
            md.text(env, 40),
            md.code(op, 60),
            md.text(f"{cls} ({r.impl})", 80),
        ]
        out.append(names + [None if c is None else round(c, 1) for c in cells])
    return out


OVERHEAD = (
    "layer's forward method",
    "minimal forward_cpu",
    "forward_native",
    "bare kernel",
    "forward / minimal",
    "forward / forward_native",
)


def perop_overhead(perop: er.PerOp) -> list[list]:
    """Per vLLM, op, dtype, hidden size and tokens: the layer's forward method
    (``forward_cpu`` on CPU) beside a minimal one, ``forward_native`` and the
    bare kernel."""

    def cell(r: er.PerOpRow) -> tuple:
        return (r.env, r.op, *perop.cell(r), r.tokens)

    us = {(*cell(r), r.route): r.median_us for r in perop.rows}
    ran = {cell(r): r.impl for r in perop.rows if r.impl}
    out = []
    for r in perop.rows:
        if not r.route.startswith("forward:") or r.median_us is None:
            continue
        key = cell(r)
        minimal = us.get((*key, MINIMAL))
        native = us.get((*key, FORWARD_NATIVE))
        cells = [r.median_us, minimal, native, us.get((*key, "kernel:bare"))]
        cells += [
            minimal and r.median_us / minimal,
            native and r.median_us / native,
        ]
        cls = r.route.partition(":")[2]
        env, op, dtype, hidden, tokens = key
        names = [md.text(env, 40), md.code(op, 60), md.text(dtype, 20), hidden]
        layer = f"{cls} ({ran[key]})" if key in ran else cls
        names += [tokens, md.text(layer, 80)]
        out.append(names + [None if c is None else round(c, 2) for c in cells])
    return out


def perop_lines(perop: er.PerOp, limit: int = ROWS) -> list[str]:
    """The per-call section: the table, each child's load, where time goes."""
    mine = (MINIMAL, FORWARD_NATIVE)
    out = [perop_table(perop, lambda r: r.route not in mine, limit=limit)]
    overhead = perop_overhead(perop)
    if overhead:
        header = ["vLLM", "op", "dtype", "hidden", "tokens", "layer (runs)"]
        header += OVERHEAD
        out.append(
            "\nThe layer path's overhead (medians, microseconds): the layer's "
            "forward method beside a minimal `forward_cpu` (allocate, call the "
            "kernel), `forward_native` and the bare kernel:\n\n"
            + md.table(header, overhead, limit)
        )
    loads = ", ".join(
        f"{md.text(x.env, 40)} {x.load_average} ({x.other_share:.0%})"
        for x in perop.load
    )
    if loads:
        out.append(
            "\nLoad average per child (other processes' share of the CPU): "
            f"{loads}. `native` is one baseline: its samples in both vLLMs."
        )
    split = perop_split(perop)
    if split:
        table = md.table(["vLLM", "op", "layer (runs)", *SPLIT], split, limit)
        out.append(
            "\nWhere a layer call's time goes (1 token, medians, microseconds):\n\n"
            + table
        )
    return out


def layout_lines(b: er.DecodeBlock, limit: int = ROWS) -> list[str]:
    """The layout the engines read back, and the rounds a ratio left out."""
    out = []
    if b.layout:
        cpus = ", ".join(map(str, b.layout.cpus[:64]))
        out.append(
            f"Layout, as the engines read it back: {b.layout.threads} OpenMP "
            f"thread(s) on CPU(s) {cpus}.\n"
        )
    for label, c in b.comparisons.items():
        if c.dropped:
            rounds = ", ".join(map(str, c.dropped[:limit]))
            said = f"rounds left out (a time not above 0 or not finite): {rounds}"
            out.append(f"- {md.code(label, 60)}: {said}.\n")
    return out


def decode_block(b: er.DecodeBlock, limit: int = ROWS) -> list[str]:
    """Ratios, per engine the step and inside ``RMSNorm``, the saving, its check."""
    rows = [
        [
            md.code(label, 60) + (" (A/A control)" if label == "base/base" else ""),
            interval_shown(c, unit="x"),
            interval_shown(c.wall, unit="x"),
            c.n,
            c.verdict and VERDICTS[c.verdict],
            {True: "yes", False: "**no**", None: "-"}[c.precise],
        ]
        for label, c in b.comparisons.items()
    ]
    header = ["decode step", "CPU time ratio [95% CI]", "wall ratio [95% CI]"]
    header += ["pairs", "the change", f"half-width ≤ {HALF_WIDTH:.0%}"]
    out = [*layout_lines(b, limit), md.table(header, rows, limit), ""]
    header = ["engine", "step, CPU ms [95% CI]", "step, wall ms"]
    parts = [b.step_ms, b.step_wall_ms]
    if b.norm_ms:
        header += ["inside RMSNorm, CPU ms", "inside RMSNorm, wall ms"]
        parts += [b.norm_ms, b.norm_wall_ms]
    rows = [
        [md.code(name, 60), *(interval_shown(p.get(name), ".2f") for p in parts)]
        for name in b.step_ms
    ]
    out += [md.table(header, rows, limit), ""]
    calls = b.norm_calls_per_step
    calls = f" ({calls:.0f} calls)" if calls is not None else ""
    for side, saved in list(b.savings.items())[:limit]:
        share = saved.share
        lo, hi = saved.expected_ratio
        out.append(
            f"- {md.text(side, 60)}: {interval_shown(saved.saving_ms, '.2f')} ms "
            f"of CPU time saved inside RMSNorm per decode step{calls}, "
            f"{share.value:.1%} [{share.ci95.low:.1%}–{share.ci95.high:.1%}] of "
            f"base's step: a step ratio of {lo:.3f}–{hi:.3f} expected."
        )
    if b.consistent is not None:  # does the end-to-end ratio agree with the saving?
        said = "does not contradict the attributed saving (its interval meets"
        how = ""
        ratio = b.comparisons.get("patched/base")
        saved = b.savings.get("patched")
        if b.consistent.contradicts:
            said = "**contradicts** the attributed saving (its interval misses"
            if ratio and saved:
                how = (
                    ": the step saves less than the time inside RMSNorm",
                    (
                        ": the step saves more than the time inside RMSNorm "
                        "accounts for"
                    ),
                )[ratio.ci95.high < saved.expected_ratio.low]
        out.append(
            f"- The end-to-end patched/base ratio {said} the expected one){how}."
        )
    out.append(
        f"- {b.busy_rounds} of {b.rounds} rounds busy (other processes used over "
        f"{BUSY_SHARE:.0%} of the CPU time)."
    )
    return out + profile_lines(b, limit)


def profile_lines(b: er.DecodeBlock, limit: int = ROWS) -> list[str]:
    """Per engine, a profiled step's parts: where a loss comes from."""
    if not b.profile_ms:
        return []
    parts = list(dict.fromkeys(k for v in b.profile_ms.values() for k in v))
    rows = [
        [md.code(name, 60), *(found.get(k) for k in parts)]
        for name, found in b.profile_ms.items()
    ]
    return [
        "",
        "Where a decode step's CPU time goes, one generation under torch's "
        "profiler (ms per step; the profiler's own cost included, so compare "
        "engines, not these with the figures above):",
        "",
        md.table(["engine", *(md.text(k, 40) for k in parts)], rows, limit),
    ]


BUILT_IN = (
    "The engines were built in the headline's layout, as vLLM builds a worker in "
    "its own, and keep what their layers decided then: where the rule decides "
    "from the threads at construction, these are the kernels unguarded.\n"
)


def layout_named(layout: str | int) -> str:
    """``auto``: vLLM's own binding; a count: that many threads, every CPU."""
    if layout == "auto":
        return "vLLM's default thread binding (VLLM_CPU_OMP_THREADS_BIND=auto)"
    return f"{md.text(str(layout), 10)} thread(s) on every CPU"


def decode_markdown(d: er.Decode, limit: int = ROWS) -> list[str]:
    """``evidence.md``'s decode section: the headline first."""
    out = [
        f"## Decode step: {md.text(d.dtype, 20)}, {layout_named(d.threads)}, "
        f"kernel build {md.text(d.kernel_build, 20)}\n\n"
        f"{md.text(d.model.named())}; "
        "batch 1; each round, every engine (each kept alive in its own process) "
        f"generates {d.tokens} tokens, the engines taking turns step by step; a "
        "round's figure is the median of its decode steps; ratios are trimmed "
        "means of per-round ratios with bootstrap 95% intervals; the CPU time is "
        "the engine process's.\n",
        *(f"- Note: {md.text(n, 400)}." for n in d.notes[:limit]),
        *(decode_block(d.headline, limit) if d.headline else ()),
    ]
    for n, b in list(d.by_threads.items())[:limit]:
        if n != str(d.threads):
            out += [f"\n### {layout_named(n)}\n", BUILT_IN, *decode_block(b, limit)]
    for n, b in list(d.compiled.items())[:limit]:
        out += [
            f"\n### Compiled (Inductor), {md.text(n, 10)} thread(s): custom_ops "
            '["none", "+rms_norm"] (the kernels) against the default (native)\n',
            *decode_block(b, limit),
        ]
        found = b.comparisons.get("+rms_norm/default")
        if found:  # against 1.0
            low, high = found.ci95
            said = f"+rms_norm {'faster' if high < 1.0 else 'slower'}"
            if low <= 1.0 <= high:
                said = "no difference resolved (the interval contains 1.0)"
            out.append(f"- Kernels under Inductor: {said}.")
    return out


def evidence_markdown(ev: er.Evidence) -> str:
    """``evidence.md``: what the run measured, and only that."""
    out = ["# vllm-patch bench evidence\n"]
    m = ev.machine
    if m:  # and the CPU flags the kernels use
        flags = ", ".join(m.key_flags[:32]) or "none of the listed"
        said = f"{m.cpu_model} ({m.arch}), {m.usable_cpus} CPUs, {m.os}"
        out.append(f"- Machine: {md.text(f'{said}; kernel flags: {flags}', 400)}")
    v = ev.vllm
    if v:
        out.append(
            f"- vLLM: base {md.text(v.base, 60)}; "
            f"patched: {md.text(v.patched, 60)} with {md.code(v.patch, 60)}"
        )
    if ev.model.description:
        out.append(f"- Model: {md.text(ev.model.description, 400)}")
    if ev.model.origin:
        o = ev.model.origin
        out.append(
            f"- Model's origin: {md.code(o.gguf, 200)} (sha256 "
            f"{md.code(o.gguf_sha256, 64)}) in {md.text(o.package, 60)} "
            f"{md.text(o.version, 20)} (wheel sha256 {md.code(o.wheel_sha256, 64)})"
        )
    load = ev.load
    if load:
        before, after = (
            f"{v[0]:g}" if v else "?" for v in (load.before, load.after)
        )
        share = load.other_processes_share
        used = "" if share is None else f"{share:.0%}"
        out.append(
            f"- Load: load average {before} at the start, {after} at the end"
            + (used and f"; other processes used {used} of the CPU time")
        )
    if ev.interrupted:
        out.append("- **Interrupted**: this is what was measured before that.")
    out += [f"- **Failed:** {md.text(f, 1000)}" for f in ev.failed]
    found = claims(ev)
    if found:
        out += ["\n## In short\n", *found]
    for d in [ev.decode, *ev.decode_dtypes] if ev.decode else []:
        out += ["", *decode_markdown(d)]
    if ev.serving:
        out += _serving_lines(ev.serving)
    acc = accuracy_lines(ev)
    if ev.qwen3_eager:
        acc += [*(acc and [""]), "### Eager Qwen3 (vLLM #31643)\n"]
        acc += qwen3_eager_markdown(ev.qwen3_eager)
    if ev.likelihood:
        acc += [*(acc and [""]), "### Log-likelihood and greedy agreement\n"]
        acc += likelihood.markdown(ev.likelihood, ev.model.named())
    if acc:
        out += ["\n## Accuracy\n", *acc]
    if ev.numerics:
        out.append(f"\n## Numerics per x86 kernel build\n\n{numerics_table(ev)}")
    for perop in [ev.perop, *ev.perop_threads] if ev.perop else []:
        out += [f"\n## {perop_heading(perop)}\n", *perop_lines(perop)]
    return "\n".join(out) + "\n"


def _serving_lines(serving: er.Serving) -> list[str]:
    said = "\n## Serving, {mode}: median [min–max] of {reps} repetitions"
    out = serving_tables(serving, said)
    s = serving.sizes
    summary = s and (
        f" ({s.num_prompts} requests of {s.input_len} tokens in, {s.output_len} "
        f"out, {s.max_concurrency} at a time; a fresh server per repetition)"
    )
    if serving.bind:
        out.append(
            f"\nEvery server's worker bound to CPUs {md.text(serving.bind, 200)} "
            "(`VLLM_CPU_OMP_THREADS_BIND`), its OpenMP team sharing them with "
            "the engine and API server processes."
        )
    if any(UNGUARDED in sides for sides in serving.configs.values()):
        out.append(
            f"\n`{UNGUARDED}`: the base vLLM with the provider on and the rule's "
            "thread guard off (`cpu_threads_shared()` made to say no in every "
            "process of that server), the kernels where the guard keeps native: "
            "what the guard gives up at this binding, or spares."
        )
    if serving.commands:
        commands = md.fence(serving.commands, "bash")
        out += ["", md.details(f"Commands{summary or ''}", commands)]
    if serving.server_log:
        out.append("\nWhat the servers logged about their kernels:\n")
        out += [
            f"- {mode}, {side}: {md.code(line)}"
            for mode, sides in serving.server_log.items()
            for side in er.SERVED
            for line in sides.get(side, ())[:ROWS]
        ]
    return out

"""The bench's outputs: the machine description, Markdown tables and a chart.

Everything printed here comes from the result document of one run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from patcher.bench.perop import DISPATCH_ROLES, NATIVE, NATIVE_COMPILED
from patcher.bench.recommend import BUSY_SHARE


def _fmt_us(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _timing(row: dict[str, Any] | None) -> str:
    """Median [quartiles] of a timed row, or why it was not timed."""
    if row is None:
        return ""
    status = row.get("status")
    if status != "ok":
        return {
            "wrong": "wrong result (not timed)",
            "unsupported_args": "unsupported",
        }.get(status, str(status))
    return (
        f"{_fmt_us(row['median_us'])} [{_fmt_us(row['q1_us'])}–{_fmt_us(row['q3_us'])}]"
    )


def _cell(row: dict[str, Any] | None) -> str:
    text = _timing(row)
    if row is not None and row.get("status") == "ok" and row["provider"] != NATIVE:
        text += f" **{row['ratio']:.2f}x**"
    return text


def _busy_warning(doc: dict[str, Any]) -> list[str]:
    shares = [v for v in doc["interference"].values() if v is not None]
    if not shares or max(shares) <= BUSY_SHARE:
        return []
    return [
        "",
        f"> **Busy machine:** other processes used up to {max(shares):.0%} of the CPU "
        "time during this run. Medians of OpenMP-parallel kernels (compiled native, "
        "the C kernels) on all cores are inflated when their threads get descheduled; "
        "see the quartiles and `min_us` in the JSON, and rerun on a quiet machine.",
    ]


def _share(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.0%}"


def _provider_order(rows: list[dict]) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    for r in rows:
        key = (r["provider"], r["source"])
        # A patched copy times its own native ones for its ratios; the table
        # and the chart show the installed ones.
        if r["provider"] in (NATIVE, NATIVE_COMPILED) and r["source"] != "installed":
            continue
        if key not in seen:
            seen.append(key)

    def rank(key: tuple[str, str]) -> tuple:
        p, s = key
        return (p != NATIVE, p != NATIVE_COMPILED, s != "installed", p, s)

    return sorted(seen, key=rank)


def perop_markdown(rows: list[dict[str, Any]]) -> str:
    out = []
    for op in sorted({r["op"] for r in rows}):
        op_rows = [r for r in rows if r["op"] == op]
        columns = _provider_order(op_rows)
        out.append(f"#### `{op}`\n")
        header = ["dtype", "shape", "threads"]
        for p, s in columns:
            header.append(_label(p, s))
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "---|" * len(header))
        configs = []
        for r in op_rows:
            c = (r["dtype"], r["num_tokens"], r["hidden_size"], r["threads"])
            if c not in configs:
                configs.append(c)
        for dtype, tokens, hidden, threads in configs:
            cells = [dtype, f"[{tokens}, {hidden}]", str(threads)]
            for p, s in columns:
                match = [
                    r
                    for r in op_rows
                    if (r["dtype"], r["num_tokens"], r["hidden_size"], r["threads"])
                    == (dtype, tokens, hidden, threads)
                    and (r["provider"], r["source"]) == (p, s)
                ]
                cells.append(_cell(match[0] if match else None))
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


DISPATCH_RATIOS = (
    ("provider", "reference"),
    ("provider", "upstream"),
    ("native", "upstream"),
)
"""Ratio columns of the dispatch table (medians, same process): the out-of-tree
provider's overhead, and what native costs against the upstream provider."""


def dispatch_markdown(rows: list[dict[str, Any]]) -> str:
    """The out-of-tree provider's per-call cost through IR dispatch, against the
    upstream provider and the minimal reference, per op and shape."""
    names: dict[str, str] = {}
    for r in rows:
        names.setdefault(r["role"], r["provider"])
    roles = [role for role in DISPATCH_ROLES if role in names]
    header = ["op", "dtype", "shape", "threads", "source"]
    header += [f"{names[role]} ({role})" for role in roles]
    ratios = [(a, b) for a, b in DISPATCH_RATIOS if a in names and b in names]
    header += [f"{names[a]} / {names[b]}" for a, b in ratios]
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    configs: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (r["op"], r["dtype"], r["num_tokens"], r["hidden_size"], r["threads"])
        configs.setdefault(key + (r["source"],), {})[r["role"]] = r
    for (op, dtype, tokens, hidden, threads, source), by_role in configs.items():
        cells = [f"`{op}`", dtype, f"[{tokens}, {hidden}]", str(threads), source]
        cells += [_timing(by_role.get(role)) for role in roles]
        for a, b in ratios:
            ratio = by_role.get(a, {}).get(f"vs_{b}")
            cells.append(f"**{ratio:.2f}x**" if ratio else "-")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def e2e_markdown(pairs: list[dict[str, Any]]) -> str:
    out = [
        "| mode | environment | priority | tok/s median [q1–q3] | ratio | "
        "same tokens | final IR op priority (vLLM log) |",
        "|---|---|---|---|---|---|---|",
    ]
    for pair in pairs:
        for name in ("native", "fused"):
            run = pair[name]
            med = run.get("median_tokens_per_s")
            rate = (
                f"{med:.2f} [{run['q1_tokens_per_s']:.2f}–{run['q3_tokens_per_s']:.2f}]"
                if med
                else f"failed: {run.get('error')}"
            )
            ratio = (
                f"**{pair['ratio']:.3f}x**" if name == "fused" and pair["ratio"] else ""
            )
            same = "" if name == "native" else str(pair.get("same_tokens"))
            out.append(
                f"| {pair['mode']} | {pair['source']} | `{run['ir_op_priority']}` | "
                f"{rate} | {ratio} | {same} | `{run.get('final_priority')}` |"
            )
    return "\n".join(out)


def token_note(pair: dict[str, Any]) -> str:
    """Why fused and native runs can produce different tokens, with where they
    parted in this run."""
    where = pair.get("first_difference")
    at = (
        f" (first at generated token {where['position'] + 1} of {where['of']})"
        if where
        else ""
    )
    return (
        f"- {pair['mode']}: the fused and native runs generated different tokens"
        f"{at}. Both implementations passed the per-op check within the op's "
        "tolerance, but their results differ in the last bits (different "
        "accumulation order and rounding in bf16). Greedy decoding picks the "
        "largest logit, and a random-weight model's top logits lie close together, "
        "so such a difference can pick another token there, and every later token "
        "follows from it. That is a rounding difference, not a wrong kernel."
    )


PATCHED_VLLM = "vLLM with this change"
"""Where the upstream provider ran, as a PR description says it."""


def evidence_markdown(doc: dict[str, Any], providers: tuple[str, ...] = ()) -> str:
    """The figures a reviewer needs, for a PR description: per op at the
    highest thread count, only ops with an alternative to native; end to end;
    the recommendation. Everything from ``doc``, nothing recomputed.

    With ``providers`` (an upstream PR's view), only those providers against
    the native ops timed in the same vLLM, end to end only their runs, and no
    recommendation."""
    m, v = doc["machine"], doc["versions"]
    rows = doc["perop"]["rows"]
    threads = max((r["threads"] for r in rows), default=None)
    natives = (NATIVE, NATIVE_COMPILED)
    if providers:
        # Each provider's rows with the native ones timed beside them (same
        # vLLM, same process), shown as that vLLM's own columns.
        sources = {r["source"] for r in rows if r["provider"] in providers}
        rows = [
            {**r, "source": "installed"}
            for r in rows
            if r["source"] in sources and r["provider"] in (NATIVE, *providers)
        ]
    alternatives = {r["op"] for r in rows if r["provider"] not in natives}
    shown = [r for r in rows if r["threads"] == threads and r["op"] in alternatives]
    pairs = (doc.get("e2e") or {}).get("pairs", [])
    dispatch = [r for r in doc["perop"].get("dispatch", []) if r["threads"] == threads]
    if providers:
        # Both ran in the vLLM the PR produces (a patched copy, or as installed).
        pairs = [
            {**p, "source": PATCHED_VLLM}
            for p in pairs
            if p.get("provider") in providers
        ]
        dispatch = [
            {**r, "source": PATCHED_VLLM}
            for r in dispatch
            if r["role"] == "native" or r["provider"] in providers
        ]
    lines = [
        f"Measured {doc['started']} on {m['cpu_model']} ({m['arch']}, "
        f"{m['usable_cpus']} CPUs; {', '.join(m['key_flags']) or 'no flags of note'}), "
        f"vLLM {v.get('vllm')}, torch {v.get('torch')}; other processes' share of CPU "
        f"time: per op {_share(doc['interference'].get('perop'))}, end to end "
        f"{_share(doc['interference'].get('e2e'))}.",
        *_busy_warning(doc),
        "",
        f"Per op, {threads} threads: microseconds per call, median [quartiles], and "
        "speed-up over native in the same process; every implementation was checked "
        "against native with the op's own tolerance before it was timed.",
        "",
        perop_markdown(shown) if shown else "No implementation other than native.\n",
    ]
    if dispatch:
        lines += [
            f"Per call through vLLM's IR dispatch, {threads} threads, as the eager "
            "forward calls the op (`maybe_inplace` where the op has it, no torch "
            "custom-op wrapper): microseconds per call, median [quartiles].",
            "",
            dispatch_markdown(dispatch),
        ]
    if pairs:
        e = doc["e2e"]
        lines += [
            f"End to end: random-weight Llama {e['model']}, batch {e['batch']}, "
            f"{e['max_tokens']} generated tokens, median of {e['repeats']} generates.",
            "",
            e2e_markdown(pairs),
            "",
        ]
    elif providers:
        lines += [
            f"End to end with {', '.join(providers)}: not measured by this bench "
            "run; the `vllm bench` commands in the Test Plan measure it.",
            "",
        ]
    if not providers:
        lines += [
            "Recommendation for this machine, from these figures:",
            "",
            recommendation_markdown(doc, snippets=False),
        ]
    return "\n".join(lines)


def recommendation_markdown(doc: dict[str, Any], *, snippets: bool = True) -> str:
    out = [
        "| op | mode | recommended priority | basis | upstream rule | agrees |",
        "|---|---|---|---|---|---|",
    ]
    for r in doc["recommendation"]:
        priority = (
            "keep vLLM's default"
            if r["priority"] is None
            else f"`{r['priority']}`"
            + (" (after `vllm-patch apply`)" if r.get("needs_apply") else "")
        )
        out.append(
            f"| `{r['op']}` | {r['mode']} | {priority} | {r['basis']} | "
            f"{r['upstream_rule']} | {'yes' if r['agrees_with_upstream'] else 'NO'} |"
        )
    out.append("")
    for mode, snip in doc["snippets"].items() if snippets else ():
        out.append(f"{mode}:\n\n```\n{snip['cli']}\n{snip['python']}\n```\n")
    return "\n".join(out)


def markdown(doc: dict[str, Any]) -> str:
    m, v, o = doc["machine"], doc["versions"], doc["options"]
    lines = [
        "# vllm-patch bench",
        "",
        f"- Machine: {m['cpu_model']} ({m['arch']}), {m['usable_cpus']} usable CPUs, "
        f"{m['memory_gib']} GiB; flags: {', '.join(m['key_flags']) or 'none of note'}",
        f"- Versions: vLLM {v.get('vllm')}, torch {v.get('torch')}, "
        f"Python {v.get('python')}, vllm-patch {v.get('vllm_patch')}",
        f"- Run: {doc['started']} – {doc['finished']}, load average before "
        f"{doc['load_before']}, after {doc['load_after']}; "
        f"{'quick' if o['quick'] else 'full'} configuration",
        f"- Other processes' share of the machine's CPU time while measuring: per op "
        f"{_share(doc['interference'].get('perop'))}, end to end "
        f"{_share(doc['interference'].get('e2e'))} (0 = quiet; OpenMP kernels on "
        "all cores suffer most when other processes compete for them)",
        *_busy_warning(doc),
        "",
        "## Per op",
        "",
        "Microseconds per call of the implementation function (no IR dispatch): "
        f"median [first–third quartile] of {o['samples']} samples, each sample "
        "timing many calls; ratio = native median / this median, from the same "
        "process. Every implementation's output was checked against native with "
        "the op's own tolerance before it was timed.",
        "",
        perop_markdown(doc["perop"]["rows"]),
    ]
    dispatch = doc["perop"].get("dispatch")
    if dispatch:
        samples = max(r.get("samples", 0) for r in dispatch)
        lines += [
            "### Per call through IR dispatch",
            "",
            "The out-of-tree provider's own per-call cost: each provider called as "
            "vLLM's eager forward calls the op (`maybe_inplace` where the op has it, "
            "priority `[provider, native]`, no torch custom-op wrapper), so its "
            "`supports_args` and its Python count. Beside it the upstream provider it "
            "stands in for (enabled on the patched copy) and a minimal reference "
            "provider that does only what the upstream impl does, all in one process; "
            f"microseconds per call, median [quartiles] of {samples} short samples "
            "taken in turn.",
            "",
            dispatch_markdown(dispatch),
        ]
    if doc["perop"]["notes"]:
        lines += ["Notes:", ""] + [f"- {n}" for n in doc["perop"]["notes"]] + [""]
    lines += ["## End to end", ""]
    if doc.get("e2e"):
        e = doc["e2e"]
        lines += [
            f"Random-weight Llama {e['model']}, batch {e['batch']}, prompt "
            f"{e['prompt_len']} tokens, {e['max_tokens']} generated tokens, "
            f"{e['repeats']} timed generates after a warm-up (engine start not timed).",
            "",
            e2e_markdown(e["pairs"]),
            "",
        ]
        lines += [f"- **Failed:** {reason}" for reason in e.get("failed", [])]
        lines += [f"- {n}" for n in e.get("notes", [])]
        lines += [token_note(p) for p in e["pairs"] if p.get("same_tokens") is False]
        lines.append("")
    else:
        lines += ["Not run.", ""]
    lines += ["## Recommendation for this machine", "", recommendation_markdown(doc)]
    return "\n".join(lines) + "\n"


def machine_markdown(doc: dict[str, Any]) -> str:
    """The machine a result was measured on, from the result document itself."""
    m, v = doc["machine"], doc["versions"]
    inter = doc.get("interference", {})
    return "\n".join(
        [
            "# The machine behind this result",
            "",
            f"- CPU: {m['cpu_model']} ({m['arch']})",
            f"- CPUs: {m['logical_cpus']} logical, {m['usable_cpus']} usable here",
            f"- Memory: {m['memory_gib']} GiB",
            f"- Kernel-relevant CPU flags: {', '.join(m['key_flags']) or 'none'}",
            f"- OS: {m['os']}",
            f"- Software: vLLM {v.get('vllm')} ({v.get('vllm_file')}), torch "
            f"{v.get('torch')}, Python {v.get('python')}, transformers "
            f"{v.get('transformers')}, vllm-patch {v.get('vllm_patch')}",
            f"- Run: {doc['started']} – {doc['finished']}",
            f"- Load average (1, 5, 15 min) before: {doc['load_before']}, after: "
            f"{doc['load_after']}",
            "- Other processes' share of CPU time: per op "
            f"{_share(inter.get('perop'))}, end to end {_share(inter.get('e2e'))}",
            "",
            "All CPU flags:",
            "",
            "```",
            " ".join(m["flags"]),
            "```",
            "",
        ]
    )


NO_CHART = (
    "no chart (perop_ratios.png): matplotlib is not installed here; "
    "`python -m pip install matplotlib` (or this project's `bench` extra: "
    "`python -m pip install -e '.[bench]'`) and run the bench again"
)


def can_draw() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _tick(dtype: str, tokens: int, hidden: int, threads: int) -> str:
    return f"{dtype} [{tokens}, {hidden}]\n{threads} thread{'s' if threads > 1 else ''}"


def _label(provider: str, source: str) -> str:
    label = "native (torch.compile)" if provider == NATIVE_COMPILED else provider
    return label if source == "installed" else f"{label} ({source})"


def _empty_panel_note(op_rows: list[dict]) -> str:
    """Why a panel has no bar: every row's status, or that only native ran."""
    reasons = sorted(
        {
            f"{_label(r['provider'], 'installed')}: {r.get('status')}"
            + (f" ({r['error']})" if r.get("error") else "")
            for r in op_rows
            if r.get("status") != "ok"
        }
    )
    if reasons:
        return "nothing to compare: " + "; ".join(reasons)[:300]
    return "only native ran for this op: no other implementation to compare"


def chart(doc: dict[str, Any], path: Path) -> Path | None:
    """Bar chart of per-op ratios to native (log scale), one panel per op; None
    without matplotlib (see ``NO_CHART``)."""
    if not can_draw():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    all_rows = doc["perop"]["rows"]
    rows = [r for r in all_rows if r["provider"] != NATIVE]
    ops = sorted({r["op"] for r in all_rows}) or ["(no op measured)"]
    fig, axes = plt.subplots(len(ops), 1, figsize=(12, 3.6 * len(ops)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops, strict=True):
        op_rows = [r for r in rows if r["op"] == op]
        series = _provider_order(op_rows)
        configs = []
        for r in op_rows:
            c = (r["dtype"], r["num_tokens"], r["hidden_size"], r["threads"])
            if c not in configs:
                configs.append(c)
        width = 0.8 / max(len(series), 1)
        drawn = 0
        for i, (p, s) in enumerate(series):
            values = []
            for c in configs:
                hit = [
                    r
                    for r in op_rows
                    if (r["dtype"], r["num_tokens"], r["hidden_size"], r["threads"])
                    == c
                    and (r["provider"], r["source"]) == (p, s)
                    and r.get("status") == "ok"
                ]
                values.append(hit[0]["ratio"] if hit else float("nan"))
            drawn += sum(v == v for v in values)  # not NaN
            ax.bar(
                [x + i * width for x in range(len(configs))],
                values,
                width,
                label=_label(p, s),
            )
        ax.set_title(op)
        if not drawn:
            ax.text(
                0.5, 0.5, _empty_panel_note([r for r in all_rows if r["op"] == op]),
                transform=ax.transAxes, ha="center", va="center", wrap=True,
                fontsize=9, color="dimgray",
            )  # fmt: skip
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_ylabel("speed-up vs native")
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(configs))])
        ax.set_xticklabels(
            [_tick(*c) for c in configs], rotation=45, ha="right", fontsize=7
        )
        ax.legend(fontsize=8)
    title = f"{doc['machine']['cpu_model']}, vLLM {doc['versions'].get('vllm')}"
    shares = [v for v in doc["interference"].values() if v is not None]
    top = 1.0
    if shares and max(shares) > BUSY_SHARE:
        fig.text(
            0.5, 0.995,
            f"BUSY MACHINE: other processes used up to {max(shares):.0%} of the CPU "
            "time while measuring; these ratios are noisy, rerun on a quiet machine",
            ha="center", va="top", color="red", fontsize=11, fontweight="bold",
        )  # fmt: skip
        top = 0.96
    fig.suptitle(title, y=top - 0.005, va="top")
    fig.tight_layout(rect=(0, 0, 1, top - 0.03))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""A bench result (``bench.json``) read as data: the words its rows use and
their Markdown tables, for the bench's own report and for a pull request
description, which quotes a result without running or importing the bench.

A row is one implementation (``provider``) of one IR op, timed in one vLLM
(``source``: as installed, or a patched copy) at one shape, dtype and thread
count: ``median_us`` with its quartiles and ``ratio`` (native's median over
this one, from the same process), or a ``status`` saying why it was not timed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_patch.runtime.machine import BUSY_SHARE

NATIVE = "native"
"""vLLM's own PyTorch implementation of an IR op: every ratio's baseline."""
NATIVE_COMPILED = "native_compiled"
"""Pseudo provider: the native implementation under ``torch.compile`` (Inductor)."""
DISPATCH_ROLES = ("native", "upstream", "reference", "provider")
"""Columns of the dispatch table: ``provider`` is the out-of-tree one."""


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


def busy_warning(doc: dict[str, Any]) -> list[str]:
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


def share(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.0%}"


def provider_order(rows: list[dict]) -> list[tuple[str, str]]:
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
        columns = provider_order(op_rows)
        out.append(f"#### `{op}`\n")
        header = ["dtype", "shape", "threads"]
        for p, s in columns:
            header.append(label(p, s))
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


def dispatch_markdown(rows: list[dict[str, Any]], *, roles_shown: bool = True) -> str:
    """The out-of-tree provider's per-call cost through IR dispatch, against the
    upstream provider and the minimal reference, per op and shape; without
    ``roles_shown`` the columns are the providers' names alone (a PR's reader
    knows no roles)."""
    names: dict[str, str] = {}
    for r in rows:
        names.setdefault(r["role"], r["provider"])
    roles = [role for role in DISPATCH_ROLES if role in names]
    header = ["op", "dtype", "shape", "threads", "source"]
    header += [f"{names[r]} ({r})" if roles_shown else names[r] for r in roles]
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


def label(provider: str, source: str) -> str:
    label = "native (torch.compile)" if provider == NATIVE_COMPILED else provider
    return label if source == "installed" else f"{label} ({source})"


PATCHED_VLLM = "vLLM with this change"
"""Where the upstream provider ran, as a PR description says it."""


@dataclass(frozen=True)
class _Evidence:
    """The rows a PR description shows, picked from a bench result."""

    threads: int | None
    perop: list[dict[str, Any]]
    dispatch: list[dict[str, Any]]
    e2e: list[dict[str, Any]]


def _evidence(doc: dict[str, Any], providers: tuple[str, ...]) -> _Evidence:
    rows = doc["perop"]["rows"]
    threads = max((r["threads"] for r in rows), default=None)
    natives = (NATIVE, NATIVE_COMPILED)
    # Each provider's rows with the native ones timed beside them (same vLLM,
    # same process), shown as that vLLM's own columns.
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
    # Both ran in the vLLM the PR produces (a patched copy, or as installed).
    pairs = [
        {**p, "source": PATCHED_VLLM} for p in pairs if p.get("provider") in providers
    ]
    dispatch = [
        {**r, "source": PATCHED_VLLM}
        for r in dispatch
        if r["role"] == "native" or r["provider"] in providers
    ]
    return _Evidence(threads, shown, dispatch, pairs)


def _measured_on(doc: dict[str, Any]) -> list[str]:
    m, v = doc["machine"], doc["versions"]
    return [
        f"Measured {doc['started']} on {m['cpu_model']} ({m['arch']}, "
        f"{m['usable_cpus']} CPUs; {', '.join(m['key_flags']) or 'no flags of note'}), "
        f"vLLM {v.get('vllm')}, torch {v.get('torch')}; other processes' share of CPU "
        f"time: per op {share(doc['interference'].get('perop'))}, end to end "
        f"{share(doc['interference'].get('e2e'))}.",
        *busy_warning(doc),
    ]


def _end_to_end(doc: dict[str, Any], ev: _Evidence, providers) -> list[str]:
    if not ev.e2e:
        return [
            f"End to end with {', '.join(providers)}: not measured by this bench "
            "run; the `vllm bench` commands above measure it.",
            "",
        ]
    e = doc["e2e"]
    return [
        f"End to end: random-weight Llama {e['model']}, batch {e['batch']}, "
        f"{e['max_tokens']} generated tokens, median of {e['repeats']} generates.",
        "",
        e2e_markdown(ev.e2e),
        "",
    ]


def evidence_markdown(doc: dict[str, Any], providers: tuple[str, ...]) -> str:
    """The figures a reviewer of an upstream PR needs: ``providers`` against
    the native ops timed in the same vLLM, per op at the highest thread count
    (only ops with an alternative to native), per call through IR dispatch,
    and end to end only their runs. Everything from ``doc``, nothing
    recomputed."""
    ev = _evidence(doc, providers)
    none = "No implementation other than native.\n"
    lines = [
        *_measured_on(doc),
        "",
        f"Per op, {ev.threads} threads: microseconds per call, median [quartiles], "
        "and speed-up over native in the same process; every implementation was "
        "checked against native with the op's own tolerance before it was timed.",
        "",
        perop_markdown(ev.perop) if ev.perop else none,
    ]
    if ev.dispatch:
        lines += [
            f"Per call through vLLM's IR dispatch, {ev.threads} threads, as the eager "
            "forward calls the op (`maybe_inplace` where the op has it, no torch "
            "custom-op wrapper): microseconds per call, median [quartiles].",
            "",
            dispatch_markdown(ev.dispatch, roles_shown=False),
        ]
    return "\n".join(lines + _end_to_end(doc, ev, providers))


def claims(doc: dict[str, Any], provider: str) -> list[str]:
    """One line per op (``provider``'s speed-up range over native, per call at
    the highest thread count, and the shapes it was not timed at) and one per
    end-to-end mode, from ``doc`` alone."""
    rows = [r for r in doc["perop"]["rows"] if r["provider"] == provider]
    threads = max((r["threads"] for r in rows), default=None)
    out = []
    for op in sorted({r["op"] for r in rows}):
        mine = [r for r in rows if r["op"] == op and r["threads"] == threads]
        ratios = [r["ratio"] for r in mine if r.get("status") == "ok"]
        line = f"`{op}`: " + (
            f"{min(ratios):.2f}x to {max(ratios):.2f}x faster than native per call"
            if ratios
            else "not timed"
        )
        line += f" ({len(ratios)} of {len(mine)} dtype/shape points, {threads} threads"
        wrong = [
            f"{r['dtype']} {list(r['shape'])}" for r in mine if r["status"] == "wrong"
        ]
        if wrong:
            line += f"; outside native's tolerance, so not timed: {', '.join(wrong)}"
        out.append(line + ")")
    for pair in (doc.get("e2e") or {}).get("pairs", []):
        if pair.get("provider") == provider and pair.get("ratio"):
            out.append(
                f"end to end, {pair['mode']}: {pair['ratio']:.3f}x the tokens/s of "
                "native"
            )
    return out

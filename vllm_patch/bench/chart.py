"""The per-op chart (``perop_ratios.png``): speed-up over native per op,
shape and provider, drawn with matplotlib where it is installed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_patch.runtime.bench_result import NATIVE, label, provider_order
from vllm_patch.runtime.machine import BUSY_SHARE

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


def _empty_panel_note(op_rows: list[dict]) -> str:
    """Why a panel has no bar: every row's status, or that only native ran."""
    reasons = sorted(
        {
            f"{label(r['provider'], 'installed')}: {r.get('status')}"
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
    ops = sorted({r["op"] for r in all_rows}) or ["(no op measured)"]
    fig, axes = plt.subplots(len(ops), 1, figsize=(12, 3.6 * len(ops)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops, strict=True):
        _panel(ax, op, [r for r in all_rows if r["op"] == op])
    _title(fig, doc)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _config(r: dict) -> tuple:
    return (r["dtype"], r["num_tokens"], r["hidden_size"], r["threads"])


def _panel(ax, op: str, all_op_rows: list[dict]) -> None:
    """One op's bars: a group per configuration, a bar per (provider, source)."""
    op_rows = [r for r in all_op_rows if r["provider"] != NATIVE]
    series = provider_order(op_rows)
    configs = list(dict.fromkeys(_config(r) for r in op_rows))
    width = 0.8 / max(len(series), 1)
    drawn = 0
    for i, (p, s) in enumerate(series):
        values = []
        for c in configs:
            hit = [
                r
                for r in op_rows
                if _config(r) == c
                and (r["provider"], r["source"]) == (p, s)
                and r.get("status") == "ok"
            ]
            values.append(hit[0]["ratio"] if hit else float("nan"))
        drawn += sum(v == v for v in values)  # not NaN
        ax.bar(
            [x + i * width for x in range(len(configs))],
            values,
            width,
            label=label(p, s),
        )
    ax.set_title(op)
    if not drawn:
        ax.text(
            0.5, 0.5, _empty_panel_note(all_op_rows),
            transform=ax.transAxes, ha="center", va="center", wrap=True,
            fontsize=9, color="dimgray",
        )  # fmt: skip
        ax.set_xticks([])
        ax.set_yticks([])
        return
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("speed-up vs native")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(configs))])
    ax.set_xticklabels(
        [_tick(*c) for c in configs], rotation=45, ha="right", fontsize=7
    )
    ax.legend(fontsize=8)


def _title(fig, doc: dict[str, Any]) -> None:
    """The machine and vLLM version on top, under a warning if it was busy."""
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

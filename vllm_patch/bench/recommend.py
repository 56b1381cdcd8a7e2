"""The recommendation: which IR op priority to pass to vLLM on this machine.

A pure function of the measured figures (no timing, no vLLM import), so the
rule can be read and tested on its own:

- eager (``--enforce-eager``): a provider goes first when it passed the
  numerics check everywhere, its per-op speed-up over native (geometric mean
  over the measured shapes, dtypes and thread counts) is at least
  ``1 + margin``, and, if it was run end to end in eager mode, that run was not
  slower than native by more than ``e2e_margin``.
- compiled (Inductor): if both priorities were run end to end compiled, the
  provider goes first only when it was faster by at least ``e2e_margin``
  (Inductor fuses the native norm with its neighbours, which a per-op timing
  cannot see). Without that run, the per-op comparison against native under
  ``torch.compile`` decides, with ``margin``, and the basis says so.
- otherwise native.

"Faster" is judged on the spread, not the medians alone: the quartiles of
both implementations must put the speed-up clearly above the margin, or
clearly below it; otherwise the bench measures that op again, and if it stays
too close to call, the recommendation is "inconclusive, keep the upstream
rule" (no override). A provider only a patched copy offers (the upstream one)
is recommended with the note that it needs ``vllm-patch apply``. Figures
measured while other processes took more than ``BUSY_SHARE`` of the CPU give no
recommendation either ("inconclusive").
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vllm_patch.runtime.bench_result import NATIVE, NATIVE_COMPILED
from vllm_patch.runtime.machine import BUSY_SHARE

MODES = ("eager", "compiled")


def geomean(values: Iterable[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _key(row: dict[str, Any]) -> tuple:
    return (
        row["op"],
        row["dtype"],
        row["num_tokens"],
        row["hidden_size"],
        row["threads"],
        row["source"],
    )


def _bounds(rows: list[dict], op: str, provider: str, baseline: str) -> list[tuple]:
    """Per configuration measured in the same run: baseline time / provider time
    as (pessimistic, median, optimistic), from the quartiles of both."""
    base = {
        _key(r): r
        for r in rows
        if r["op"] == op and r["provider"] == baseline and r.get("status") == "ok"
    }
    out = []
    for r in rows:
        if r["op"] == op and r["provider"] == provider and r.get("status") == "ok":
            b = base.get(_key(r))
            if b and b.get("median_us") and r.get("median_us"):
                out.append(
                    (
                        b.get("q1_us", b["median_us"]) / r.get("q3_us", r["median_us"]),
                        b["median_us"] / r["median_us"],
                        b.get("q3_us", b["median_us"]) / r.get("q1_us", r["median_us"]),
                    )
                )
    return out


def _speedups(rows: list[dict], op: str, provider: str, baseline: str) -> list[float]:
    """baseline time / provider time, per configuration measured in the same run."""
    return [med for _, med, _ in _bounds(rows, op, provider, baseline)]


FASTER, NOT_FASTER, INCONCLUSIVE = "faster", "not faster", "inconclusive"


def clarity(
    rows: list[dict], op: str, provider: str, baseline: str = NATIVE, margin=0.05
) -> str:
    """Whether ``provider`` beats ``baseline`` by ``margin`` whatever the spread:
    faster when even the pessimistic ratios (baseline's first quartile over the
    provider's third) clear it, not faster when even the optimistic ones miss
    it, else inconclusive (the quartiles overlap the margin: measure again)."""
    bounds = _bounds(rows, op, provider, baseline)
    if not bounds:
        return INCONCLUSIVE
    low = geomean(b[0] for b in bounds) or 0.0
    high = geomean(b[2] for b in bounds) or 0.0
    if low >= 1 + margin:
        return FASTER
    if high < 1 + margin:
        return NOT_FASTER
    return INCONCLUSIVE


def unclear_ops(rows: list[dict], source: str, margin: float = 0.05) -> list[str]:
    """Ops whose providers measured in ``source`` are neither clearly faster than
    native nor clearly not: the bench measures these again."""
    mine = [r for r in rows if r["source"] == source]
    return sorted(
        {
            op
            for op in {r["op"] for r in mine}
            for provider, info in candidates(mine, op).items()
            if info["ok"]
            and not info["wrong"]
            and clarity(mine, op, provider, NATIVE, margin) == INCONCLUSIVE
        }
    )


def candidates(rows: list[dict], op: str) -> dict[str, dict[str, Any]]:
    """Providers other than native measured for ``op``, with what disqualifies them."""
    found: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["op"] != op or r["provider"] in (NATIVE, NATIVE_COMPILED):
            continue
        c = found.setdefault(r["provider"], {"ok": 0, "wrong": 0, "sources": set()})
        c["sources"].add(r["source"])
        if r.get("status") == "ok":
            c["ok"] += 1
        elif r.get("status") == "wrong":
            c["wrong"] += 1
    return found


def _e2e_bounds(e2e: list[dict], mode: str, provider: str, op: str) -> tuple | None:
    """fused tok/s over native tok/s for the end-to-end pair covering ``op``, as
    (pessimistic, median, optimistic) from the quartiles of both runs."""
    for pair in e2e:
        if (
            pair.get("mode") == mode
            and pair.get("provider") == provider
            and op in (pair.get("ops") or [])
            and pair.get("ratio") is not None
        ):
            native, fused = pair.get("native") or {}, pair.get("fused") or {}
            try:
                return (
                    fused["q1_tokens_per_s"] / native["q3_tokens_per_s"],
                    pair["ratio"],
                    fused["q3_tokens_per_s"] / native["q1_tokens_per_s"],
                )
            except (KeyError, TypeError, ZeroDivisionError):
                return pair["ratio"], pair["ratio"], pair["ratio"]
    return None


def _e2e_verdict(bounds: tuple | None, floor: float) -> str | None:
    """Clearly at least ``floor`` (FASTER), clearly below it, or within the spread."""
    if bounds is None:
        return None
    if bounds[0] >= floor:
        return FASTER
    return NOT_FASTER if bounds[2] < floor else INCONCLUSIVE


@dataclass(frozen=True)
class _Choice:
    """What one (op, mode) entry recommends, and why."""

    choice: str
    priority: list[str] | None
    basis: str
    needs_apply: bool = False


def recommend(
    rows: list[dict[str, Any]],
    e2e: list[dict[str, Any]] | None = None,
    *,
    upstream_fused_ops: Iterable[str] = (),
    margin: float = 0.05,
    e2e_margin: float = 0.03,
    busy: float | None = None,
) -> list[dict[str, Any]]:
    """One entry per (op, mode): the priority list, the numbers behind it, and
    whether it agrees with the upstream rule (fused first in eager for
    ``upstream_fused_ops``, native under Inductor, native for every other op)."""
    e2e = e2e or []
    upstream_fused_ops = set(upstream_fused_ops)
    out = []
    for op in sorted({r["op"] for r in rows}):
        cands = candidates(rows, op)
        for mode in MODES:
            considered, best = _consider(rows, e2e, op, mode, cands, margin, e2e_margin)
            chosen = _choose(cands, considered, best)
            if (
                busy is not None
                and busy > BUSY_SHARE
                and any("clarity" in c for c in considered)
            ):
                chosen = _measured_under_load(busy, chosen)
            upstream = (
                "fused" if mode == "eager" and op in upstream_fused_ops else NATIVE
            )
            agrees = chosen.choice == INCONCLUSIVE or (chosen.choice != NATIVE) == (
                upstream == "fused"
            )
            out.append(
                {
                    "op": op,
                    "mode": mode,
                    "choice": chosen.choice,
                    "priority": chosen.priority,
                    "basis": chosen.basis,
                    "considered": considered,
                    "upstream_rule": upstream,
                    "agrees_with_upstream": agrees,
                    "needs_apply": chosen.needs_apply,
                }
            )
    return out


def _consider(rows, e2e, op, mode, cands, margin, e2e_margin):
    """Every candidate judged for (op, mode), and the best that is faster
    than native (None if none is)."""
    best: dict[str, Any] | None = None
    considered = []
    for provider, info in sorted(cands.items()):
        entry = {"provider": provider, "sources": sorted(info["sources"])}
        if info["wrong"] or not info["ok"]:
            entry["verdict"] = (
                "rejected: wrong results" if info["wrong"] else "not measured"
            )
            considered.append(entry)
            continue
        entry.update(_judge(rows, e2e, op, provider, mode, margin, e2e_margin))
        considered.append(entry)
        # Prefer what the installed vLLM can use as it is over a
        # provider that needs the patch applied; then the faster one.
        entry["rank"] = ("installed" in entry["sources"], entry["score"])
        if entry["faster"] and (best is None or entry["rank"] > best["rank"]):
            best = entry
    return considered, best


def _choose(cands, considered, best) -> _Choice:
    if best is not None:
        choice = best["provider"]
        needs_apply = "installed" not in best["sources"]
        basis = best["basis"]
        if needs_apply:
            basis += (
                f"; {choice} needs `vllm-patch apply` first: the installed "
                "vLLM does not enable it here"
            )
        return _Choice(choice, [choice, NATIVE], basis, needs_apply)
    basis = (
        "no other implementation"
        if not cands
        else "; ".join(
            f"{c['provider']} not chosen: {c.get('basis', c.get('verdict'))}"
            for c in considered
        )
    )
    if any(c.get("clarity") == INCONCLUSIVE for c in considered):
        # Too close to call even after measuring again: no override,
        # vLLM's own default (the upstream rule) stays.
        return _Choice(
            INCONCLUSIVE, None, f"inconclusive, keep the upstream rule ({basis})"
        )
    return _Choice(NATIVE, [NATIVE], basis)


def _measured_under_load(busy: float, chosen: _Choice) -> _Choice:
    """Measured under load: whichever way it came out, another run may come
    out the other way."""
    return _Choice(
        INCONCLUSIVE,
        None,
        f"inconclusive, keep the upstream rule: other processes used "
        f"{busy:.0%} of the CPU time while measuring ({chosen.basis})",
    )


def _judge(rows, e2e, op, provider, mode, margin, e2e_margin) -> dict[str, Any]:
    if mode == "eager":
        return _judge_eager(rows, e2e, op, provider, margin, e2e_margin)
    return _judge_compiled(rows, e2e, op, provider, margin, e2e_margin)


def _judge_eager(rows, e2e, op, provider, margin, e2e_margin) -> dict[str, Any]:
    speedup = geomean(_speedups(rows, op, provider, NATIVE))
    worst = min(_speedups(rows, op, provider, NATIVE), default=None)
    bounds = _e2e_bounds(e2e, "eager", provider, op)
    e2e_ratio = bounds[1] if bounds else None
    verdict = clarity(rows, op, provider, NATIVE, margin)
    # End to end only vetoes a provider that is clearly slower there.
    e2e_verdict = _e2e_verdict(bounds, 1 - e2e_margin)
    if e2e_verdict == NOT_FASTER:
        verdict = NOT_FASTER
    elif e2e_verdict == INCONCLUSIVE and verdict == FASTER:
        verdict = INCONCLUSIVE
    basis = f"per op: {_x(speedup)} geomean vs native (slowest case {_x(worst)})"
    basis += (
        f"; end to end eager: {_x(e2e_ratio)} tok/s vs native"
        if e2e_ratio is not None
        else "; not run end to end"
    )
    if verdict == INCONCLUSIVE:
        basis += ", within the spread of repeated measurements"
    return {
        "per_op_speedup": speedup,
        "per_op_worst": worst,
        "e2e_ratio": e2e_ratio,
        "clarity": verdict,
        "faster": verdict == FASTER,
        "score": speedup or 0.0,
        "basis": basis,
    }


def _judge_compiled(rows, e2e, op, provider, margin, e2e_margin) -> dict[str, Any]:
    bounds = _e2e_bounds(e2e, "compiled", provider, op)
    e2e_ratio = bounds[1] if bounds else None
    speedup = geomean(_speedups(rows, op, provider, NATIVE_COMPILED))
    others = [
        p for p in e2e if p.get("mode") == "compiled" and op in (p.get("ops") or [])
    ]
    if e2e_ratio is None and others:
        # A compiled end-to-end run of this op exists: per-op figures in
        # isolation do not outweigh it.
        return {
            "per_op_speedup_vs_compiled": speedup,
            "e2e_ratio": None,
            "faster": False,
            "score": 0.0,
            "basis": "not run end to end compiled, where "
            f"{others[0]['provider']} gave {_x(others[0].get('ratio'))}",
        }
    if e2e_ratio is not None:
        verdict = _e2e_verdict(bounds, 1 + e2e_margin)
        score = e2e_ratio
        basis = f"end to end compiled: {_x(e2e_ratio)} tok/s vs native"
    else:
        verdict = clarity(rows, op, provider, NATIVE_COMPILED, margin)
        score = speedup or 0.0
        basis = (
            f"per op only: {_x(speedup)} geomean vs torch.compile(native) in isolation"
        )
    spread = ", within the spread" if verdict == INCONCLUSIVE else ""
    if e2e_ratio is None:  # where the spread note goes in that sentence
        basis += f"{spread} (Inductor's fusion with neighbouring ops not measured)"
    else:
        basis += spread
    return {
        "per_op_speedup_vs_compiled": speedup,
        "e2e_ratio": e2e_ratio,
        "clarity": verdict,
        "faster": verdict == FASTER,
        "score": score,
        "basis": basis,
    }


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def priority_snippets(recs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per mode: the ``ir_op_priority`` dict and how to pass it (vLLM 0.32 spelling)
    for the ops that had an alternative to native."""
    out = {}
    for mode in MODES:
        prio = {
            r["op"]: r["priority"]
            for r in recs
            if r["mode"] == mode and r["considered"] and r["priority"] is not None
        }
        config = json.dumps({"ir_op_priority": prio})
        eager_flag = " --enforce-eager" if mode == "eager" else ""
        eager_kw = ", enforce_eager=True" if mode == "eager" else ""
        out[mode] = {
            "ir_op_priority": prio,
            "cli": f"vllm serve MODEL{eager_flag} --kernel-config '{config}'",
            "python": f"LLM(model=MODEL{eager_kw}, kernel_config={config})",
        }
    return out

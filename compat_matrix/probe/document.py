"""The probe's JSON document (schema 1): the environment's facts, the provider
probed, and every check's outcome in order. A check that crashes is recorded as
a failure; it does not stop the others.
"""

from __future__ import annotations

import sys
import time
import traceback
from typing import Any

from compat_matrix.probe.checks import CHECKS, PREREQUISITES, start_ahead
from compat_matrix.probe.environment import cpu_info, python_info, torch_info, vllm_info
from compat_matrix.probe.framework import (
    DEFAULT_PROVIDER,
    CheckOutcome,
    Probe,
    Skip,
)
from compat_matrix.probe.provider_module import declared_name
from compat_matrix.probe.vllm_ir import UPSTREAM_PROVIDER

SCHEMA = 1


def run_probe(
    provider: str = DEFAULT_PROVIDER,
    name: str | None = None,
    *,
    e2e: bool = False,
    only: list[str] | None = None,
) -> dict:
    module_name, _, attr = provider.partition(":")
    name = name or declared_name(module_name)
    p = Probe(module_name, attr or "register", name or "", e2e=e2e)
    with p.cleanup:  # ends what was started ahead, whatever the checks did
        # First, before this process imports vLLM: a child may fork from it.
        t0 = time.perf_counter()
        start_ahead(p, only)
        ahead = {
            "checks": sorted(p.started),
            "forked": sorted(n for n, s in p.started.items() if _forked(s)),
            "seconds": round(time.perf_counter() - t0, 2),
        }
        doc: dict[str, Any] = {
            "schema": SCHEMA,
            "python": python_info(),
            "vllm": vllm_info(),
            "torch": torch_info(),
            "cpu": cpu_info(),
            "provider": {"module": module_name, "name": p.name},
            "checks": [],
            "started_ahead": ahead,
        }
        for number, (check_name, check) in enumerate(CHECKS, 1):
            doc["checks"].append(_run_check(p, number, check_name, check, only))
    doc["pre_ir"] = p.pre_ir
    doc["ok"] = all(c["status"] != "fail" for c in doc["checks"])
    doc["summary"] = summary(doc)
    return doc


def _forked(started) -> bool:
    return getattr(getattr(started, "child", started), "pid", None) is not None


def summary(doc: dict) -> str:
    """One plain line: the counts, the first failure, and whether the workaround
    is still needed (the provider module's ``status()`` says, when it has one)."""
    checks = doc["checks"]
    counts = {
        s: sum(c["status"] == s for c in checks) for s in ("pass", "fail", "skip")
    }
    line = f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped"
    failed = [c for c in checks if c["status"] == "fail"]
    if failed:
        line += f"; FAILED {failed[0]['name']}: {failed[0]['reason']}"
    name = doc["provider"]["name"]
    status = next(
        (
            c["details"].get("status")
            for c in checks
            if c["name"] == "provider_registers"
        ),
        None,
    )
    if doc.get("pre_ir"):
        line += f"; {name!r} does not apply ({doc['pre_ir']}): the plugin stands down"
    elif (status or {}).get("redundant"):
        ops = ", ".join(status.get("redundant_ops") or [])
        line += (
            f"; the workaround can go: this vLLM already enables "
            f"{UPSTREAM_PROVIDER!r} on CPU for {ops}, so {name!r} is not needed"
        )
    elif status and not failed:
        line += (
            f"; {name!r} is still needed: this vLLM does not enable "
            f"{UPSTREAM_PROVIDER!r} on CPU"
        )
    return line


def _run_check(p: Probe, number: int, check_name: str, check, only) -> dict:
    print(f"probe [{number}/{len(CHECKS)}] {check_name} ...", file=sys.stderr)
    started = time.perf_counter()
    try:
        if only and check_name not in only and check_name not in PREREQUISITES:
            raise Skip(f"not selected (--only {','.join(only)})")
        reason, details = check(p)
        status = "pass"
    except CheckOutcome as outcome:
        status, reason, details = outcome.status, outcome.reason, outcome.details
    except Exception as exc:  # one broken check must not stop the others
        status, reason = "fail", f"crashed: {type(exc).__name__}: {exc}"
        details = {"traceback": traceback.format_exc().splitlines()[-12:]}
    seconds = round(time.perf_counter() - started, 2)
    print(f"probe [{number}/{len(CHECKS)}] {check_name}: {status} ({seconds} s)",
          file=sys.stderr)  # fmt: skip
    return {
        "name": check_name,
        "status": status,
        "reason": " ".join(str(reason).split()),
        "seconds": seconds,
        "details": details,
    }

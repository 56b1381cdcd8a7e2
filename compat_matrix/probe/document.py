"""The probe's JSON document (schema 1): the environment's facts, the provider
probed, and every check's outcome in order. A check that crashes is recorded as
a failure; it does not stop the others.
"""

from __future__ import annotations

import platform
import sys
import time
import traceback
from typing import Any

from compat_matrix.check_status import CheckStatus
from compat_matrix.probe.checks import CHECKS, PREREQUISITES, STARTED_AHEAD, resolve
from compat_matrix.probe.framework import PROVIDER_MODULE, CheckOutcome, Probe, Skip
from compat_matrix.probe.provider_module import declared_name
from compat_matrix.probe.vllm_ir import UPSTREAM_PROVIDER
from vllm_patch.runtime import child, machine

SCHEMA = 1


def probe_document(*, e2e: bool = False, only: list[str] | None = None) -> dict:
    """Run every check in this process (the slow parts started ahead) and
    return the document."""
    p = Probe(PROVIDER_MODULE, declared_name(PROVIDER_MODULE) or "", e2e=e2e)
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
            "python": platform.python_version(),
            "vllm": vllm_facts(),
            "torch": torch_facts(),
            "cpu": cpu_facts(),
            "provider": {"module": p.module_name, "name": p.name},
            "checks": [],
            "started_ahead": ahead,
        }
        for number, check_name in enumerate(CHECKS, 1):
            doc["checks"].append(_run_check(p, number, check_name, only))
    doc["pre_ir"] = p.pre_ir
    doc["ok"] = all(c["status"] != CheckStatus.FAIL for c in doc["checks"])
    doc["summary"] = summary_line(doc)
    return doc


def vllm_facts() -> dict[str, Any]:
    """The vLLM this interpreter imports: its folder and distribution (from
    metadata), and its version as it reports it on import."""
    info: dict[str, Any] = {"version": None, "distribution": None, "location": None}
    package = machine.vllm_package()
    if package is None:
        return info
    info["location"] = str(package)
    info["distribution"], info["version"] = machine.vllm_distribution(package)
    try:
        import vllm

        info["version"] = str(getattr(vllm, "__version__", None) or info["version"])
    except Exception as exc:  # the version from the metadata is still worth having
        info["import_error"] = f"{type(exc).__name__}: {exc}"
    return info


def torch_facts() -> dict[str, Any]:
    try:
        import torch

        return {"version": torch.__version__}
    except Exception as exc:
        return {"version": None, "import_error": f"{type(exc).__name__}: {exc}"}


def cpu_facts() -> dict[str, Any]:
    """The CPU model and the flags that matter to vLLM's CPU kernels."""
    cpu = machine.cpu()
    return {"model": cpu["model"], "flags": machine.kernel_flags(cpu["flags"])}


def start_ahead(p: Probe, only: list[str] | None) -> None:
    """Start the checks' slow parts (``STARTED_AHEAD``) before the checks run.
    A part that cannot start is left to its check, which then says why."""
    for name, start in STARTED_AHEAD.items():
        if only and name not in only:
            continue
        try:
            started = resolve(start)(p)
        except Exception:  # the check runs it again and reports the reason
            continue
        if started is None:
            continue
        p.started[name] = started
        if isinstance(started, child.Child):
            p.cleanup.callback(child.stop, started)
        else:  # the child and what it needs (a patched copy), ended together
            p.cleanup.callback(started.stack.close)


def _forked(started) -> bool:
    return getattr(getattr(started, "child", started), "pid", None) is not None


def summary_line(doc: dict) -> str:
    """One plain line: the counts, the first failure, and whether the workaround
    is still needed (the provider module's ``status()`` says, when it has one)."""
    checks = doc["checks"]
    counts = {
        s: sum(c["status"] == s for c in checks)
        for s in (CheckStatus.PASS, CheckStatus.FAIL, CheckStatus.SKIP)
    }
    line = (
        f"{counts[CheckStatus.PASS]} passed, {counts[CheckStatus.FAIL]} failed, "
        f"{counts[CheckStatus.SKIP]} skipped"
    )
    failed = [c for c in checks if c["status"] == CheckStatus.FAIL]
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


def _run_check(p: Probe, number: int, check_name: str, only) -> dict:
    print(f"probe [{number}/{len(CHECKS)}] {check_name} ...", file=sys.stderr)
    started = time.perf_counter()
    try:
        if only and check_name not in only and check_name not in PREREQUISITES:
            raise Skip(f"not selected (--only {','.join(only)})")
        reason, details = resolve(CHECKS[check_name])(p)
        status = CheckStatus.PASS
    except CheckOutcome as outcome:
        status, reason, details = outcome.status, outcome.reason, outcome.details
    except Exception as exc:  # one broken check must not stop the others
        status, reason = CheckStatus.FAIL, f"crashed: {type(exc).__name__}: {exc}"
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

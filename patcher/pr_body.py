"""The pull request description, in vLLM's template (Purpose, Test Plan, Test
Result), with evidence read from the files the project's tools wrote.

Every figure in the Test Result comes from a JSON file named in the text; what
no file holds is shown as "not measured" with the command that measures it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from patcher.bench import report
from patcher.patchset import Patch
from patcher.upstream import Upstream

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_EVIDENCE = (
    PROJECT_ROOT / "compat_matrix" / "results",
    PROJECT_ROOT / "bench" / "reference",
)
PROBE_COMMAND = "python -m compat_matrix.probe --e2e"
BENCH_COMMAND = "vllm-patch bench"
MACHINE_KEYS = ("machine", "cpu", "host", "system", "platform")


@dataclass
class Evidence:
    compat: list[tuple[Path, dict]] = field(default_factory=list)
    bench: list[tuple[Path, dict]] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)


def cell_vllm(data: dict) -> tuple[str | None, str | None]:
    """(package, version) of a compat cell: ``{"vllm": {"version"}}`` or the
    matrix's flat ``{"package", "version"}``."""
    vllm = data.get("vllm")
    if isinstance(vllm, dict) and vllm.get("version"):
        return vllm.get("package") or data.get("package"), str(vllm["version"])
    if isinstance(data.get("version"), str):
        return data.get("package"), data["version"]
    return None, None


def is_compat_cell(data: Any) -> bool:
    return (
        isinstance(data, dict)
        and isinstance(data.get("checks"), list)
        and cell_vllm(data)[1] is not None
    )


def load_evidence(dirs: list[Path]) -> Evidence:
    """Every ``*.json`` under ``dirs``: compat cells by their schema, the rest bench."""
    found = Evidence()
    for folder in dirs:
        for path in sorted(folder.rglob("*.json")) if folder.is_dir() else []:
            try:
                data = json.loads(path.read_text("utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                found.unreadable.append(f"{path}: {exc}")
                continue
            if is_compat_cell(data):
                found.compat.append((path, data))
            elif isinstance(data, dict):
                found.bench.append((path, data))
    return found


def _version(text: Any) -> Version | None:
    try:
        return Version(str(text))
    except InvalidVersion:
        return None


def cells_for(evidence: Evidence, version: Version | None) -> list[tuple[Path, dict]]:
    if version is None:
        return []
    return [(p, d) for p, d in evidence.compat if _version(cell_vllm(d)[1]) == version]


def render(
    patch: Patch,
    upstream: Upstream,
    version: Version | None,
    evidence: Evidence,
    checkout: Path | None = None,
    described: dict[str, list[str]] | None = None,
) -> str:
    """``described``: what the diff does, per file, as the codemods recorded it."""
    parts = [
        "## Purpose\n",
        upstream.purpose,
        "",
        *([upstream.rule, ""] if upstream.rule else []),
        "This PR:\n",
        *[
            f"- `{rel}`: {change}"
            for rel, changes in (described or {}).items()
            for change in changes
        ],
        "",
        "## Test Plan\n",
        *_test_plan(upstream, version, checkout),
        "",
        "## Test Result\n",
        *_compat_section(evidence, version),
        "",
        *_bench_section(evidence),
    ]
    if evidence.unreadable:
        parts += ["", "Evidence files that could not be read:", ""]
        parts += [f"- {u}" for u in evidence.unreadable]
    return "\n".join(parts).rstrip() + "\n"


def _test_plan(upstream: Upstream, version: Version | None, checkout: Path | None):
    on = f"vLLM {version}" if version else "this vLLM"
    yield f"1. Compatibility probe (import, IR registration, engine run), {on}, CPU:"
    yield f"   `{PROBE_COMMAND}`"
    yield "2. Per-op and end-to-end benchmark, native vs vllm_c, eager and compiled:"
    yield f"   `{BENCH_COMMAND}`"
    if upstream.tests:
        yield "3. Upstream tests that cover the IR providers:"
        yield f"   `pytest {' '.join(upstream.tests)}`"
        missing = [
            t for t in upstream.tests if checkout and not (checkout / t).is_file()
        ]
        if missing:
            yield f"   (not in this checkout: {', '.join(f'`{t}`' for t in missing)})"


def _machine(data: dict) -> str:
    for key in MACHINE_KEYS:
        value = data.get(key)
        if isinstance(value, dict) and value:
            return ", ".join(
                f"{k}: {_fmt(v)}"
                for k, v in value.items()
                if _scalar(v) or _short_list(v)
            )
        if isinstance(value, str) and value:
            return value
    return "not recorded"


def _short_list(v: Any) -> bool:
    """A few words (CPU flags that matter), not a dump (every flag)."""
    return (
        isinstance(v, list) and 0 < len(v) <= 16 and all(isinstance(x, str) for x in v)
    )


def _torch(data: dict) -> str:
    torch = data.get("torch")
    if isinstance(torch, dict):
        return str(torch.get("version") or torch.get("used") or "not installed")
    versions = data.get("versions")
    if isinstance(versions, dict) and versions.get("torch"):
        return str(versions["torch"])
    return str(torch) if torch else "not recorded"


def _cell_ok(data: dict) -> bool:
    if isinstance(data.get("ok"), bool):
        return data["ok"]
    return data.get("status") == "pass"


def _compat_section(evidence: Evidence, version: Version | None):
    yield f"### Compatibility probe (vLLM {version or 'version unknown'})\n"
    cells = cells_for(evidence, version)
    if not cells:
        yield f"Not measured for this version. Produce it with `{PROBE_COMMAND}`."
        others = sorted(
            {" ".join(filter(None, cell_vllm(d))) for _, d in evidence.compat}
        )
        if others:
            yield f"(Cells exist for other versions: {', '.join(others)}.)"
        return
    for path, data in cells:
        checks = [c for c in data["checks"] if isinstance(c, dict)]
        counts: dict[str, int] = {}
        for c in checks:
            counts[str(c.get("status"))] = counts.get(str(c.get("status")), 0) + 1
        tally = ", ".join(f"{n} {status}" for status, n in counts.items())
        verdict = "passed" if _cell_ok(data) else "did NOT pass"
        package, ver = cell_vllm(data)
        when = f", {data['date']}" if data.get("date") else ""
        yield (
            f"From `{path.name}`{when}: {package or 'vllm'} {ver}, "
            f"torch {_torch(data)}; the cell {verdict} ({tally}). "
            f"Machine: {_machine(data)}.\n"
        )
        rows = [
            [
                c.get("name", "?"),
                c.get("status", "?"),
                c.get("reason") or "",
                _fmt(c.get("seconds")),
            ]
            for c in checks
        ]
        yield from _table(["check", "status", "reason", "seconds"], rows)
        yield ""


def _bench_section(evidence: Evidence):
    yield "### Benchmark\n"
    if not evidence.bench:
        yield f"Not measured. Produce it with `{BENCH_COMMAND}`."
        return
    for path, data in evidence.bench:
        yield f"From `{path.name}` (`{BENCH_COMMAND}`).\n"
        yield report.evidence_markdown(data)
        yield ""


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return " ".join(map(str, v))
    return "" if v is None else str(v)


def _table(header: list[str], rows: list[list[str]]):
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    yield line(header)
    yield line(["---"] * len(header))
    for row in rows:
        yield line(row)

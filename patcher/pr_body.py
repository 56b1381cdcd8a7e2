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

from patcher.patchset import Patch
from patcher.upstream import Upstream

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_EVIDENCE = (
    PROJECT_ROOT / "compat_matrix" / "results",
    PROJECT_ROOT / "bench" / "reference",
)
PROBE_COMMAND = "python -m compat_matrix.probe --e2e"
BENCH_COMMAND = "vllm-patch bench"
MAX_ROWS = 24
MACHINE_KEYS = ("machine", "cpu", "host", "system", "platform")


@dataclass
class Evidence:
    compat: list[tuple[Path, dict]] = field(default_factory=list)
    bench: list[tuple[Path, dict]] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)


def is_compat_cell(data: Any) -> bool:
    return (
        isinstance(data, dict)
        and isinstance(data.get("checks"), list)
        and (isinstance(data.get("vllm"), dict))
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
    return [
        (p, d)
        for p, d in evidence.compat
        if _version(d["vllm"].get("version")) == version
    ]


def render(
    patch: Patch,
    upstream: Upstream,
    version: Version | None,
    evidence: Evidence,
    checkout: Path | None = None,
) -> str:
    parts = [
        "## Purpose\n",
        upstream.purpose,
        "",
        "Changed files:\n",
        *[f"- `{e.file}`: {e.summary}" for e in patch.edits],
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
        for test in upstream.tests:
            if checkout is not None and not (checkout / test).is_file():
                yield f"   (`{test}` is not in this checkout)"


def _machine(data: dict) -> str:
    for key in MACHINE_KEYS:
        value = data.get(key)
        if isinstance(value, dict) and value:
            return ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items() if _scalar(v))
        if isinstance(value, str) and value:
            return value
    return "not recorded"


def _compat_section(evidence: Evidence, version: Version | None):
    yield f"### Compatibility probe (vLLM {version or 'version unknown'})\n"
    cells = cells_for(evidence, version)
    if not cells:
        yield f"Not measured for this version. Produce it with `{PROBE_COMMAND}`."
        measured = sorted(
            {
                f"{d['vllm'].get('package', p.stem.rsplit('-', 1)[0])} "
                f"{d['vllm'].get('version')}"
                for p, d in evidence.compat
            }
        )
        if measured:
            yield f"(Cells exist for other versions: {', '.join(measured)}.)"
        return
    for path, data in cells:
        torch = (data.get("torch") or {}).get("version", "not recorded")
        ok = data.get("ok")
        verdict = "all checks passed" if ok is True else "NOT all checks passed"
        yield f"From `{path.name}`: vLLM {data['vllm'].get('version')}, torch {torch}; "
        yield f"{verdict}. Machine: {_machine(data)}.\n"
        rows = [
            [
                c.get("name", "?"),
                c.get("status", "?"),
                c.get("reason") or "",
                _fmt(c.get("seconds")),
            ]
            for c in data["checks"]
            if isinstance(c, dict)
        ]
        yield from _table(["check", "status", "reason", "seconds"], rows)
        yield ""


def _bench_section(evidence: Evidence):
    yield "### Benchmark\n"
    if not evidence.bench:
        yield f"Not measured. Produce it with `{BENCH_COMMAND}`."
        return
    for path, data in evidence.bench:
        vllm = data.get("vllm")
        vllm = vllm.get("version") if isinstance(vllm, dict) else vllm
        yield f"From `{path.name}`" + (f" (vLLM {vllm})" if vllm else "") + ". "
        yield f"Machine: {_machine(data)}.\n"
        shown = False
        for where, rows in _tables(data):
            yield f"`{where}`:\n"
            yield from _bench_table(rows)
            yield ""
            shown = True
        for where, value in _scalars(data):
            yield f"- `{where}`: {_fmt(value)}"
            shown = True
        if not shown:
            yield "No results in this file."
        yield ""


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def _tables(data: Any, where: str = ""):
    """Lists of flat records anywhere in ``data``: the per-op and e2e results."""
    if isinstance(data, dict):
        for key, value in data.items():
            if key in MACHINE_KEYS:
                continue
            yield from _tables(value, f"{where}.{key}" if where else key)
    elif isinstance(data, list) and data and all(isinstance(r, dict) for r in data):
        if any(any(isinstance(v, (int, float)) for v in r.values()) for r in data):
            yield where, data


def _scalars(data: dict, where: str = ""):
    """Numbers named like throughput (tok/s), outside the tables."""
    for key, value in data.items():
        name = f"{where}.{key}" if where else key
        if isinstance(value, dict) and key not in MACHINE_KEYS:
            yield from _scalars(value, name)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if (
                "tok" in key.lower()
                or "ratio" in key.lower()
                or "speedup" in key.lower()
            ):
                yield name, value


def _bench_table(rows: list[dict]):
    columns: list[str] = []
    for row in rows:
        columns += [k for k, v in row.items() if _scalar(v) and k not in columns]
    native = [c for c in columns if "native" in c.lower()]
    fused = [c for c in columns if "vllm_c" in c.lower()]
    has_ratio = any("ratio" in c.lower() or "speedup" in c.lower() for c in columns)
    ratio = len(native) == 1 and len(fused) == 1 and not has_ratio
    header = columns + ([f"{native[0]} / {fused[0]}"] if ratio else [])
    body = []
    for row in rows[:MAX_ROWS]:
        cells = [_fmt(row.get(c)) for c in columns]
        if ratio:
            a, b = row.get(native[0]), row.get(fused[0])
            ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and b
            cells.append(f"{a / b:.2f}x" if ok else "")
        body.append(cells)
    yield from _table(header, body)
    if len(rows) > MAX_ROWS:
        yield f"\n({len(rows) - MAX_ROWS} more rows in the file)"


def _table(header: list[str], rows: list[list[str]]):
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    yield line(header)
    yield line(["---"] * len(header))
    for row in rows:
        yield line(row)

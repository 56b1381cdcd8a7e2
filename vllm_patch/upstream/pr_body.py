"""The pull request description, in vLLM's template (Purpose, Test Plan, Test
Result), speaking of vLLM alone.

The Test Result holds only figures this tool measured: the upstream tests run
in this ``pr`` run, and the bench's ``vllm_c`` against native from its JSON, per
op and end to end on the patched vLLM (compatibility cells are read but not
shown: they describe this project's probe, not vLLM). What was not measured
is shown as such, with the command.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.version import Version

from patcher.errors import PatchError
from patcher.patchset import Patch
from vllm_patch.runtime.bench_result import evidence_markdown
from vllm_patch.upstream.meta import Upstream
from vllm_patch.upstream.vllm_tests import TestRun, reviewer_command


def _data_folder(package: str, folder: str) -> Path:
    """``folder`` of ``package``'s data, in a checkout or a regular install,
    found without importing its modules."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise PatchError(f"{package} is not installed beside vllm-patch")
    return Path(next(iter(spec.submodule_search_locations))) / folder


DEFAULT_EVIDENCE = (
    _data_folder("compat_matrix", "results"),
    _data_folder("vllm_patch.bench", "reference"),
)
"""The compatibility cells' results and the bench's reference result, shipped
with this project."""
BENCH_COMMAND = "vllm-patch bench"


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


def render(
    patch: Patch,
    upstream: Upstream,
    version: Version | None,
    evidence: Evidence,
    checkout: Path | None = None,
    described: dict[str, list[str]] | None = None,
    tests_run: TestRun | None = None,
    left_out: dict[str, str] | None = None,
) -> str:
    """vLLM's PR template, speaking of vLLM alone: what the change does, the
    commands a reviewer pastes, and only figures this tool measured.
    ``described``: what the diff does, per file, as the codemods recorded it."""
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
        *[
            f"\nLeft out of this commit: `{file}` ({reason})."
            for file, reason in (left_out or {}).items()
        ],
        "",
        "## Test Plan\n",
        *_test_plan(patch, upstream, checkout),
        "",
        "## Test Result\n",
        *_tests_section(tests_run, version, upstream.tests),
        "",
        *_bench_section(evidence, patch),
    ]
    if evidence.unreadable:
        parts += ["", "Evidence files that could not be read:", ""]
        parts += [f"- {u}" for u in evidence.unreadable]
    parts += ["", CHECKLIST]
    return "\n".join(parts).rstrip() + "\n"


CHECKLIST = """\
---
<details>
<summary> Essential Elements of an Effective PR Description Checklist </summary>

- [x] The purpose of the PR.
- [x] The test plan, with the commands to run.
- [x] The test results, with where each figure was measured.
- [ ] (Optional) The necessary documentation update.
</details>"""


def _priority(provider: str, ops: list[str]) -> str:
    return json.dumps({"ir_op_priority": {op: [provider] for op in ops}})


def _fused_provider(patch: Patch) -> tuple[str, list[str]]:
    """The upstream provider the patch enables and its ops, as the patch's
    provider module declares them."""
    spec = patch.provider() or {}
    if spec.get("upstream") and spec.get("ops"):
        return spec["upstream"], spec["ops"]
    raise PatchError(
        "no upstream provider and ops declared",
        path=str(patch.folder / "patch.toml"),
        looked_for="[provider] module with UPSTREAM_PROVIDER and OPS",
        found="none",
    )


def _test_plan(patch: Patch, upstream: Upstream, checkout: Path | None):
    fused, ops = _fused_provider(patch)
    model = upstream.model
    yield "On a CPU build of vLLM (`VLLM_TARGET_DEVICE=cpu`):\n"
    yield "1. The IR tests this PR extends and the IR op tests:\n"
    yield f"```bash\npytest {' '.join(upstream.tests)}\n```"
    missing = [t for t in upstream.tests if checkout and not (checkout / t).is_file()]
    if missing:
        yield f"(not in this checkout: {', '.join(f'`{t}`' for t in missing)})"
    yield ""
    yield f"2. Accuracy, `{fused}` against `native` norms on a small model:\n"
    yield "```bash"
    for name in (fused, "native"):
        config = shlex.quote(_priority(name, ops))
        yield f"vllm serve {model} --enforce-eager --kernel-config {config} &"
        yield (
            f"lm_eval --model local-completions --model_args "
            f"model={model},base_url=http://localhost:8000/v1/completions,"
            "num_concurrent=4 --tasks gsm8k --limit 250"
        )
        yield "kill %1"
    yield "```"
    yield ""
    yield (
        "3. Speed, eager and compiled (drop `--enforce-eager`), each with "
        f"`{fused}` and with `native`; latency and throughput generate with "
        "`ignore_eos` already, `bench serve` needs `--ignore-eos`:\n"
    )
    yield "```bash"
    config = shlex.quote(_priority(fused, ops))
    yield (
        f"vllm bench latency --model {model} --input-len 128 --output-len 128 "
        f"--batch-size 1 --enforce-eager --kernel-config {config}"
    )
    yield (
        f"vllm bench throughput --model {model} --input-len 128 --output-len 128 "
        f"--num-prompts 64 --enforce-eager --kernel-config {config}"
    )
    yield (
        f"vllm bench serve --model {model} --dataset-name random --random-input-len "
        "128 --random-output-len 128 --num-prompts 64 --ignore-eos"
    )
    yield "```"


def _tests_section(run: TestRun | None, version: Version | None, tests: tuple):
    yield "### Upstream tests on CPU\n"
    if run is None or not run.ran:
        why = run.reason if run else "no test file of this PR in the checkout"
        command = run.command if run else reviewer_command(list(tests))
        yield f"Not run: {why}. Run `{command}` on a CPU build of vLLM {version or ''}."
        return
    yield (
        f"`{run.command}` with this change, CPU build of vLLM {run.vllm}, torch "
        f"{run.torch}: **{run.summary()}** in {run.seconds:.0f} s, measured while "
        f"writing this description on {run.machine}; {run.reason}."
    )
    if run.failures:
        bad = run.counts.get("failed", 0) + run.counts.get("errors", 0)
        first = (
            f" (the first {len(run.failures)} of {bad})"
            if bad > len(run.failures)
            else ""
        )
        yield f"\nFailed{first}:\n"
        yield from (f"- `{f}`" for f in run.failures)
    yield ""


def _bench_section(evidence: Evidence, patch: Patch):
    fused, _ = _fused_provider(patch)
    yield f"### `{fused}` against native\n"
    if not evidence.bench:
        yield f"Not measured. Produce it with `{BENCH_COMMAND}`."
        return
    for _, data in evidence.bench:
        yield evidence_markdown(data, providers=(fused,))
        yield ""

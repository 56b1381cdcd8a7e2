"""The pull request description: the checkout's own template (``template``)
filled with text that speaks of vLLM alone.

The pieces: what changed and why (the patch's Purpose text and the diff's
changes), the claims (the patch's rule and what was measured), the commands a
reviewer reruns, the results, and the details (the rest of the Purpose text,
the patch's numerics note, the CI wiring). The results hold only figures
measured for this description: the upstream tests run in this ``pr`` run, and
the bench's ``vllm_c`` against native from its JSON, per op and end to end on
the patched vLLM (compatibility cells are read but not shown: they describe
this project's probe, not vLLM). What was not measured is shown as such, with
the command. No local path, traceback or name of this tool goes in.
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
from vllm_patch.runtime.bench_result import claims as bench_claims
from vllm_patch.runtime.bench_result import evidence_markdown
from vllm_patch.upstream.ci_yaml import CiEdit
from vllm_patch.upstream.meta import Upstream
from vllm_patch.upstream.template import Piece, fill, read_template
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


@dataclass(frozen=True)
class Facts:
    """What a description is made of, besides the patch's own text."""

    version: Version | None
    evidence: Evidence
    checkout: Path | None = None
    described: dict[str, list[str]] = field(default_factory=dict)
    """What the diff does, per file, as the codemods recorded it."""
    tests_run: TestRun | None = None
    left_out: dict[str, str] = field(default_factory=dict)
    ci: CiEdit | None = None


def render(patch: Patch, upstream: Upstream, facts: Facts) -> str:
    """The checkout's PR template (or the fallback layout) filled."""
    summary, _, motivation = upstream.purpose.partition("\n\n")
    pieces = [
        Piece(("purpose",), "\n\n".join([summary, _changes(facts)])),
        Piece(("claims", "purpose"), "\n".join(_claims(patch, upstream, facts))),
        Piece(("plan",), "\n".join(_test_plan(patch, upstream, facts.checkout))),
        Piece(("result", "plan"), "\n".join(_results(patch, upstream, facts))),
        Piece(
            ("details", "purpose"), "\n\n".join(_details(motivation, upstream, facts))
        ),
    ]
    return fill(read_template(facts.checkout), pieces)


def _changes(facts: Facts) -> str:
    lines = ["This PR:", ""]
    lines += [
        f"- `{rel}`: {change}"
        for rel, changes in facts.described.items()
        for change in changes
    ]
    return "\n".join(lines)


def _claims(patch: Patch, upstream: Upstream, facts: Facts):
    if upstream.rule:
        yield f"- {upstream.rule}"
    run = facts.tests_run
    if run and run.ran:
        yield (
            f"- vLLM's tests of the changed code on CPU, with this change: "
            f"**{run.summary()}** (`{run.command}`, vLLM {run.vllm})."
        )
    ci = facts.ci
    if ci and ci.added_tests:
        yield (
            f"- vLLM's CPU CI runs {', '.join(f'`{t}`' for t in ci.added_tests)} "
            f'in its "{ci.label}" step.'
        )
    for _, data in facts.evidence.bench:
        machine = data["machine"]["cpu_model"]
        for line in bench_claims(data, _fused_provider(patch)[0]):
            yield f"- On {machine}, {line}."


def _details(motivation: str, upstream: Upstream, facts: Facts):
    if motivation.strip():
        yield motivation.strip()
    if upstream.numerics_note:
        yield upstream.numerics_note
    ci = facts.ci
    if ci and ci.text is None and ci.wiring.tests:
        tests = ", ".join(f"`{t}`" for t in ci.wiring.tests)
        yield f"CI: {tests} not added to a CPU CI step: {ci.reason}."
    for file, reason in facts.left_out.items():
        yield f"Left out of this commit: `{file}` ({reason})."


def _results(patch: Patch, upstream: Upstream, facts: Facts):
    yield from _tests_section(facts.tests_run, facts.version, upstream.tests)
    yield from _bench_section(facts.evidence, patch)


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
    yield "### vLLM's tests on CPU\n"
    build = f"a CPU build of vLLM {version}" if version else "a CPU build of vLLM"
    if run is None or not run.ran:
        command = run.command if run else reviewer_command(list(tests))
        yield (
            f"Not run while writing this description. To run them, on {build} "
            f"with this change:\n\n```bash\n{command}\n```"
        )
        yield ""
        return
    yield (
        f"`{run.command}` with this change, on a CPU build of vLLM {run.vllm} "
        f"(torch {run.torch}), {run.machine}: **{run.summary()}** in "
        f"{run.seconds:.0f} s. Run without the repository's `tests/conftest.py`, "
        "whose fixtures these tests do not use."
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
        yield (
            "Not measured for this description; the speed commands above measure "
            "it, eager and compiled."
        )
        return
    for _, data in evidence.bench:
        yield evidence_markdown(data, providers=(fused,))
        yield ""

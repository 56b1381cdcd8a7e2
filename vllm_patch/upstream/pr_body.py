"""The PR description: the checkout's template filled with this run's figures,
the patch's ``upstream.md`` and what ``AGENTS.md`` asks a PR to state."""

import copy
import os
import re
import shlex
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from patcher.errors import PatchError
from patcher.files import read_text_in
from patcher.patchset import Patch, provider_specs
from vllm_patch.runtime import bench_result, evidence_record
from vllm_patch.runtime import markdown as md
from vllm_patch.runtime.evidence_record import NATIVE, SIDES, Evidence, PerOpRow
from vllm_patch.upstream.ci_yaml import CiEdit
from vllm_patch.upstream.figures import Measured
from vllm_patch.upstream.meta import Upstream
from vllm_patch.upstream.template import Piece, Template, boxes, fill
from vllm_patch.upstream.vllm_tests import KEYS, TestRun, TestRuns, described_machine

TOOL = "vllm-patch"
# AGENTS.md's commit example: a fenced block whose trailer precedes Signed-off-by
# (0.34.0: `Co-authored-by: Agent Name Here`; its prose also names Assisted-by
# and Generated-by, "other projects" use).
EXAMPLE_TRAILER = re.compile(
    r"^```[^\n]*\n(?:(?!```)[^\n]*\n)*?([A-Z][\w-]*-by):[^\n]*\n"
    r"Signed-off-by:",
    re.MULTILINE,
)
TRAILER = "Co-authored-by"  # without an example: git's and GitHub's own
# The checklist's boxes the run can speak to, by words of their text (0.34.0's
# template); the tool ticks none: each is the author's statement.
AI_BOX = "AI assistance was used"
TESTED_BOX = "Testing and Validation"
CHECKLIST_SKILL = "/pr-checklist"
SKILL = ".agents/skills/pr-checklist/SKILL.md"
BODY_LIMIT = 65536  # GitHub's bound on a pull request's body, in characters

SERVE = """Serving, on each build, eager and compiled:

```bash
vllm serve {model} [--enforce-eager]
vllm bench serve --model {model} --dataset-name random --random-input-len 128 \
--random-output-len 128 --num-prompts 64 --ignore-eos --seed 0
```"""
LM_EVAL = """Accuracy, against `vllm serve {model}` on each build:

```bash
lm_eval --model local-completions --tasks gsm8k --model_args \
model={model},base_url=http://localhost:8000/v1/completions,num_concurrent=4
```"""


def load_evidence(folder: Path | None, patch: Patch) -> Evidence | None:
    """``folder``'s ``bench --serve`` evidence for ``patch``, both vLLMs measured."""
    if folder is None:
        return None
    ev = evidence_record.read(folder)
    configs = ev.serving.configs if ev.serving else {}
    found = [
        f"serving.configs.{mode}.{side}: not measured"
        for mode, sides in configs.items()
        for side in SIDES
        if not sides.get(side)
    ]
    if (lm := ev.accuracy.lm_eval) and set(lm.scores) != set(SIDES):
        found.append("accuracy.lm_eval: no exact_match and stderr for base and patched")
    if ev.vllm is None or ev.vllm.patch != patch.name:
        said = md.printable(ev.vllm.patch if ev.vllm else "none named", 60)
        found[:0] = [
            f"figures of another change ({said}); measure this one with "
            f"`vllm-patch bench --serve --patch {patch.name} --out DIR`"
        ]
    if found:
        raise PatchError(
            "not usable evidence",
            path=str(Path(os.path.realpath(folder)) / evidence_record.EVIDENCE),
            looked_for=f"what `bench --serve` measured for {patch.name}",
            found=found[0],
        )
    return ev


@dataclass(frozen=True)
class Facts:
    """What a description is made of, besides the patch's own text."""

    evidence: Evidence | None = None
    described: dict[str, list[str]] = field(default_factory=dict)  # per file
    tests: TestRuns | None = None
    left_out: dict[str, str] = field(default_factory=dict)
    ci: list[CiEdit] = field(default_factory=list)
    measured: Measured | None = None  # None: --no-bench (or --evidence)


def tool_version() -> str:
    try:
        return f"{TOOL} {version(TOOL)}"
    except PackageNotFoundError:
        return TOOL


def attribution(checkout: Path | None) -> str:
    """The trailer of the kind ``AGENTS.md``'s commit example shows, naming the
    tool."""
    try:
        agents = read_text_in(checkout, "AGENTS.md", "AGENTS.md") or ""
    except PatchError:
        agents = ""
    example = EXAMPLE_TRAILER.search(agents)
    return f"{example[1] if example else TRAILER}: {tool_version()}"


def render(patch: Patch, upstream: Upstream, facts: Facts, template: Template) -> str:
    """The checkout's PR template filled, its tables cut until within ``BODY_LIMIT``."""
    for rows in (100, 20, 3, 0):
        pieces = _pieces(upstream, facts, rows)
        text = fill(copy.deepcopy(template), pieces)
        if len(text) <= BODY_LIMIT:
            break
    return text


def checklist(facts: Facts, template: Template) -> list[str]:
    """For the run's output: each box of the template, left unticked, and what
    this run says of it (the author ticks them)."""
    runs = facts.tests
    passed = runs and runs.after.ran and not _failed(runs.after)
    failed_before = runs and runs.before and runs.before.ran and _failed(runs.before)
    said = {
        AI_BOX: "true of this diff (made by vllm-patch, written with AI assistance)",
        TESTED_BOX: (
            "this run supports it (the new test passes with the change and fails "
            "without; CI runs it); the judgement is yours"
            if passed and failed_before and facts.ci
            else "this run does not support it (vLLM's tests did not pass with "
            "the change and fail without here)"
        ),
        CHECKLIST_SKILL: (
            f"not run by vllm-patch: AGENTS.md asks that `{SKILL}` be run before "
            "the PR is opened (drafts too) and its findings addressed"
        ),
    }
    out = []
    for box in boxes(template):
        note = next((v for k, v in said.items() if k in box), "the author's call")
        out.append(f"  [ ] {md.printable(box, 60)}: {note}")
    return out


def _failed(run: TestRun) -> int:
    return run.counts["failed"] + run.counts["errors"]


def _pieces(upstream: Upstream, facts: Facts, rows: int) -> list[Piece]:
    title = re.sub(r"^(\[[^\]]*\])+\s*", "", upstream.title)
    overview = f"{title}. {what_changes(facts.described)}\n{upstream.rule}"
    claims = _claims(upstream, facts, rows)  # a part not measured: None
    return [
        Piece(("purpose",), overview),
        Piece(("claims", "purpose"), "\n".join(filter(None, claims))),
        Piece(("plan",), "\n\n".join(_plan(upstream, facts))),
        Piece(("result", "plan"), "\n\n".join(_results(facts, rows))),
        Piece(("details", "purpose"), "\n\n".join(_details(upstream, facts))),
    ]


def what_changes(described: dict[str, list[str]], mark: str = "`") -> str:
    """One sentence naming the diff's sources, vLLM's tests and CI files."""
    roles: dict[str, list[str]] = {"": [], "tests/": [], ".buildkite/": []}
    for rel in described:
        role = next((r for r in roles if r and rel.startswith(r)), "")
        roles[role].append(f"{mark}{rel}{mark}")
    src, tests, ci = map(_and, roles.values())
    tests = f", with vLLM's tests in {tests}" if tests else ""
    ci = f" and their CPU CI step in {ci}" if ci else ""
    return f"This changes {src}{tests}{ci}."


def _and(items: list[str]) -> str:
    return " and ".join([", ".join(items[:-1]), items[-1]] if len(items) > 1 else items)


def _claims(upstream: Upstream, facts: Facts, rows: int):
    yield _tests_claim(facts.tests, _command(upstream, facts))
    ev, m = facts.evidence, facts.measured
    if ev:
        yield from bench_result.claims(ev, rows)
    elif m and m.per_call:
        yield bench_result.perop_claim(m.per_call, rows)
    if m and m.qwen3 and not (ev and ev.qwen3_eager):
        yield bench_result.qwen3_claim(m.qwen3)
    if not (ev or (m and m.per_call)):
        yield "- Speed and accuracy: nothing was measured."
    for edit in (e for e in facts.ci if e.added_tests):
        tests = ", ".join(f"`{t}`" for t in edit.added_tests)
        sh = edit.wiring.file.endswith(".sh")
        where = f"`{edit.wiring.file}`" if sh else f'its "{edit.wiring.step}" step'
        yield f"- vLLM's CPU CI runs {tests} in {where}."


def _command(upstream: Upstream, facts: Facts) -> str:
    runs = facts.tests
    return runs.after.command if runs else shlex.join(["pytest", *upstream.tests])


def _tests_claim(runs: TestRuns | None, command: str) -> str:
    if runs is None or not runs.after.ran:
        return f"- vLLM's tests of the change: to run, `{command}` with and without it."
    counts = runs.after.counts
    shown = ", ".join(f"{counts[k]:,} {k}" for k in KEYS if k != "errors" or counts[k])
    said = f"- vLLM's edited tests on CPU: {shown} with this change"
    before = runs.before
    if before is None or not before.ran:
        return said + "."
    failed = _failed(before)
    names = ", ".join(map(md.code, dict.fromkeys(map(_test_name, before.failures))))
    return f"{said}; without it {failed} fail" + (f" ({names})." if names else ".")


def _test_name(test_id: str) -> str:  # [Class::]test, unparametrised
    where, _, name = test_id.split("[")[0].rpartition("::")
    where = where.rsplit(".", 1)[-1]  # a class, or a function's module
    return f"{where}::{name}" if where[:1].isupper() else name


def _plan(upstream: Upstream, facts: Facts):
    model, command = upstream.model, _command(upstream, facts)
    ev, m = facts.evidence, facts.measured
    if m and m.vllm:
        put = ", ".join(f"`{f}`" for f in m.put_in) or "no file"
        yield (
            f"Ran on {m.vllm} (the newest CPU build on PyPI) with this branch's "
            f"{put} put in place of the build's own, kernel build `{m.kernel_build}`"
            f" ({KERNEL_BUILDS.get(m.kernel_build, 'not an x86 build')})."
        )
    yield f"The tests, with and without this change:\n\n```bash\n{command}\n```"
    if not (ev and ev.serving):
        yield SERVE.format(model=model)
    if not (ev and ev.accuracy.lm_eval):
        yield LM_EVAL.format(model=model)


TRUNCATES = (
    "the kernels truncate float32 to bfloat16, so the bfloat16 fused add stays "
    "native and is not exercised"
)
KERNEL_BUILDS = {
    "_C": (
        "AVX512-BF16: every kernel path this change enables on x86 runs; not "
        "exercised: the `_C_AVX512` and `_C_AVX2` builds, where the bfloat16 "
        "fused add stays native (no vLLM CI job runs them), and aarch64, POWER "
        "and s390x"
    ),
    "_C_AVX512": f"AVX-512 without AVX512-BF16: {TRUNCATES}",
    "_C_AVX2": (
        f"AVX2: {TRUNCATES}; no vLLM CI job runs the `_C_AVX512` or `_C_AVX2` builds"
    ),
}


def _results(facts: Facts, rows: int):
    runs = facts.tests if facts.tests and facts.tests.after.ran else None
    ev, m = facts.evidence, facts.measured
    tests = runs.after.machine if runs else None
    bench = ev and ev.machine and described_machine(asdict(ev.machine))
    if tests and bench and tests != bench:
        yield (
            f"Serving and accuracy measured on {md.text(bench, 400)}; vLLM's tests "
            f"on {md.text(tests, 400)}."
        )
    elif tests or bench:
        yield f"Measured on {md.text(tests or bench, 400)}."
    if ev and ev.decode:  # the evidence's headline: time per decode step
        lines = "\n".join(bench_result.decode_markdown(ev.decode, rows))
        yield re.sub(r"^#{2,3} (.+)$", r"**\1**", lines, flags=re.M)
    if runs:
        yield from _test_table(runs)
    if m and m.per_call:
        yield md.details(
            bench_result.perop_heading(m.per_call, md.html),
            bench_result.perop_table(m.per_call, _scale, rows),
        )
    qwen3 = (ev and ev.qwen3_eager) or (m and m.qwen3)
    if qwen3:
        yield "\n".join(bench_result.qwen3_eager_markdown(qwen3))
    if ev and ev.serving:
        yield _serving(ev, rows)
    if ev and ev.numerics:
        numerics = bench_result.numerics_table(ev, rows)
        yield md.details("Numerics per x86 kernel build", numerics)
    if ev and ev.perop:
        # The out-of-tree providers' IR routes are this tool's, not vLLM's.
        ours = tuple(f"ir:{spec['name']}" for spec in provider_specs())
        yield md.details(
            bench_result.perop_heading(ev.perop, md.html),
            bench_result.perop_table(ev.perop, lambda r: r.route not in ours, rows),
        )


def _scale(row: PerOpRow) -> bool:
    """Each side's ``RMSNorm`` call; native and the patched kernel, for scale."""
    scale = row.route == NATIVE or (row.env, row.route) == ("patched", "kernel")
    return scale or row.route.startswith("layer:")


def _test_table(runs: TestRuns):
    after, files = runs.after, []
    if runs.same:
        verb = "matches" if len(runs.same) == 1 else "match"
        files.append(f"whose {_and([f'`{f}`' for f in runs.same])} {verb} this branch")
    if runs.copied:
        copied = _and([f"`{f}`" for f in runs.copied])
        files.append(
            f"with this branch's {copied} (without and with the change) in place of "
            "the build's own"
        )
    yield (
        f"`{after.command}` on a CPU build of vLLM {after.vllm} (torch {after.torch}) "
        f"{' and '.join(files)}, in {after.seconds:.0f} s:"
    )
    done = [("with this change", after)]
    done += [("without it", runs.before)] if runs.before and runs.before.ran else []
    yield md.table(
        ["vLLM", *KEYS], [(s, *(r.counts[k] for k in KEYS)) for s, r in done]
    )
    for said, run in done:
        if run.failures:
            ids = "\n".join(f"- {md.code(f)}" for f in run.failures)
            yield md.details(f"Failing {said} (the first {len(run.failures)})", ids)


def _serving(ev: Evidence, rows: int) -> str:
    said = "{mode}, median [min–max] of {reps} server starts:"
    tables = bench_result.serving_tables(ev.serving, said)
    base = f"vLLM {md.html(ev.vllm.base, 40)}, and" if ev.vllm else "vLLM"
    summary = f"Serving {md.html(ev.model.named(), 80)}: {base} with the change"
    commands = md.fence(ev.serving.commands[:rows], "bash")
    return md.details(summary, "\n\n".join([*tables, commands]))


PROVENANCE = """\
- How this was made: the diff is generated by {tool} (LibCST codemods; a tool \
written with AI assistance), which also ran the tests and measurements quoted \
here and filled this description.
- Not a duplicate: this branch's base has no `RMSNorm.forward_cpu`; #31643 took \
the kernels off on purpose, and this PR answers it above. Open PRs were not \
searched by the tool: `gh pr list --repo vllm-project/vllm --state open --search \
"RMSNorm forward_cpu"`.
- Tests run: {tests} Model evaluation: {evaluation}"""


def _details(upstream: Upstream, facts: Facts):
    yield upstream.purpose
    for edit in facts.ci:
        if edit.text is None and edit.wiring.tests:
            tests = ", ".join(f"`{t}`" for t in edit.wiring.tests)
            yield f"CI: {tests} not added to `{edit.wiring.file}`: {edit.reason}."
    for file, reason in facts.left_out.items():
        yield f"Left out of this commit: `{file}` ({reason})."
    ran = facts.tests and facts.tests.after.ran
    qwen3 = facts.measured and facts.measured.qwen3
    yield PROVENANCE.format(
        tool=tool_version(),
        tests="the table above." if ran else "none here; the command above.",
        evaluation=(
            "the eager Qwen3 comparison above; gsm8k needs the commands above."
            if qwen3
            else "not run here; the commands above."
        ),
    )
    changes = [f"- `{rel}`: {c}" for rel, made in facts.described.items() for c in made]
    if changes:
        yield md.details("What the diff does, file by file", "\n".join(changes))

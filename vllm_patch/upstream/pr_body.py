"""The PR description: the checkout's template filled with this run's figures,
the patch's ``upstream.md`` and what ``AGENTS.md`` asks a PR to state."""

import ast
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
from vllm_patch.bench import likelihood, qwen3_eager, record, report
from vllm_patch.bench.record import NATIVE, SIDES, Evidence, PerOpRow
from vllm_patch.runtime import markdown as md
from vllm_patch.upstream.ci_yaml import CiEdit
from vllm_patch.upstream.figures import (
    BIAS_ADDS,
    BIAS_HIDDEN,
    BIAS_TOKENS,
    BIAS_UPDATE,
    Bias,
    Measured,
)
from vllm_patch.upstream.meta import Upstream
from vllm_patch.upstream.template import Piece, Template, boxes, fill
from vllm_patch.upstream.vllm_tests import (
    KEYS,
    TestRun,
    TestRuns,
    described_machine,
)

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

NOT_RUN = (
    "This run starts no server; serving throughput and gsm8k each need "
    "`vllm serve` on each build, minutes to hours on a small CPU. The commands:"
)
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
    """``folder``'s ``bench --serve`` evidence for ``patch``,
    both vLLMs measured."""
    if folder is None:
        return None
    ev = record.read(folder)
    configs = ev.serving.configs if ev.serving else {}
    found = [
        f"serving.configs.{mode}.{side}: not measured"
        for mode, sides in configs.items()
        for side in SIDES
        if not sides.get(side)
    ]
    lm = ev.accuracy.lm_eval
    if lm and set(lm.scores) != set(SIDES):
        found.append(
            "accuracy.lm_eval: no exact_match and stderr for base and patched"
        )
    if ev.vllm is None or ev.vllm.patch != patch.name:
        said = md.printable(ev.vllm.patch if ev.vllm else "none named", 60)
        found[:0] = [
            f"figures of another change ({said}); measure this one with "
            f"`vllm-patch bench --serve --patch {patch.name} --out DIR`"
        ]
    if found:
        raise PatchError(
            "not usable evidence",
            path=str(Path(os.path.realpath(folder)) / record.EVIDENCE),
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


def render(
    patch: Patch, upstream: Upstream, facts: Facts, template: Template
) -> str:
    """The checkout's PR template filled, its tables cut until within
    ``BODY_LIMIT``."""
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
    before = runs.before if runs else None
    failed_before = before and before.ran and _failed(before)
    said = {
        AI_BOX: (
            "true of this diff (made by vllm-patch, written with AI assistance)"
        ),
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
    overview = f"{title}, off on CPU since #31643. {SCOPE}\n{upstream.rule}"
    claims = _claims(upstream, facts, rows)  # a part not measured: None
    return [
        Piece(("purpose",), overview),
        Piece(("claims", "purpose"), "\n".join(filter(None, claims))),
        Piece(("plan",), "\n\n".join(_plan(upstream, facts))),
        Piece(("result", "plan"), "\n\n".join(_results(facts, rows))),
        Piece(("details", "purpose"), "\n\n".join(_details(upstream, facts))),
    ]


# Where CustomOp runs forward_cpu on CPU (vLLM 0.32.0 - 0.34.0): the change's
# reach, stated first so that no reviewer takes it for a serving speed-up.
SCOPE = (
    "It acts in eager mode (`--enforce-eager`) and with `+rms_norm` in "
    "`custom_ops` only: default CPU serving compiles with Inductor, which keeps "
    "the native norm, and is unchanged."
)


def tests_said(source: str) -> str:
    """What a new test file tests: each test function and its docstring's first
    line (a file that does not parse: its line count)."""
    try:
        module = ast.parse(source)
    except SyntaxError:
        return f"a new test file ({source.count(chr(10))} lines)"
    tests = [
        f"{md.code(f.name, 80)}"
        + (f" ({md.text(doc.splitlines()[0], 160)})" if doc else "")
        for f in module.body
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
        and f.name.startswith("test")
        for doc in [ast.get_docstring(f)]
    ]
    return (
        "new tests: " + "; ".join(tests) if tests else "a new file, no test in it"
    )


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
    return " and ".join(
        [", ".join(items[:-1]), items[-1]] if len(items) > 1 else items
    )


def _claims(upstream: Upstream, facts: Facts, rows: int):
    yield _tests_claim(facts.tests, _command(upstream, facts))
    ev, m = facts.evidence, facts.measured
    if ev:
        yield from report.claims(ev, rows)
    elif m and m.per_call:
        yield report.perop_claim(m.per_call, rows)
    if m and m.real:
        yield _real_model_claim(m)
    if m and m.bias:
        yield _bias_claim(m)
    if m and m.qwen3 and not (ev and ev.qwen3_eager):
        yield _strided_claim(m.qwen3)
    if not (ev or (m and (m.per_call or m.real or m.bias))):
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
        return (
            f"- vLLM's tests of the change: to run, `{command}` with and "
            "without it."
        )
    counts = runs.after.counts
    shown = ", ".join(
        f"{counts[k]:,} {k}" for k in KEYS if k != "errors" or counts[k]
    )
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


def _real_model_claim(m: Measured) -> str:
    """Per dtype the log-likelihood difference and the greedy agreement."""
    said, greedy = [], []
    for found in m.real:
        ll, answers = found.likelihood, found.greedy
        said.append(f"{ll.dtype} {likelihood.shown(ll.difference['patched'])}")
        greedy.append(
            f"{answers.identical('patched')}/{len(answers.prompts)} ({ll.dtype})"
        )
    first = m.real[0].likelihood
    return (
        f"- A real model, {md.text(m.model)} (eager, {md.code(first.build)}): "
        f"this change − base in nats per token over {first.tokens:,} tokens of "
        f"text, with a 95 % interval: {'; '.join(said)}. Greedy answers the "
        f"base's token for token: {', '.join(greedy)}."
    )


def _unbiased(b: Bias) -> bool:
    """This change's bfloat16 magnitudes are native's (within 1e-3, where the
    truncating kernel is 3e-3 off after one norm and 0.15 after 64 adds)."""
    return all(
        abs(found["this change"] - found["native"]) < 1e-3
        for found in (b.rms_norm, b.fused_add)
    )


def _bias_claim(m: Measured) -> str:
    """Per build measured: does this change keep native's bfloat16 magnitude."""
    said = []
    for b in m.bias:
        verdict = "no bias native lacks" if _unbiased(b) else "the kernel's bias"
        said.append(
            f"on {md.code(b.build)} {verdict}: after {BIAS_ADDS} fused adds "
            f"the residual's norm is {b.fused_add['this change']:.4f} of the exact "
            f"sum with this change, {b.fused_add['native']:.4f} native, "
            f"{b.fused_add['kernel']:.3f} through the kernel"
        )
    return f"- bfloat16: {'; '.join(said)} (details below)."


def _strided_claim(q) -> str:
    """The strided per-head norms: this PR's finding and its experiment."""
    patched, unguarded = q.patched, q.unguarded
    n = len(q.prompts)
    return (
        "- Strided per-head q/k norms stay native (this PR's finding, below): on "
        f"an eager random-weight Qwen3 in {qwen3_eager.DTYPE}, "
        f"{patched.identical_prompts}/{n} prompts give the base's greedy tokens "
        f"with this change, {unguarded.identical_prompts}/{n} with the kernels "
        "for every input."
    )


def _ran_on(facts: Facts) -> str | None:
    """The sentence naming the vLLM build and kernel library that ran."""
    m, runs = facts.measured, facts.tests
    after = runs.after if runs and runs.after.ran else None
    vllm = (m and m.vllm) or (after and f"vLLM {after.vllm}")
    build = (m and m.kernel_build) or (after and after.kernel_build)
    if not (vllm and build):
        return None
    put = (m.put_in if m and m.vllm else runs.copied) or ()
    files = _and([f"`{f}`" for f in put])
    used = (
        f"this branch's {files} put in place of the build's own"
        if put
        else "the change applied to the build's own files (no file of this "
        "branch ran: the run was told to run none)"
    )
    note = BUILDS.get(build, "not an x86 build")
    return f"Ran on {vllm}, {used}; kernel build `{build}` ({note})."


def _plan(upstream: Upstream, facts: Facts):
    command = _command(upstream, facts)
    ran = _ran_on(facts)
    if ran:
        yield ran
    yield f"The tests, with and without this change:\n\n```bash\n{command}\n```"


BUILDS = {
    "_C": "AVX512-BF16",
    "_C_AVX512": "AVX-512 without AVX512-BF16",
    "_C_AVX2": "AVX2",
}
# Where the kernels run in bfloat16, by the rule (cpu_norm_rule.cpu_norm_dtypes),
# and why that is unbiased; the figures are the run's own, per build measured.
BF16_RULE = (
    "With this change the kernels run in bfloat16 only where the build rounds "
    "float32 to bfloat16 to nearest even, as native's `.to(torch.bfloat16)` "
    "does: x86 `_C` (AVX512-BF16, `_mm512_cvtneps_pbh`), aarch64 with BF16 "
    "(in hardware), POWER and s390x (in software). Rounding to nearest even errs "
    "both ways, so no drift builds up along the residual stream. `_C_AVX512` and "
    "`_C_AVX2` keep the high 16 bits (`csrc/cpu/cpu_types_x86.hpp`): every "
    "element moves toward zero, and the fused add carries that from layer to "
    "layer, so bfloat16 stays native there; float32 and float16 run the kernels "
    "on every x86 build. Rounding to nearest even in those conversions is the "
    "follow-up that would let bfloat16 run the kernels there too."
)
STRIDED = (
    "**Strided per-head norms (this PR's finding).** #31643 (\"[Bugfix][CPU] "
    'Fix RotaryEmbedding fallback causing gibberish with --enforce-eager") '
    "pinned `RotaryEmbedding`, `RMSNorm`, `GemmaRMSNorm` and `RMSNormGated` to "
    "native on CPU. Why `RMSNorm` broke is our reading, not #31643's: Qwen3 runs "
    "`q_norm` and `k_norm` on per-head views of the qkv output, whose rows are "
    "strided, and the CPU kernels read their input as contiguous rows. The "
    "experiment: an eager random-weight Qwen3 with the kernels for every input "
    "(unguarded) against this change, which sends non-contiguous input to "
    "native."
)


def _bias_section(m: Measured) -> str:
    """The bfloat16 rule per build, and this run's figures per build measured."""
    rows = [
        [
            f"{md.code(b.build)}",
            route,
            f"{b.rms_norm[route]:.4f}",
            f"{b.fused_add[route]:.4f}",
        ]
        for b in m.bias
        for route in b.rms_norm
    ]
    runs = "; ".join(
        f"{md.code(b.build)}: "
        + ", ".join(f"{op} {how}" for op, how in b.layer_runs.items())
        for b in m.bias
    )
    measured = ", ".join(b.build for b in m.bias)
    others = [f"`{b}`" for b in BUILDS if b not in {x.build for x in m.bias}]
    unmeasured = ", ".join([*others, "aarch64, POWER and s390x"])
    header = [
        "build",
        "route",
        "one rms_norm: |out| / |exact|",
        f"residual norm after {BIAS_ADDS} fused adds / exact",
    ]
    return md.details(
        f"bfloat16 bias per kernel build (measured here: {md.html(measured)})",
        f"{BF16_RULE}\n\nMeasured here ({BIAS_TOKENS} x {BIAS_HIDDEN}, "
        f"bfloat16, 1 thread, against float64 from the same inputs; updates at "
        f"{BIAS_UPDATE:g} of the residual's scale). With this change the layer "
        f"ran: {runs}. Not measured here: {unmeasured} (this CPU cannot load them)."
        "\n\n" + md.table(header, rows),
    )


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
        lines = "\n".join(report.decode_markdown(ev.decode, rows))
        yield re.sub(r"^#{2,3} (.+)$", r"**\1**", lines, flags=re.M)
    if runs:
        yield from _test_table(runs)
    if m and m.per_call:
        yield md.details(
            report.perop_heading(m.per_call, md.html),
            report.perop_table(m.per_call, _scale, rows),
        )
    if m and m.real:
        table = "\n".join(likelihood.markdown(m.real, m.model))
        yield md.details(f"{md.html(m.model)}: log-likelihood and greedy", table)
    if m and m.bias:
        yield _bias_section(m)
    qwen3 = (ev and ev.qwen3_eager) or (m and m.qwen3)
    if qwen3:
        shown = report.qwen3_eager_markdown(qwen3)
        table = shown[0].split("\n\n", 1)[-1]  # its table, without its reading
        setup = (
            f"Here: {md.text(qwen3.model.named(), 400)}; {len(qwen3.prompts)} "
            f"prompts, {qwen3.max_tokens} greedy tokens each, one offline engine "
            "per side."
        )
        yield md.details(
            "Strided per-head norms: eager Qwen3",
            "\n".join([STRIDED, "", setup, "", table, *shown[1:]]),
        )
    if ev and ev.serving:
        yield _serving(ev, rows)
    if ev and ev.numerics:
        numerics = report.numerics_table(ev, rows)
        yield md.details("Numerics per x86 kernel build", numerics)
    if ev and ev.perop:
        # The out-of-tree providers' IR routes are this tool's, not vLLM's.
        ours = tuple(f"ir:{spec['name']}" for spec in provider_specs())
        yield md.details(
            report.perop_heading(ev.perop, md.html),
            report.perop_table(ev.perop, lambda r: r.route not in ours, rows),
        )


def _scale(row: PerOpRow) -> bool:
    """Each side's ``RMSNorm`` call; native and the patched kernel, for scale."""
    scale = row.route == NATIVE or (row.env, row.route) == ("patched", "kernel")
    return scale or row.route.startswith("layer:")


def _test_table(runs: TestRuns):
    after, files = runs.after, []
    if runs.same:
        verb = "matches" if len(runs.same) == 1 else "match"
        files.append(
            f"whose {_and([f'`{f}`' for f in runs.same])} {verb} this branch"
        )
    if runs.copied:
        copied = _and([f"`{f}`" for f in runs.copied])
        files.append(
            f"with this branch's {copied} (without and with the change) in place "
            "of the build's own"
        )
    yield (
        f"`{after.command}` on a CPU build of vLLM {after.vllm} (torch "
        f"{after.torch}) {' and '.join(files)}, in {after.seconds:.0f} s:"
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
    tables = report.serving_tables(ev.serving, said)
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
    if facts.described:
        yield what_changes(facts.described)
    yield upstream.purpose
    for edit in facts.ci:
        if edit.text is None and edit.wiring.tests:
            tests = ", ".join(f"`{t}`" for t in edit.wiring.tests)
            yield f"CI: {tests} not added to `{edit.wiring.file}`: {edit.reason}."
    for file, reason in facts.left_out.items():
        yield f"Left out of this commit: `{file}` ({reason})."
    ran = facts.tests and facts.tests.after.ran
    m, ev = facts.measured, facts.evidence
    evaluated = []
    if m and m.real:
        evaluated.append(f"{md.text(m.model)}'s log-likelihood and greedy answers")
    if m and m.qwen3:
        evaluated.append("the eager Qwen3 comparison")
    if ev and ev.accuracy.lm_eval:
        evaluated.append("gsm8k")
    yield PROVENANCE.format(
        tool=tool_version(),
        tests="the table above." if ran else "none here; the command above.",
        evaluation=f"{_and(evaluated)}, above." if evaluated else "none here.",
    )
    unrun = []
    if not (ev and ev.serving):
        unrun.append(SERVE.format(model=upstream.model))
    if not (ev and ev.accuracy.lm_eval):
        unrun.append(LM_EVAL.format(model=upstream.model))
    if unrun:
        yield md.details(
            "Not run here: serving and gsm8k", "\n\n".join([NOT_RUN, *unrun])
        )
    changes = [
        f"- `{rel}`: {c}" for rel, made in facts.described.items() for c in made
    ]
    if changes:
        yield md.details("What the diff does, file by file", "\n".join(changes))

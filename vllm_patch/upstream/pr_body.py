"""The pull request description: the checkout's template (``template``) filled
with text about vLLM alone. Every figure is from this ``pr`` run: vLLM's edited
tests with and without the change (``vllm_tests``) and ``--evidence DIR``'s
``evidence.json`` (``bench --serve``: serving, accuracy, numerics, machine); a
claim not measured is the command that would measure it. Text about the diff is
generated from it; the rest is the patch's ``upstream.md`` and the checkout's
paragraph it quotes (``[upstream] quote``)."""

from __future__ import annotations

import copy
import os
import re
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

from packaging.version import Version

from patcher.errors import PatchError
from patcher.files import inside, read_text_at
from patcher.patchset import Patch, provider_specs
from vllm_patch.runtime import bench_result, evidence_record
from vllm_patch.runtime import markdown as md
from vllm_patch.runtime.evidence_record import SIDES, Evidence
from vllm_patch.runtime.markdown import details, table
from vllm_patch.upstream.ci_yaml import CiEdit
from vllm_patch.upstream.meta import Upstream
from vllm_patch.upstream.template import Piece, fill, read_template
from vllm_patch.upstream.vllm_tests import KEYS, TestRuns, described_machine

SERVE = (
    "vllm serve {model} [--enforce-eager]\nvllm bench serve --model {model} "
    "--dataset-name random --random-input-len 128 --random-output-len 128 "
    "--num-prompts 64 --ignore-eos --seed 0"
)
LM_EVAL = (
    "lm_eval --model local-completions --tasks gsm8k --model_args "
    "model={model},base_url=http://localhost:8000/v1/completions,num_concurrent=4"
)


def load_evidence(folder: Path | None, patch: Patch) -> Evidence | None:
    """``folder/evidence.json`` as ``bench --serve`` writes it for ``patch``
    (``runtime.evidence_record``), both vLLMs measured, or None."""
    if folder is None:
        return None
    ev = evidence_record.read(folder)
    found = _misfit(ev, patch)
    if found:
        raise PatchError(
            "not usable evidence",
            path=str(Path(os.path.realpath(folder)) / evidence_record.EVIDENCE),
            looked_for=f"what `bench --serve` measured for {patch.name}",
            found=found,
        )
    return ev


def _misfit(ev: Evidence, patch: Patch) -> str | None:
    if ev.vllm is None or ev.vllm.patch != patch.name:
        said = md.printable(ev.vllm.patch if ev.vllm else "none named", 60)
        return (
            f"figures of another change ({said}); measure this "
            f"one with `vllm-patch bench --serve --patch {patch.name} --out DIR`"
        )
    for mode, sides in (ev.serving.configs if ev.serving else {}).items():
        for side in SIDES:
            if not sides.get(side):
                return f"serving.configs.{mode}.{side}: not measured"
    if ev.lm_eval and set(ev.lm_eval.scores) != set(SIDES):
        return "accuracy.lm_eval: no exact_match and stderr for base and patched"
    return None


@dataclass(frozen=True)
class Facts:
    """What a description is made of, besides the patch's own text."""

    version: Version | None
    evidence: Evidence | None = None
    checkout: Path | None = None
    described: dict[str, list[str]] = field(default_factory=dict)  # per file
    tests: TestRuns | None = None
    left_out: dict[str, str] = field(default_factory=dict)
    ci: CiEdit | None = None


BODY_LIMIT = 65536
"""GitHub's bound on a pull request's body, in characters."""


def render(patch: Patch, upstream: Upstream, facts: Facts) -> str:
    """The checkout's PR template (or the fallback layout) filled, within
    ``BODY_LIMIT``: the evidence's tables cut shorter until it fits."""
    template = read_template(facts.checkout)
    for rows in (100, 20, 3, 0):
        text = fill(copy.deepcopy(template), _pieces(upstream, facts, rows))
        if len(text) <= BODY_LIMIT:
            break
    return text


def _pieces(upstream: Upstream, facts: Facts, rows: int) -> list[Piece]:
    title = re.sub(r"^(\[[^\]]*\])+\s*", "", upstream.title)
    overview = f"{title}. {what_changes(facts.described)}\n{upstream.rule}"
    return [
        Piece(("purpose",), overview),
        Piece(("claims", "purpose"), "\n".join(_claims(upstream, facts, rows))),
        Piece(("plan",), "\n\n".join(_plan(upstream, facts))),
        Piece(("result", "plan"), "\n\n".join(_results(facts, rows))),
        Piece(("details", "purpose"), "\n\n".join(_details(upstream, facts))),
    ]


def what_changes(described: dict[str, list[str]], mark: str = "`") -> str:
    """One sentence naming the files the diff changes: sources, vLLM's tests
    (under ``tests/``) and CI (under ``.buildkite/``)."""
    roles: dict[str, list[str]] = {"": [], "tests/": [], ".buildkite/": []}
    for rel in described:
        role = next((r for r in roles if r and rel.startswith(r)), "")
        roles[role].append(f"{mark}{rel}{mark}")
    src, tests, ci = map(_and, roles.values())
    tests = f", with vLLM's tests in {tests}" if tests else ""
    return f"This changes {src}{tests}" + (
        f" and their CPU CI step in {ci}." if ci else "."
    )


def _and(items: list[str]) -> str:
    return " and ".join([", ".join(items[:-1]), items[-1]] if len(items) > 1 else items)


def _claims(upstream: Upstream, facts: Facts, rows: int):
    yield _tests_claim(facts.tests, _command(upstream, facts))
    ev = facts.evidence
    yield (ev and bench_result.throughput_claim(ev)) or (
        "- Serving speed against the base: to measure, `vllm bench serve`."
    )
    if ev and ev.perop:
        yield from filter(None, [bench_result.perop_claim(ev.perop, rows)])
    yield from filter(None, [ev and bench_result.tokens_claim(ev)])
    yield (ev and bench_result.lm_eval_claim(ev)) or (
        "- Accuracy against the base: to measure, `lm_eval` on both builds."
    )
    if facts.ci and facts.ci.added_tests:
        tests = ", ".join(f"`{t}`" for t in facts.ci.added_tests)
        yield f'- vLLM\'s CPU CI runs {tests} in its "{facts.ci.wiring.step}" step.'


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
    failed = before.counts["failed"] + before.counts["errors"]
    names = ", ".join(map(md.code, dict.fromkeys(map(_test_name, before.failures))))
    return f"{said}; without it {failed} fail" + (f" ({names})." if names else ".")


def _test_name(test_id: str) -> str:  # [Class::]test, unparametrised
    where, _, name = test_id.split("[")[0].rpartition("::")
    where = where.rsplit(".", 1)[-1]  # a class, or a function's module
    return f"{where}::{name}" if where[:1].isupper() else name


def _plan(upstream: Upstream, facts: Facts):
    model, command = upstream.model, _command(upstream, facts)
    ev = facts.evidence
    build = f"vLLM {facts.version}" if facts.version else "vLLM"
    yield (
        f"On a CPU build of {build} (`VLLM_TARGET_DEVICE=cpu`), with and without "
        "this change:"
    )
    yield f"```bash\n{command}\n```"
    if not (ev and ev.serving):
        yield "Serving, on each build, eager and compiled:"
        yield f"```bash\n{SERVE.format(model=model)}\n```"
    if not (ev and ev.lm_eval):
        yield f"Accuracy, against `vllm serve {model}` on each build:"
        yield f"```bash\n{LM_EVAL.format(model=model)}\n```"


def _results(facts: Facts, rows: int):
    runs = facts.tests if facts.tests and facts.tests.after.ran else None
    ev = facts.evidence
    tests = runs.after.machine if runs else None
    bench = ev and ev.machine and described_machine(asdict(ev.machine))
    if tests and bench and tests != bench:
        yield (
            f"Serving and accuracy measured on {md.text(bench, 400)}; vLLM's tests "
            f"on {md.text(tests, 400)}."
        )
    elif tests or bench:
        yield f"Measured on {md.text(tests or bench, 400)}."
    if runs:
        yield from _test_table(runs)
    if ev and ev.serving:
        yield _serving(ev, rows)
    if ev and ev.numerics:
        numerics = bench_result.numerics_table(ev.numerics, rows)
        yield details("Numerics per x86 kernel build", numerics)
    if ev and ev.perop:
        # The out-of-tree providers' IR routes are this tool's, not vLLM's.
        ours = tuple(f"ir:{spec['name']}" for spec in provider_specs())
        yield details(
            bench_result.perop_heading(ev.perop, md.html),
            bench_result.perop_table(ev.perop, leave_out=ours, limit=rows),
        )


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
    yield table(["vLLM", *KEYS], [(s, *(r.counts[k] for k in KEYS)) for s, r in done])
    for said, run in done:
        if run.failures:
            ids = "\n".join(f"- {md.code(f)}" for f in run.failures)
            yield details(f"Failing {said} (the first {len(run.failures)})", ids)


def _serving(ev: Evidence, rows: int) -> str:
    said = "{mode}, median [min–max] of {reps} server starts:"
    tables = bench_result.serving_tables(ev.serving, said)
    base = f"vLLM {md.html(ev.vllm.base, 40)}, and" if ev.vllm else "vLLM"
    summary = f"Serving {md.html(_named(ev), 80)}: {base} with the change"
    commands = bench_result.commands(ev.serving, rows)
    return details(summary, "\n\n".join([*tables, commands]))


def _named(ev: Evidence) -> str:
    return (ev.model and (ev.model.name or ev.model.description)) or "the model"


def _details(upstream: Upstream, facts: Facts):
    yield upstream.purpose
    quoted = _quote(facts.checkout, upstream.quote) if upstream.quote else None
    if quoted:
        yield f"`{upstream.quote[0]}` in this release:\n\n> {quoted}"
    ci = facts.ci
    if ci and ci.text is None and ci.wiring.tests:
        tests = ", ".join(f"`{t}`" for t in ci.wiring.tests)
        yield f"CI: {tests} not added to a CPU CI step: {ci.reason}."
    for file, reason in facts.left_out.items():
        yield f"Left out of this commit: `{file}` ({reason})."
    changes = [f"- `{rel}`: {c}" for rel, made in facts.described.items() for c in made]
    if changes:
        yield details("What the diff does, file by file", "\n".join(changes))


def _quote(checkout: Path | None, quote: tuple[str, str]) -> str | None:
    """The paragraph of the checkout's ``file`` that holds ``says``, one line."""
    rel, says = quote
    if checkout is None or not os.path.lexists(checkout / rel):
        return None
    what = f"the paragraph saying {says!r}"
    text = read_text_at(inside(checkout, rel, what=what), what)
    found = [p for p in re.split(r"\n\s*\n", text) if says in p]
    return " ".join(found[0].replace('"""', " ").split()) if found else None

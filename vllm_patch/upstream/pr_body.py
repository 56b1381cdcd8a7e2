"""The pull request description: the checkout's template (``template``) filled
with text about vLLM alone. Every figure is from this ``pr`` run: vLLM's edited
tests with and without the change (``vllm_tests``) and ``--evidence DIR``'s
``evidence.json`` (``bench --serve``: serving, accuracy, numerics, machine); a
claim not measured is the command that would measure it. Text about the diff is
generated from it; the rest is the patch's ``upstream.md`` and the checkout's
paragraph it quotes (``[upstream] quote``)."""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import Version

from patcher.errors import PatchError
from patcher.files import inside, read_text_at
from patcher.patchset import Patch, provider_specs
from vllm_patch.runtime import bench_result
from vllm_patch.runtime.bench_result import MODES, SIDES
from vllm_patch.runtime.markdown import details, table
from vllm_patch.upstream.ci_yaml import CiEdit
from vllm_patch.upstream.meta import Upstream
from vllm_patch.upstream.template import Piece, fill, read_template
from vllm_patch.upstream.vllm_tests import KEYS, TestRuns, described_machine

NOT_QUALITY = " (random weights: the builds' numerics, not model quality)"
LM_EVAL_KEYS = ("exact_match", "stderr")
TABLES = ("machine", "model", "serving", "accuracy", "numerics")
SERVE = (
    "vllm serve {model} [--enforce-eager]\nvllm bench serve --model {model} "
    "--dataset-name random --random-input-len 128 --random-output-len 128 "
    "--num-prompts 64 --ignore-eos --seed 0"
)
LM_EVAL = (
    "lm_eval --model local-completions --tasks gsm8k --model_args "
    "model={model},base_url=http://localhost:8000/v1/completions,num_concurrent=4"
)


def load_evidence(folder: Path | None, patch: Patch) -> dict | None:
    """``folder/evidence.json`` as ``bench --serve`` writes it for ``patch``
    (``runtime.bench_result``: schema 1, serving figures lists of numbers), or None."""
    if folder is None:
        return None
    data = bench_result.read(folder)
    found = _misfit(data, patch)
    if found:
        raise PatchError(
            "not usable evidence",
            path=str(Path(os.path.realpath(folder)) / bench_result.EVIDENCE),
            looked_for=f"what `bench --serve` measured for {patch.name}",
            found=found,
        )
    return data


def _at(data: object, *keys: str) -> object:
    for key in keys:
        data = data.get(key) if isinstance(data, dict) else None
    return data


def _misfit(data: object, patch: Patch) -> str | None:
    if _at(data, "schema") != 1:
        return "no `schema: 1`"
    if _at(data, "vllm", "patch") != patch.name:
        return (
            f"figures of another change ({_at(data, 'vllm', 'patch')}); measure this "
            f"one with `vllm-patch bench --serve --patch {patch.name} --out DIR`"
        )
    for key in TABLES:
        if not isinstance(_at(data, key) or {}, dict):
            return f"{key}: not a table"
    for config, sides in (_at(data, "serving", "configs") or {}).items():
        for side in SIDES:
            for metric, got in (_at(sides, side) or {"": None}).items():
                if not _numbers(got):
                    return f"serving.configs.{config}.{side}.{metric}: not numbers"
    lm = _at(data, "accuracy", "lm_eval")
    if lm and not _numbers([_at(lm, s, k) for s in SIDES for k in LM_EVAL_KEYS]):
        return "accuracy.lm_eval: no exact_match and stderr for base and patched"
    return None


def _numbers(got: object) -> bool:
    return (
        isinstance(got, list)
        and bool(got)
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in got)
    )


@dataclass(frozen=True)
class Facts:
    """What a description is made of, besides the patch's own text."""

    version: Version | None
    evidence: dict | None = None
    checkout: Path | None = None
    described: dict[str, list[str]] = field(default_factory=dict)  # per file
    tests: TestRuns | None = None
    left_out: dict[str, str] = field(default_factory=dict)
    ci: CiEdit | None = None


def render(patch: Patch, upstream: Upstream, facts: Facts) -> str:
    """The checkout's PR template (or the fallback layout) filled."""
    ev = facts.evidence or {}
    title = re.sub(r"^(\[[^\]]*\])+\s*", "", upstream.title)
    overview = f"{title}. {what_changes(facts.described)}\n{upstream.rule}"
    pieces = [
        Piece(("purpose",), overview),
        Piece(("claims", "purpose"), "\n".join(_claims(upstream, facts, ev))),
        Piece(("plan",), "\n\n".join(_plan(upstream, facts, ev))),
        Piece(("result", "plan"), "\n\n".join(_results(facts, ev))),
        Piece(("details", "purpose"), "\n\n".join(_details(upstream, facts))),
    ]
    return fill(read_template(facts.checkout), pieces)


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


def _claims(upstream: Upstream, facts: Facts, ev: dict):
    yield _tests_claim(facts.tests, _command(upstream, facts))
    configs = _at(ev, "serving", "configs") or {}
    ratios = ", ".join(
        f"{bench_result.ratio_shown(ev, m, 'output_throughput')} {m}"
        for m in MODES
        if m in configs
    )
    if ratios:
        yield (
            f"- Output throughput with this change over the base, serving "
            f"{_model(ev)}, median [min–max] of the repetitions: {ratios}."
        )
    else:
        yield "- Serving speed against the base: to measure, `vllm bench serve`."
    if ev.get("perop"):
        yield _perop_claim(ev["perop"])
    tokens, lm = _at(ev, "accuracy", "tokens"), _at(ev, "accuracy", "lm_eval")
    if tokens:
        count = _plain(tokens.get("tokens"))
        same = bench_result.first_difference(tokens.get("first_divergence"))
        note = NOT_QUALITY if _at(ev, "model", "random_weights") else ""
        yield (
            f"- Greedy completions of {_plain(tokens.get('prompts'))} prompts, "
            f"{count} tokens, against the base: {same}; largest |Δ logprob| "
            f"{_plain(tokens.get('max_abs_dlogprob'))}{note}."
        )
    if lm:
        scores = [
            f"{_plain(lm[s]['exact_match'])} ± {_plain(lm[s]['stderr'])} {said}"
            for s, said in zip(SIDES, ("base", "with this change"), strict=True)
        ]
        yield f"- {lm.get('task')} exact_match: {', '.join(scores)}."
    else:
        yield "- Accuracy against the base: to measure, `lm_eval` on both builds."
    if facts.ci and facts.ci.added_tests:
        tests = ", ".join(f"`{t}`" for t in facts.ci.added_tests)
        yield f'- vLLM\'s CPU CI runs {tests} in its "{facts.ci.wiring.step}" step.'


def _perop_claim(perop: dict) -> str:
    """The base's time per call of vLLM's norm layer over this change's."""
    layer: dict[str, dict[int, dict[str, float]]] = {}
    for r in perop["rows"]:
        if r["route"].startswith("layer:") and "median_us" in r:
            layer.setdefault(r["op"], {}).setdefault(r["tokens"], {})[r["env"]] = r[
                "median_us"
            ]
    said = [
        f"{op} "
        + " / ".join(f"{t['base'] / t['patched']:.1f}x" for t in by.values())
        + f" at {' / '.join(map(str, by))} tokens"
        for op, by in layer.items()
        if all(set(t) >= set(SIDES) for t in by.values())
    ]
    return (
        f"- Per call of vLLM's norm layer ({perop['dtype']}, hidden "
        f"{perop['hidden_size']}, {perop['threads']} thread), the base's time over "
        f"this change's: {'; '.join(said)}."
    )


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
    names = ", ".join(f"`{n}`" for n in dict.fromkeys(map(_test_name, before.failures)))
    return f"{said}; without it {failed} fail" + (f" ({names})." if names else ".")


def _test_name(test_id: str) -> str:  # [Class::]test, unparametrised
    where, _, name = test_id.split("[")[0].rpartition("::")
    where = where.rsplit(".", 1)[-1]  # a class, or a function's module
    return f"{where}::{name}" if where[:1].isupper() else name


def _model(ev: dict) -> object:
    """The model in a few words (its ``description`` is for evidence.md)."""
    return _at(ev, "model", "name") or _at(ev, "model", "description") or "the model"


def _plain(value: object) -> str:
    """A value of the evidence in words, never a Python repr."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {_plain(v)}" for k, v in value.items())
    if isinstance(value, list | tuple):
        return ", ".join(map(_plain, value))
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _plan(upstream: Upstream, facts: Facts, ev: dict):
    model, command = upstream.model, _command(upstream, facts)
    build = f"vLLM {facts.version}" if facts.version else "vLLM"
    yield (
        f"On a CPU build of {build} (`VLLM_TARGET_DEVICE=cpu`), with and without "
        "this change:"
    )
    yield f"```bash\n{command}\n```"
    if not ev.get("serving"):
        yield "Serving, on each build, eager and compiled:"
        yield f"```bash\n{SERVE.format(model=model)}\n```"
    if not _at(ev, "accuracy", "lm_eval"):
        yield f"Accuracy, against `vllm serve {model}` on each build:"
        yield f"```bash\n{LM_EVAL.format(model=model)}\n```"


def _results(facts: Facts, ev: dict):
    runs = facts.tests if facts.tests and facts.tests.after.ran else None
    tests = runs.after.machine if runs else None
    bench = described_machine(ev["machine"]) if ev.get("machine") else None
    if tests and bench and tests != bench:
        yield f"Serving and accuracy measured on {bench}; vLLM's tests on {tests}."
    elif tests or bench:
        yield f"Measured on {tests or bench}."
    if runs:
        yield from _test_table(runs)
    if ev.get("serving"):
        yield _serving(ev)
    if ev.get("numerics"):
        rows = [(build, _plain(ops)) for build, ops in ev["numerics"].items()]
        numerics = table(["kernel build", "smallest rtol against native, per op"], rows)
        yield details("Numerics per x86 kernel build", numerics)
    if ev.get("perop"):
        p = ev["perop"]
        # The out-of-tree providers' IR routes are this tool's, not vLLM's.
        ours = tuple(f"ir:{spec['name']}" for spec in provider_specs())
        yield details(
            f"Microseconds per call (median; native's time over it), {p['dtype']}, "
            f"hidden {p['hidden_size']}, {p['threads']} thread",
            bench_result.perop_markdown(p, leave_out=ours),
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
            ids = "\n".join(f"- `{f}`" for f in run.failures)
            yield details(f"Failing {said} (the first {len(run.failures)})", ids)


def _serving(ev: dict) -> str:
    tables = [
        f"{mode}, median [min–max] of {bench_result.reps(ev, mode)} server starts:"
        f"\n\n{bench_result.serving_table(ev, mode)}"
        for mode in MODES
        if mode in ev["serving"]["configs"]
    ]
    commands = "\n".join(ev["serving"].get("commands") or ())
    summary = (
        f"Serving {_model(ev)}: vLLM {_at(ev, 'vllm', 'base')}, and with the change"
    )
    return details(summary, "\n\n".join([*tables, f"```bash\n{commands}\n```"]))


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

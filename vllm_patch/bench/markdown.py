"""The bench's Markdown: the report and the machine description (the tables of
figures are ``vllm_patch.runtime.bench_result``'s, which a PR description shares).

Everything printed here comes from the result document of one run.
"""

from __future__ import annotations

from typing import Any

from vllm_patch.runtime.bench_result import (
    busy_warning,
    dispatch_markdown,
    e2e_markdown,
    perop_markdown,
    share,
)


def token_note(pair: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """Why fused and native runs can produce different tokens, with where they
    parted in this run and what the per-op check found for the provider."""
    where = pair.get("first_difference")
    at = (
        f" (first at generated token {where['position'] + 1} of {where['of']})"
        if where
        else ""
    )
    mine = [
        r
        for r in rows
        if r["provider"] == pair["provider"]
        and r["op"] in pair["ops"]
        and r.get("source") == pair.get("source")
    ]
    off = [r for r in mine if r.get("status") != "ok"]
    if not off:
        checked = (
            f"{pair['provider']} passed the per-op check within the op's tolerance "
            f"in all {len(mine)} measurements"
        )
    else:
        cases = list(dict.fromkeys(f"{r['op']} {r['dtype']} {r['shape']}" for r in off))
        shown = ", ".join(cases[:3]) + (" ..." if len(cases) > 3 else "")
        checked = (
            f"{pair['provider']} was outside the op's tolerance in {len(off)} of "
            f"{len(mine)} per-op measurements ({shown}), close to it in the rest"
        )
    return (
        f"- {pair['mode']}: the fused and native runs generated different tokens"
        f"{at}. {checked}: the two implementations round differently in bf16 "
        "(accumulation order, and on CPUs whose kernels truncate to bf16, the "
        "conversion). Greedy decoding picks the largest logit, and a random-weight "
        "model's top logits lie close together, so such a difference can pick "
        "another token there, and every later token follows from it."
    )


def recommendation_markdown(doc: dict[str, Any], *, snippets: bool = True) -> str:
    out = [
        "| op | mode | recommended priority | basis | upstream rule | agrees |",
        "|---|---|---|---|---|---|",
    ]
    for r in doc["recommendation"]:
        priority = (
            "keep vLLM's default"
            if r["priority"] is None
            else f"`{r['priority']}`"
            + (" (after `vllm-patch apply`)" if r.get("needs_apply") else "")
        )
        out.append(
            f"| `{r['op']}` | {r['mode']} | {priority} | {r['basis']} | "
            f"{r['upstream_rule']} | {'yes' if r['agrees_with_upstream'] else 'NO'} |"
        )
    out.append("")
    for mode, snip in doc["snippets"].items() if snippets else ():
        out.append(f"{mode}:\n\n```\n{snip['cli']}\n{snip['python']}\n```\n")
    return "\n".join(out)


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        *_header(doc),
        *_perop_section(doc),
        *_e2e_section(doc),
        "## Recommendation for this machine",
        "",
        recommendation_markdown(doc),
    ]
    return "\n".join(lines) + "\n"


def _header(doc: dict[str, Any]) -> list[str]:
    m, v, o = doc["machine"], doc["versions"], doc["options"]
    return [
        "# vllm-patch bench",
        "",
        f"- Machine: {m['cpu_model']} ({m['arch']}), {m['usable_cpus']} usable CPUs, "
        f"{m['memory_gib']} GiB; flags: {', '.join(m['key_flags']) or 'none of note'}",
        f"- Versions: vLLM {v.get('vllm')}, torch {v.get('torch')}, "
        f"Python {v.get('python')}, vllm-patch {v.get('vllm_patch')}",
        f"- Run: {doc['started']} – {doc['finished']}, load average before "
        f"{doc['load_before']}, after {doc['load_after']}; "
        f"{'quick' if o['quick'] else 'full'} configuration",
        f"- Other processes' share of the machine's CPU time while measuring: per op "
        f"{share(doc['interference'].get('perop'))}, end to end "
        f"{share(doc['interference'].get('e2e'))} (0 = quiet; OpenMP kernels on "
        "all cores suffer most when other processes compete for them)",
        *busy_warning(doc),
        "",
    ]


def _perop_section(doc: dict[str, Any]) -> list[str]:
    lines = [
        "## Per op",
        "",
        "Microseconds per call of the implementation function (no IR dispatch): "
        f"median [first–third quartile] of {doc['options']['samples']} samples, each "
        "sample timing many calls; ratio = native median / this median, from the "
        "same process. Every implementation's output was checked against native "
        "with the op's own tolerance before it was timed.",
        "",
        perop_markdown(doc["perop"]["rows"]),
    ]
    dispatch = doc["perop"].get("dispatch")
    if dispatch:
        samples = max(r.get("samples", 0) for r in dispatch)
        lines += [
            "### Per call through IR dispatch",
            "",
            "The out-of-tree provider's own per-call cost: each provider called as "
            "vLLM's eager forward calls the op (`maybe_inplace` where the op has it, "
            "priority `[provider, native]`, no torch custom-op wrapper), so its "
            "`supports_args` and its Python count. Beside it the upstream provider it "
            "stands in for (enabled on the patched copy) and a minimal reference "
            "provider that does only what the upstream impl does, all in one process; "
            f"microseconds per call, median [quartiles] of {samples} short samples "
            "taken in turn.",
            "",
            dispatch_markdown(dispatch),
        ]
    if doc["perop"]["notes"]:
        lines += ["Notes:", ""] + [f"- {n}" for n in doc["perop"]["notes"]] + [""]
    return lines


def _e2e_section(doc: dict[str, Any]) -> list[str]:
    lines = ["## End to end", ""]
    e = doc.get("e2e")
    if not e:
        return [*lines, "Not run.", ""]
    lines += [
        f"Random-weight Llama {e['model']}, batch {e['batch']}, prompt "
        f"{e['prompt_len']} tokens, {e['max_tokens']} generated tokens, "
        f"{e['repeats']} timed generates after a warm-up (engine start not timed).",
        "",
        e2e_markdown(e["pairs"]),
        "",
    ]
    lines += [f"- **Failed:** {reason}" for reason in e.get("failed", [])]
    lines += [f"- {n}" for n in e.get("notes", [])]
    rows = doc["perop"]["rows"]
    lines += [token_note(p, rows) for p in e["pairs"] if p.get("same_tokens") is False]
    lines.append("")
    return lines


def machine_markdown(doc: dict[str, Any]) -> str:
    """The machine a result was measured on, from the result document itself."""
    m, v = doc["machine"], doc["versions"]
    inter = doc.get("interference", {})
    return "\n".join(
        [
            "# The machine behind this result",
            "",
            f"- CPU: {m['cpu_model']} ({m['arch']})",
            f"- CPUs: {m['logical_cpus']} logical, {m['usable_cpus']} usable here",
            f"- Memory: {m['memory_gib']} GiB",
            f"- Kernel-relevant CPU flags: {', '.join(m['key_flags']) or 'none'}",
            f"- OS: {m['os']}",
            f"- Software: vLLM {v.get('vllm')} ({v.get('vllm_file')}), torch "
            f"{v.get('torch')}, Python {v.get('python')}, transformers "
            f"{v.get('transformers')}, vllm-patch {v.get('vllm_patch')}",
            f"- Run: {doc['started']} – {doc['finished']}",
            f"- Load average (1, 5, 15 min) before: {doc['load_before']}, after: "
            f"{doc['load_after']}",
            "- Other processes' share of CPU time: per op "
            f"{share(inter.get('perop'))}, end to end {share(inter.get('e2e'))}",
            "",
            "All CPU flags:",
            "",
            "```",
            " ".join(m["flags"]),
            "```",
            "",
        ]
    )

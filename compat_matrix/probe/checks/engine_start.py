"""vLLM end to end (``--e2e``): ``LLM.generate`` on a small random Llama, once
with the provider ranked first and once on the patched copy with ``vllm_c``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from compat_matrix.probe.framework import (
    PATCH_NAME,
    Fail,
    Probe,
    Skip,
    need_kernels,
)
from compat_matrix.probe.vllm_ir import UPSTREAM_PROVIDER
from patcher.patchset import select
from patcher.tree import open_tree
from vllm_patch.bench.engine_run import TINY_LLAMA, make_random_llama, run_generate
from vllm_patch.runtime.cache import cache_dir
from vllm_patch.runtime.import_checks import explain
from vllm_patch.runtime.patched_copy import patched_copy

# Per engine run. On a shared 2-core machine under load one eager start took
# more than 10 minutes; a timeout is for a hung engine, not a slow one.
E2E_TIMEOUT = 1800
E2E_TOKENS = 8


def check_e2e(p: Probe) -> tuple[str, dict]:
    if not p.e2e:
        raise Skip("not requested (--e2e)")
    if p.pre_ir:
        return _harmless_run(p)
    need_kernels(p)
    model = _random_llama()
    details: dict[str, Any] = {"model": str(model), "model_config": TINY_LLAMA}
    run = dict(compiled=False, prompt_len=8, max_tokens=E2E_TOKENS, timeout=E2E_TIMEOUT)
    priority = {op: [p.name, "native"] for op in p.ops}
    details["provider_run"] = provider_run = run_generate(
        model, ir_op_priority=priority, **run
    )
    patch = select([PATCH_NAME])[0]
    with patched_copy(open_tree(None), patch, record=details) as copy:
        details["upstream_run"] = upstream_run = run_generate(
            model, ir_op_priority=None, pythonpath=(str(copy),), **run
        )
    problems = []
    for label, result, want in (
        ("provider", provider_run, p.name),
        ("patched vllm_c", upstream_run, UPSTREAM_PROVIDER),
    ):
        result["final_priority_parsed"] = parsed = parse_priority(
            result["final_priority"]
        )
        if result["ok"]:
            result.pop("log_tail", None)  # kept only to explain a failure
        else:
            problems.append(f"{label} run failed: {result['error']}")
            continue
        wrong = [op for op in p.ops if (parsed.get(op) or [None])[0] != want]
        if wrong:
            problems.append(f"{label} run: final priority {result['final_priority']}")
        outputs = result["output_token_ids"]
        if not outputs or any(len(o) != E2E_TOKENS for o in outputs):
            problems.append(f"{label} run produced {outputs}")
    if not details.get("restored"):
        problems.append("revert did not restore the e2e copy")
    if problems:
        raise Fail(problems[0], details)
    same = provider_run["output_token_ids"] == upstream_run["output_token_ids"]
    details["same_tokens"] = same
    return (
        f"eager LLM.generate ran with {p.name!r} first "
        f"({provider_run['seconds']} s) and with the patched {UPSTREAM_PROVIDER!r} "
        f"first ({upstream_run['seconds']} s); "
        f"{E2E_TOKENS} tokens each, {'identical' if same else 'different'} token ids",
        details,
    )


def parse_priority(logged: str | None) -> dict[str, list[str]]:
    """``IrOpPriorityConfig(rms_norm=['a', 'b'], ...)`` -> {op: [providers]}."""
    if not logged:
        return {}
    return {
        op: re.findall(r"'([^']*)'", providers)
        for op, providers in re.findall(r"(\w+)=\[([^\]]*)\]", logged)
    }


def _random_llama() -> Path:
    try:
        return make_random_llama(cache_dir() / "models", **TINY_LLAMA)
    except ImportError as exc:
        # Asked for and not run: the environment is broken, which is a failure.
        raise Fail(f"cannot build the random Llama: {explain(exc)}") from None


def _harmless_run(p: Probe) -> tuple[str, dict]:
    """On a vLLM without IR: the engine starts and generates with the plugin
    installed (vLLM loads it in each of its processes), and the plugin's only
    trace in the log is its INFO line."""
    model = _random_llama()
    if p.module is None:
        raise Skip("the provider did not load (see provider_registers)")
    # vLLM's log lines name their source as [file.py:line]: the plugin's are these.
    mark = f"[{Path(p.module.__file__).name}:"
    run = run_generate(
        model,
        ir_op_priority=None,
        compiled=False,
        prompt_len=8,
        max_tokens=E2E_TOKENS,
        timeout=E2E_TIMEOUT,
        grep=(mark, "Traceback"),
    )
    details: dict[str, Any] = {"model_config": TINY_LLAMA, "run": run}
    lines = run.get("log_lines", [])
    ours = [line for line in lines if mark in line]
    problems = []
    if not run["ok"]:
        problems.append(f"the engine run failed: {run['error']}")
    elif any(len(o) != E2E_TOKENS for o in run["output_token_ids"] or [[]]):
        problems.append(f"the engine produced {run['output_token_ids']}")
    if not ours:
        problems.append("the plugin left no line in the log: was it loaded?")
    loud = [line for line in ours if " INFO " not in f" {line} "]
    problems += [f"the plugin logged: {line}" for line in loud[:1]]
    problems += [
        f"a traceback in the log: {line}" for line in lines if "Traceback" in line
    ][:1]
    if problems:
        raise Fail(problems[0], details)
    run.pop("log_tail", None)  # kept only to explain a failure
    return (
        f"eager LLM.generate ran with the project installed ({run['seconds']} s, "
        f"{E2E_TOKENS} tokens); the plugin logged only {len(ours)} INFO line(s) "
        "(one per vLLM process), no warning, no traceback",
        details,
    )

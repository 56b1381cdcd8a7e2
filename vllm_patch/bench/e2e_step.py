"""End to end: vLLM decode on a random Llama, native norms against a provider.

For each mode (eager, compiled) and provider, the provider's environment (the
installed vLLM, or a patched copy for a provider the patch enables) runs twice,
once with the provider's ops pinned to ``native`` and once with the provider
first; each run does several timed generates after a warm-up (see
``vllm_patch.bench.engine_run``). The ratio is fused over native median tokens/s. The
final IR op priority vLLM logged for each run is kept: it shows which kernels
the run asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_patch.bench import engine_run
from vllm_patch.bench.bench_env import BenchEnv
from vllm_patch.bench.perop import quantiles


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    rates = run.get("tokens_per_s") or []
    out = {k: v for k, v in run.items() if k not in ("log_tail", "output_token_ids")}
    if rates:
        q1, med, q3 = quantiles(rates)
        out.update(median_tokens_per_s=med, q1_tokens_per_s=q1, q3_tokens_per_s=q3)
    else:
        out.update(median_tokens_per_s=None, q1_tokens_per_s=None, q3_tokens_per_s=None)
    if not run.get("ok"):
        out["log_tail"] = run.get("log_tail", "")[-1500:]
    return out


def run_pair(
    model_dir: Path,
    *,
    provider: str,
    ops: list[str],
    bench_env: BenchEnv,
    mode: str,
    prompt_len: int,
    max_tokens: int,
    batch: int,
    repeats: int,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Native, then the provider first, in one mode and one environment."""
    runs = {}
    tokens = {}
    for name, priority in (
        ("native", {op: ["native"] for op in ops}),
        ("fused", {op: [provider, "native"] for op in ops}),
    ):
        progress(f"end to end [{bench_env.label}] {mode}, {name}: {priority}")
        raw = engine_run.run_generate(
            model_dir,
            ir_op_priority=priority,
            compiled=mode == "compiled",
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            batch=batch,
            repeats=repeats,
            python=bench_env.python,
            pythonpath=bench_env.pythonpath,
        )
        tokens[name] = raw.get("output_token_ids")
        runs[name] = {"ir_op_priority": priority, **summarize(raw)}
        med = runs[name]["median_tokens_per_s"]
        progress(
            f"  -> {f'{med:.2f} tok/s' if med else 'failed: ' + str(raw.get('error'))}"
            f" ({raw['seconds']:.0f} s); final priority: {raw.get('final_priority')}"
        )
    native, fused = (
        runs["native"]["median_tokens_per_s"],
        runs["fused"]["median_tokens_per_s"],
    )
    return {
        "mode": mode,
        "provider": provider,
        "ops": ops,
        "source": bench_env.label,
        "native": runs["native"],
        "fused": runs["fused"],
        "ratio": fused / native if native and fused else None,
        "same_tokens": tokens["native"] == tokens["fused"]
        if all(tokens.values())
        else None,
        "first_difference": first_difference(tokens["native"], tokens["fused"]),
    }


def first_difference(a: list | None, b: list | None) -> dict[str, int] | None:
    """The earliest generated position where two runs' tokens differ (over all
    prompts), and how many tokens a prompt generated; None when they agree."""
    if not a or not b:
        return None
    positions = [
        next((i for i, (x, y) in enumerate(zip(ra, rb, strict=False)) if x != y), None)
        for ra, rb in zip(a, b, strict=False)
    ]
    found = [p for p in positions if p is not None]
    if not found:
        return None
    return {"position": min(found), "of": max(len(r) for r in a)}

"""One bench run: per op in every environment, then end to end, into the
result document (schema ``SCHEMA``) that every output is rendered from.

Every measurement runs in a child (``vllm_patch.runtime.child``): per op
``perop`` in the installed vLLM and in a patched copy of it
(``vllm_patch.runtime.patched_copy``) for each patch that applies, at each
thread count; end to end ``e2e_step`` pairs. The recommendation
(``recommend``) is a pure function of the figures.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_patch.runtime import machine

SCHEMA = "vllm-patch-bench/1"
PEROP_TIMEOUT = 3600
"""Seconds for one environment's per-op child at one thread count."""


def _portable(path: str | None) -> str | None:
    """``path`` relative to the environment, the cache or the temporary folder
    it lies in, so that a result holds no machine-specific absolute path."""
    if not path:
        return path
    from vllm_patch.runtime.cache import cache_dir

    roots = (
        (cache_dir(), "<vllm-patch cache>"),
        (Path(sys.prefix), "<python environment>"),
        (Path(tempfile.gettempdir()), "<temporary folder>"),
    )
    for root, label in roots:
        try:
            return f"{label}/{Path(path).resolve().relative_to(root.resolve())}"
        except ValueError:
            continue
    return Path(path).name


def measure_env(
    bench_env, spec: dict[str, Any], cfg: dict[str, Any], progress
) -> dict[str, Any]:
    """Per-op figures in one environment at every thread count; ops whose
    providers are too close to native to call are measured again with twice the
    samples, up to ``cfg["remeasure"]`` times (their rows are replaced)."""
    from vllm_patch.bench import perop, recommend
    from vllm_patch.runtime import child

    def echo(line: str) -> None:
        if line.startswith(perop.PROGRESS):
            progress(line.strip())

    def measure(ops, samples, dispatch) -> list[dict]:
        results = []
        for threads in cfg["threads"]:
            outcome = child.run(
                "vllm_patch.bench.perop:child_measure",
                {
                    "spec": {
                        **spec,
                        "ops": ops,
                        "samples": samples,
                        "threads": threads,
                        "dispatch": dispatch,
                    }
                },
                python=bench_env.python,
                pythonpath=bench_env.pythonpath,
                timeout=PEROP_TIMEOUT,
                progress=echo,
            )
            if not outcome.ok:
                raise RuntimeError(
                    f"per-op in {bench_env.label}: {outcome.error}\n"
                    + outcome.log_tail(3000)
                )
            results.append(outcome.result)
        return results

    first = measure(spec["ops"], spec["samples"], spec.get("dispatch"))
    out: dict[str, Any] = {
        "rows": [r for res in first for r in res["rows"]],
        # Per call through IR dispatch, where the upstream provider is enabled.
        "dispatch": [r for res in first for r in res["dispatch"]],
        "notes": [],
        "inventory": first[-1]["inventory"],
        "versions": first[-1]["versions"],
    }
    for res in first:
        out["notes"] += [n for n in res["notes"] if n not in out["notes"]]
    samples = spec["samples"]
    for _ in range(cfg["remeasure"]):
        unclear = recommend.unclear_ops(out["rows"], bench_env.label)
        if not unclear:
            break
        samples *= 2
        progress(
            f"per-op [{bench_env.label}]: {', '.join(unclear)} too close to call; "
            f"measuring again with {samples} samples"
        )
        again = [r for res in measure(unclear, samples, None) for r in res["rows"]]
        out["rows"] = [r for r in out["rows"] if r["op"] not in unclear] + again
        out["notes"].append(
            f"{bench_env.label}: {', '.join(unclear)} measured again with {samples} "
            "samples: the first figures did not separate fused from native"
        )
    return out


def collect(
    cfg: dict[str, Any], progress: Callable[[str], None], save=None
) -> dict[str, Any]:
    """Run the whole bench and return the result document; ``save(doc)`` gets
    the document so far after each step (per op, then each end-to-end mode)."""
    from patcher.patchset import provider_specs
    from patcher.tree import open_tree
    from vllm_patch.bench import recommend
    from vllm_patch.bench.bench_env import BenchEnv, patches_to_copy
    from vllm_patch.runtime.patched_copy import patched_copy

    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    load_before = machine.load_average()
    tree = open_tree(None)
    providers = provider_specs()
    spec = {
        k: cfg[k]
        for k in (
            "ops",
            "num_tokens",
            "hidden_sizes",
            "dtypes",
            "samples",
            "min_sample_s",
        )
    }
    installed = BenchEnv("installed")
    cpus = machine.usable_cpus()
    interference: dict[str, float | None] = {}
    snap = machine.cpu_snapshot()
    result = measure_env(
        installed,
        {
            **spec,
            "compile": True,
            "providers": providers,
            "dispatch": providers,
            "source": installed.label,
        },
        cfg,
        progress,
    )
    rows: list[dict] = result["rows"]
    dispatch: list[dict] = result["dispatch"]
    notes: list[str] = result["notes"]
    inventory: dict[str, Any] = result["inventory"]
    versions: dict[str, Any] = result["versions"]

    copies, copy_notes = patches_to_copy(tree)
    notes += copy_notes
    skip = {op: [p for p, ok in impls.items() if ok] for op, impls in inventory.items()}
    upstream_fused_ops: set[str] = set()
    # What runs end to end against native, each as (provider, ops, BenchEnv):
    # the first out-of-tree provider in the installed vLLM, then the upstream
    # provider in the patched vLLM (as installed, or on each patched copy).
    e2e_targets: list[tuple[str, list[str], BenchEnv]] = []

    def passed(provider: str) -> list[str]:
        """The ops ``provider`` passed the per-op check for, in the installed vLLM."""
        return sorted(
            {
                r["op"]
                for r in rows
                if r["provider"] == provider and r.get("status") == "ok"
            }
        )

    for p in providers:
        if passed(p["name"]) and not e2e_targets:
            e2e_targets.append((p["name"], passed(p["name"]), installed))
        upstream_fused_ops |= set(p.get("ops") or [])
    for upstream in sorted({p["upstream"] for p in providers if p.get("upstream")}):
        # Already enabled in the installed vLLM (patched in place, or a release
        # with the change): measured as installed, no copy needed.
        if passed(upstream):
            e2e_targets.append((upstream, passed(upstream), installed))

    versions["vllm_file"] = _portable(versions.get("vllm_file"))

    def document(e2e_doc: dict[str, Any] | None) -> dict[str, Any]:
        pairs = [p for p in (e2e_doc or {}).get("pairs", []) if p]
        shares = [v for v in interference.values() if v is not None]
        recs = recommend.recommend(
            rows,
            pairs,
            upstream_fused_ops=upstream_fused_ops,
            busy=max(shares, default=None),
        )
        return {
            "schema": SCHEMA,
            "started": started,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "load_before": load_before,
            "load_after": machine.load_average(),
            "interference": interference,
            "machine": machine.facts(),
            "versions": versions,
            "options": cfg,
            "providers": providers,
            "perop": {
                "rows": rows,
                "dispatch": dispatch,
                "inventory": inventory,
                "notes": notes,
            },
            "e2e": e2e_doc,
            "recommendation": recs,
            "snippets": recommend.priority_snippets(recs),
        }

    with contextlib.ExitStack() as stack:
        for patch in copies:
            folder = stack.enter_context(patched_copy(tree, patch))
            env = BenchEnv(f"patched copy ({patch.name})", pythonpath=(str(folder),))
            progress(f"per-op: {env.label} at {folder}")
            result = measure_env(
                env,
                {
                    **spec,
                    "compile": True,
                    "providers": [],
                    "skip_supported": skip,
                    "dispatch": providers,
                    "source": env.label,
                },
                cfg,
                progress,
            )
            rows += result["rows"]
            dispatch += result["dispatch"]
            notes += [n for n in result["notes"] if n not in notes]
            enabled: set[str] = set()  # implementations only the copy offers
            for op, impls in result["inventory"].items():
                new = [p for p, ok in impls.items() if ok and p not in skip.get(op, [])]
                if new:
                    enabled.update(new)
                    upstream_fused_ops.add(op)
            if not enabled:
                notes.append(f"{env.label}: the patch enables no implementation here")
            else:
                new_rows = [
                    r
                    for r in rows
                    if r["source"] == env.label
                    and r["provider"] in enabled
                    and r.get("status") == "ok"
                ]
                if new_rows:
                    provider = new_rows[0]["provider"]
                    ops = sorted(
                        {r["op"] for r in new_rows if r["provider"] == provider}
                    )
                    e2e_targets.append((provider, ops, env))

        if providers and not dispatch:
            notes.append(
                "per call through IR dispatch: no environment here enables the "
                "upstream provider the out-of-tree one stands in for; not measured"
            )
        interference["perop"] = machine.other_load(snap, machine.cpu_snapshot(), cpus)
        e2e_doc = None
        if cfg["e2e"]:
            save_e2e = (lambda e: save(document(e))) if save else (lambda e: None)
            save_e2e(_e2e_document(cfg, "end to end: still running (or interrupted)"))
            snap = machine.cpu_snapshot()
            e2e_doc = _run_e2e(cfg, e2e_targets, progress, save_e2e)
            interference["e2e"] = machine.other_load(snap, machine.cpu_snapshot(), cpus)
    return document(e2e_doc)


def _e2e_document(cfg: dict[str, Any], *notes: str) -> dict[str, Any]:
    return {
        "model": cfg["model"],
        "batch": cfg["e2e_batch"],
        "prompt_len": cfg["e2e_prompt_len"],
        "max_tokens": cfg["e2e_max_tokens"],
        "repeats": cfg["e2e_repeats"],
        "pairs": [],
        "notes": list(notes),
        "failed": [],
    }


def _run_e2e(cfg, targets, progress, save) -> dict[str, Any]:
    """Per mode, each target's pair (native, then its provider first) in turn,
    saved as it comes; a step that fails is recorded with its reason in
    ``failed`` (the bench then exits 1), never raised."""
    from vllm_patch.bench import e2e_step, engine_run
    from vllm_patch.runtime.cache import cache_dir
    from vllm_patch.runtime.import_checks import explain

    doc = _e2e_document(cfg)
    if not targets:
        doc["notes"].append("no provider passed the per-op check: nothing to compare")
        return doc
    progress("end to end: building or reusing the random Llama")
    try:
        model_dir = engine_run.make_random_llama(
            cache_dir() / "bench-models", **cfg["model"]
        )
    except Exception as exc:  # transformers missing or broken: keep the per-op part
        doc["failed"].append(f"cannot build the random Llama: {explain(exc)}")
        return doc
    doc["model_dir"] = _portable(str(model_dir))
    for mode in cfg["e2e_modes"]:
        for provider, ops, env in targets:
            pair = e2e_step.run_pair(
                model_dir,
                provider=provider,
                ops=ops,
                bench_env=env,
                mode=mode,
                prompt_len=cfg["e2e_prompt_len"],
                max_tokens=cfg["e2e_max_tokens"],
                batch=cfg["e2e_batch"],
                repeats=cfg["e2e_repeats"],
                progress=progress,
            )
            doc["pairs"].append(pair)
            doc["failed"] += [
                f"{mode}, {provider}, {name}: {pair[name].get('error')}"
                for name in ("native", "fused")
                if not pair[name].get("ok")
            ]
            save(doc)
    return doc

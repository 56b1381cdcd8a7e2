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
from dataclasses import dataclass, field
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


def _measure_threads(
    bench_env,
    spec: dict[str, Any],
    cfg: dict[str, Any],
    progress,
    ops,
    samples,
    dispatch,
) -> list[dict]:
    """One per-op child per thread count in ``bench_env``: their results."""
    from vllm_patch.bench import perop
    from vllm_patch.runtime import child

    def echo(line: str) -> None:
        if line.startswith(perop.PROGRESS):
            progress(line.strip())

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


def measure_env(
    bench_env, spec: dict[str, Any], cfg: dict[str, Any], progress
) -> dict[str, Any]:
    """Per-op figures in one environment at every thread count; ops whose
    providers are too close to native to call are measured again with twice the
    samples, up to ``cfg["remeasure"]`` times (their rows are replaced)."""
    first = _measure_threads(
        bench_env,
        spec,
        cfg,
        progress,
        spec["ops"],
        spec["samples"],
        spec.get("dispatch"),
    )
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
    _remeasure_unclear(bench_env, spec, cfg, progress, out)
    return out


def _remeasure_unclear(bench_env, spec, cfg, progress, out: dict[str, Any]) -> None:
    """Measure again, with twice the samples each time, the ops whose figures
    do not separate a provider from native; their rows in ``out`` are replaced."""
    from vllm_patch.bench import recommend

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
        again = _measure_threads(bench_env, spec, cfg, progress, unclear, samples, None)
        again_rows = [r for res in again for r in res["rows"]]
        out["rows"] = [r for r in out["rows"] if r["op"] not in unclear] + again_rows
        out["notes"].append(
            f"{bench_env.label}: {', '.join(unclear)} measured again with {samples} "
            "samples: the first figures did not separate fused from native"
        )


@dataclass
class _Run:
    """What the steps of one bench run share: its configuration, the tree, the
    per-op figures as they come in, and what runs end to end."""

    cfg: dict[str, Any]
    progress: Callable[[str], None]
    tree: Any
    providers: list[dict[str, Any]]
    spec: dict[str, Any]
    started: str
    load_before: Any
    cpus: int
    snap: Any
    rows: list[dict] = field(default_factory=list)
    dispatch: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    inventory: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, Any] = field(default_factory=dict)
    interference: dict[str, float | None] = field(default_factory=dict)
    upstream_fused_ops: set[str] = field(default_factory=set)
    skip: dict[str, list[str]] = field(default_factory=dict)
    """Per op, the implementations the installed vLLM offers: a copy does not
    time them again."""
    e2e_targets: list[tuple[str, list[str], Any]] = field(default_factory=list)
    """What runs end to end against native, each as (provider, ops, BenchEnv):
    the first out-of-tree provider in the installed vLLM, then the upstream
    provider in the patched vLLM (as installed, or on each patched copy)."""


def collect(
    cfg: dict[str, Any], progress: Callable[[str], None], save=None
) -> dict[str, Any]:
    """Run the whole bench and return the result document; ``save(doc)`` gets
    the document so far after each step (per op, then each end-to-end mode)."""
    from vllm_patch.bench.bench_env import patches_to_copy
    from vllm_patch.runtime.patched_copy import patched_copy

    run = _start(cfg, progress)
    _measure_installed(run)
    copies, copy_notes = patches_to_copy(run.tree)
    run.notes += copy_notes
    _targets_in_installed(run)
    run.versions["vllm_file"] = _portable(run.versions.get("vllm_file"))
    with contextlib.ExitStack() as stack:
        for patch in copies:
            folder = stack.enter_context(patched_copy(run.tree, patch))
            _measure_copy(run, patch, folder)
        if run.providers and not run.dispatch:
            run.notes.append(
                "per call through IR dispatch: no environment here enables the "
                "upstream provider the out-of-tree one stands in for; not measured"
            )
        run.interference["perop"] = machine.other_load(
            run.snap, machine.cpu_snapshot(), run.cpus
        )
        e2e_doc = _end_to_end(run, save) if cfg["e2e"] else None
    return _document(run, e2e_doc)


def _start(cfg: dict[str, Any], progress: Callable[[str], None]) -> _Run:
    from patcher.patchset import provider_specs
    from patcher.tree import open_tree

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
    cpus = machine.usable_cpus()
    return _Run(
        cfg=cfg,
        progress=progress,
        tree=tree,
        providers=providers,
        spec=spec,
        started=started,
        load_before=load_before,
        cpus=cpus,
        snap=machine.cpu_snapshot(),
    )


def _measure_installed(run: _Run) -> None:
    """Per op in the installed vLLM: every provider, and dispatch where enabled."""
    from vllm_patch.bench.bench_env import BenchEnv

    installed = BenchEnv("installed")
    result = measure_env(
        installed,
        {
            **run.spec,
            "compile": True,
            "providers": run.providers,
            "dispatch": run.providers,
            "source": installed.label,
        },
        run.cfg,
        run.progress,
    )
    run.rows = result["rows"]
    run.dispatch = result["dispatch"]
    run.notes = result["notes"]
    run.inventory = result["inventory"]
    run.versions = result["versions"]
    run.skip = {
        op: [p for p, ok in impls.items() if ok] for op, impls in run.inventory.items()
    }


def _targets_in_installed(run: _Run) -> None:
    """The first out-of-tree provider that passed in the installed vLLM, and
    each upstream provider already enabled there (patched in place, or a
    release with the change): measured as installed, no copy needed."""
    from vllm_patch.bench.bench_env import BenchEnv

    installed = BenchEnv("installed")

    def passed(provider: str) -> list[str]:
        """The ops ``provider`` passed the per-op check for, in the installed vLLM."""
        return sorted(
            {
                r["op"]
                for r in run.rows
                if r["provider"] == provider and r.get("status") == "ok"
            }
        )

    for p in run.providers:
        if passed(p["name"]) and not run.e2e_targets:
            run.e2e_targets.append((p["name"], passed(p["name"]), installed))
        run.upstream_fused_ops |= set(p.get("ops") or [])
    for upstream in sorted({p["upstream"] for p in run.providers if p.get("upstream")}):
        if passed(upstream):
            run.e2e_targets.append((upstream, passed(upstream), installed))


def _measure_copy(run: _Run, patch, folder: Path) -> None:
    """Per op on one patched copy: only what the copy adds; its first provider
    that passed runs end to end."""
    from vllm_patch.bench.bench_env import BenchEnv

    env = BenchEnv(f"patched copy ({patch.name})", pythonpath=(str(folder),))
    run.progress(f"per-op: {env.label} at {folder}")
    result = measure_env(
        env,
        {
            **run.spec,
            "compile": True,
            "providers": [],
            "skip_supported": run.skip,
            "dispatch": run.providers,
            "source": env.label,
        },
        run.cfg,
        run.progress,
    )
    run.rows += result["rows"]
    run.dispatch += result["dispatch"]
    run.notes += [n for n in result["notes"] if n not in run.notes]
    enabled: set[str] = set()  # implementations only the copy offers
    for op, impls in result["inventory"].items():
        new = [p for p, ok in impls.items() if ok and p not in run.skip.get(op, [])]
        if new:
            enabled.update(new)
            run.upstream_fused_ops.add(op)
    if not enabled:
        run.notes.append(f"{env.label}: the patch enables no implementation here")
        return
    new_rows = [
        r
        for r in run.rows
        if r["source"] == env.label
        and r["provider"] in enabled
        and r.get("status") == "ok"
    ]
    if new_rows:
        provider = new_rows[0]["provider"]
        ops = sorted({r["op"] for r in new_rows if r["provider"] == provider})
        run.e2e_targets.append((provider, ops, env))


def _end_to_end(run: _Run, save) -> dict[str, Any]:
    """The end-to-end part, saved (with the per-op part) as it comes."""

    def save_e2e(e2e_doc: dict[str, Any]) -> None:
        if save:
            save(_document(run, e2e_doc))

    save_e2e(_e2e_document(run.cfg, "end to end: still running (or interrupted)"))
    snap = machine.cpu_snapshot()
    e2e_doc = _run_e2e(run.cfg, run.e2e_targets, run.progress, save_e2e)
    run.interference["e2e"] = machine.other_load(snap, machine.cpu_snapshot(), run.cpus)
    return e2e_doc


def _document(run: _Run, e2e_doc: dict[str, Any] | None) -> dict[str, Any]:
    from vllm_patch.bench import recommend

    pairs = [p for p in (e2e_doc or {}).get("pairs", []) if p]
    shares = [v for v in run.interference.values() if v is not None]
    recs = recommend.recommend(
        run.rows,
        pairs,
        upstream_fused_ops=run.upstream_fused_ops,
        busy=max(shares, default=None),
    )
    return {
        "schema": SCHEMA,
        "started": run.started,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_before": run.load_before,
        "load_after": machine.load_average(),
        "interference": run.interference,
        "machine": machine.facts(),
        "versions": run.versions,
        "options": run.cfg,
        "providers": run.providers,
        "perop": {
            "rows": run.rows,
            "dispatch": run.dispatch,
            "inventory": run.inventory,
            "notes": run.notes,
        },
        "e2e": e2e_doc,
        "recommendation": recs,
        "snippets": recommend.priority_snippets(recs),
    }


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

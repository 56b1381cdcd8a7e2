"""A bench run's evidence folder, rewritten after every part (interruptions keep it)."""

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from patcher.errors import PatchError, UsageError
from patcher.files import inside, output_dir, read_text_at, write_output
from vllm_patch.bench.engine_run import DECODE_LLAMA, KINDS
from vllm_patch.runtime import bench_result, evidence_record, machine

# The servers', clients' and engines' environment: nothing is downloaded
# (lm_eval may fetch its task's dataset, as the user asked).
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
SECTIONS = ("decode", "serving", "accuracy", "numerics", "perop", "qwen3_eager")


def choose_patch(tree, name: str | None = None) -> Any:
    """The patch ``name`` (else ``apply``'s pick); it must apply: vLLM is the base."""
    from patcher import engine
    from patcher.status import PlanStatus

    chosen = engine.choose(tree, [name] if name else None)
    found = [(p, engine.plan(tree, p).status) for p in chosen]
    for patch, status in found:
        if status is PlanStatus.APPLICABLE:
            return patch
    raise UsageError(
        "the installed vLLM is not unpatched, so there is no base to compare",
        path=str(tree.location),
        looked_for="an installed vLLM its default patch applies to",
        found="; ".join(f"{p.name}: {status}" for p, status in found),
    )


def random_model(progress, c: dict[str, int], tokenizer=True, kind="llama") -> tuple:
    """The cached random model of sizes ``c`` (built in a child), and its meta."""
    from vllm_patch.runtime import child
    from vllm_patch.runtime.cache import cache_dir

    name = KINDS[kind][0]
    progress(f"building (or reusing) the random-weight {name}")
    folder = child.run(
        "vllm_patch.bench.engine_run:make_random",
        dict(c, path=str(cache_dir() / "bench-models"), kind=kind, tokenizer=tokenizer),
    ).value()
    sizes = f"{c['num_layers']} layers, hidden {c['hidden_size']}"
    return str(folder), {
        "path": None,
        "random_weights": True,
        "name": f"a random-weight {name} ({sizes})",
        "description": (
            f"a random-weight {name} made locally ({sizes}, intermediate "
            f"{c['intermediate_size']}, vocabulary {c['vocab_size']}, bf16 weights)"
            + (" with a word-level tokenizer made locally" if tokenizer else "")
            + "; nothing downloaded"
        ),
        "config": c,
    }


def user_model(path: Path) -> tuple[str, dict[str, Any]]:
    """A local model folder; its ``config.json`` read inside it (or HF's ``blobs/``)."""
    folder = Path(os.path.realpath(path))
    if not os.path.lexists(folder / "config.json"):
        raise UsageError(
            "not a model folder",
            path=str(path),
            looked_for="a local model folder with config.json",
            found="no config.json",
        )
    blobs = folder.parent.parent / "blobs"
    what = "a model's config.json"
    within = [folder, blobs] if folder.parent.name == "snapshots" else [folder]
    config = inside(folder, "config.json", within, what=what)
    try:
        found = json.loads(read_text_at(config, what))
    except (ValueError, RecursionError) as exc:
        raise PatchError("not JSON", path=str(config), looked_for=what) from exc
    names = found.get("architectures") if isinstance(found, dict) else None
    listed = isinstance(names, list) and all(isinstance(n, str) for n in names)
    arch = listed and ", ".join(names) or "architecture not stated"
    context = isinstance(found, dict) and found.get("max_position_embeddings")
    name = f"{Path(path).name} ({arch})"
    return str(folder), {
        "path": str(path),
        "random_weights": False,
        "name": name,
        "description": f"{name}, a local folder; nothing downloaded",
        "context": context if type(context) is int and context > 0 else None,
    }


def provider_opt_ins() -> tuple[str, ...]:
    """The out-of-tree providers' opt-ins: never set for a measured vLLM."""
    from patcher.patchset import provider_specs

    return tuple(p["opt_in_env"] for p in provider_specs() if p.get("opt_in_env"))


def worker_threads(layout: str) -> int:
    """The OpenMP threads of a layout; ``auto``: what vLLM gives its worker."""
    # VLLM_CPU_OMP_THREADS_BIND=auto (vLLM 0.32.0) keeps a core per local rank
    # for the engine process on x86, Arm and RISC-V: one worker, cores - 1.
    return max(1, machine.usable_cpus() - 1) if layout == "auto" else int(layout)


class BenchRun:
    """This run's evidence document, and its parts (``command.PARTS``)."""

    def __init__(self, out: Path, progress: Callable[[str], None]) -> None:
        self.out = output_dir(out)
        self.progress = progress
        self.snap = machine.cpu_snapshot()
        self.doc: dict[str, Any] = {
            "schema": evidence_record.SCHEMA,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine.facts(),
            "load": {"before": machine.load_average()},
            "vllm": {},
            "model": {},
            **dict.fromkeys(SECTIONS),  # None: not measured
            "failed": [],
        }

    def save(self) -> None:
        doc = self.doc
        doc["load"].update(
            after=machine.load_average(),
            other_processes_share=machine.other_share(self.snap),
        )
        doc["seconds"] = round(time.monotonic() - self.snap["wall"], 1)
        text = json.dumps(doc, indent=1) + "\n"
        write_output(self.out / evidence_record.EVIDENCE, text)
        if doc["vllm"]:
            markdown = bench_result.evidence_markdown(evidence_record.parse(doc))
            write_output(self.out / "evidence.md", markdown)

    def model(self, args, sizes: dict[str, int], tokenizer: bool) -> tuple:
        if args.model:
            return user_model(args.model)
        return random_model(self.progress, sizes, tokenizer)

    def decode(self, args, copy: str) -> None:
        from vllm_patch.bench import decode

        model, meta = self.model(args, DECODE_LLAMA, tokenizer=False)
        self.doc["model"] = self.doc["model"] or meta
        envs = {"base": (), "patched": (copy,)}
        first, *more = decode.run(args, model, meta, envs, self.progress)
        self.doc["decode"] = first
        self.doc["decode_dtypes"] = more

    def serve(self, args, copy: str) -> None:
        from vllm_patch.bench import serving

        serving.run(self, args, copy)

    def numerics(self, args, copy: str) -> None:
        from vllm_patch.bench.numerics import per_build

        self.doc["numerics"], self.doc["tolerance"] = per_build(self.progress)

    def perop(self, args, copy: str) -> None:
        from vllm_patch.bench.perop import per_op

        envs = {"base": (), "patched": (copy,), "provider": ()}
        first, *more = dict.fromkeys(worker_threads(t) for t in args.threads)
        found = [per_op(envs, self.progress, n, ["provider"]) for n in [first, *more]]
        self.doc["perop"] = found[0]
        self.doc["perop_threads"] = found[1:]

    def qwen3(self, args, copy: str) -> None:
        from vllm_patch.bench.qwen3_eager import compare

        patch = self.doc["vllm"]["patch"]
        self.doc["qwen3_eager"] = compare(copy, patch, self.progress)

"""A bench run's evidence folder, rewritten after every part (interruptions keep it)."""

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from patcher.files import output_dir, write_output
from vllm_patch.bench import models, record, report
from vllm_patch.runtime import machine

SECTIONS = (
    "decode",
    "serving",
    "accuracy",
    "likelihood",
    "numerics",
    "perop",
    "qwen3_eager",
)


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
            "schema": record.SCHEMA,
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
        write_output(self.out / record.EVIDENCE, text)
        if doc["vllm"]:
            markdown = report.evidence_markdown(record.parse(doc))
            write_output(self.out / "evidence.md", markdown)

    def model(self, args) -> tuple[str, dict[str, Any]]:
        """``--model``'s folder, else SmolLM2 (made once)."""
        if args.model:
            return models.user_model(args.model)
        return models.real_model(self.progress)

    def decode(self, args, copy: str) -> None:
        from vllm_patch.bench import decode

        model, meta = self.model(args)
        self.doc["model"] = self.doc["model"] or meta
        envs = {"base": (), "patched": (copy,)}
        first, *more = decode.run(args, model, meta, envs, self.progress)
        self.doc["decode"] = first
        self.doc["decode_dtypes"] = more

    def likelihood(self, args, copy: str) -> None:
        from vllm_patch.bench import likelihood

        model, meta = self.model(args)
        self.doc["model"] = self.doc["model"] or meta
        found = likelihood.run(model, copy, args.dtype, self.progress)
        self.doc["likelihood"] = [c.to_json() for c in found]

    def serve(self, args, copy: str) -> None:
        from vllm_patch.bench import serving

        serving.run(self, args, copy)

    def numerics(self, args, copy: str) -> None:
        from vllm_patch.bench.numerics import per_build

        builds, tolerance = per_build(self.progress)
        self.doc["numerics"] = builds
        self.doc["tolerance"] = record.to_json(tolerance)

    def perop(self, args, copy: str) -> None:
        from vllm_patch.bench.perop import per_op

        envs = {"base": (), "patched": (copy,), "provider": ()}
        first, *more = dict.fromkeys(worker_threads(t) for t in args.threads)
        found = [per_op(envs, self.progress, n, ["provider"]) for n in [first, *more]]
        self.doc["perop"] = record.to_json(found[0])
        self.doc["perop_threads"] = record.to_json(found[1:])

    def qwen3(self, args, copy: str) -> None:
        from vllm_patch.bench.qwen3_eager import compare

        patch = self.doc["vllm"]["patch"]
        found = compare(copy, patch, self.progress)
        self.doc["qwen3_eager"] = record.to_json(found)

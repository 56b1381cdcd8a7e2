"""A bench run's evidence folder, rewritten after every part so that an
interruption keeps what was measured."""

import dataclasses
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
    """This run's evidence document, and its parts (``command.PARTS``): per
    section its record (None: not measured), in the order the run reached them."""

    def __init__(self, out: Path, progress: Callable[[str], None]) -> None:
        self.out = output_dir(out)
        self.progress = progress
        self.snap = machine.cpu_snapshot()
        self.doc: dict[str, Any] = {
            "schema": record.SCHEMA,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine_record(),
            "load": record.Load(before=tuple(machine.load_average())),
            "vllm": {},  # the versions, set before the first part
            "model": {},  # not measured yet
            **dict.fromkeys(SECTIONS),  # None: not measured
            "failed": [],
        }

    def evidence(self) -> record.Evidence:
        """The records held, as ``record.read`` gives the file back."""
        held = {k: v for k, v in self.doc.items() if v not in (None, {})}
        held["failed"] = tuple(self.doc["failed"])
        return record.Evidence(**held)

    def save(self) -> None:
        self.doc["load"] = dataclasses.replace(
            self.doc["load"],
            after=tuple(machine.load_average()),
            other_processes_share=machine.other_share(self.snap),
        )
        self.doc["seconds"] = round(time.monotonic() - self.snap["wall"], 1)
        text = json.dumps(record.to_json(self.doc), indent=1) + "\n"
        write_output(self.out / record.EVIDENCE, text)
        if self.doc["vllm"]:
            markdown = report.evidence_markdown(self.evidence())
            write_output(self.out / "evidence.md", markdown)

    def model(self, args) -> tuple[str, record.Model]:
        """``--model``'s folder, else SmolLM2 (made once)."""
        if args.model:
            return models.user_model(args.model)
        return models.real_model(self.progress)

    def decode(self, args, copy: str) -> None:
        from vllm_patch.bench import decode

        model, meta = self.model(args)
        self.doc["model"] = self.doc["model"] or meta
        envs = {"base": (), "patched": (copy,)}
        found = decode.run(args, model, meta, envs, self.progress)
        self.doc["decode"] = found[0]
        self.doc["decode_dtypes"] = tuple(found[1:])

    def likelihood(self, args, copy: str) -> None:
        from vllm_patch.bench import likelihood

        model, meta = self.model(args)
        self.doc["model"] = self.doc["model"] or meta
        found = likelihood.run(model, copy, args.dtype, self.progress)
        self.doc["likelihood"] = tuple(found)

    def serve(self, args, copy: str) -> None:
        from vllm_patch.bench import serving

        serving.run(self, args, copy)

    def numerics(self, args, copy: str) -> None:
        from vllm_patch.bench.numerics import per_build

        builds, tolerance = per_build(self.progress)
        self.doc["numerics"] = builds
        self.doc["tolerance"] = tolerance

    def perop(self, args, copy: str) -> None:
        from vllm_patch.bench.perop import per_op

        envs = {"base": (), "patched": (copy,), "provider": ()}
        counts = dict.fromkeys(worker_threads(t) for t in args.threads)
        found = [per_op(envs, self.progress, n, ["provider"]) for n in counts]
        self.doc["perop"] = found[0]
        self.doc["perop_threads"] = tuple(found[1:])

    def qwen3(self, args, copy: str) -> None:
        from vllm_patch.bench.qwen3_eager import compare

        patch = self.doc["vllm"].patch
        self.doc["qwen3_eager"] = compare(copy, patch, self.progress)


def machine_record() -> record.Machine:
    """``machine.facts``: the machine this run measures on."""
    found = machine.facts()
    return record.Machine(
        cpu_model=found["cpu_model"],
        arch=found["arch"],
        logical_cpus=found["logical_cpus"],
        usable_cpus=found["usable_cpus"],
        memory_gib=found["memory_gib"],
        key_flags=tuple(found["key_flags"]),
        flags=tuple(found["flags"]),
        os=found["os"],
    )

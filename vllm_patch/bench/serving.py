"""vLLM's serving benchmark, the base vLLM against the patched one.

For each mode (eager, vLLM's default compiled) and repetition, a fresh server
of the base vLLM, one of the patched vLLM (the installed one, and a patched
copy of it first on the server's ``PYTHONPATH``) and one of the base again
(``A_A``: the A/A control, whose ratio to the base is the noise floor) each
serve one run of ``vllm bench serve``: the random dataset with fixed input and
output lengths, ``--ignore-eos``, the same seed and so the same requests. The
order reverses every repetition, spreading the machine's load drift over all
three. The first repetition's base and patched servers also answer the
accuracy prompts (``vllm_patch.bench.accuracy``).
"""

from __future__ import annotations

import json
import re
import shlex
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_patch.bench import accuracy, server
from vllm_patch.runtime import child
from vllm_patch.runtime.bench_result import METRICS, SIDES

LOG_MARKER = "Final IR op priority after setting platform defaults"
"""Server log lines kept in the evidence: which kernels each server chose."""
CUSTOM_OPS = re.compile(r"'custom_ops': \[[^\]]*\]")
"""And from its config line, the custom ops it enables: ``['all']`` runs each
CustomOp's ``forward_cpu``, ``['none']`` its ``forward_native``."""


@dataclass(frozen=True)
class Sizes:
    input_len: int = 128
    output_len: int = 128
    num_prompts: int = 32
    max_concurrency: int = 4
    model_len: int = 0
    """The servers' ``--max-model-len``; 0: what the benchmark and the accuracy
    prompts need."""

    def serve_extra(self) -> list[str]:
        length = self.model_len or self.input_len + self.output_len + 64
        return ["--max-model-len", str(length), "--max-num-seqs"] + [
            str(self.max_concurrency)
        ]


def client_args(url: str, tokenizer: str, sizes: Sizes) -> list[str]:
    """``vllm bench serve``'s arguments, but where it saves its result."""
    return [
        "bench", "serve", "--backend", "vllm", "--base-url", url,
        "--model", server.SERVED_NAME, "--tokenizer", tokenizer,
        "--dataset-name", "random", "--random-input-len", str(sizes.input_len),
        "--random-output-len", str(sizes.output_len), "--random-range-ratio", "0",
        "--num-prompts", str(sizes.num_prompts),
        "--max-concurrency", str(sizes.max_concurrency),
        "--num-warmups", str(sizes.max_concurrency), "--ignore-eos", "--seed", "0",
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
        "--disable-tqdm",
    ]  # fmt: skip


def commands(model: str, sizes: Sizes) -> list[str]:
    """The commands as a reviewer runs them (``vllm`` is ``vllm-patch serve``'s
    launcher here); the server's port is PORT."""
    serve = shlex.join(["vllm", "serve", *server.serve_args(model, 0, False, [])])
    serve = serve.replace("--port 0", "--port PORT")
    extra = shlex.join(sizes.serve_extra())
    client = client_args(f"http://{server.HOST}:PORT", model, sizes)
    return [
        f"{serve} {extra}  # eager: also --enforce-eager",
        shlex.join(["vllm", *client, "--save-result"]),
    ]


def run_client(
    url: str, tokenizer: str, sizes: Sizes, env: dict[str, str]
) -> dict[str, float]:
    """One ``vllm bench serve`` run: its metrics, as it saved them."""
    with tempfile.TemporaryDirectory(prefix="vllm-patch-bench-") as folder:
        argv = client_args(url, tokenizer, sizes)
        argv += ["--save-result", "--result-dir", folder, "--result-filename"]
        client = child.start(
            "vllm_patch.serve:vllm_main", {"argv": [*argv, "result.json"]}, env=env
        )
        try:
            outcome = child.finish(client)
        except BaseException:  # Ctrl-C: the client goes too
            child.stop(client)
            raise
        saved = Path(folder) / "result.json"
        if not outcome.ok or not saved.is_file():
            raise RuntimeError(
                f"vllm bench serve failed: {outcome.error or 'no result saved'}: "
                f"{child.last_error_line(outcome.log)}"
            )
        result = json.loads(saved.read_text("utf-8"))
    if result.get("failed"):
        raise RuntimeError(f"vllm bench serve: {result['failed']} requests failed")
    return {m: result[m] for m in METRICS}


@dataclass
class Side:
    name: str
    """``base``, ``patched`` or ``A_A`` (the base again)."""
    pythonpath: tuple[str, ...] = ()


def kernel_lines(log: str) -> list[str]:
    """The server log's lines on its kernel choice, without their prefixes."""
    lines = log.splitlines()
    found = {ln.split("] ", 1)[-1] for ln in lines if LOG_MARKER in ln}
    found |= {f"compilation_config {m[0]}" for m in map(CUSTOM_OPS.search, lines) if m}
    return sorted(found)


def measure(
    doc: dict[str, Any],
    *,
    model: str,
    sides: list[Side],
    modes: list[str],
    repeats: int,
    sizes: Sizes,
    prompts: list[str],
    lm_eval: dict[str, Any] | None,
    save: Callable[[], None],
    progress: Callable[[str], None],
    env: dict[str, str],
    drop_env: tuple[str, ...] = (),
) -> None:
    """Fill ``doc["serving"]`` and ``doc["accuracy"]`` as the runs come,
    calling ``save()`` after each."""
    serving, found = doc["serving"], doc["accuracy"]
    for mode in modes:
        for rep in range(1, repeats + 1):
            answers: dict[str, list] = {}
            # Each side first in turn: what one start leaves the next falls on both.
            for side in sides if rep % 2 else sides[::-1]:
                label = f"[{mode} {rep}/{repeats}] {side.name}"
                with server.running(
                    model,
                    eager=mode == "eager",
                    extra=sizes.serve_extra(),
                    pythonpath=side.pythonpath,
                    env=env,
                    drop_env=drop_env,
                    say=lambda msg, label=label: progress(f"{label}: {msg}"),
                ) as srv:
                    metrics = run_client(srv.url, model, sizes, env)
                    progress(
                        f"{label}: {metrics['request_throughput']:.2f} req/s, "
                        f"{metrics['output_throughput']:.1f} output tok/s, "
                        f"TPOT median {metrics['median_tpot_ms']:.1f} ms"
                    )
                    if rep == 1 and side.name in SIDES:
                        progress(f"{label}: {len(prompts)} greedy completions")
                        answers[side.name] = accuracy.completions(srv.url, prompts)
                        if lm_eval is not None and mode == "eager":
                            progress(f"{label}: lm_eval {lm_eval['task']}")
                            found["lm_eval"][side.name] = accuracy.run_lm_eval(
                                srv.url, model, lm_eval
                            )
                runs = serving["configs"].setdefault(mode, {})
                runs = runs.setdefault(side.name, {m: [] for m in METRICS})
                for m in METRICS:
                    runs[m].append(metrics[m])
                logged = serving["server_log"].setdefault(mode, {})
                logged[side.name] = kernel_lines(srv.log)
                if side.name in SIDES and len(answers) == len(SIDES):
                    tokens = found["tokens"]
                    tokens["configs"][mode] = accuracy.compare(
                        *(answers[s] for s in SIDES)
                    )
                    tokens.update(accuracy.summary(tokens["configs"]))
                save()

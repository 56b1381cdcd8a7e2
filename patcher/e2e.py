"""Run vLLM end to end on a random-weight Llama, offline, in a subprocess.

Shared by the benchmark and the compatibility probe. The model is generated
locally with ``transformers`` (no hub, no tokenizer); prompts are token ids.
The engine runs in a child interpreter (``python -m patcher.e2e``) because it
spawns processes of its own, because callers may point at another
environment's interpreter or a patched copy of vLLM (``PYTHONPATH``), and
because one engine per process is the only way to change IR op priority.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The smallest Llama that still runs every layer type: for checks that the engine
# runs a given kernel, not for timing.
TINY_LLAMA = dict(
    hidden_size=256,
    num_layers=2,
    intermediate_size=512,
    num_heads=4,
    num_kv_heads=2,
    vocab_size=1024,
)
FINAL_PRIORITY_MARKER = "Final IR op priority after setting platform defaults:"
LOG_TAIL_CHARS = 4000

# The project root, so that ``-m patcher.e2e`` resolves in an interpreter that
# does not have this project installed.
_PROJECT_ROOT = Path(__file__).resolve().parent.parent


def make_random_llama(
    path: Path,
    *,
    hidden_size: int = 2048,
    num_layers: int = 8,
    intermediate_size: int = 5632,
    num_heads: int = 16,
    num_kv_heads: int = 4,
    vocab_size: int = 32000,
    seed: int = 0,
) -> Path:
    """A random-weight LlamaForCausalLM (bf16) saved under ``path``.

    ``path`` is a cache folder: the model goes into a subfolder named by the
    hash of its configuration, and a second call with the same configuration
    returns it without rebuilding. Returns the model folder.
    """
    config = {
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": intermediate_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "seed": seed,
    }
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    target = Path(path) / f"random-llama-{digest[:12]}"
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        **{k: v for k, v in config.items() if k not in ("seed", "num_hidden_layers")},
        num_hidden_layers=num_layers,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_config).to(torch.bfloat16)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so an interrupted build is never reused.
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        (staging / "vllm_patch_config.json").write_text(json.dumps(config, indent=1))
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent build
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def parse_final_priority(log: str) -> str | None:
    """The text vLLM logged after the final-priority marker (the last one)."""
    found = None
    for line in log.splitlines():
        _, marker, rest = line.partition(FINAL_PRIORITY_MARKER)
        if marker:
            found = rest.strip()
    return found


def run_generate(
    model_dir: Path,
    *,
    ir_op_priority: dict[str, list[str]] | None,
    compiled: bool,
    prompt_len: int = 16,
    max_tokens: int = 64,
    batch: int = 1,
    repeats: int = 1,
    python: str = sys.executable,
    env: dict | None = None,
    engine_args: dict[str, Any] | None = None,
    timeout: float = 900,
    grep: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Start vLLM on ``model_dir`` in a child interpreter and time generation.

    One warm-up generate, then ``repeats`` timed ones (engine start is not
    timed); ``engine_args`` are further ``LLM(...)`` keyword arguments (say
    ``fail_on_environ_validation``). Returns tokens_per_s (one per repeat),
    output_token_ids (of the first timed repeat, one list per prompt),
    final_priority (what vLLM logged), seconds (wall time of the whole child), ok,
    error and log_tail; with ``grep``, also log_lines: every line of the log
    holding one of its strings.
    """
    spec = {
        "model_dir": str(model_dir),
        "ir_op_priority": ir_op_priority,
        "compiled": compiled,
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
        "batch": batch,
        "repeats": repeats,
        "engine_args": engine_args or {},
    }
    child_env = dict(os.environ)
    child_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    child_env.update(env or {})
    paths = [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    child_env["PYTHONPATH"] = os.pathsep.join([*paths, str(_PROJECT_ROOT)])

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vllm-patch-e2e-") as tmp:
        result_file = Path(tmp) / "result.json"
        log_file = Path(tmp) / "log.txt"
        cmd = [python, "-m", "patcher.e2e", "--spec", json.dumps(spec)]
        cmd += ["--result", str(result_file)]
        error = None
        with log_file.open("wb") as log_out:
            proc = subprocess.Popen(
                cmd,
                stdout=log_out,
                stderr=subprocess.STDOUT,
                env=child_env,
                cwd=tmp,
                start_new_session=True,  # so a timeout can end the engine's children
            )
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                rc = None
                error = f"timed out after {timeout:.0f} s"
        log = log_file.read_text("utf-8", errors="replace")
        child: dict[str, Any] = {}
        if result_file.is_file():
            child = json.loads(result_file.read_text("utf-8"))
    seconds = time.perf_counter() - started

    if error is None and rc != 0:
        error = child.get("error") or f"exit code {rc}: {_last_error_line(log)}"
    elif error is None and not child:
        error = "the child wrote no result"
    found = {}
    if grep:
        found["log_lines"] = [
            line for line in log.splitlines() if any(g in line for g in grep)
        ]
    return {
        **found,
        "tokens_per_s": child.get("tokens_per_s", []),
        "output_token_ids": child.get("output_token_ids", []),
        "final_priority": parse_final_priority(log),
        "seconds": round(seconds, 1),
        "ok": error is None,
        "error": error,
        "log_tail": log[-LOG_TAIL_CHARS:],
    }


def _kill_group(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _last_error_line(log: str) -> str:
    lines = [ln for ln in log.splitlines() if ln.strip()]
    for line in reversed(lines):
        if re.search(r"(Error|Exception)\b", line):
            return line.strip()[-300:]
    return lines[-1].strip()[-300:] if lines else "no output"


def prompt_token_ids(batch: int, prompt_len: int, vocab_size: int) -> list[list[int]]:
    """Deterministic prompts that differ per row (ids 10 .. vocab_size-1)."""
    import random

    rng = random.Random(1234)
    span = vocab_size - 10
    return [[10 + rng.randrange(span) for _ in range(prompt_len)] for _ in range(batch)]


def _child_main(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs inside the child interpreter: start the engine, warm up, time."""
    from vllm import LLM, SamplingParams

    model_dir = Path(spec["model_dir"])
    hf_config = json.loads((model_dir / "config.json").read_text())
    prompt_len, max_tokens = spec["prompt_len"], spec["max_tokens"]
    kwargs: dict[str, Any] = dict(spec.get("engine_args") or {})
    if spec["ir_op_priority"]:
        kwargs["kernel_config"] = {"ir_op_priority": spec["ir_op_priority"]}
    llm = LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        enforce_eager=not spec["compiled"],
        max_model_len=prompt_len + max_tokens + 16,
        max_num_seqs=max(spec["batch"], 1),
        seed=0,
        **kwargs,
    )
    prompts = [
        {"prompt_token_ids": ids}
        for ids in prompt_token_ids(spec["batch"], prompt_len, hf_config["vocab_size"])
    ]
    params = SamplingParams(
        temperature=0.0, ignore_eos=True, detokenize=False, max_tokens=max_tokens
    )
    llm.generate(prompts, params, use_tqdm=False)  # warm-up, not timed
    rates, outputs = [], []
    for _ in range(spec["repeats"]):
        t0 = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        generated = sum(len(r.outputs[0].token_ids) for r in results)
        rates.append(generated / elapsed)
        if not outputs:
            outputs = [list(r.outputs[0].token_ids) for r in results]
    return {"tokens_per_s": rates, "output_token_ids": outputs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m patcher.e2e")
    parser.add_argument("--spec", required=True, help="JSON, see run_generate")
    parser.add_argument("--result", required=True, type=Path)
    args = parser.parse_args(argv)
    try:
        result = _child_main(json.loads(args.spec))
    except Exception as exc:  # reported to the parent, which owns the verdict
        import traceback

        traceback.print_exc()
        args.result.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 1
    args.result.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run vLLM end to end on a random-weight Llama, offline, in a subprocess.

Shared by the benchmark and the compatibility probe. The model is generated
locally with ``transformers`` (no hub, no tokenizer); prompts are token ids.
The engine runs in a child interpreter (``vllm_patch.runtime.child``) because it
spawns processes of its own, because callers may point at another
environment's interpreter or a patched copy of vLLM (``PYTHONPATH``), and
because one engine per process is the only way to change IR op priority.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_patch.runtime import child

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
# Served by ``bench --serve`` without ``--model``: small enough that 12 server
# starts and runs fit in half an hour on 2 cores.
SERVED_LLAMA = dict(
    hidden_size=512,
    num_layers=4,
    intermediate_size=1408,
    num_heads=8,
    num_kv_heads=4,
    vocab_size=4096,
)
FINAL_PRIORITY_MARKER = "Final IR op priority after setting platform defaults:"


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
    tokenizer: bool = False,
) -> Path:
    """A random-weight LlamaForCausalLM (bf16) saved under ``path``; with
    ``tokenizer``, a word-level tokenizer too (:func:`save_word_tokenizer`).

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
        **({"tokenizer": "words"} if tokenizer else {}),
    }
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    target = Path(path) / f"random-llama-{digest[:12]}"
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so an interrupted build is never reused.
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        _save_llama(staging, config)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent build
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _save_llama(folder: Path, config: dict[str, Any]) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    own = ("seed", "tokenizer")
    hf_config = LlamaConfig(
        **{k: v for k, v in config.items() if k not in own}, torch_dtype="bfloat16"
    )
    torch.manual_seed(config["seed"])
    model = LlamaForCausalLM(hf_config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    if config.get("tokenizer"):
        save_word_tokenizer(folder, config["vocab_size"])
    (folder / "vllm_patch_config.json").write_text(json.dumps(config, indent=1))


def save_word_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the model's vocabulary (words ``w3`` ..),
    made locally: a served model needs one for text prompts."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(model_dir)


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
    pythonpath: tuple[str, ...] = (),
    engine_args: dict[str, Any] | None = None,
    timeout: float = 900,
    grep: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Start vLLM on ``model_dir`` in a child interpreter and time generation.

    One warm-up generate, then ``repeats`` timed ones (engine start is not
    timed); ``engine_args`` are further ``LLM(...)`` keyword arguments (say
    ``fail_on_environ_validation``); ``python``, ``env`` and ``pythonpath``
    (a patched copy) are the child's, as ``vllm_patch.runtime.child`` takes them.

    Returns tokens_per_s (one per repeat), output_token_ids (of the first timed
    repeat, one list per prompt), final_priority (what vLLM logged), seconds
    (wall time of the whole child), ok, error and log_tail; with ``grep``, also
    log_lines: every line of the log holding one of its strings.
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
    # Little KV cache by default: the model is small, the machine may be too.
    extra = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    outcome = child.run(
        "vllm_patch.bench.engine_run:generate",
        {"spec": spec},
        python=python,
        env={**extra, **(env or {})},
        pythonpath=pythonpath,
        timeout=timeout,
    )
    return _generate_result(outcome, grep)


def _generate_result(
    outcome: child.ChildOutcome, grep: tuple[str, ...]
) -> dict[str, Any]:
    """``run_generate``'s answer, read from the child's outcome and log."""
    result = outcome.result or {}
    found = {}
    if grep:
        found["log_lines"] = [
            line for line in outcome.log.splitlines() if any(g in line for g in grep)
        ]
    return {
        **found,
        "tokens_per_s": result.get("tokens_per_s", []),
        "output_token_ids": result.get("output_token_ids", []),
        "final_priority": parse_final_priority(outcome.log),
        "seconds": round(outcome.seconds, 1),
        "ok": outcome.ok,
        "error": outcome.error,
        "log_tail": outcome.log_tail(),
    }


def prompt_token_ids(batch: int, prompt_len: int, vocab_size: int) -> list[list[int]]:
    """Deterministic prompts that differ per row (ids 10 .. vocab_size-1)."""
    import random

    rng = random.Random(1234)
    span = vocab_size - 10
    return [[10 + rng.randrange(span) for _ in range(prompt_len)] for _ in range(batch)]


def generate(spec: dict[str, Any]) -> dict[str, Any]:
    """The child's side (a ``vllm_patch.runtime.child`` target): start the engine, warm
    up, time."""
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

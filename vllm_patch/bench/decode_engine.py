"""``python -m vllm_patch.bench.decode_engine CONFIG_JSON``: vLLM's ``LLM`` in
this process, answering ``{"ready": ...}`` then a JSON line on stdout per command
line on stdin: ``{"threads": N, "tokens": L}`` adds a greedy request, ``{"step":
true}`` times one engine step, ``{"stop": true}`` ends. vLLM logs to stderr."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

PROMPT = list(range(10, 18))
NORM_KEYS = ("norm_wall", "norm_cpu", "norm_calls")
GREEDY = {"temperature": 0.0, "ignore_eos": True, "detokenize": False}


def hook_norms(model, totals: list[int]) -> list[str]:
    """Add the wall and CPU nanoseconds inside every ``RMSNorm`` (or a subclass
    in its place) and its calls to ``totals`` (as ``NORM_KEYS``): the classes."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    started = [0, 0]

    def before(module, args) -> None:
        started[:] = time.perf_counter_ns(), time.process_time_ns()

    def after(module, args, output) -> None:
        totals[0] += time.perf_counter_ns() - started[0]
        totals[1] += time.process_time_ns() - started[1]
        totals[2] += 1

    names = set()
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.register_forward_pre_hook(before)
            module.register_forward_hook(after)
            names.add(type(module).__name__)
    return sorted(names)


def start(config: dict[str, Any], totals: list[int]) -> tuple[Any, dict[str, Any]]:
    """The engine (eager: its norms timed into ``totals``) and its own word."""
    import dataclasses

    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    from vllm_patch.runtime import cpu_library

    eager = config["mode"] != "compiled"
    length = len(PROMPT) + config["max_tokens"] + 8
    extra = {"dtype": config["dtype"], "max_model_len": length, "seed": 0}
    extra |= {"max_num_seqs": 1, "enable_prefix_caching": False}
    extra |= {"enforce_eager": eager, "skip_tokenizer_init": True}
    if "kv_cache_memory_bytes" in {f.name for f in dataclasses.fields(EngineArgs)}:
        extra["kv_cache_memory_bytes"] = 2**28  # not all memory may be free
    if config.get("custom_ops"):
        extra["compilation_config"] = {"custom_ops": config["custom_ops"]}
    llm = LLM(model=config["model"], **extra)
    hooked = llm.apply_model(lambda m: hook_norms(m, totals))[0] if eager else []
    about = {"pid": os.getpid(), "kernel_build": cpu_library.loaded()}
    about["custom_ops"] = list(llm.llm_engine.vllm_config.compilation_config.custom_ops)
    return llm, about | {"norm_classes": hooked}


def step(llm, totals: list[int]) -> dict[str, Any]:
    """One engine step's nanoseconds (and the norms' ``NORM_KEYS``), ``finished``."""
    norms = list(totals)
    wall, cpu = time.perf_counter_ns(), time.process_time_ns()
    outputs = llm.llm_engine.step()
    out = {"wall": time.perf_counter_ns() - wall, "cpu": time.process_time_ns() - cpu}
    out.update((k, a - b) for k, a, b in zip(NORM_KEYS, totals, norms, strict=True))
    out["finished"] = not llm.llm_engine.has_unfinished_requests()
    if out["finished"]:
        assert any(o.finished for o in outputs)
    return out


def main(config_text: str) -> int:
    answers = os.fdopen(os.dup(1), "w", buffering=1)  # a line is an answer
    os.dup2(2, 1)  # vLLM and everything else print to stderr
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    import torch

    # vLLM's CPU worker replaces torch.set_num_threads with a no-op once it
    # starts (it binds threads itself in its own processes, not in this one).
    set_threads = torch.set_num_threads
    from vllm import SamplingParams

    totals = [0, 0, 0]
    llm, about = start(json.loads(config_text), totals)
    print(json.dumps({"ready": about}), file=answers)
    for n, line in enumerate(sys.stdin):
        command = json.loads(line)
        if command.get("stop"):
            break
        if command.get("step"):
            print(json.dumps(step(llm, totals)), file=answers)
            continue
        set_threads(command["threads"])
        params = SamplingParams(max_tokens=command["tokens"], **GREEDY)
        llm.llm_engine.add_request(str(n), {"prompt_token_ids": PROMPT}, params)
        print(json.dumps({"added": str(n)}), file=answers)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

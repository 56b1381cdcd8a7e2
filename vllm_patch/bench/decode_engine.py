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


class NormClock:
    """Wall and CPU nanoseconds spent inside the hooked modules, and calls."""

    def __init__(self) -> None:
        self.totals = (0, 0, 0)  # as NORM_KEYS
        self._start = (0, 0)

    def before(self, module, args) -> None:
        self._start = (time.perf_counter_ns(), time.process_time_ns())

    def after(self, module, args, output) -> None:
        wall, cpu, calls = self.totals
        wall += time.perf_counter_ns() - self._start[0]
        self.totals = (wall, cpu + time.process_time_ns() - self._start[1], calls + 1)


def hook_norms(model, clock: NormClock) -> list[str]:
    """Time every ``RMSNorm`` (or a subclass in its place): the class names."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    names = []
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.register_forward_pre_hook(clock.before)
            module.register_forward_hook(clock.after)
            names.append(type(module).__name__)
    return sorted(set(names))


def start(config: dict[str, Any]) -> tuple[Any, NormClock | None, dict[str, Any]]:
    """The engine, its norm clock (eager only) and what it says about itself."""
    import dataclasses

    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    from vllm_patch.runtime import cpu_library

    compiled = config["mode"] == "compiled"
    length = len(PROMPT) + config["max_tokens"] + 8
    extra = {"dtype": config["dtype"], "max_model_len": length, "seed": 0}
    extra |= {"max_num_seqs": 1, "enable_prefix_caching": False}
    if "kv_cache_memory_bytes" in {f.name for f in dataclasses.fields(EngineArgs)}:
        extra["kv_cache_memory_bytes"] = 2**28  # not all memory may be free
    if config.get("custom_ops"):
        extra["compilation_config"] = {"custom_ops": config["custom_ops"]}
    extra["skip_tokenizer_init"] = True
    llm = LLM(model=config["model"], enforce_eager=not compiled, **extra)
    clock = None if compiled else NormClock()
    hooked = llm.apply_model(lambda m: hook_norms(m, clock))[0] if clock else []
    about = {"pid": os.getpid(), "kernel_build": cpu_library.loaded()}
    about["custom_ops"] = list(llm.llm_engine.vllm_config.compilation_config.custom_ops)
    return llm, clock, about | {"norm_classes": hooked}


def step(llm, clock: NormClock | None) -> dict[str, Any]:
    """One engine step's nanoseconds (and the norms' ``NORM_KEYS``), ``finished``."""
    norms = clock.totals if clock else (0, 0, 0)
    wall, cpu = time.perf_counter_ns(), time.process_time_ns()
    outputs = llm.llm_engine.step()
    out: dict[str, Any] = {
        "wall": time.perf_counter_ns() - wall,
        "cpu": time.process_time_ns() - cpu,
    }
    after = clock.totals if clock else (0, 0, 0)
    out.update((k, a - b) for k, a, b in zip(NORM_KEYS, after, norms, strict=True))
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

    llm, clock, about = start(json.loads(config_text))
    print(json.dumps({"ready": about}), file=answers)
    for n, line in enumerate(sys.stdin):
        command = json.loads(line)
        if command.get("stop"):
            break
        if command.get("step"):
            print(json.dumps(step(llm, clock)), file=answers)
            continue
        set_threads(command["threads"])
        tokens = command["tokens"]
        params = SamplingParams(
            temperature=0.0, ignore_eos=True, detokenize=False, max_tokens=tokens
        )
        llm.llm_engine.add_request(str(n), {"prompt_token_ids": PROMPT}, params)
        print(json.dumps({"added": str(n)}), file=answers)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

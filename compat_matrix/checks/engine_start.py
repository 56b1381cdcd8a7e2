"""One real vLLM engine, in-process, on a random-weight Llama, generating under
torch's profiler (the ``--e2e`` checks run it in a child interpreter)."""

import dataclasses
import os

from compat_matrix.checks.calls import kernel_calls

NEW_TOKENS = 8


def generate(model: str, mode: str) -> dict:
    """The CPU kernels' calls while ``mode`` (eager or compiled) generates, and
    the token ids it generated."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in-process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, older releases
    import torch
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs

    # A small KV cache: a share of the machine's memory may not be free.
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    small = (
        {"kv_cache_memory_bytes": 2**28} if "kv_cache_memory_bytes" in fields else {}
    )
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=mode == "eager",
        max_model_len=64,
        max_num_seqs=1,
        seed=0,
        **small,
    )
    prompt = [{"prompt_token_ids": list(range(10, 18))}]
    params = SamplingParams(
        temperature=0.0, ignore_eos=True, detokenize=False, max_tokens=NEW_TOKENS
    )
    llm.generate(prompt, params, use_tqdm=False)  # warm-up: compiles
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        result = llm.generate(prompt, params, use_tqdm=False)
    return {"calls": kernel_calls(p), "tokens": list(result[0].outputs[0].token_ids)}

"""``--e2e``: an engine with the provider on a random Llama, in a child: eager it
calls the CPU kernels as it generates, compiled (Inductor) none."""

import dataclasses
import os

import pytest

NEW_TOKENS = 8


def generate(model: str, mode: str) -> dict:
    """In the child: the kernels an in-process engine calls, and its tokens."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in-process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, older releases
    import torch
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs

    from compat_matrix.checks.calls import kernel_calls

    # A small KV cache: a share of the machine's memory may not be free.
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    small = {k: v for k, v in {"kv_cache_memory_bytes": 2**28}.items() if k in fields}
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


@pytest.fixture(scope="session")
def model(request):
    if not request.config.getoption("--e2e"):
        pytest.skip("engine starts not asked for (--e2e)")
    from vllm_patch.bench.random_models import TINY_LLAMA, make_random_llama
    from vllm_patch.runtime.cache import cache_dir

    return make_random_llama(cache_dir() / "models", **TINY_LLAMA)


def run_engine(model, mode, fact) -> dict:
    from vllm_patch.runtime import child

    target = "compat_matrix.checks.test_e2e:generate"
    outcome = child.run(target, {"model": str(model), "mode": mode}, timeout=1800)
    found = outcome.value()  # else its log's tail
    fact(f"e2e_{mode}", found)
    assert len(found["tokens"]) == NEW_TOKENS, found
    return found


def test_e2e_eager_engine_calls_kernels(model, fact):
    found = run_engine(model, "eager", fact)
    assert found["calls"]["_C::rms_norm"] >= 1, found


def test_e2e_compiled_engine_calls_no_kernel(model, fact):
    found = run_engine(model, "compiled", fact)
    assert not any(found["calls"].values()), found

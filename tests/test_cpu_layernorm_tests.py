"""The test the patch commits into vLLM (``cpu_layernorm_tests.SOURCE``): its
oracle, measured on this machine's kernels, agrees with the rule."""

import pytest
from conftest import requires_vllm

from patches.rms_norm_forward_cpu.cpu_layernorm_tests import SOURCE

pytestmark = requires_vllm


@pytest.fixture
def vllm_test():
    """SOURCE run as a module against the installed vLLM, at one thread (as its
    fixture), under a default vLLM config (as vLLM's ``default_vllm_config``)."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU platform only")
    namespace = {"__name__": "test_cpu_layernorm"}
    exec(compile(SOURCE, "test_cpu_layernorm.py", "exec"), namespace)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with set_current_vllm_config(VllmConfig()):
        yield namespace
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "add_residual", [False, True], ids=["rms_norm", "fused_add"]
)
def test_oracle_is_the_rule_here(vllm_test, add_residual):
    """Per dtype, the kernel matches native by the test's own measurement exactly
    where the rule (``cpu_norm_dtypes``) runs it on this build: neither the
    rule nor the test's tolerance and bias margin drifted from the other."""
    import torch

    from patches.cpu_norm_rule import cpu_norm_dtypes

    matches = vllm_test["_kernel_matches_native"]
    with torch.inference_mode():
        measured = tuple(d for d in vllm_test["DTYPES"] if matches(d, add_residual))
    assert measured == tuple(
        d for d in vllm_test["DTYPES"] if d in cpu_norm_dtypes()
    )

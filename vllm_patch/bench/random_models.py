"""Random-weight models made locally with ``transformers`` (no hub), cached by
configuration: a Llama and a Qwen3 (q/k norms on per-head views)."""

import functools
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

# The smallest Llama that still runs every layer type: for checks that the
# engine runs a given kernel, not for timing.
TINY_LLAMA = {
    "hidden_size": 256,
    "num_layers": 2,
    "intermediate_size": 512,
    "num_heads": 4,
    "num_kv_heads": 2,
    "vocab_size": 1024,
}
# Qwen3's layout, small: q_norm and k_norm over head_dim 64 on strided views
# (vLLM #31643's configuration, which no Llama has).
TINY_QWEN3 = {
    "hidden_size": 256,
    "num_layers": 4,
    "intermediate_size": 768,
    "num_heads": 4,
    "num_kv_heads": 2,
    "vocab_size": 2048,
    "head_dim": 64,
}
HF_NAMES = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
}
KINDS = {"llama": ("Llama", 1e-5), "qwen3": ("Qwen3", 1e-6)}  # name, rms_norm_eps


def make_random(
    path, *, kind="llama", seed=0, tokenizer=False, **sizes: int
) -> Path:
    """A random bf16 model of ``sizes``, built in ``path`` once per
    configuration."""
    path = Path(path)
    config = {HF_NAMES.get(k, k): v for k, v in sizes.items()}
    if kind != "llama":
        config["architecture"] = kind
    config["max_position_embeddings"] = 2048
    # Random tied embeddings make every greedy completion one token repeated.
    config["tie_word_embeddings"] = False
    config["seed"] = seed
    config["rms_norm_eps"] = KINDS[kind][1]
    if tokenizer:
        config["tokenizer"] = "words"
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    target = path / f"random-{kind}-{digest[:12]}"
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so an interrupted build is never reused.
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        own = ("seed", "tokenizer", "architecture")
        hf_config = getattr(transformers, f"{KINDS[kind][0]}Config")(
            **{k: v for k, v in config.items() if k not in own},
            torch_dtype="bfloat16",
        )
        torch.manual_seed(seed)
        model = getattr(transformers, f"{KINDS[kind][0]}ForCausalLM")(hf_config)
        model.to(torch.bfloat16).save_pretrained(staging, safe_serialization=True)
        if tokenizer:  # words w3 .. w(vocab - 1): a served model needs one
            special = {
                "unk_token": "<unk>",
                "bos_token": "<s>",
                "eos_token": "</s>",
            }
            vocab = {token: i for i, token in enumerate(special.values())}
            vocab.update({f"w{i}": i for i in range(3, config["vocab_size"])})
            words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
            words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
            made = transformers.PreTrainedTokenizerFast(
                tokenizer_object=words, **special
            )
            made.save_pretrained(staging)
        (staging / "vllm_patch_config.json").write_text(
            json.dumps(config, indent=1)
        )
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent build
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


make_random_llama = functools.partial(make_random, kind="llama")

"""The GGUF conversion (numpy and gguf only) against a tiny GGUF written here, and
the model cache's checks; the real model end to end in the integration tier."""

import json
import os

import pytest

from vllm_patch.bench import smollm2

gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")


def llama_cpp_permute(w, heads: int):
    """What llama.cpp's converter does to q and k (``LlamaModel.permute``)."""
    rows = w.shape[0]
    return (
        w.reshape(heads, 2, rows // heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.mark.parametrize(
    ("heads", "stored", "rows"),
    [
        # one head of 4 rows: llama.cpp interleaves the halves (0, 1 | 2, 3)
        (1, [0, 2, 1, 3], [0, 1, 2, 3]),
        (1, [0, 3, 1, 4, 2, 5], [0, 1, 2, 3, 4, 5]),
        # two heads of 4 rows: each head on its own
        (2, [0, 2, 1, 3, 4, 6, 5, 7], [0, 1, 2, 3, 4, 5, 6, 7]),
    ],
)
def test_unpermute_puts_each_heads_rows_back_in_halves(heads, stored, rows):
    w = np.array(stored, dtype=np.float32)[:, None] * [1, 10]
    assert smollm2.unpermute(w, heads).tolist() == [[r, 10 * r] for r in rows]


@pytest.mark.parametrize(
    ("heads", "rows", "cols"), [(1, 4, 3), (3, 12, 5), (9, 576, 2)]
)
def test_unpermute_undoes_llama_cpps_permute(heads, rows, cols):
    w = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    assert (smollm2.unpermute(llama_cpp_permute(w, heads), heads) == w).all()


@pytest.mark.parametrize(
    ("gguf_name", "hf_name"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.29.ffn_down.weight", "model.layers.29.mlp.down_proj.weight"),
        ("blk.7.ffn_norm.weight", "model.layers.7.post_attention_layernorm.weight"),
    ],
)
def test_tensor_names_become_hugging_faces(gguf_name, hf_name):
    assert smollm2.hf_name(gguf_name) == hf_name


@pytest.mark.parametrize(
    "name", ["blk.0.attn_qkv.weight", "rope_freqs.weight", "x"]
)
def test_a_tensor_the_conversion_does_not_know_is_refused(name):
    with pytest.raises(ValueError, match="does not know"):
        smollm2.hf_name(name)


HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 32, 4, 2, 64, 48


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A one-layer Llama GGUF as llama.cpp writes one (q and k permuted, one
    tensor Q8_0), and the Hugging Face tensors it was written from."""
    rng = np.random.default_rng(0)
    dim = HIDDEN // HEADS
    shapes = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.layers.0.self_attn.q_proj.weight": (HIDDEN, HIDDEN),
        "model.layers.0.self_attn.k_proj.weight": (KV_HEADS * dim, HIDDEN),
        "model.layers.0.mlp.up_proj.weight": (FFN, HIDDEN),
        "model.layers.0.input_layernorm.weight": (HIDDEN,),
        "model.norm.weight": (HIDDEN,),
    }
    hf = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    # what Q8_0 keeps of it: the conversion gets that back exactly
    up = "model.layers.0.mlp.up_proj.weight"
    packed = gguf.quants.quantize(hf[up], gguf.GGMLQuantizationType.Q8_0)
    hf[up] = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q8_0)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(dim)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    stored = {
        "token_embd.weight": hf["model.embed_tokens.weight"],
        "blk.0.attn_q.weight": llama_cpp_permute(
            hf["model.layers.0.self_attn.q_proj.weight"], HEADS
        ),
        "blk.0.attn_k.weight": llama_cpp_permute(
            hf["model.layers.0.self_attn.k_proj.weight"], KV_HEADS
        ),
        "blk.0.attn_norm.weight": hf["model.layers.0.input_layernorm.weight"],
        "output_norm.weight": hf["model.norm.weight"],
    }
    for name, values in stored.items():
        writer.add_tensor(name, values)
    writer.add_tensor(
        "blk.0.ffn_up.weight", packed, raw_dtype=gguf.GGMLQuantizationType.Q8_0
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(str(path)), hf


def test_the_conversion_gives_back_the_tensors_llama_cpp_was_given(tiny):
    reader, hf = tiny
    found = dict(smollm2.hf_tensors(reader, smollm2.metadata(reader)))
    assert sorted(found) == sorted(hf)
    for name, values in hf.items():
        assert found[name].shape == values.shape, name
        assert (found[name] == values).all(), name


def test_the_config_is_the_gguf_metadatas(tiny):
    reader, _ = tiny
    config = smollm2.hf_config(smollm2.metadata(reader), VOCAB, tied=True)
    assert config == {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": 1,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HIDDEN // HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def test_a_gguf_of_another_architecture_is_refused():
    with pytest.raises(ValueError, match="expected a llama GGUF, found 'gpt2'"):
        smollm2.hf_config({"general.architecture": "gpt2"}, 10, tied=True)


# --- the cache: data, never orders --------------------------------------------


def folder_with_manifest(path, files: dict[str, bytes]):
    path.mkdir()
    for name, data in files.items():
        (path / name).write_bytes(data)
    digests = {n: smollm2.hashlib.sha256(d).hexdigest() for n, d in files.items()}
    (path / smollm2.MANIFEST).write_text(json.dumps({"files": digests}))
    return digests


def test_a_folder_as_its_manifest_lists_it_is_reused(tmp_path):
    digests = folder_with_manifest(
        tmp_path / "m", {"config.json": b"{}", "w": b"1"}
    )
    assert smollm2.checked(tmp_path / "m") == digests


@pytest.mark.parametrize(
    "spoil",
    [
        lambda m: (m / "w").write_bytes(b"2"),  # changed
        lambda m: (m / "extra").write_bytes(b""),  # planted beside
        lambda m: (m / "w").unlink(),  # missing
        lambda m: ((m / "w").unlink(), (m / "w").symlink_to("/etc/passwd")),
        lambda m: ((m / "w").unlink(), os.mkfifo(m / "w")),
        lambda m: (m / smollm2.MANIFEST).write_text("not json"),
        lambda m: (m / smollm2.MANIFEST).write_text('{"files": {"../w": "x"}}'),
    ],
    ids=["changed", "extra", "missing", "link", "fifo", "manifest", "outside"],
)
def test_a_folder_that_differs_from_its_manifest_is_not_reused(tmp_path, spoil):
    folder_with_manifest(tmp_path / "m", {"config.json": b"{}", "w": b"1"})
    spoil(tmp_path / "m")
    assert smollm2.checked(tmp_path / "m") is None


def test_a_link_in_place_of_the_model_folder_is_not_reused(tmp_path):
    folder_with_manifest(tmp_path / "real", {"w": b"1"})
    (tmp_path / "m").symlink_to(tmp_path / "real")
    assert smollm2.checked(tmp_path / "m") is None


def test_a_link_in_place_of_the_model_cache_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLMPATCH_CACHE", str(tmp_path))
    (tmp_path / "models").symlink_to(tmp_path)
    with pytest.raises(smollm2.PatchError, match="not a folder"):
        smollm2.models_dir()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p.symlink_to("/etc/passwd"), "cannot read"),
        (lambda p: os.mkfifo(p), "not a regular file"),
        (lambda p: p.write_bytes(b"x" * 11), "file too large"),
    ],
    ids=["link", "fifo", "large"],
)
def test_hashing_a_cached_file_refuses_what_is_not_a_small_regular_file(
    tmp_path, make, message
):
    make(tmp_path / "f")
    with pytest.raises(smollm2.PatchError, match=message):
        smollm2.sha256_of(tmp_path / "f", "a file", limit=10)


def test_a_wheel_with_another_hash_is_refused_with_both_hashes(tmp_path):
    with pytest.raises(smollm2.PatchError) as caught:
        smollm2.pinned("abc", smollm2.WHEEL_SHA256, tmp_path / "w.whl", "wheel")
    assert caught.value.found == "abc"
    assert smollm2.WHEEL_SHA256 in caught.value.looked_for


# --- the real model (integration) ---------------------------------------------


@pytest.mark.integration
def test_the_real_model_is_made_once_and_checked_by_hash_on_reuse():
    made = smollm2.ensure_model()
    again = smollm2.ensure_model(progress=pytest.fail)  # no rebuild: no progress
    assert again == made
    config = json.loads((smollm2.Path(made.path) / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (576, 30)
    assert (
        "chat_template.jinja" in made.files or "tokenizer_config.json" in made.files
    )
    assert made.to_json()["origin"]["wheel_sha256"] == smollm2.WHEEL_SHA256

"""Weight loaders and tokenizer: GGUF dequantization against the gguf package, a tiny GGUF written
here (Q/K row permutation, mixed tensor types), HF transformers reference checkpoints, the orbax
parameter cache, clear errors, and the SmolLM2 tokenizer against HF's token ids."""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import pre_tokenizers

from models import gguf_loader, hf_loader, llama, loader
from models.presets import ModelConfig

FIX = Path(__file__).parent / "fixtures"
Q = gguf.GGMLQuantizationType
forward = jax.jit(llama.prefill, static_argnames=("config", "all_logits", "kv_transform"))


# -- dequantization --------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_dequantize_matches_gguf_package(qtype):
    # zlib.crc32, not hash(): str hashes change per process, which made the inputs vary.
    rng = np.random.default_rng(zlib.crc32(qtype.encode()))
    x = (rng.standard_normal((6, 64)) * rng.uniform(0.1, 3, (6, 1))).astype(np.float32)
    raw = gguf.quants.quantize(x, Q[qtype])
    ref = gguf.quants.dequantize(raw, Q[qtype])
    ours = gguf_loader.dequantize(raw, qtype, (6, 64))
    np.testing.assert_array_equal(ours, ref)
    err = np.abs(ours - x)
    # Float types round to nearest: half a unit in the last place, relative to |x| (plus half
    # the fp16 subnormal spacing for tiny values).
    relative = {"F32": 0.0, "F16": 2.0**-11, "BF16": 2.0**-8}
    if qtype in relative:
        assert np.all(err <= relative[qtype] * np.abs(x) + (2.0**-25 if qtype == "F16" else 0))
    else:
        assert err.max() <= 0.6


def test_dequantize_errors():
    with pytest.raises(gguf_loader.GGUFError, match="unsupported GGUF tensor type Q5_0"):
        gguf_loader.dequantize(np.zeros(22, np.uint8), "Q5_0", (32,), "w")
    with pytest.raises(gguf_loader.GGUFError, match="whole number of blocks"):
        gguf_loader.dequantize(np.zeros(19, np.uint8), "Q8_0", (32,), "w")


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF rows -> interleaved RoPE rows)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def test_unpermute_inverts_llama_cpp():
    w = np.random.default_rng(0).standard_normal((3 * 16, 5))
    np.testing.assert_array_equal(gguf_loader.unpermute_rope_rows(_llama_cpp_permute(w, 3), 3), w)
    assert not np.array_equal(_llama_cpp_permute(w, 3), w)


# -- a tiny GGUF written here ----------------------------------------------------------------

TINY = ModelConfig(
    name="tiny-gguf",
    vocab_size=262,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_embeddings=False,
    max_position_embeddings=128,
)
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# our layer key -> GGUF suffix, storage type (Q/K in F32 so the un-permutation is checked exactly)
TYPES = {
    "attn_norm": ("attn_norm.weight", "F32"),
    "wq": ("attn_q.weight", "F32"),
    "wk": ("attn_k.weight", "F32"),
    "wv": ("attn_v.weight", "Q4_1"),
    "wo": ("attn_output.weight", "Q4_0"),
    "mlp_norm": ("ffn_norm.weight", "F32"),
    "w_gate": ("ffn_gate.weight", "Q8_0"),
    "w_up": ("ffn_up.weight", "F16"),
    "w_down": ("ffn_down.weight", "BF16"),
}


def write_tiny_gguf(path: Path, params, *, override_type: str | None = None):
    """Write `params` as a llama.cpp-style GGUF; return the params the file holds after the
    round trip, dequantized by the gguf package (in our layout)."""
    c = TINY
    expected = {"layers": {k: [] for k in TYPES}}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + ["Ġt", "he", "xy", "zw", "<|im_start|>", "<|im_end|>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(["Ġ t", "h e"])
    w.add_token_types([1] * 260 + [3, 3])
    w.add_bos_token_id(260)
    w.add_eos_token_id(261)
    w.add_chat_template(CHATML)

    def put(name, x, qtype):
        x = np.asarray(x, np.float32)
        if qtype == "F32":
            w.add_tensor(name, x)
            return x
        raw = gguf.quants.quantize(x, Q[qtype])
        w.add_tensor(name, raw, raw_dtype=Q[qtype])
        return gguf.quants.dequantize(raw, Q[qtype]) if qtype in Q.__members__ else None

    expected["embed"] = put("token_embd.weight", params["embed"], "Q8_0")
    for i in range(c.num_layers):
        for k, (suffix, qtype) in TYPES.items():
            x = np.asarray(params["layers"][k][i])
            if x.ndim == 2:
                x = x.T  # ours [in, out] -> GGUF/PyTorch rows [out, in]
            if k == "wq":
                x = _llama_cpp_permute(x, c.num_heads)
            elif k == "wk":
                x = _llama_cpp_permute(x, c.num_kv_heads)
            if override_type and k == "w_up":
                qtype = override_type
            y = put(f"blk.{i}.{suffix}", x, qtype)
            if k == "wq":
                y = gguf_loader.unpermute_rope_rows(y, c.num_heads)
            elif k == "wk":
                y = gguf_loader.unpermute_rope_rows(y, c.num_kv_heads)
            expected["layers"][k].append(y.T if y.ndim == 2 else y)
    expected["layers"] = {k: np.stack(v) for k, v in expected["layers"].items()}
    expected["final_norm"] = put("output_norm.weight", params["final_norm"], "F32")
    expected["lm_head"] = put("output.weight", np.asarray(params["lm_head"]).T, "Q8_0").T
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    params = llama.init_params(TINY, jax.random.key(0))
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    expected = write_tiny_gguf(path, params)
    return path, params, expected


def test_gguf_roundtrip(tiny_gguf):
    path, orig, expected = tiny_gguf
    config, params, tok = gguf_loader.load_gguf(path, progress=False)
    assert config == ModelConfig(
        **{**TINY.__dict__, "name": "tiny", "rms_norm_eps": float(np.float32(1e-5))}
    )
    for k in ("wq", "wk", "attn_norm", "mlp_norm"):  # F32: exact, so the Q/K un-permute is right
        np.testing.assert_array_equal(params["layers"][k], orig["layers"][k])
    for k, tol in (("wv", 0.25), ("wo", 0.3), ("w_gate", 0.02), ("w_up", 2e-3), ("w_down", 0.02)):
        err = np.abs(np.asarray(params["layers"][k]) - np.asarray(orig["layers"][k])).max()
        assert 0 < err < tol, (k, err)
    # every tensor equals the gguf package's own dequantization of the same bytes
    for (path_, a), b in zip(
        jax.tree.flatten_with_path(params)[0], jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), b, err_msg=jax.tree_util.keystr(path_))
    # tokenizer from the GGUF vocabulary
    ids = tok.encode("<|im_start|>the t")
    assert ids[0] == 260 and tok.decode(ids, skip_special_tokens=False) == "<|im_start|>the t"
    assert tok.token_to_id("he") in ids and tok.token_to_id("Ġt") in ids
    assert tok.eos_ids == (261,)
    chat = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template("hi") == chat


def test_gguf_errors(tiny_gguf, tmp_path):
    path, params, _ = tiny_gguf
    with pytest.raises(FileNotFoundError, match="not found"):
        gguf_loader.load_gguf(tmp_path / "absent.gguf")
    short = tmp_path / "short.gguf"
    data = path.read_bytes()
    short.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(gguf_loader.GGUFError, match="truncated"):
        gguf_loader.load_gguf(short, progress=False)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + data[4:])
    with pytest.raises(gguf_loader.GGUFError, match="not a GGUF file"):
        gguf_loader.load_gguf(bad, progress=False)
    garbled = tmp_path / "garbled.gguf"
    garbled.write_bytes(data[:8] + b"\xff" * 64 + data[72:])
    with pytest.raises(gguf_loader.GGUFError):
        gguf_loader.load_gguf(garbled, progress=False)
    q5 = tmp_path / "q5.gguf"
    write_tiny_gguf(q5, params, override_type="Q5_0")
    with pytest.raises(gguf_loader.GGUFError, match="unsupported GGUF tensor type Q5_0"):
        gguf_loader.load_gguf(q5, progress=False)


# -- Hugging Face checkpoints ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny_llama3", "tiny_llama_linear", "tiny_qwen2"])
def test_hf_checkpoint_matches_transformers(name):
    """Logits of transformers (scripts/make_hf_fixture.py) for llama3 / linear rope scaling,
    tied and untied heads, q/k/v bias and a sharded checkpoint. Tolerance: 1e-4 absolute."""
    config, params, tok = hf_loader.load_hf(FIX / name, progress=False)
    assert tok is None
    assert config.qkv_bias == (name == "tiny_qwen2")
    assert config.tie_embeddings == (name == "tiny_llama_linear")
    assert (config.rope_scaling and config.rope_scaling.kind) == {
        "tiny_llama3": "llama3",
        "tiny_llama_linear": "linear",
        "tiny_qwen2": None,
    }[name]
    ref = json.loads((FIX / name / "reference_logits.json").read_text())
    ids = jnp.asarray(ref["ids"], jnp.int32)
    lengths = jnp.full((ids.shape[0],), ids.shape[1])
    logits, _ = forward(params, config, ids, lengths, None, all_logits=True)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref["logits"]), atol=1e-4, rtol=0)


def test_hf_errors(tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(FIX / "tiny_qwen2", d)
    shard = sorted(d.glob("model-*.safetensors"))[3]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        hf_loader.load_hf(d, progress=False)
    shutil.rmtree(d)
    shutil.copytree(FIX / "tiny_llama3", d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(hf_loader.CheckpointError, match="truncated"):
        hf_loader.load_hf(d, progress=False)
    cfg = json.loads((d / "config.json").read_text())
    with pytest.raises(hf_loader.CheckpointError, match="model_type"):
        hf_loader.config_from_hf({**cfg, "model_type": "gpt2"}, "x")
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf_loader.load_hf(tmp_path, progress=False)


# -- load_model: names, errors, the orbax cache ----------------------------------------------


def test_load_model_names_and_errors(tmp_path):
    with pytest.raises(ValueError, match="smollm2-135m"):
        loader.load_model("no-such-model", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="no bundled weights"):
        loader.load_model("llama-3-8b", cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError):
        loader.load_model(str(tmp_path / "missing.gguf"), cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError):
        loader.load_model(str(tmp_path / "nowhere" / "dir"), cache_dir=tmp_path)
    assert loader.resolve_source("smollm2")[1] == loader.smollm2_gguf_path()


def test_orbax_cache_skips_conversion(tmp_path, monkeypatch):
    src = tmp_path / "ck"
    shutil.copytree(FIX / "tiny_llama3", src)
    cache = tmp_path / "cache"
    cfg1, p1, _ = loader.load_model(str(src), jnp.bfloat16, progress=False, cache_dir=cache)
    assert (cache / "ck-bfloat16" / "meta.json").is_file()
    calls = []
    real = hf_loader.load_hf
    monkeypatch.setattr(hf_loader, "load_hf", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg2, p2, _ = loader.load_model(str(src), jnp.bfloat16, progress=False, cache_dir=cache)
    assert calls == [] and cfg2 == cfg1
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        assert a.dtype == b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    st = (src / "model.safetensors").stat()
    os.utime(src / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    loader.load_model(str(src), jnp.bfloat16, progress=False, cache_dir=cache)
    assert calls == [1]  # a changed source is converted again


# -- the SmolLM2 tokenizer against HF's ------------------------------------------------------


@pytest.fixture(scope="module")
def smol_tok():
    return gguf_loader.load_gguf_tokenizer(loader.smollm2_gguf_path())


def test_smollm2_tokenizer_matches_hf(smol_tok):
    ref = json.loads((FIX / "smollm2_hf_reference.json").read_text())
    for case in ref["cases"]:
        text = smol_tok.apply_chat_template(case["prompt"]) if case["chat"] else case["prompt"]
        assert text == case["text"]
        assert smol_tok.encode(text) == case["ids"]
        assert smol_tok.decode(case["ids"], skip_special_tokens=False) == text
    assert smol_tok.encode(ref["digits"]["text"]) == ref["digits"]["ids"]
    assert smol_tok.bos_id == 1 and 2 in smol_tok.eos_ids and not smol_tok.add_bos
    assert smol_tok.encode("Hi", add_bos=True)[0] == 1


def test_tokenizer_from_hf_dir(smol_tok, tmp_path):
    """tokenizer.json + tokenizer_config.json (the HF layout) give the same ids and template."""
    from models.tokenizer import Tokenizer

    smol_tok.tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            dict(
                bos_token="<|im_start|>",
                eos_token={"content": "<|im_end|>"},
                add_bos_token=False,
                chat_template=smol_tok.chat_template,
            )
        )
    )
    tok = Tokenizer.from_dir(tmp_path)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert text == smol_tok.apply_chat_template("Hi there")
    assert tok.encode(text) == smol_tok.encode(text)
    assert tok.bos_id == 1 and tok.eos_id == 2 and tok.eos_ids == smol_tok.eos_ids
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path / "nope")

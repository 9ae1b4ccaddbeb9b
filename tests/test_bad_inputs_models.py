"""Bad input to `models/`, one table per surface (issue 36, "Nothing silent").

API rows assert the exact exception type and the names the message must carry (the argument,
config field, file or tensor). CLI rows assert exit status 2, `error:` on stderr naming the flag,
and no traceback. Rows marked "accepted" pin the documented policy for an edge that is not an
error. lab/what_happens_when_models.md has one short section per row.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_loaders import TINY, write_tiny_gguf
from typer.testing import CliRunner

from kivi_jax.attention import pallas_available
from models import gguf_loader, hf_loader, llama, loader, tokenizer
from models.cli import app

FIX = Path(__file__).parent / "fixtures"
runner = CliRunner()

# -- helpers ---------------------------------------------------------------------------------


def hf_copy(tmp_path, fixture="tiny_llama3", *, config=None, raw_config=None, tensors=None):
    """A copy of a fixture checkpoint with config.json edited (config: dict -> dict, or
    raw_config: the file's text) and model.safetensors edited (tensors: dict -> dict)."""
    d = tmp_path / "ck"
    shutil.copytree(FIX / fixture, d)
    if config is not None:
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(config(cfg)))
    if raw_config is not None:
        (d / "config.json").write_text(raw_config)
    if tensors is not None:
        f = d / "model.safetensors"
        save_file(tensors(dict(load_file(f))), f)
    return d


def edit(**changes):
    """A config edit: set each key (None: delete it)."""

    def f(cfg):
        for k, v in changes.items():
            if v is None:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        return cfg

    return f


def drop_rope_field(field):
    def f(cfg):
        del cfg["rope_parameters"][field]
        return cfg

    return f


def with_tensor(name, value=None, *, like=None):
    """A tensors edit: add or replace `name` (a copy of `like` when value is None)."""

    def f(t):
        t[name] = np.array(t[like]) if value is None else value
        return t

    return f


def without_tensor(name):
    def f(t):
        del t[name]
        return t

    return f


def poisoned(name, count=5):
    """NaN in the first `count` values of `name`'s first row, +inf in the first of its second."""

    def f(t):
        a = np.array(t[name])
        a[0, :count] = np.nan
        a[1, 0] = np.inf
        t[name] = a
        return t

    return f


def scaled(name, value):
    """A tensors edit: `name`[0, 0] = value."""

    def f(t):
        a = np.array(t[name])
        a[0, 0] = value
        t[name] = a
        return t

    return f


def cli(args, **kw):
    return runner.invoke(app, args, **kw)


def assert_cli_error(res, *needles):
    """Exit status 2, `error:` on stderr naming each needle, no traceback, nothing on stdout.

    The needles are looked for in the error itself, not in warnings printed before it."""
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert isinstance(res.exception, SystemExit), res.exception  # not an escaped exception
    assert res.stderr.startswith("error: ") or "\nerror: " in res.stderr, res.stderr
    error = res.stderr[res.stderr.rindex("error: ") :]
    for n in needles:
        assert n in error, (n, error)
    assert "Traceback" not in res.output
    assert res.stdout == ""


# -- HF config.json --------------------------------------------------------------------------

# the first of the 9 unused tensors, in natural order (the message quotes five)
LLAMA3_LAYER1 = ["model.layers.1.input_layernorm.weight", "model.layers.1.mlp.down_proj.weight"]

HF_CONFIG_CASES = [
    # id, config edit | raw text, exception, needles
    ("fewer-layers", edit(num_hidden_layers=1), None, ["num_hidden_layers=1", "9 tensor(s)",
     *LLAMA3_LAYER1, "allow_unused=True", "--allow-unused-weights"]),
    ("more-layers", edit(num_hidden_layers=3), None, ["9 tensor(s)", "missing",
     "model.layers.2.input_layernorm.weight"]),
    ("missing-key", edit(hidden_size=None), None, ["config.json", "'hidden_size'", "missing"]),
    ("missing-rope-field", drop_rope_field("low_freq_factor"), None,
     ["config.json", "low_freq_factor", "missing"]),
    ("list-not-object", None, "[1, 2]", ["config.json", "JSON object", "list"]),
    ("zero-heads", edit(num_attention_heads=0), None, ["num_attention_heads", "got 0"]),
    ("bad-json", None, '{"model_type": "llama",', ["config.json", "not valid JSON", "line 1"]),
    ("string-int", edit(num_hidden_layers="two"), None, ["num_hidden_layers", "'two'"]),
    ("bool-int", edit(num_hidden_layers=True), None, ["num_hidden_layers", "True"]),
    ("fractional-int", edit(intermediate_size=95.5), None, ["intermediate_size", "95.5"]),
    ("kv-heads-not-dividing", edit(num_key_value_heads=3), None,
     ["config.json", "num_kv_heads=3"]),
    ("head-dim-not-exact", edit(hidden_size=66, head_dim=None), None,
     ["hidden_size=66", "num_attention_heads=4", "head_dim"]),
    ("rope-not-object", edit(rope_parameters="llama3"), None, ["rope_parameters", "object"]),
    ("rope-factor-negative", lambda c: {**c, "rope_parameters": {**c["rope_parameters"],
     "factor": -8.0}}, None, ["factor", "-8.0"]),
    ("rope-unsupported", lambda c: {**c, "rope_parameters": {"rope_type": "yarn",
     "factor": 2.0}}, None, ["config.json", "'yarn'"]),
    ("eps-string", edit(rms_norm_eps="small"), None, ["rms_norm_eps", "'small'"]),
    ("theta-nan", lambda c: {**c, "rope_parameters": {**c["rope_parameters"],
     "rope_theta": float("nan")}}, None, ["rope_theta", "nan"]),
    ("model-type", edit(model_type="gpt2"), None, ["config.json", "model_type", "'gpt2'"]),
    ("tie-string", edit(tie_word_embeddings="false"), None, ["tie_word_embeddings", "'false'"]),
]  # fmt: skip


@pytest.mark.parametrize(
    "config,raw,needles", [c[1:] for c in HF_CONFIG_CASES], ids=[c[0] for c in HF_CONFIG_CASES]
)
def test_hf_bad_config(tmp_path, config, raw, needles):
    d = hf_copy(tmp_path, config=config, raw_config=raw)
    with pytest.raises(hf_loader.CheckpointError) as e:
        hf_loader.load_hf(d, progress=False)
    assert type(e.value) is hf_loader.CheckpointError
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


HF_INDEX_CASES = [
    ("no-weight-map", '{"metadata": {"total_size": 1}}', ["model.safetensors.index.json",
     "weight_map"]),
    ("index-list", "[]", ["model.safetensors.index.json", "weight_map"]),
    ("index-bad-json", "{", ["model.safetensors.index.json", "not valid JSON"]),
]  # fmt: skip


@pytest.mark.parametrize(
    "text,needles", [c[1:] for c in HF_INDEX_CASES], ids=[c[0] for c in HF_INDEX_CASES]
)
def test_hf_bad_index(tmp_path, text, needles):
    d = hf_copy(tmp_path, "tiny_qwen2")
    (d / "model.safetensors.index.json").write_text(text)
    with pytest.raises(hf_loader.CheckpointError) as e:
        hf_loader.load_hf(d, progress=False)
    assert type(e.value) is hf_loader.CheckpointError
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


K1 = "model.layers.1.self_attn.k_proj.weight"
HF_TENSOR_CASES = [
    # id, tensors edit, dtype, needles
    ("missing-tensor", without_tensor("model.layers.1.mlp.up_proj.weight"), jnp.float32,
     ["1 tensor(s)", "missing", "model.layers.1.mlp.up_proj.weight"]),
    ("unused-tensor", with_tensor("model.layers.0.mlp.extra.weight", like="model.norm.weight"),
     jnp.float32, ["1 tensor(s)", "not used", "model.layers.0.mlp.extra.weight"]),
    ("nan-weights", poisoned(K1), jnp.float32, [K1, "6 non-finite", "5 NaN, 1 inf", "damaged"]),
    ("nan-weights-bf16", poisoned(K1, count=2), jnp.bfloat16, [K1, "3 non-finite"]),
    ("float16-overflow", scaled("model.layers.0.mlp.down_proj.weight", 1e6), jnp.float16,
     ["model.layers.0.mlp.down_proj.weight", "overflow float16", "1e+06"]),
    ("wrong-shape", with_tensor("model.layers.0.self_attn.q_proj.weight",
     np.zeros((64, 32), np.float32)), jnp.float32,
     ["model.layers.0.self_attn.q_proj.weight", "shape (64, 32)", "(64, 64)"]),
]  # fmt: skip


@pytest.mark.parametrize(
    "tensors,dtype,needles", [c[1:] for c in HF_TENSOR_CASES], ids=[c[0] for c in HF_TENSOR_CASES]
)
def test_hf_bad_tensors(tmp_path, tensors, dtype, needles):
    d = hf_copy(tmp_path, tensors=tensors)
    with pytest.raises(hf_loader.CheckpointError) as e:
        hf_loader.load_hf(d, dtype, progress=False)
    assert type(e.value) is hf_loader.CheckpointError
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_hf_accepted_edges(tmp_path):
    """Policies that load: allow_unused (warns, naming the tensors), an integral float, the
    derived rotary_emb.inv_freq buffer, and a stored copy of a tied embedding; a tied lm_head
    that differs from the embedding is an unused tensor."""
    _, ref, _ = hf_loader.load_hf(FIX / "tiny_llama3", progress=False)
    d = hf_copy(tmp_path / "a", config=edit(num_hidden_layers=1))
    with pytest.warns(UserWarning, match=r"ignoring 9 tensor\(s\).*model\.layers\.1\."):
        cfg, params, _ = hf_loader.load_hf(d, progress=False, allow_unused=True)
    assert cfg.num_layers == 1 and params["layers"]["wq"].shape[0] == 1
    np.testing.assert_array_equal(params["layers"]["wq"][0], ref["layers"]["wq"][0])

    d = hf_copy(tmp_path / "b", config=edit(num_hidden_layers=2.0))
    assert hf_loader.load_hf(d, progress=False)[0].num_layers == 2

    inv = "model.layers.0.self_attn.rotary_emb.inv_freq"
    d = hf_copy(tmp_path / "c", tensors=with_tensor(inv, np.ones(8, np.float32)))
    np.testing.assert_array_equal(hf_loader.load_hf(d, progress=False)[1]["embed"], ref["embed"])

    tied = "tiny_llama_linear"
    copy = with_tensor("lm_head.weight", like="model.embed_tokens.weight")
    d = hf_copy(tmp_path / "d", tied, tensors=copy)
    cfg, params, _ = hf_loader.load_hf(d, progress=False)
    assert cfg.tie_embeddings and "lm_head" not in params
    other = with_tensor("lm_head.weight", np.zeros((128, 64), np.float32))
    d = hf_copy(tmp_path / "e", tied, tensors=other)
    with pytest.raises(hf_loader.CheckpointError, match=r"not used .*: lm_head\.weight"):
        hf_loader.load_hf(d, progress=False)


# -- GGUF ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_params():
    return llama.init_params(TINY, jax.random.key(0))


@pytest.fixture(scope="module")
def tiny_gguf_file(tmp_path_factory, tiny_params):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, tiny_params)
    return path


def damaged_block(src: Path, dst: Path, tensor: str) -> None:
    """Copy of `src` whose first Q8_0 block of `tensor` has a NaN scale (fp16 0x7E00): the 32
    values of that block decode to NaN, as a flipped bit in a downloaded file would do."""
    data = bytearray(src.read_bytes())
    t = next(t for t in gguf.GGUFReader(str(src)).tensors if t.name == tensor)
    assert t.tensor_type.name == "Q8_0"
    off = int(t.data_offset)
    data[off : off + 2] = np.float16(np.nan).tobytes()
    dst.write_bytes(bytes(data))


def _gguf_with(tmp_path, tiny_params, monkeypatch, method, replacement):
    """A tiny GGUF written with GGUFWriter.`method` replaced (metadata edits)."""
    path = tmp_path / "edited.gguf"
    with monkeypatch.context() as m:
        orig = getattr(gguf.GGUFWriter, method)
        m.setattr(gguf.GGUFWriter, method, lambda self, *a: replacement(orig, self, *a))
        write_tiny_gguf(path, tiny_params)
    return path


GGUF_CASES = [
    # id, GGUFWriter method, replacement, needles
    ("fewer-blocks", "add_block_count", lambda orig, w, n: orig(w, 1),
     ["llama.block_count=1", "9 tensor(s)", "blk.1.attn_norm.weight", "allow_unused=True"]),
    ("more-blocks", "add_block_count", lambda orig, w, n: orig(w, 3),
     ["missing", "blk.2.attn_norm.weight"]),
    ("no-head-count", "add_head_count", lambda orig, w, n: None,
     ["llama.attention.head_count is missing"]),
    ("zero-heads", "add_head_count", lambda orig, w, n: orig(w, 0),
     ["llama.attention.head_count", "positive integer", "got 0"]),
    ("kv-heads-not-dividing", "add_head_count_kv", lambda orig, w, n: orig(w, 3),
     ["GGUF metadata", "num_kv_heads=3"]),
    ("no-merges", "add_token_merges", lambda orig, w, m: None,
     ["tokenizer.ggml.merges is missing"]),
    ("nan-eps", "add_layer_norm_rms_eps", lambda orig, w, x: orig(w, float("nan")),
     ["llama.attention.layer_norm_rms_epsilon", "nan"]),
]  # fmt: skip


@pytest.mark.parametrize(
    "method,replacement,needles", [c[1:] for c in GGUF_CASES], ids=[c[0] for c in GGUF_CASES]
)
def test_gguf_bad_metadata(tmp_path, tiny_params, monkeypatch, method, replacement, needles):
    path = _gguf_with(tmp_path, tiny_params, monkeypatch, method, replacement)
    with pytest.raises(gguf_loader.GGUFError) as e:
        gguf_loader.load_gguf(path, progress=False)
    assert type(e.value) is gguf_loader.GGUFError
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_gguf_damaged_data_block_is_an_error(tmp_path, tiny_gguf_file, tiny_params, monkeypatch):
    bad = tmp_path / "nan.gguf"
    damaged_block(tiny_gguf_file, bad, "blk.1.ffn_gate.weight")
    with pytest.raises(gguf_loader.GGUFError) as e:
        gguf_loader.load_gguf(bad, progress=False)
    msg = str(e.value)
    assert "blk.1.ffn_gate.weight" in msg and "32 non-finite value(s) (32 NaN, 0 inf)" in msg
    # allow_unused loads a file with extra blocks and says which it ignored
    extra = _gguf_with(
        tmp_path, tiny_params, monkeypatch, "add_block_count", lambda orig, w, n: orig(w, 1)
    )
    with pytest.warns(UserWarning, match=r"ignoring 9 tensor\(s\).*blk\.1\."):
        cfg, params, _ = gguf_loader.load_gguf(extra, progress=False, allow_unused=True)
    assert cfg.num_layers == 1 and params["layers"]["wq"].shape[0] == 1


# -- the converted-parameter cache -----------------------------------------------------------


def _flip_middle(f: Path, n: int = 4096) -> None:
    b = bytearray(f.read_bytes())
    m = max(0, len(b) // 2 - n // 2)
    b[m : m + n] = bytes(x ^ 0xFF for x in b[m : m + n])
    f.write_bytes(bytes(b))


def _largest_data_file(directory: Path) -> Path:
    files = [f for f in (directory / "params").rglob("*") if f.is_file() and f.parent.name == "d"]
    return max(files, key=lambda f: f.stat().st_size)


@pytest.fixture
def counted_hf(monkeypatch):
    calls = []
    real = hf_loader.load_hf
    monkeypatch.setattr(hf_loader, "load_hf", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_byte_flipped_cache_is_rebuilt(tmp_path, counted_hf, capsys):
    """4 KiB flipped in the middle of the largest data file: the restore sees a checksum
    mismatch (or an unreadable chunk), says so on stderr and converts again."""
    src = hf_copy(tmp_path)
    cache = tmp_path / "cache"
    _, p1, _ = loader.load_model(str(src), progress=False, cache_dir=cache)
    _flip_middle(_largest_data_file(cache / "ck-float32"))
    capsys.readouterr()
    _, p2, _ = loader.load_model(str(src), progress=False, cache_dir=cache)
    out = capsys.readouterr()
    assert counted_hf == [1, 1], "a damaged cache must be converted again"
    assert out.out == "" and str(cache / "ck-float32") in out.err
    assert "fails its checksum" in out.err or "unreadable" in out.err, out.err
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    loader.load_model(str(src), progress=False, cache_dir=cache)
    assert counted_hf == [1, 1], "the rebuilt cache is used again"


def test_cache_checksum_catches_decodable_corruption(tmp_path, counted_hf, capsys):
    """Arrays that orbax restores without complaint but that differ from the converted ones
    (here: rewritten with one value changed, meta.json kept) fail the checksum."""
    import orbax.checkpoint as ocp

    src = hf_copy(tmp_path)
    cache = tmp_path / "cache"
    _, p1, _ = loader.load_model(str(src), progress=False, cache_dir=cache)
    wrong = jax.tree.map(np.asarray, p1)
    wrong["layers"]["wq"] = wrong["layers"]["wq"].copy()
    wrong["layers"]["wq"][1, 3, 5] += 1.0
    shutil.rmtree(cache / "ck-float32" / "params")
    with ocp.StandardCheckpointer() as ck:
        ck.save((cache / "ck-float32" / "params").resolve(), wrong)
    capsys.readouterr()
    _, p2, _ = loader.load_model(str(src), progress=False, cache_dir=cache)
    err = capsys.readouterr().err
    assert "fails its checksum (['layers']['wq'])" in err, err
    assert counted_hf == [1, 1]
    np.testing.assert_array_equal(np.asarray(p2["layers"]["wq"]), np.asarray(p1["layers"]["wq"]))


def test_allow_unused_is_part_of_the_cache_key(tmp_path):
    """A cache converted with allow_unused=True does not let a strict load skip the check."""
    src = hf_copy(tmp_path, config=edit(num_hidden_layers=1))
    cache = tmp_path / "cache"
    with pytest.warns(UserWarning, match="ignoring 9 tensor"):
        loader.load_model(str(src), progress=False, cache_dir=cache, allow_unused=True)
    with pytest.raises(hf_loader.CheckpointError, match="not used"):
        loader.load_model(str(src), progress=False, cache_dir=cache)


# -- CLI: flags rejected before any model loads ----------------------------------------------

needs_no_pallas = pytest.mark.skipif(pallas_available(), reason="pallas runs on this machine")

CLI_FLAG_CASES = [
    # command args, needles on stderr
    (["generate", "-p", "hi", "--temperature", "-1"], ["--temperature", "-1.0"]),
    (["generate", "-p", "hi", "--temperature", "nan"], ["--temperature", "nan"]),
    (["generate", "-p", "hi", "--temperature", "inf"], ["--temperature", "inf"]),
    (["generate", "-p", "hi", "--top-p", "2"], ["--top-p", "2.0"]),
    (["generate", "-p", "hi", "--top-p", "0"], ["--top-p", "0.0"]),
    (["generate", "-p", "hi", "--top-k", "-5"], ["--top-k", "-5"]),
    (["generate", "-p", "hi", "--greedy", "--temperature", "0.7"], ["--greedy", "--temperature"]),
    (["generate", "-p", "hi", "--group-size", "7"], ["--group-size 7", "group_size"]),
    (["generate", "-p", "hi", "--residual-length", "48"], ["--residual-length 48", "residual"]),
    (["generate", "-p", "hi", "--cache", "fp16", "--group-size", "7"], ["--group-size 7"]),
    (["generate", "-p", "hi", "--cache", "kivi3"], ["--cache", "'kivi3'"]),
    (["generate", "-p", "hi", "--mesh", "seq=0"], ["--mesh 'seq=0'", "positive sizes"]),
    (["generate", "-p", "hi", "--mesh", "model=2,seq=2"], ["--mesh", "data, seq"]),
    (["generate", "-p", "hi", "--mesh", "data=2"], ["--mesh 'data=2'", "seq axis"]),
    (["generate", "-p", "hi", "--mesh", "seq=2", "--cache", "fp16"], ["--mesh", "KIVI"]),
    (["generate", "-p", "hi", "--mesh", "seq=2", "--stream"], ["--mesh", "--stream"]),
    (["generate", "-p", "hi", "--prefill-chunk", "0"], ["--prefill-chunk must be >= 1"]),
    (["generate", "-p", "hi", "--layer-override", "3-1 key_bits=4"], ["--layer-override",
     "'3-1 key_bits=4'"]),
    (["generate", "-p", "hi", "--layer-override", "3 colour=4"], ["--layer-override", "colour"]),
    (["generate", "-p", "hi", "--cache", "fp16", "--layer-override", "3 key_bits=4"],
     ["--layer-override", "quantized"]),
    (["generate", "-p", "hi", "--prefill-chunk", "8", "--stream"], ["--prefill-chunk", "--stream"]),
    (["eval", "ppl", "--mesh", "seq=2", "--protocol", "simulated"], ["--mesh", "streaming"]),
    (["eval", "ppl", "--mesh", "seq=2", "--cache", "fp16"], ["--mesh", "KIVI"]),
    (["eval", "ppl", "--mesh", "data=2"], ["--mesh 'data=2'", "seq axis"]),
    pytest.param(["generate", "-p", "hi", "--implementation", "pallas"],
                 ["--implementation pallas", "Hopper"], marks=needs_no_pallas),
    (["generate", "-p", "hi", "--implementation", "fast"], ["--implementation", "'fast'"]),
    (["generate", "-p", "hi", "--dtype", "float16"], ["--dtype", "'float16'"]),
    (["generate", "-p", "hi", "--max-new-tokens", "0"], ["--max-new-tokens", "got 0"]),
    (["generate"], ["--prompt", "--prompt-file"]),
    (["generate", "-p", "hi", "--prompt-file", "x.txt"], ["--prompt", "--prompt-file",
     "mutually exclusive"]),
    (["generate", "-p", "   "], ["--prompt", "empty"]),
    (["eval", "ppl", "--dtype", "float16"], ["--dtype", "'float16'"]),
    (["eval", "ppl", "--group-size", "7"], ["--group-size 7"]),
    (["eval", "ppl", "--residual", "48"], ["--residual 48", "residual_length"]),
    pytest.param(["eval", "ppl", "--implementation", "pallas"], ["--implementation pallas"],
                 marks=needs_no_pallas),
    (["eval", "ppl", "--outlier-channels", "-1"], ["--outlier-channels -1", "non-negative"]),
    (["eval", "ppl", "--outlier-channels", "2", "--cache", "fp8"], ["--outlier-channels 2",
     "key_axis='channel'"]),
    (["eval", "passkey", "--cache", "fp16", "--outlier-channels", "2"], ["--outlier-channels",
     "quantized caches"]),
    (["generate", "-p", "hi", "--outlier-channels", "256"], ["--outlier-channels 256", "< 256"]),
    (["eval", "ppl", "--cache", "fp16", "--pre-rope"], ["--pre-rope", "quantized caches"]),
    (["eval", "ppl", "--prefill", "0"], ["--prefill", "got 0"]),
    (["eval", "ppl", "--windows", "-1"], ["--windows", "got -1"]),
    (["eval", "ppl", "--batch-size", "0"], ["--batch-size", "got 0"]),
    (["eval", "ppl", "--token-ids", "/nonexistent/ids.json"], ["--token-ids", "no such file"]),
    (["eval", "ppl", "--token-ids", "x.json", "--text-file", "t.txt"], ["--token-ids", "pick one"]),
    (["eval", "passkey", "--max-new-tokens", "0"], ["--max-new-tokens", "got 0"]),
    (["eval", "passkey", "--dtype", "float16"], ["--dtype", "'float16'"]),
    (["eval", "passkey", "--trials", "0"], ["--trials", "got 0"]),
    (["eval", "passkey", "--batch-size", "0"], ["--batch-size", "got 0"]),
    (["eval", "passkey", "--lengths", "0"], ["--lengths", "got 0"]),
    (["eval", "passkey", "--lengths", "1024.5"], ["--lengths", "1024.5"]),
    (["eval", "passkey", "--depths", "1.5"], ["--depths", "1.5"]),
    (["eval", "passkey", "--depths", "nan"], ["--depths", "nan"]),
    (["eval", "passkey", "--cache", "fp16", "--group-size", "12"], ["--group-size 12"]),
    pytest.param(["eval", "passkey", "--implementation", "pallas-lowp"],
                 ["--implementation pallas-lowp"], marks=needs_no_pallas),
    (["eval", "report", "--windows", "0"], ["--windows", "got 0"]),
    (["eval", "report", "--only", "pasky:"], ["--only 'pasky:'", "no task id starts with it"]),
    (["eval", "report", "--only", "sim:", "--write-only"], ["--only", "--write-only runs none"]),
    (["memory", "--model", "smollm2", "--params", "-7e9"], ["--params", "-7000000000.0"]),
    (["memory", "--model", "smollm2", "--params", "nan"], ["--params", "nan"]),
    (["memory", "--model", "smollm2", "--params", "inf"], ["--params", "inf"]),
    (["memory", "--model", "smollm2", "--params", "0"], ["--params", "0.0"]),
    (["memory", "--model", "smollm2", "--layers", "-1"], ["--layers", "got -1"]),
    (["memory", "--model", "smollm2", "--kv-heads", "0"], ["--kv-heads", "got 0"]),
    (["memory", "--model", "smollm2", "--head-dim", "0"], ["--head-dim", "got 0"]),
    (["memory", "--model", "smollm2", "--dtype-bytes", "0"], ["--dtype-bytes", "got 0"]),
    (["memory", "--model", "smollm2", "--group-size", "7"], ["--group-size 7"]),
    (["memory", "--model", "smollm2", "--residual", "48"], ["--residual 48"]),
    (["memory", "--model", "smollm2", "--gpu-memory", "-5GB"], ["--gpu-memory", "'-5GB'"]),
    (["memory", "--model", "smollm2", "--weights", "int3"], ["--weights", "'int3'"]),
    (["memory", "--model", "smollm2", "--cache", "kivi3"], ["--cache", "'kivi3'"]),
    (["memory", "--model", "smollm2", "--tokens", "0"], ["--tokens", "got 0"]),
    # what the parser finds itself: the same one `error:` line, with the command's help hint
    (["generate", "-p", "hi", "--temperature", "abc"], ["'--temperature'", "number",
     "generate --help"]),
    (["generate", "-p", "hi", "--max-new-tokens", "1.5"], ["'--max-new-tokens'", "integer"]),
    (["memory", "--bogus"], ["No such option: --bogus", "memory --help"]),
    (["eval", "ppl", "--bogus"], ["No such option: --bogus", "eval ppl --help"]),
    (["generate", "-p"], ["-p", "requires an argument"]),
    (["nosuch"], ["No such command 'nosuch'", " --help'"]),
    (["eval", "nosuch"], ["No such command 'nosuch'", "eval --help"]),
]  # fmt: skip


@pytest.mark.parametrize(
    "content,needles",
    [
        ("[1, 2,", ["not JSON", "line 1"]),
        ('{"ids": [1]}', ["non-empty JSON list", "dict"]),
        ("[]", ["non-empty JSON list", "an empty list"]),
        ("[5, -1, 3]", ["entry 1 is -1", "non-negative integer"]),
        ("[5, 2.5]", ["entry 1 is 2.5"]),
        ("[5, true]", ["entry 1 is True"]),
    ],
)
def test_damaged_token_ids_files_fail_before_loading_a_model(
    content, needles, tmp_path, monkeypatch
):
    monkeypatch.setenv("KIVI_JAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    f = tmp_path / "ids.json"
    f.write_text(content)
    assert_cli_error(cli(["eval", "ppl", "--token-ids", str(f)]), "--token-ids", *needles)


@pytest.mark.parametrize("args,needles", CLI_FLAG_CASES, ids=lambda v: " ".join(v)[:60])
def test_cli_rejects_bad_flags(args, needles, tmp_path, monkeypatch):
    """Each bad flag: status 2 before any model is loaded (so no model is needed)."""
    monkeypatch.setenv("KIVI_JAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    assert_cli_error(cli(args), *needles)


@pytest.mark.parametrize(
    "make,needles",
    [
        (lambda d: str(d / "absent.txt"), ["--prompt-file", "absent.txt", "no such file"]),
        (lambda d: str(d), ["--prompt-file", "cannot read it"]),
        (lambda d: (d / "bin.txt").write_bytes(b"ok \xff\xfe") and str(d / "bin.txt"),
         ["--prompt-file", "bin.txt", "not UTF-8", "byte 3"]),
        (lambda d: (d / "blank.txt").write_text("\n\n") and str(d / "blank.txt"),
         ["--prompt-file", "blank.txt", "empty"]),
    ],
    ids=["missing", "directory", "not-utf8", "empty"],
)  # fmt: skip
def test_cli_bad_prompt_file(tmp_path, monkeypatch, make, needles):
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    assert_cli_error(cli(["generate", "--prompt-file", make(tmp_path)]), *needles)


def test_cli_empty_stdin_prompt(monkeypatch):
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    assert_cli_error(cli(["generate", "--prompt-file", "-"], input=""), "--prompt-file -", "empty")


@pytest.mark.parametrize(
    "args,error",
    [
        (["generate", "-p", "hi", "--top-k", "-5"], "error: --top-k must be >= 0 (0: off), got -5"),
        (["memory", "--bogus"], "error: No such option: --bogus (see 'kivi-jax memory --help')"),
    ],
    ids=["a command's check", "the parser's"],
)
def test_console_script_prints_no_traceback(args, error):
    """The installed entry point (not CliRunner): a bad flag is one line on stderr, status 2."""
    exe = Path(sys.executable).with_name("kivi-jax")
    res = subprocess.run(
        [str(exe), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KIVI_JAX_CACHE_DIR": "/nonexistent-kivi-jax-cache"},
    )
    assert res.returncode == 2, res.stderr
    assert res.stdout == "" and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == [error]


def test_bare_command_prints_the_help():
    res = cli([])
    assert res.exit_code == 2 and "generate" in res.output and "error:" not in res.output


# -- CLI: bad models and the tiny GGUF end to end --------------------------------------------

TINY_ARGS = ["--cache", "fp16", "--max-new-tokens", "4", "--json"]


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("KIVI_JAX_CACHE_DIR", str(tmp_path / "kivi-cache"))
    return tmp_path / "kivi-cache"


def _json_out(res) -> dict:
    assert res.exit_code == 0, (res.output, res.exception)
    return json.loads(res.stdout)  # the whole of stdout: one JSON object, nothing else


def add_word_tokenizer(d: Path, words: int) -> Path:
    """A whitespace word-level tokenizer.json with ids 0..words-1 ("w0", "w1", ...; id 0 is
    [UNK]) and no chat template, so that the tiny HF fixtures take a text prompt."""
    import tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    return d


def test_cli_prompt_the_vocabulary_cannot_encode(tiny_gguf_file, cache_env, monkeypatch):
    """Tokenizer.encode's refusal (a byte with no token: tests/test_tokenizer_parity.py) is
    a user's error like any other: one line, status 2."""

    def refuse(self, text, add_bos=None):
        raise ValueError("text[2] = '\\x1d' (U+001D) cannot be tokenized")

    monkeypatch.setattr(tokenizer.Tokenizer, "encode", refuse)
    res = cli(["generate", "-p", "hi\x1d", "--model", str(tiny_gguf_file), *TINY_ARGS])
    assert_cli_error(res, "U+001D", "cannot be tokenized")


def test_cli_bad_models(tmp_path, tiny_gguf_file, cache_env):
    nan = tmp_path / "nan.gguf"
    damaged_block(tiny_gguf_file, nan, "blk.0.ffn_gate.weight")
    res = cli(["generate", "-p", "hi", "--model", str(nan), *TINY_ARGS])
    assert_cli_error(res, "blk.0.ffn_gate.weight", "32 non-finite")

    fewer = hf_copy(tmp_path / "a", config=edit(num_hidden_layers=1))
    # checked before converting: the commands take text
    assert_cli_error(cli(["generate", "-p", "hi", "--model", str(fewer)]), "no tokenizer.json")
    add_word_tokenizer(fewer, 100)
    for args in (["generate", "-p", "hi"], ["eval", "ppl"], ["eval", "passkey"]):
        res = cli([*args, "--model", str(fewer)])
        assert_cli_error(res, "num_hidden_layers=1", "--allow-unused-weights")
    # allowed: one warning line naming what is ignored, then a normal run
    raw = ["generate", "--model", str(fewer), "--no-chat-template", *TINY_ARGS]
    res = cli([*raw, "-p", "w5 w7 w9", "--allow-unused-weights"])
    out = _json_out(res)
    assert res.stderr.startswith("kivi-jax: warning: ") and "ignoring 9 tensor(s)" in res.stderr
    assert out["prompt_tokens"] == 3 and len(out["generated_tokens"]) == 4
    # no chat template: a clean error, as for any other model without one
    res = cli(["generate", "--model", str(fewer), "-p", "w5", "--allow-unused-weights"])
    assert_cli_error(res, "no chat template", "--no-chat-template")
    # a tokenizer larger than the embedding (128 rows): a prompt id past it is refused
    big = add_word_tokenizer(hf_copy(tmp_path / "big"), 200)
    assert_cli_error(cli([*raw, "--model", str(big), "-p", "w5 w150"]), "token id 150", "128")

    typo = add_word_tokenizer(hf_copy(tmp_path / "b", config=edit(num_hidden_layers="two")), 9)
    for args in (["generate", "-p", "hi"], ["eval", "ppl"], ["eval", "passkey"]):
        assert_cli_error(cli([*args, "--model", str(typo)]), "config.json", "num_hidden_layers")
    bad_json = add_word_tokenizer(hf_copy(tmp_path / "c", raw_config="{"), 9)
    assert_cli_error(cli(["generate", "-p", "hi", "--model", str(bad_json)]), "config.json")


def test_damaged_cache_keeps_stdout_one_json_object(tiny_gguf_file, cache_env):
    """meta.json overwritten with "x": the notice goes to stderr, stdout stays one JSON object,
    and the answer is the same as from the intact cache."""
    args = ["generate", "-p", "hi", "--model", str(tiny_gguf_file), *TINY_ARGS]
    first = _json_out(cli(args))
    (meta,) = cache_env.glob("*/meta.json")
    meta.write_text("x\n")
    res = cli(args)
    again = _json_out(res)
    assert "ignoring unreadable parameter cache" in res.stderr and str(meta.parent) in res.stderr
    assert again["generated_tokens"] == first["generated_tokens"]
    # the byte-flipped cache too: stdout is still only the JSON object
    _flip_middle(_largest_data_file(meta.parent))
    res = cli(args)
    assert _json_out(res)["generated_tokens"] == first["generated_tokens"]
    assert str(meta.parent) in res.stderr


def test_temperature_zero_is_greedy_and_prompt_file_equals_prompt(
    tmp_path, tiny_gguf_file, cache_env
):
    """Accepted edges: --temperature 0 decodes as --greedy (top-p / top-k then have no effect);
    --prompt-file FILE and - (stdin) equal --prompt with the file's trailing newlines dropped."""
    base = ["generate", "--model", str(tiny_gguf_file), *TINY_ARGS, "--max-new-tokens", "8"]
    greedy = _json_out(cli([*base, "-p", "the t", "--greedy"]))
    zero = _json_out(cli([*base, "-p", "the t", "--temperature", "0", "--top-k", "3"]))
    assert zero["generated_tokens"] == greedy["generated_tokens"]
    sampled = [
        _json_out(cli([*base, "-p", "the t", "--temperature", "5", "--seed", str(s)]))
        for s in range(4)
    ]
    assert any(s["generated_tokens"] != greedy["generated_tokens"] for s in sampled)

    f = tmp_path / "prompt.txt"
    f.write_text("the t\n\n")
    from_file = _json_out(cli([*base, "--prompt-file", str(f), "--greedy"]))
    from_stdin = _json_out(cli([*base, "--prompt-file", "-", "--greedy"], input="the t\n"))
    for out in (from_file, from_stdin):
        assert out["prompt"] == "the t"
        assert out["generated_tokens"] == greedy["generated_tokens"]
        assert out["prompt_tokens"] == greedy["prompt_tokens"]


def test_sampling_rejects_non_finite_temperature():
    from models.generate import Sampling

    for t in (math.inf, math.nan, 0.0, -1.0):
        with pytest.raises(ValueError, match="temperature"):
            Sampling(temperature=t)

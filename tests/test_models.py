"""The Llama family on tiny random configs: presets, RoPE, prefill/decode consistency over dense and
KIVI caches, padding, kv_transform, the NNX module, sampling and the generation loop."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kivi_jax
from models import generate as G
from models import llama
from models.presets import PRESETS, ModelConfig, RopeScaling, get_preset

TINY = ModelConfig(
    name="tiny",
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rope_theta=10000.0,
    qkv_bias=True,
    tie_embeddings=False,
    max_position_embeddings=512,
)
TINY_TIED = dataclasses.replace(
    TINY, name="tiny-tied", qkv_bias=False, tie_embeddings=True, num_kv_heads=1
)


# Jitted once per module (eager execution of the layer scan and cache updates is slow).
prefill = jax.jit(llama.prefill, static_argnames=("config", "all_logits", "kv_transform"))
decode_step = jax.jit(llama.decode_step, static_argnames=("config", "implementation"))


@pytest.fixture(scope="module")
def tiny_params():
    return llama.init_params(TINY, jax.random.key(0))


# -- presets ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, billions",
    [
        ("smollm2-135m", 0.1345),
        ("llama-2-7b", 6.738),
        ("llama-3-8b", 8.030),
        ("llama-3-70b", 70.554),
        ("mistral-7b", 7.242),
        ("qwen2.5-7b", 7.616),
    ],
)
def test_preset_parameter_counts(name, billions):
    c = get_preset(name)
    assert abs(c.num_params() / 1e9 - billions) / billions < 1e-3
    shapes = llama.param_shapes(c)
    total = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))
    assert total == c.num_params()


def test_preset_names_and_errors():
    assert get_preset("smollm2") is PRESETS["smollm2-135m"]
    assert get_preset("Llama-3.1-8B") is PRESETS["llama-3-8b"]
    with pytest.raises(ValueError, match="llama-3-8b"):
        get_preset("gpt-5")
    with pytest.raises(ValueError, match="num_kv_heads"):
        dataclasses.replace(TINY, num_kv_heads=3)
    with pytest.raises(ValueError, match="rope scaling kind"):
        RopeScaling("yarn", 2.0)
    hash(get_preset("llama-3-70b"))  # static jit argument


# -- RoPE ------------------------------------------------------------------------------------


def test_rope_is_relative_and_norm_preserving():
    cfg = dataclasses.replace(
        TINY, rope_scaling=RopeScaling("llama3", 8.0, original_max_position_embeddings=64)
    )
    q = jax.random.normal(jax.random.key(1), (1, 1, 32))
    k = jax.random.normal(jax.random.key(2), (1, 1, 32))
    dots = []
    for m, n in [(5, 2), (40, 37), (300, 297)]:
        qm = llama.apply_rope(q, jnp.array([m]), cfg)
        kn = llama.apply_rope(k, jnp.array([n]), cfg)
        dots.append(float(jnp.sum(qm * kn)))
        np.testing.assert_allclose(jnp.linalg.norm(qm), jnp.linalg.norm(q), rtol=1e-5)
    np.testing.assert_allclose(dots, dots[0], rtol=1e-4)


def test_rope_scaling_frequencies():
    base = llama.rope_frequencies(TINY)
    lin = llama.rope_frequencies(dataclasses.replace(TINY, rope_scaling=RopeScaling("linear", 4.0)))
    np.testing.assert_allclose(lin, base / 4)
    sc = RopeScaling("llama3", 8.0, 1.0, 4.0, original_max_position_embeddings=1024)
    l3 = llama.rope_frequencies(dataclasses.replace(TINY, rope_scaling=sc))
    wl = 2 * np.pi / base
    np.testing.assert_allclose(l3[wl < 1024 / 4], base[wl < 1024 / 4])  # high frequencies kept
    np.testing.assert_allclose(l3[wl > 1024], base[wl > 1024] / 8)  # low frequencies slowed
    mid = (wl >= 1024 / 4) & (wl <= 1024)
    assert mid.any() and np.all(l3[mid] <= base[mid]) and np.all(l3[mid] >= base[mid] / 8)


# -- prefill / decode ------------------------------------------------------------------------


def _cache(name, cfg, batch, max_len, **kw):
    return kivi_jax.make_cache(
        name,
        num_layers=cfg.num_layers,
        batch=batch,
        kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_len=max_len,
        dtype=jnp.float32,
        **kw,
    )


@pytest.mark.parametrize(
    "cfg, cache_name",
    [(TINY, "fp16"), (TINY, "kivi2"), (TINY_TIED, "kivi4")],
    ids=["tiny-fp16", "tiny-kivi2", "tied-kivi4"],
)
def test_decode_matches_full_forward(cfg, cache_name):
    """Prefill a prefix, then decode token by token: the logits equal one causal forward pass
    (for KIVI with a residual window longer than the sequence, nothing is quantized)."""
    params = llama.init_params(cfg, jax.random.key(3))
    B, S, P = 2, 12, 5
    toks = jax.random.randint(jax.random.key(4), (B, S), 0, cfg.vocab_size)
    full, _ = prefill(params, cfg, toks, jnp.full((B,), S), None, all_logits=True)
    cache = _cache(cache_name, cfg, B, 32, residual_length=64)
    lg, cache = prefill(params, cfg, toks[:, :P], jnp.full((B,), P), cache)
    np.testing.assert_allclose(lg, full[:, P - 1], atol=2e-5, rtol=1e-5)
    for t in range(P, S):
        lg, cache = decode_step(params, cfg, toks[:, t], cache)
        np.testing.assert_allclose(lg, full[:, t], atol=2e-5, rtol=1e-5)
    assert np.all(np.asarray(cache.lengths) == S)


@pytest.mark.parametrize("name, group, residual", [("kivi2", 32, 32), ("k4v2", 16, 0)])
def test_kivi_short_window_quantizes(tiny_params, name, group, residual):
    """With a short window and 72 tokens, decode runs through quantized K/V: near, not equal
    to, the dense logits (so the comparison above is not vacuous). Other bits/G/R too."""
    cfg, B, S, P = TINY, 1, 72, 68
    toks = jax.random.randint(jax.random.key(5), (B, S), 0, cfg.vocab_size)
    full, _ = prefill(tiny_params, cfg, toks, jnp.full((B,), S), None, all_logits=True)
    cache = _cache(name, cfg, B, 96, group_size=group, residual_length=residual)
    _, cache = prefill(tiny_params, cfg, toks[:, :P], jnp.full((B,), P), cache)
    for t in range(P, S):
        lg, cache = decode_step(tiny_params, cfg, toks[:, t], cache)
    err = np.abs(np.asarray(lg) - np.asarray(full[:, -1])).max()
    assert 1e-3 < err < 0.5 * np.abs(np.asarray(full[:, -1])).max()


def test_padding_never_leaks(tiny_params):
    cfg = TINY
    a = [5, 9, 2, 44, 17, 3, 60]
    b = [8, 1, 30]
    toks = np.zeros((2, 16), np.int32)
    toks[0, :7], toks[1, :3] = a, b
    lengths = jnp.array([7, 3])
    lg, cache = prefill(tiny_params, cfg, jnp.asarray(toks), lengths, _cache("fp16", cfg, 2, 32))
    toks2 = toks.copy()
    toks2[1, 3:] = 77  # different padding
    lg2, _ = prefill(tiny_params, cfg, jnp.asarray(toks2), lengths, None)
    alone, _ = prefill(tiny_params, cfg, jnp.asarray([b]), jnp.array([3]), None)
    np.testing.assert_allclose(lg[1], alone[0], atol=1e-5)
    np.testing.assert_array_equal(lg2, lg)
    assert float(jnp.abs(cache.k[:, 1, :, 3:]).max()) == 0.0  # nothing past the length
    nxt, cache = decode_step(tiny_params, cfg, jnp.array([1, 2]), cache)
    _, c1 = prefill(tiny_params, cfg, jnp.asarray([b]), jnp.array([3]), _cache("fp16", cfg, 1, 32))
    ref, _ = decode_step(tiny_params, cfg, jnp.array([2]), c1)
    np.testing.assert_allclose(nxt[1], ref[0], atol=1e-5)


def test_kv_transform(tiny_params):
    cfg, B, S = TINY, 2, 8
    toks = jax.random.randint(jax.random.key(6), (B, S), 0, cfg.vocab_size)
    L = jnp.full((B,), S)
    seen = []

    def ident(k, v):
        seen.append(k.shape)
        return k, v

    base, c0 = prefill(tiny_params, cfg, toks, L, _cache("fp16", cfg, B, 16), all_logits=True)
    same, _ = prefill(tiny_params, cfg, toks, L, None, all_logits=True, kv_transform=ident)
    np.testing.assert_allclose(same, base, atol=1e-6)
    assert seen[0] == (B, cfg.num_kv_heads, S, cfg.head_dim)
    noisy = lambda k, v: (k, v * 0.5)
    diff, c1 = prefill(
        tiny_params, cfg, toks, L, _cache("fp16", cfg, B, 16), all_logits=True, kv_transform=noisy
    )
    assert float(jnp.abs(diff - base).max()) > 1e-3
    # the cache gets the untransformed K/V (layer 0: later layers see the transformed output)
    np.testing.assert_array_equal(c1.v[0], c0.v[0])


def test_nnx_module_wraps_params(tiny_params):
    from flax import nnx

    m = llama.Llama(TINY, rngs=nnx.Rngs(0))
    assert jax.tree.structure(m.params()) == jax.tree.structure(tiny_params)
    m2 = llama.Llama.from_params(TINY, tiny_params)
    toks = jnp.array([[3, 4, 5]])
    a, _ = m2(toks, jnp.array([3]))
    b, _ = prefill(tiny_params, TINY, toks, jnp.array([3]), None)
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="wq"):
        llama.check_params(
            {**tiny_params, "layers": {**tiny_params["layers"], "wq": jnp.zeros((2, 3))}}, TINY
        )


# -- per-layer weights (the decode layout on GPUs) -------------------------------------------


def test_unstack_layers_round_trip_and_checks(tiny_params):
    un = llama.unstack_layers(tiny_params)
    assert llama.is_unstacked(un) and not llama.is_unstacked(tiny_params)
    assert len(un["layers"]) == TINY.num_layers
    np.testing.assert_array_equal(un["layers"][1]["wq"], tiny_params["layers"]["wq"][1])
    assert llama.unstack_layers(un) is un
    back = llama.stack_layers(un)
    assert jax.tree.structure(back) == jax.tree.structure(tiny_params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tiny_params), strict=True):
        np.testing.assert_array_equal(a, b)
    llama.check_params(un, TINY)
    with pytest.raises(ValueError, match="1 layers"):
        llama.check_params({**un, "layers": un["layers"][:1]}, TINY)
    bad = ({**un["layers"][0], "wq": jnp.zeros((2, 3))}, un["layers"][1])
    with pytest.raises(ValueError, match="wq"):
        llama.check_params({**un, "layers": bad}, TINY)


def test_fuse_projections_joins_the_matrices_of_one_input(tiny_params):
    fused = llama.fuse_projections(tiny_params)
    assert llama.is_unstacked(fused) and llama.fuse_projections(fused) is fused
    lp, c = fused["layers"][1], TINY
    q, kv, F = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    assert not {"wq", "wk", "wv", "bq", "bk", "bv", "w_gate", "w_up"} & set(lp)
    assert lp["wqkv"].shape == (c.hidden_size, q + 2 * kv) and lp["bqkv"].shape == (q + 2 * kv,)
    assert lp["w_gate_up"].shape == (c.hidden_size, 2 * F)
    st = tiny_params["layers"]
    np.testing.assert_array_equal(lp["wqkv"][:, q : q + kv], st["wk"][1])
    np.testing.assert_array_equal(lp["bqkv"][q + kv :], st["bv"][1])
    np.testing.assert_array_equal(lp["w_gate_up"][:, F:], st["w_up"][1])
    # from per-layer params the same arrays
    again = llama.fuse_projections(llama.unstack_layers(tiny_params))
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(fused), strict=True):
        np.testing.assert_array_equal(a, b)


def _norms_around_one(params):
    """params with every norm weight drawn from 1 + 0.3 N(0, 1): init_params' ones would make
    a wrong fold (rows scaled by the wrong norm, or not at all) invisible."""
    leaves, treedef = jax.tree.flatten_with_path(params)
    keys = iter(jax.random.split(jax.random.key(3), len(leaves)))
    out = [
        1 + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype)
        if "norm" in jax.tree_util.keystr(path)
        else x
        for path, x in leaves
    ]
    return jax.tree.unflatten(treedef, out)


def _stacked_and(other, stacked, cfg, cache_name):
    """((logits, cache), (logits, cache)) of the stacked params and of `other` (a layout of
    the same model; its cache one buffer or part per layer where cache_name ends in
    -per-layer): two rows prefilled with 30 and 23 tokens, then 10 decode steps through a
    short KIVI window (so quantized groups are read); logits [11, B, V]."""
    B, S, P = 2, 40, 30
    toks = jax.random.randint(jax.random.key(8), (B, S), 0, cfg.vocab_size)
    name = cache_name.removesuffix("-per-layer")
    kw = dict(group_size=16, residual_length=16) if name != "fp16" else {}
    outs = []
    for p in (stacked, other):
        pkw = dict(kw, per_layer=True) if p is other and cache_name.endswith("per-layer") else kw
        lg, c = prefill(p, cfg, toks[:, :P], jnp.array([P, P - 7]), _cache(name, cfg, B, 64, **pkw))
        steps = [lg]
        for t in range(P, S):
            lg, c = decode_step(p, cfg, toks[:, t], c)
            steps.append(lg)
        outs.append((jnp.stack(steps), c))
    return outs


def _fp8_parts_stacked(stacked, parts):
    """The stores of a stacked fp8 cache and of its per-layer twin as matching lists: layer i
    of the stacked stores is part i's."""
    n = len(parts.parts)
    a = [jax.tree.map(lambda x, i=i: x[i], (stacked.keys, stacked.values)) for i in range(n)]
    return a, [jax.tree.map(lambda x: x[0], (p.keys, p.values)) for p in parts.parts]


def test_fold_norms_scales_the_rows_each_norm_feeds(tiny_params):
    params = _norms_around_one(tiny_params)
    fused, folded = llama.fuse_projections(params), llama.fold_norms(params)
    assert (
        llama.decode_params(params)["layers"][1]["wqkv"].shape == fused["layers"][1]["wqkv"].shape
    )
    assert llama.fold_norms(folded) is folded and "final_norm" in folded
    st = params["layers"]
    for i, lp in enumerate(folded["layers"]):
        assert not {"attn_norm", "mlp_norm"} & set(lp) and lp["wqkv"].dtype == jnp.float32
        for name, norm in (("wqkv", "attn_norm"), ("w_gate_up", "mlp_norm")):
            want = st[norm][i][:, None] * fused["layers"][i][name]
            np.testing.assert_array_equal(lp[name], want)
        np.testing.assert_array_equal(lp["bqkv"], fused["layers"][i]["bqkv"])  # biases: as is
        np.testing.assert_array_equal(lp["w_down"], st["w_down"][i])


@pytest.mark.parametrize("cache_name", ["fp16", "kivi2", "fp8-per-layer"])
@pytest.mark.parametrize("config", [TINY, TINY_TIED], ids=lambda c: c.name)
def test_folded_norms_compute_the_same_model(cache_name, config):
    """The decode layout (norms folded into the fused GEMMs, `llama.decode_params`) against
    the stacked scan with the norms applied: prefill and decode logits, and the caches. The
    sums differ by float32 roundings, so a quantized code may land on the next step: that is
    allowed in under 0.1% of the codes, and nowhere else."""
    params = _norms_around_one(llama.init_params(config, jax.random.key(0)))
    (a, ca), (b, cb) = _stacked_and(llama.decode_params(params), params, config, cache_name)
    np.testing.assert_allclose(a, b, atol=2e-4, rtol=2e-4)
    assert float(jnp.abs(a).max()) > 0.1
    if cache_name == "fp8-per-layer":
        ca, cb = _fp8_parts_stacked(ca, cb)
    for x, y in zip(jax.tree.leaves(ca), jax.tree.leaves(cb), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if np.issubdtype(x.dtype, np.floating):  # values, scales, windows: float32 roundings
            np.testing.assert_allclose(x.astype(np.float32), y.astype(np.float32), atol=1e-4)
        else:  # codes, lengths: equal but for codes on the edge of a step
            assert np.mean(x != y) < 1e-3, (x.dtype, x.shape, np.mean(x != y))


@pytest.mark.parametrize("layout", ["per-layer", "fused"])
@pytest.mark.parametrize("cache_name", ["fp16", "fp16-per-layer", "kivi2", "fp8-per-layer"])
def test_unstacked_layers_compute_the_same_model(tiny_params, cache_name, layout):
    """The unrolled loop over per-layer weights (projections fused or not) is the same model
    as the scan: prefill logits and cache, then decode steps through a short KIVI window (so
    quantized groups are read). -per-layer: the unrolled loop over a cache with one buffer
    (dense) or one part (fp8) per layer."""
    split = llama.fuse_projections if layout == "fused" else llama.unstack_layers
    (a, ca), (b, cb) = _stacked_and(split(tiny_params), tiny_params, TINY, cache_name)
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    assert float(jnp.abs(a).max()) > 0.1
    if cache_name == "fp16-per-layer":  # compare in the stacked form
        assert cb.per_layer and not ca.per_layer
        ca, cb = (ca.k, ca.v, ca.lengths), (cb.k, cb.v, cb.lengths)
    elif cache_name == "fp8-per-layer":
        assert len(cb.parts) == TINY.num_layers
        ca, cb = _fp8_parts_stacked(ca, cb)
    for x, y in zip(jax.tree.leaves(ca), jax.tree.leaves(cb), strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), atol=1e-5)


def test_generate_takes_either_layout(tiny_params, monkeypatch):
    prompts = [[5, 9, 2, 44], [8, 1]]
    a = G.generate(tiny_params, TINY, prompts, cache="kivi2", max_new_tokens=6)
    b = G.generate(
        llama.unstack_layers(tiny_params), TINY, prompts, cache="kivi2", max_new_tokens=6
    )
    assert a.tokens == b.tokens
    dense = [
        G.generate(p, TINY, prompts, cache="fp16", max_new_tokens=6)
        for p in (tiny_params, llama.unstack_layers(tiny_params))  # stacked, then per layer
    ]
    assert dense[0].tokens == dense[1].tokens
    if jax.default_backend() != "gpu":
        assert G.decode_layout(tiny_params, TINY) is tiny_params  # CPUs: the stacked scan
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    gpu = G.decode_layout(tiny_params, TINY)  # per-layer, projections fused, norms folded
    assert llama.is_unstacked(gpu) and "wqkv" in gpu["layers"][0]
    assert "attn_norm" not in gpu["layers"][0]
    monkeypatch.undo()
    assert G.generate(gpu, TINY, prompts, cache="kivi2", max_new_tokens=6).tokens == a.tokens


# -- sampling --------------------------------------------------------------------------------


def test_sampling():
    logits = jax.random.normal(jax.random.key(7), (512, 50)) * 3
    top = jnp.argmax(logits, -1)
    np.testing.assert_array_equal(G.sample(logits, jax.random.key(0), G.GREEDY), top)
    k1 = G.sample(logits, jax.random.key(1), G.Sampling(top_k=1))
    np.testing.assert_array_equal(k1, top)
    p0 = G.sample(logits, jax.random.key(2), G.Sampling(top_p=1e-6))
    np.testing.assert_array_equal(p0, top)
    k3 = G.sample(logits, jax.random.key(3), G.Sampling(top_k=3))
    top3 = jax.lax.top_k(logits, 3)[1]
    assert bool(jnp.all(jnp.any(top3 == k3[:, None], axis=1)))
    # top-p keeps the smallest set of most likely tokens whose mass reaches p
    two = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 4000))
    s = np.asarray(G.sample(two, jax.random.key(4), G.Sampling(top_p=0.7)))
    assert set(np.unique(s)) == {0, 1}
    np.testing.assert_allclose(np.mean(s == 0), 0.5 / 0.8, atol=0.03)
    hot = np.asarray(G.sample(two, jax.random.key(5), G.Sampling(temperature=1e-3)))
    assert np.all(hot == 0)
    with pytest.raises(ValueError, match="top_p"):
        G.Sampling(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        G.Sampling(temperature=0.0)


# -- the generation loop ---------------------------------------------------------------------


def test_bucket():
    assert [G.bucket(n) for n in (1, 16, 17, 33, 100)] == [16, 16, 32, 64, 128]


def test_generate_batch_equals_single_and_stream(tiny_params):
    cfg = TINY
    prompts = [[5, 9, 2, 44, 17, 3, 60], [8, 1, 30]]
    out = G.generate(
        tiny_params, cfg, prompts, cache="kivi2", max_new_tokens=10, residual_length=32
    )
    assert [len(t) for t in out.tokens] == [10, 10]
    for p, toks in zip(prompts, out.tokens, strict=True):
        single = G.generate(
            tiny_params, cfg, [p], cache="kivi2", max_new_tokens=10, residual_length=32
        )
        assert single.tokens[0] == toks
        streamed = list(
            G.stream(tiny_params, cfg, p, cache="kivi2", max_new_tokens=10, residual_length=32)
        )
        assert streamed == toks


def test_generate_stops_and_samples(tiny_params):
    cfg = TINY
    prompts = [[5, 9, 2], [8, 1, 30, 4]]
    free = G.generate(tiny_params, cfg, prompts, max_new_tokens=12)
    stop = free.tokens[0][3]
    out = G.generate(tiny_params, cfg, prompts, max_new_tokens=12, stop_ids=[stop])
    cut = free.tokens[0].index(stop) + 1
    assert out.tokens[0] == free.tokens[0][:cut] and out.stopped[0]
    s1 = G.generate(
        tiny_params,
        cfg,
        prompts,
        max_new_tokens=12,
        sampling=G.Sampling(temperature=1.5, top_p=0.95),
        seed=1,
    )
    s2 = G.generate(
        tiny_params,
        cfg,
        prompts,
        max_new_tokens=12,
        sampling=G.Sampling(temperature=1.5, top_p=0.95),
        seed=1,
    )
    s3 = G.generate(
        tiny_params,
        cfg,
        prompts,
        max_new_tokens=12,
        sampling=G.Sampling(temperature=1.5, top_p=0.95),
        seed=2,
    )
    assert s1.tokens == s2.tokens and s1.tokens != s3.tokens
    with pytest.raises(ValueError, match="max_position_embeddings"):
        G.generate(tiny_params, cfg, [[1] * 500], max_new_tokens=20)


def test_second_prompt_in_bucket_compiles_nothing(tiny_params):
    cfg = dataclasses.replace(TINY, name="tiny-compile-count")
    G.generate(tiny_params, cfg, [[1, 2, 3, 4, 5]], cache="kivi4", max_new_tokens=9)
    n_programs, _ = G.compiled_programs(), None
    n_compiles, _ = G.compile_stats()
    again = G.generate(
        tiny_params, cfg, [[7, 8, 9, 10, 11, 12, 13, 14, 15]], cache="kivi4", max_new_tokens=13
    )  # same buckets: prompt 16, output 16
    assert G.compiled_programs() == n_programs
    assert G.compile_stats()[0] == n_compiles
    assert again.compile_seconds == 0.0
    G.generate(tiny_params, cfg, [[1] * 20], cache="kivi4", max_new_tokens=9)  # bucket 32
    assert G.compiled_programs() > n_programs


def test_per_layer_fp8_cache_only_where_its_layers_are_large():
    """new_cache with per_layer: a dense cache always has a buffer per layer; an fp8 one a part
    per layer only from PER_LAYER_MIN_ELEMENTS elements of K and V per layer (a stacked
    layer's copy grows with it, the parts' own launches do not); a kernel-read cache never."""
    cfg = get_preset("llama-3-8b")
    per_row = 2 * cfg.num_kv_heads * cfg.head_dim  # K and V elements per token and layer
    rows = -(-G.PER_LAYER_MIN_ELEMENTS // (per_row * 4096))  # the fewest rows of 4k at the bound
    make = lambda name, b: jax.eval_shape(
        lambda: G.new_cache(name, cfg, b, 4096, jnp.bfloat16, per_layer=True, group_size=64)
    )
    assert isinstance(make("fp8", rows), kivi_jax.MixedCache)
    assert isinstance(make("fp8", rows - 1), kivi_jax.KiviCache)
    assert isinstance(make("kivi2", 4 * rows), kivi_jax.KiviCache)
    assert make("fp16", 1).per_layer

"""Decode attention over the caches: reference vs an independent dequantize-then-attend, the
folded form vs the reference, accuracy against full precision, dispatch and errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kivi_jax as kj

L, D = 2, 64
attend = jax.jit(kj.decode_attention, static_argnames=("implementation", "interpret"))


def _inputs(seed, b, hkv, hq, s):
    ks = jax.random.split(jax.random.key(seed), 3)
    k = jax.random.normal(ks[0], (L, b, hkv, s, D))
    k = k.at[..., 5].multiply(8.0)  # an outlier channel, as in real keys
    v = jax.random.normal(ks[1], (L, b, hkv, s, D))
    q = jax.random.normal(ks[2], (b, hq, D))
    return q, k, v


def _attend_np(q, k, v, lengths):
    """float64 softmax attention; q [B, Hq, D], k/v [B, Hkv, S, D] (numpy)."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, d).astype(np.float64) / np.sqrt(d)
    s = np.einsum("bhrd,bhtd->bhrt", qg, k.astype(np.float64))
    mask = np.arange(k.shape[2])[None, :] < np.asarray(lengths)[:, None]
    s = np.where(mask[:, None, None], s, -np.inf)
    with np.errstate(invalid="ignore"):  # empty rows: all -inf
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
    return np.einsum("bhrt,bhtd->bhrd", p, v.astype(np.float64)).reshape(b, hq, d)


def _kivi_image(x, n, config, which):
    """What attention reads of one row's tokens x [Hkv, S, D] with n tokens (numpy float32):
    quantized through the public transforms where KIVI quantizes, exact in the newest W (the
    window: keys W = max(R, G), values W = R; a key block quantized at once, values one by
    one, and both read exact while in the window)."""
    g, r = config.group_size, config.residual_length
    out = np.array(x[:, :n], np.float32)
    if which == "k":
        w = max(r, g)
        nq = (n // w) * w  # whole blocks quantized
        quantize = kj.quantize_keys
    else:
        w = r
        nq = max(n - r, 0)
        quantize = kj.quantize_values
    if nq:
        deq = np.asarray(kj.dequantize(quantize(x[:, :nq], config)))
        exact_from = max(n - w, 0)  # the window's tokens are read exact
        out[:, :exact_from] = deq[:, :exact_from]
    return out


CONFIGS = [
    kj.KiviConfig(2, 2, 32, 128),
    kj.KiviConfig(4, 4, 64, 128),
    kj.KiviConfig(4, 2, 64, 0),
    kj.KiviConfig(2, 4, 32, 32),
]


@pytest.mark.parametrize(
    "config,hkv,hq", list(zip(CONFIGS, (2, 2, 1, 2), (2, 8, 8, 4), strict=True)), ids=str
)
def test_reference_matches_independent_dequantize_then_attend(config, hkv, hq):
    lengths = [300, 129, 0, 64]
    q, k, v = _inputs(0, 4, hkv, hq, 300)
    cache = kj.KiviCache.init(
        config, num_layers=L, batch=4, kv_heads=hkv, head_dim=D, max_len=320, dtype=jnp.float32
    )
    cache = cache.prefill(k, v, jnp.array(lengths, jnp.int32))
    layer = 1
    kk, vv = np.zeros((4, hkv, 300, D), np.float32), np.zeros((4, hkv, 300, D), np.float32)
    for b, n in enumerate(lengths):
        kk[b, :, :n] = _kivi_image(np.asarray(k[layer, b]), n, config, "k")
        vv[b, :, :n] = _kivi_image(np.asarray(v[layer, b]), n, config, "v")
    want = _attend_np(np.asarray(q), kk, vv, lengths)
    want[2] = 0.0  # an empty row attends to nothing
    for impl in ("reference", "folded"):
        got = np.asarray(attend(q, cache, layer, implementation=impl))
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4, err_msg=impl)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_folded_form_agrees_with_reference_to_float32_rounding(config):
    q, k, v = _inputs(1, 3, 2, 6, 700)
    cache = kj.KiviCache.init(
        config, num_layers=L, batch=3, kv_heads=2, head_dim=D, max_len=700, dtype=jnp.float32
    )
    cache = cache.prefill(k, v, jnp.array([700, 333, 31], jnp.int32))
    ref = attend(q, cache, 0, implementation="reference")
    folded = attend(q, cache, 0, implementation="folded")
    np.testing.assert_allclose(folded, ref, atol=1e-5, rtol=1e-5)


def test_a_window_longer_than_the_sequence_is_full_precision():
    q, k, v = _inputs(2, 2, 2, 4, 200)
    lengths = jnp.array([200, 77], jnp.int32)
    kivi = kj.make_cache(
        "kivi2",
        num_layers=L,
        batch=2,
        kv_heads=2,
        head_dim=D,
        max_len=200,
        dtype=jnp.float32,
        residual_length=256,
    ).prefill(k, v, lengths)
    dense = kj.make_cache(
        "fp16", num_layers=L, batch=2, kv_heads=2, head_dim=D, max_len=200, dtype=jnp.float32
    ).prefill(k, v, lengths)
    want = _attend_np(np.asarray(q), np.asarray(k[1]), np.asarray(v[1]), lengths)
    for c in (kivi, dense):
        np.testing.assert_allclose(attend(q, c, 1), want, atol=1e-5)


def test_dense_auto_reads_the_cache_dtype():
    """ "auto" on a dense cache attends in the cache dtype with float32 accumulation: exact for
    a float32 cache, within bf16 rounding of the float32 reference for a bf16 one, and
    ragged rows (one empty) masked like the reference."""
    q, k, v = _inputs(9, 3, 2, 8, 96)
    lengths = jnp.array([96, 41, 0], jnp.int32)
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)):
        c = kj.make_cache(
            "fp16", num_layers=L, batch=3, kv_heads=2, head_dim=D, max_len=128, dtype=dtype
        ).prefill(k.astype(dtype), v.astype(dtype), lengths)
        ref = attend(q, c, 1, implementation="reference")
        auto = attend(q, c, 1, implementation="auto")
        np.testing.assert_allclose(
            np.asarray(auto, np.float32), np.asarray(ref, np.float32), atol=tol
        )
        assert float(jnp.abs(auto[2]).max()) == 0.0  # the empty row
    assert float(jnp.abs(auto - ref).max()) > 0  # bf16: a different computation, not a copy


def _dense_case(dtype, lengths=(96, 41, 0, 1)):
    q, k, v = _inputs(13, len(lengths), 2, 8, 96)
    c = kj.make_cache(
        "fp16", num_layers=L, batch=len(lengths), kv_heads=2, head_dim=D, max_len=128, dtype=dtype
    ).prefill(k.astype(dtype), v.astype(dtype), jnp.array(lengths, jnp.int32))
    return q.astype(dtype), c


def test_dense_cache_stores_tokens_before_heads_and_views_the_old_layout():
    """[L, B, T, Hkv, D] storage (what cuDNN reads); `k`/`v` give the [L, B, Hkv, T, D] view."""
    _, k, v = _inputs(3, 2, 2, 8, 40)
    c = kj.DenseCache.init(num_layers=L, batch=2, kv_heads=2, head_dim=D, max_len=64)
    c = c.prefill(k, v, jnp.array([40, 7], jnp.int32))
    assert c.k_seq.shape == (L, 2, 64, 2, D) and c.k.shape == (L, 2, 2, 64, D)
    np.testing.assert_array_equal(c.v[:, 0, :, :40], v[:, 0].astype(jnp.bfloat16))
    assert float(jnp.abs(c.k[:, 1, :, 7:]).max()) == 0.0
    tok = jax.random.normal(jax.random.key(4), (2, 2, D))
    c = c.advance().write(1, tok, 2 * tok)
    np.testing.assert_array_equal(c.k_seq[1, 1, 7], tok[1].astype(jnp.bfloat16))
    np.testing.assert_array_equal(c.v[1, 0, :, 40], (2 * tok[0]).astype(jnp.bfloat16))


def test_per_layer_dense_cache_equals_the_stacked_one():
    """One buffer per layer (read in place by a custom call) holds and attends the same bits;
    its layer index must be concrete."""
    q, k, v = _inputs(3, 2, 2, 8, 40)
    lengths = jnp.array([40, 7], jnp.int32)
    tok = jax.random.normal(jax.random.key(4), (2, 2, D))
    caches = [
        kj.DenseCache.init(num_layers=L, batch=2, kv_heads=2, head_dim=D, max_len=64, per_layer=p)
        .prefill(k, v, lengths)
        .advance()
        .write(1, tok, 2 * tok)
        for p in (False, True)
    ]
    stacked, per_layer = caches
    assert per_layer.per_layer and len(per_layer.k_seq) == L
    assert per_layer.k_seq[0].shape == (2, 64, 2, D) and per_layer.num_layers == L
    assert per_layer.nbytes() == stacked.nbytes()
    np.testing.assert_array_equal(per_layer.k, stacked.k)
    np.testing.assert_array_equal(per_layer.v, stacked.v)
    for layer in range(L):
        for impl in ("auto", "reference"):
            np.testing.assert_array_equal(
                kj.decode_attention(q, per_layer, layer, implementation=impl),
                kj.decode_attention(q, stacked, layer, implementation=impl),
            )
    with pytest.raises(ValueError, match="concrete layer index"):
        jax.jit(lambda c, l: c.write(l, tok, tok))(per_layer, jnp.int32(1))
    with pytest.raises(ValueError, match="concrete layer index"):
        jax.jit(lambda c, l: kj.decode_attention(q, c, l))(per_layer, jnp.int32(1))


def test_per_layer_fp8_cache_holds_a_part_per_layer_and_attends_the_same():
    """per_layer on a cache that XLA reads through GEMMs (fp8 without sinks): one part per
    layer, whose stores are whole arrays; the same bits stored and attended as the stacked
    cache. Caches the kernel reads (kivi2) or that XLA dequantizes (fp8 with sinks, nvfp4)
    stay stacked."""
    q, k, v = _inputs(5, 2, 2, 8, 40)
    lengths = jnp.array([40, 9], jnp.int32)
    tok = jax.random.normal(jax.random.key(6), (2, 2, D))
    dims = dict(num_layers=L, batch=2, kv_heads=2, head_dim=D, max_len=64, group_size=16)
    dims["residual_length"] = 16
    caches = [
        kj.make_cache("fp8", **dims, per_layer=p).prefill(k, v, lengths).advance()
        for p in (False, True)
    ]
    stacked, split = (c.write(1, tok, 2 * tok) for c in caches)
    assert isinstance(stacked, kj.KiviCache)
    assert isinstance(split, kj.MixedCache) and split.groups == ((0,), (1,))
    assert all(p.num_layers == 1 and p.config == stacked.config for p in split.parts)
    for layer in range(L):
        part = split.parts[layer]
        for a, b in zip(jax.tree.leaves(part.keys), jax.tree.leaves(stacked.keys), strict=True):
            np.testing.assert_array_equal(a[0], b[layer])
        for impl in ("xla", "reference"):
            np.testing.assert_array_equal(
                attend(q, split, layer, implementation=impl),
                attend(q, stacked, layer, implementation=impl),
            )
    assert split.nbytes().codes == stacked.nbytes().codes
    for name, knobs in (("kivi2", {}), ("fp8", dict(sinks=4)), ("nvfp4", {})):
        c = kj.make_cache(name, **dims, per_layer=True, **knobs)
        assert isinstance(c, kj.KiviCache), name


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cuDNN may apply on a GPU")
def test_dense_cudnn_declines_without_a_gpu_and_auto_falls_back_to_xla():
    q, c = _dense_case(jnp.bfloat16)
    assert kj.attention.dense_path(q, c) == "xla"
    with pytest.raises(NotImplementedError, match="cuDNN"):
        attend(q, c, 1, implementation="cudnn")
    ref = attend(q, c, 1, implementation="reference")
    np.testing.assert_allclose(
        np.asarray(attend(q, c, 1), np.float32), np.asarray(ref, np.float32), atol=3e-2
    )
    np.testing.assert_array_equal(attend(q, c, 1), attend(q, c, 1, implementation="xla"))


def test_dense_cudnn_declines_a_float32_cache_and_quantized_caches():
    q, c = _dense_case(jnp.float32)
    assert kj.attention.dense_path(q, c) == "xla"
    with pytest.raises(NotImplementedError, match="16-bit cache"):
        attend(q, c, 1, implementation="cudnn")
    kc = kj.make_cache("kivi2", num_layers=L, batch=2, kv_heads=2, head_dim=D, max_len=64)
    with pytest.raises(NotImplementedError, match="dense caches only"):
        attend(q[:2], kc, 1, implementation="cudnn")


@pytest.mark.parametrize(
    "name, group, knobs",
    [
        ("fp8", 64, {}),
        ("nvfp4", 64, {}),
        ("mxfp4", 32, {}),
        ("fp8", 64, {"sinks": 4}),
        ("nvfp4", 64, {"sinks": 8, "rotation": "both"}),
        ("fp8", 64, {"residual_length": 0}),
        ("fp8", 16, {"rotation": "keys"}),
    ],
    ids=str,
)
@pytest.mark.parametrize("q_dtype, atol", [(jnp.float32, 2e-6), (jnp.bfloat16, 4e-3)])
def test_xla_reads_per_token_caches_as_stored_and_agrees_with_reference(
    name, group, knobs, q_dtype, atol
):
    """The stored order (cache-ordered slots, swapped bytes): the same attention as the
    reference, on ragged rows (full, part-quantized, empty); to float32 rounding for a float32
    query, to the rounding of bf16 operands (and output) for a bf16 one."""
    rng = np.random.default_rng(7)
    nl, nb, hkv, d, t = 2, 3, 2, 64, 700
    c = kj.make_cache(
        name,
        num_layers=nl,
        batch=nb,
        kv_heads=hkv,
        head_dim=d,
        max_len=768,
        group_size=group,
        **knobs,
    )
    k, v = (jnp.asarray(rng.normal(size=(nl, nb, hkv, t, d)), jnp.bfloat16) for _ in range(2))
    c = c.prefill(k, v, jnp.array([700, 300, 0]))
    q = jnp.asarray(rng.normal(size=(nb, 8, d)), jnp.float32)
    ref = attend(q, c, 1, implementation="reference")
    got = np.asarray(attend(q.astype(q_dtype), c, 1, implementation="xla"), np.float32)
    np.testing.assert_allclose(got, ref, atol=atol, rtol=0)
    assert not np.any(got[2])  # an empty row attends to nothing


def test_xla_reads_fp8_elements_where_they_lie(monkeypatch):
    """fp8 without sinks: the products take the stored elements and scale their results
    (`QuantizedStore.fp8_slots`), never a dequantized copy (`token_slots`); with sinks, which
    `token_slots` overlays, the dequantized path."""
    rng = np.random.default_rng(3)
    k, v = (jnp.asarray(rng.normal(size=(2, 2, 2, 300, 64)), jnp.bfloat16) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(2, 8, 64)), jnp.float32)
    caches = {
        sinks: kj.make_cache(
            "fp8", num_layers=2, batch=2, kv_heads=2, head_dim=64, max_len=384, sinks=sinks
        ).prefill(k, v, jnp.array([300, 170]))
        for sinks in (0, 4)
    }
    refs = {n: attend(q, c, 1, implementation="reference") for n, c in caches.items()}

    def no_copy(self, layer):
        raise AssertionError("dequantized copy")

    monkeypatch.setattr(kj.cache.QuantizedStore, "token_slots", no_copy)
    got = attend(q, caches[0], 1, implementation="xla")
    np.testing.assert_allclose(got, refs[0], atol=2e-6, rtol=0)
    with pytest.raises(AssertionError, match="dequantized copy"):
        attend(q, caches[4], 1, implementation="xla")


def test_fp8_slots_times_their_scales_are_the_token_slots():
    """`fp8_slots` and `token_slots` describe the same stored order: each element times its
    block's scale is the dequantized slot, bit for bit, keys and V^T alike, with the same
    positions and channels; other formats and stores with sinks decline."""
    rng = np.random.default_rng(5)
    k, v = (jnp.asarray(rng.normal(size=(2, 2, 2, 300, 64)), jnp.bfloat16) for _ in range(2))
    c = kj.make_cache(
        "fp8", num_layers=2, batch=2, kv_heads=2, head_dim=64, max_len=384, group_size=16
    ).prefill(k, v, jnp.array([300, 170]))
    for store in (c.keys, c.values):
        x, scale, pos, chan = store.fp8_slots(1)
        want, want_pos, want_chan = store.token_slots(1)
        if store.transposed:  # V^T rows [B, H, D, Tq] -> [B, H, Tq, D]
            x = x.swapaxes(-1, -2)
        got = x.astype(jnp.float32) * jnp.repeat(scale.swapaxes(-1, -2), 16, axis=-1)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(pos, want_pos)
        np.testing.assert_array_equal(chan, want_chan)
    for name, knobs in (("nvfp4", {}), ("fp8", {"sinks": 4})):
        other = kj.make_cache(
            name, num_layers=1, batch=1, kv_heads=1, head_dim=64, max_len=256, **knobs
        )
        with pytest.raises(NotImplementedError):
            other.keys.fp8_slots(0)


def test_xla_declines_per_channel_and_blocked_caches():
    for name in ("kivi2", "pertoken2"):
        c = kj.make_cache(name, num_layers=2, batch=2, kv_heads=2, head_dim=64, max_len=256)
        with pytest.raises(NotImplementedError):
            attend(jnp.ones((2, 4, 64)), c, 1, implementation="xla")


@pytest.mark.parametrize("name", ["best3", "best25", "fp8"])
def test_xla_reads_pre_rope_caches_through_the_dequantized_layer(name):
    """Keys quantized before RoPE (with sinks and both rotations for best3 / best25): "xla"
    attends the layer dequantized, keys turned by RoPE at their positions, as "reference" does
    (float32 q: to float32 rounding; bf16 q: bf16 operands)."""
    rope = 1e4 ** -(np.arange(32) / 32)
    rng = np.random.default_rng(7)
    k, v = (jnp.asarray(rng.normal(size=(2, 2, 2, 600, 64)), jnp.bfloat16) for _ in range(2))
    c = kj.make_cache(
        name, num_layers=2, batch=2, kv_heads=2, head_dim=64, max_len=768, pre_rope=True,
        rope_frequencies=rope,
    ).prefill(k, v, jnp.array([600, 150]))  # fmt: skip
    q = jnp.asarray(rng.normal(size=(2, 8, 64)), jnp.float32)
    want = attend(q, c, 1, implementation="reference")
    np.testing.assert_allclose(attend(q, c, 1, implementation="xla"), want, atol=2e-5, rtol=0)
    low = attend(q.astype(jnp.bfloat16), c, 1, implementation="xla").astype(jnp.float32)
    assert float(jnp.abs(low - want).max()) < 2e-2 * float(jnp.abs(want).max())


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU with cuDNN")
def test_dense_cudnn_matches_the_reference_on_ragged_rows():
    """cuDNN against the float32 reference on rows of 96, 41, 0 and 1 tokens: the empty row
    gives 0 (our convention, whatever cuDNN does with a zero length), "auto" takes cuDNN."""
    for dtype in (jnp.bfloat16, jnp.float16):
        q, c = _dense_case(dtype)
        assert kj.attention.dense_path(q, c) == "cudnn"
        ref = np.asarray(attend(q, c, 1, implementation="reference"), np.float32)
        for impl in ("cudnn", "auto"):
            got = np.asarray(attend(q, c, 1, implementation=impl), np.float32)
            np.testing.assert_allclose(got, ref, atol=3e-2)
            assert np.abs(got[2]).max() == 0.0


def test_quantized_attention_error_is_bounded_and_shrinks_with_bits():
    # Stated bound, measured (2026-11-29) on Gaussian q/k/v with one 8x outlier key channel,
    # D=64, 2000 tokens, R=0 so that everything but an incomplete key group is quantized: the
    # relative L2 error of the attention output against float64 is 0.63 (2-bit), 0.135 (4-bit)
    # and 0.0074 (8-bit) at G=32, and G=64 is worse than G=32. Bounds leave ~20% margin.
    q, k, v = _inputs(3, 2, 2, 8, 2000)
    lengths = jnp.array([2000, 1500], jnp.int32)
    want = _attend_np(np.asarray(q), np.asarray(k[0]), np.asarray(v[0]), lengths)
    errs = {}
    for bits, bound in ((2, 0.8), (4, 0.17), (8, 0.01)):
        for g in (32, 64):
            cfg = kj.KiviConfig(bits, bits, g, 0)
            c = kj.KiviCache.init(
                cfg, num_layers=L, batch=2, kv_heads=2, head_dim=D, max_len=2000, dtype=jnp.float32
            ).prefill(k, v, lengths)
            got = np.asarray(attend(q, c, 0))
            errs[bits, g] = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert errs[bits, 32] < bound, errs
        assert errs[bits, 32] < errs[bits, 64], errs
    assert errs[2, 32] > 2 * errs[4, 32] > 4 * errs[8, 32], errs


def test_auto_is_reference_without_a_hopper_gpu_and_pallas_needs_one():
    q, k, v = _inputs(4, 1, 2, 4, 300)
    c = kj.make_cache(
        "kivi2", num_layers=L, batch=1, kv_heads=2, head_dim=D, max_len=300, dtype=jnp.float32
    ).prefill(k, v, jnp.array([300]))
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(
            kj.decode_attention(q, c, 0, implementation="auto"),
            kj.decode_attention(q, c, 0, implementation="reference"),
        )
        with pytest.raises(NotImplementedError):
            kj.decode_attention(q, c, 0, implementation="pallas")
    dense = kj.make_cache("fp16", num_layers=L, batch=1, kv_heads=2, head_dim=D, max_len=300)
    with pytest.raises(NotImplementedError, match="quantized"):
        kj.decode_attention(q, dense, 0, implementation="pallas")
    abl = kj.make_cache("pertoken2", num_layers=L, batch=1, kv_heads=2, head_dim=D, max_len=300)
    with pytest.raises(NotImplementedError, match="KIVI axes"):
        kj.decode_attention(q, abl, 0, implementation="pallas", interpret=True)
    with pytest.raises(NotImplementedError, match="KIVI axes"):
        kj.decode_attention(q, abl, 0, implementation="folded")


def test_compiler_options_are_valid_and_leave_the_kernel_out_of_cuda_graphs():
    options = kj.compiler_options()
    types = options["xla_gpu_enable_command_buffer"].split(",")
    assert "CUSTOM_CALL" not in types and {"FUSION", "CUBLAS", "CUDNN"} <= set(types)
    # XLA parses them on every backend: a misspelt type name fails this compile
    f = jax.jit(lambda x: 2 * x, compiler_options=options)
    np.testing.assert_array_equal(f(jnp.ones(3)), 2.0)


def test_bad_queries_raise():
    c = kj.make_cache("kivi2", num_layers=1, batch=2, kv_heads=2, head_dim=D, max_len=8)
    with pytest.raises(ValueError, match="implementation"):
        kj.decode_attention(jnp.ones((2, 4, D)), c, 0, implementation="cuda")
    with pytest.raises(ValueError, match="q must have shape"):
        kj.decode_attention(jnp.ones((2, D)), c, 0)
    with pytest.raises(ValueError, match="Hq=3"):
        kj.decode_attention(jnp.ones((2, 3, D)), c, 0)
    with pytest.raises(ValueError, match="B=2"):
        kj.decode_attention(jnp.ones((1, 4, D)), c, 0)
    with pytest.raises(ValueError, match="floating"):
        kj.decode_attention(jnp.ones((2, 4, D), jnp.int32), c, 0)
    with pytest.raises(ValueError, match="cache"):
        kj.decode_attention(jnp.ones((2, 4, D)), {"k": 1}, 0)


def test_merge_partials_equals_attention_over_the_union():
    q, k, v = _inputs(5, 2, 1, 2, 100)
    qg = np.asarray(q).reshape(2, 1, 2, D) / np.sqrt(D)
    from kivi_jax.attention import _softmax_attend

    mask = jnp.ones((2, 100), bool)
    whole, _ = _softmax_attend(jnp.asarray(qg), k[0], v[0], mask)
    a = _softmax_attend(jnp.asarray(qg), k[0, :, :, :37], v[0, :, :, :37], mask[:, :37])
    b = _softmax_attend(jnp.asarray(qg), k[0, :, :, 37:], v[0, :, :, 37:], mask[:, 37:])
    empty = _softmax_attend(jnp.asarray(qg), k[0, :, :, :5], v[0, :, :, :5], ~mask[:, :5])
    o, _ = kj.merge_partials([a, b, empty])
    np.testing.assert_allclose(o, whole, atol=1e-6)


@pytest.mark.parametrize(
    "config",
    [
        kj.KiviConfig(2, 2, 64, 128),
        kj.KiviConfig(4, 2, 32, 0),
        kj.KiviConfig(2, 2, 64, 128, sinks=8, rotation="both"),  # best3's knobs
        kj.KiviConfig(2, 2, 32, 0, sinks=40),  # sinks past a group, no windows
    ],
    ids=str,
)
def test_pallas_kernel_through_decode_attention_matches_reference(config):
    """The dispatch glue (split point, tail, log-sum-exp merge) around the fused kernel: under
    the GPU interpreter on CPU, natively on a Hopper GPU (then also through "auto")."""
    from kivi_jax.attention import pallas_available

    on_gpu = pallas_available()
    if not on_gpu and jax.default_backend() != "cpu":
        pytest.skip("needs a Hopper GPU or the CPU interpreter")
    q, k, v = _inputs(6, 2, 2, 8, 600 if on_gpu else 300)
    q = q.astype(jnp.bfloat16)
    cache = kj.KiviCache.init(
        config,
        num_layers=L,
        batch=2,
        kv_heads=2,
        head_dim=D,
        max_len=k.shape[3],
        dtype=jnp.bfloat16,
    )
    cache = cache.prefill(k, v, jnp.array([k.shape[3], 200], jnp.int32))
    ref = np.asarray(attend(q, cache, 1, implementation="reference"), np.float32)
    impls = ("pallas", "auto") if on_gpu else ("pallas",)
    for impl in impls:
        got = attend(q, cache, 1, implementation=impl, interpret=not on_gpu)
        # bf16 output; the kernel's fp16 tensor-core math agrees to ~1e-3 of max |o|.
        np.testing.assert_allclose(
            np.asarray(got, np.float32), ref, atol=1e-2 * np.abs(ref).max(), err_msg=impl
        )


def test_decode_attention_passes_the_kernel_tuning():
    """`tuning` reaches the Pallas kernel: one that does not fit raises there, a given launch
    agrees with the reference, and the opt-in fp8 value product (G = D) within its documented
    precision."""
    from kivi_jax.attention import pallas_available
    from pallas_kernels.kivi_decode import TuningConfig

    on_gpu = pallas_available()
    if not on_gpu and jax.default_backend() != "cpu":
        pytest.skip("needs a Hopper GPU or the CPU interpreter")
    d, s = 128, 384
    ks = jax.random.split(jax.random.key(3), 3)
    k = jax.random.normal(ks[0], (1, 2, 2, s, d)).at[..., 7].multiply(8.0)
    v = jax.random.normal(ks[1], (1, 2, 2, s, d))
    q = jax.random.normal(ks[2], (2, 8, d)).astype(jnp.bfloat16)
    cache = kj.KiviCache.init(
        kj.KiviConfig(2, 2, 128, 128),
        num_layers=1,
        batch=2,
        kv_heads=2,
        head_dim=d,
        max_len=s,
        dtype=jnp.bfloat16,
    )
    cache = cache.prefill(k, v, jnp.array([s, 300], jnp.int32))
    run = lambda tun: kj.decode_attention(
        q, cache, 0, implementation="pallas", interpret=not on_gpu, tuning=tun
    )
    with pytest.raises(ValueError, match="shared memory"):  # four pipelines of eight stages
        run(TuningConfig(num_splits=1, stages=8, wg_per_block=4))
    ref = np.asarray(kj.decode_attention(q, cache, 0, implementation="reference"), np.float32)
    got = np.asarray(run(TuningConfig(num_splits=2, stages=2)), np.float32)
    # ~5e-3 of max |o| (bf16 output, fp16 operands), the x8 outlier channel in q * s_g
    np.testing.assert_allclose(got, ref, atol=1e-2 * np.abs(ref).max())
    # fp8_values: P * s_t in e4m3 (4 significant bits, 2^-4 relative per weight), so the error
    # scales with the values, not with o (zero-mean random values average to a small o): here
    # 4e-3 of max |v| (5e-2 of max |o|); a wrong field weight or scale is off by O(max |v|).
    got8 = np.asarray(run(TuningConfig(num_splits=1, stages=2, fp8_values=True)), np.float32)
    np.testing.assert_allclose(got8, ref, atol=1.5e-2 * float(jnp.abs(v).max()))
    # "pallas-lowp": the fp8 value product (on wgmma) on the given tuning, keys exact
    lowp = kj.decode_attention(
        q,
        cache,
        0,
        implementation="pallas-lowp",
        interpret=not on_gpu,
        tuning=TuningConfig(num_splits=1, stages=2),
    )
    lowp_tuning = TuningConfig(num_splits=1, stages=2, fp8_values=True)
    np.testing.assert_array_equal(
        np.asarray(lowp, np.float32), np.asarray(run(lowp_tuning), np.float32)
    )
    np.testing.assert_allclose(
        np.asarray(lowp, np.float32), ref, atol=1.5e-2 * float(jnp.abs(v).max())
    )
    exact = np.asarray(run(TuningConfig(num_splits=1, stages=2)), np.float32)
    assert (np.asarray(lowp, np.float32) != exact).any(), "-lowp did not change the products"
    with pytest.raises(ValueError, match="implementation"):
        kj.decode_attention(q, cache, 0, implementation="lowp")


def test_sinks_join_the_merge_of_the_splits_as_single_keys():
    """`merge_partials(..., keys=sink_keys(...))` (the kernel's splits and a cache's sinks in
    one pass) gives what merging each held sink as a part of its own gives (o = its value,
    lse = its logit); rows with nothing (no sink held, every split empty) o = 0, lse = -inf;
    a held infinite sink key NaN in its kv head only."""
    from pallas_kernels.kivi_decode.decode import sink_keys
    from pallas_kernels.merge import merge_partials

    B, Hkv, nq, S, N, D = 4, 2, 3, 5, 8, 32
    ks = jax.random.split(jax.random.key(5), 5)
    k = jax.random.normal(ks[0], (2, B, Hkv, N, D))
    v = jax.random.normal(ks[1], (2, B, Hkv, N, D))
    k = k.at[1, 3, 0, 2, 5].set(jnp.inf)  # row 3, head 0: a held infinite key
    q = jax.random.normal(ks[2], (B, Hkv * nq, D))
    o = jax.random.normal(ks[3], (B, Hkv, S, nq, D))
    lse = (jax.random.normal(ks[4], (B, Hkv, S, nq)) * 3).at[:, :, 1].set(-jnp.inf)
    lse = lse.at[1].set(-jnp.inf).at[2].set(-jnp.inf)  # rows 1 and 2: every split empty
    held = jnp.array([8, 5, 0, 8], jnp.int32)  # row 2: no sink held either
    scale = D**-0.5
    got_o, got_lse = merge_partials(o, lse, axis=2, keys=sink_keys(q, (k, v), 1, scale, held))
    logits = jnp.einsum(  # float32 products on a GPU too (its default is TF32)
        "bhqd,bhnd->bhnq", q.reshape(B, Hkv, nq, D) * scale, k[1], precision="highest"
    )
    logits = jnp.where(
        jnp.arange(N)[None, None, :, None] < held[:, None, None, None], logits, -jnp.inf
    )
    parts_o = jnp.concatenate([o, jnp.broadcast_to(v[1][:, :, :, None], (B, Hkv, N, nq, D))], 2)
    want_o, want_lse = merge_partials(parts_o, jnp.concatenate([lse, logits], 2), axis=2)
    ok = np.ones((B, Hkv), bool)
    ok[3, 0] = False
    np.testing.assert_allclose(got_o[ok], want_o[ok], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_lse[ok], want_lse[ok], rtol=1e-5, atol=1e-5)
    assert np.isnan(np.asarray(got_o[3, 0])).all() and np.isfinite(got_o[3, 1]).all()
    np.testing.assert_array_equal(got_o[2], 0.0)
    np.testing.assert_array_equal(got_lse[2], -np.inf)
    assert np.isfinite(np.asarray(got_o[1])).all()  # row 1: its 5 sinks alone

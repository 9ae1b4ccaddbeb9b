"""Element formats (fp8, nvfp4, mxfp4), attention sinks, the Hadamard rotation and outlier key
channels: each codec against an independent numpy oracle built from the specifications, the
exact bit accounting, the edges, and attention over such caches against float64 definitions."""

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import kivi_jax as kj
from kivi_jax import formats, rotation

# ---------------------------------------------------------------------------------------------
# Oracles, in numpy with ml_dtypes' casts (round to nearest even), from the specifications.

E2M1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def _fp4(x):
    return np.clip(x, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)


def oracle_fp8(x, scale_dtype):
    """One scale per group: amax / 448 rounded up into scale_dtype; elements to E4M3."""
    amax = np.abs(x).max(-1, keepdims=True)
    s = (amax / 448).astype(scale_dtype)
    s = np.where(s.astype(np.float32) < amax / 448, np.nextafter(s, np.inf, dtype=s.dtype), s)
    sf = s.astype(np.float32)
    y = np.where(sf > 0, x / np.where(sf > 0, sf, 1), 0)
    return np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * sf


def oracle_nvfp4(x):
    """NVFP4: a float32 scale per group (amax / (448 * 6)), E4M3 scales per block of 16
    (block amax / 6 over it, to nearest), E2M1 elements to nearest, saturating."""
    *lead, g = x.shape
    gs = (np.abs(x).max(-1, keepdims=True) / np.float32(448 * 6)).astype(np.float32)
    safe = np.where(gs > 0, gs, 1)[..., None]
    xb = x.reshape(*lead, g // 16, 16)
    bs = np.clip(np.abs(xb).max(-1, keepdims=True) / 6 / safe, 0, 448)
    bs = bs.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    div = bs * safe
    y = np.where(div > 0, _fp4(xb / np.where(div > 0, div, 1)), 0)
    return (y * bs * gs[..., None]).reshape(x.shape)


def oracle_mxfp4(x):
    """OCP MX v1.0, 6.3: X = 2^(floor(log2(amax)) - emax_elem), emax_elem = 2 for E2M1; the
    elements V / X to nearest, clamped at the largest normal (6)."""
    *lead, g = x.shape
    xb = x.reshape(*lead, g // 32, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    e = np.floor(np.log2(np.maximum(amax, 2.0**-127))) - 2
    scale = np.exp2(np.clip(e, -127, 127)).astype(np.float32)
    return (_fp4(xb / scale) * scale).reshape(x.shape)


def _qdq(fmt, x, g, scale_dtype=jnp.float16):
    codes, scale, aux = formats.encode(fmt, jnp.asarray(x), formats.code_bits(fmt, 4), scale_dtype)
    return np.asarray(formats.decode(fmt, codes, scale, aux, g))


def _groups(seed, shape, spread):
    """Random groups with magnitudes spread over 2^-spread .. 2^spread, outliers included."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp2(rng.uniform(-spread, spread, shape[:-1] + (1,)))
    x[..., 3] *= 40  # an outlier in every group
    return x.astype(np.float32)


@pytest.mark.parametrize("seed,spread", [(0, 1), (1, 12)])
def test_codecs_equal_their_specification_oracles(seed, spread):
    x = _groups(seed, (6, 5, 64), spread)
    np.testing.assert_array_equal(_qdq("fp8", x, 64), oracle_fp8(x, np.float16))
    # NVFP4's float32 group scale may differ from numpy's by an ulp (XLA divides by the
    # constant 2688 through its reciprocal); a wrong code would be off by 1/12 or more
    np.testing.assert_allclose(_qdq("nvfp4", x, 64), oracle_nvfp4(x), rtol=1e-6, atol=0)
    np.testing.assert_array_equal(_qdq("mxfp4", x, 32), oracle_mxfp4(x))


def test_fp4_codes_follow_e2m1():
    # bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa: code c holds E2M1[c & 7]
    want = np.array([*E2M1, *(-np.array(E2M1))], np.float32)
    got = np.asarray(formats.fp4_decode(jnp.arange(16, dtype=jnp.uint8)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got[8:]), True)
    grid = jnp.asarray(want)
    np.testing.assert_array_equal(np.asarray(formats._fp4_codes(grid)), np.arange(16))


def _bits(x) -> np.ndarray:
    """An array's bytes, for bit-for-bit comparisons (any dtype, NaNs included)."""
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8)


@pytest.mark.parametrize("fmt,g", [("fp8", 32), ("nvfp4", 32), ("mxfp4", 32), ("int", 32)])
def test_edges_nan_inf_zero_and_huge_groups(fmt, g):
    x = np.ones((5, g), np.float32)
    x[0, 4] = np.nan
    x[1, 7] = np.inf
    x[2] = 0
    x[3] = np.linspace(-3e38, 3e38, g)  # finite, spanning float32
    x[4, :] = np.random.default_rng(0).standard_normal(g)
    bits = 2 if fmt == "int" else formats.code_bits(fmt, 4)
    codes, scale, aux = formats.encode(fmt, jnp.asarray(x), bits, jnp.float16)
    y = np.asarray(formats.decode(fmt, codes, scale, aux, g))
    assert np.isnan(y[0]).all() and np.isnan(y[1]).all()  # a non-finite group: NaN, whole
    np.testing.assert_array_equal(y[2], 0)
    assert np.isfinite(y[3]).all() and np.isfinite(y[4]).all()
    again = formats.encode(fmt, jnp.asarray(x), bits, jnp.float16)  # deterministic
    for a, b in zip((codes, scale, aux), again, strict=True):
        # bit for bit: NaN scales (the non-finite groups) compare unequal as values, and
        # numpy's NaN-aware comparison skips the fp8 dtypes of the block scales
        if a is None:  # no side values in this format
            assert b is None
            continue
        np.testing.assert_array_equal(_bits(a), _bits(b))


def test_bits_per_element_counts_every_stored_byte():
    cases = {
        kj.KiviConfig(2, 2, 32): 3.0,  # 2 + (fp16 scale + fp16 minimum) / 32
        kj.cache_config("fp8", 64): 8.25,  # 8 + fp16 scale / 64
        kj.cache_config("nvfp4", 64): 5.0,  # 4 + E4M3 / 16 + fp32 / 64
        kj.cache_config("mxfp4", 32): 4.25,  # 4 + E8M0 / 32
        kj.KiviConfig(2, 4, 64, value_format="nvfp4"): (2.5 + 4.0 + 0.5 + 0.5) / 2,
        # + per group of 64 tokens 3 channels of 64 fp16 values and 3 one-byte indices
        kj.KiviConfig(2, 2, 64, outlier_channels=3): (2.5 + 2.5 + 3 * (64 * 16 + 8) / 64**2) / 2,
    }
    for cfg, want in cases.items():
        assert cfg.bits_per_element(64) == want, cfg
        c = kj.KiviCache.init(
            cfg, num_layers=2, batch=3, kv_heads=2, head_dim=64, max_len=700, dtype=jnp.bfloat16
        )
        nb = c.nbytes()
        elements = 2 * 2 * 3 * 2 * c.keys.capacity * 64  # K and V, L, B, Hkv, Tq, D
        assert (nb.codes + nb.scales) * 8 == want * elements, cfg


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(key_format="fp16"), "key_format must be one of"),
        (dict(value_format="nvfp4"), "set value_bits=4"),
        (dict(key_bits=4, key_format="mxfp4"), "set key_axis='token'"),
        (dict(value_bits=4, value_format="mxfp4", group_size=16), "multiple of its block of 32"),
        (dict(sinks=-1), "sinks must be a non-negative int"),
        (dict(sinks=2.0), "sinks must be a non-negative int"),
        (dict(rotation="yes"), "rotation must be one of"),
        (dict(outlier_channels=-1), "outlier_channels must be a non-negative int"),
        (dict(outlier_channels=256), "outlier_channels must be a non-negative int < 256"),
        (dict(outlier_channels=True), "outlier_channels must be a non-negative int"),
        (dict(outlier_channels=2, key_axis="token"), "set key_axis='channel'"),
        (
            dict(outlier_channels=2, key_bits=8, key_format="fp8", key_axis="token"),
            "key_format='int'",
        ),
    ],
)
def test_config_errors_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        kj.KiviConfig(**kw)


def test_named_caches_and_their_knobs():
    assert kj.cache_config("nvfp4", 64).value_format == "nvfp4"
    assert kj.cache_config("kivi2", sinks=4, rotation="values").sinks == 4
    with pytest.raises(ValueError, match="takes no sinks"):
        kj.cache_config("fp16", sinks=4)
    with pytest.raises(ValueError, match="multiple of its block of 32"):
        kj.cache_config("mxfp4", 16)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        kj.make_cache(
            "kivi2", num_layers=1, batch=1, kv_heads=1, head_dim=72, max_len=8, rotation="keys",
            group_size=8,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The rotation


def _hadamard(d):
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h


@pytest.mark.parametrize("d", [8, 64, 256])
def test_rotation_is_the_signed_hadamard_matrix_and_orthogonal(d):
    x = np.random.default_rng(d).standard_normal((3, d)).astype(np.float32)
    r = np.diag(rotation.signs(d)) @ _hadamard(d) / np.sqrt(d)
    np.testing.assert_allclose(np.asarray(rotation.rotate(x)), x @ r, atol=1e-5)
    np.testing.assert_allclose(np.asarray(rotation.unrotate(rotation.rotate(x))), x, atol=1e-5)
    np.testing.assert_allclose(rotation.matrix(d), r, atol=1e-7)
    # attention's side (queries, outputs): the same R as one fused product
    np.testing.assert_allclose(np.asarray(rotation.rotate_rows(x)), x @ r, atol=1e-5)
    np.testing.assert_allclose(np.asarray(rotation.unrotate_rows(x)), x @ r.T, atol=1e-5)
    with pytest.raises(ValueError, match="power-of-two"):
        rotation.rotate_rows(np.ones((2, 12), np.float32))
    np.testing.assert_allclose(r @ r.T, np.eye(d), atol=1e-12)
    # one token rotates to the same bits alone or among others (streaming equals prefill)
    np.testing.assert_array_equal(
        np.asarray(rotation.rotate(x[1])), np.asarray(rotation.rotate(x))[1]
    )


# ---------------------------------------------------------------------------------------------
# Caches: sinks kept exact and out of the key groups' ranges; attention over every format


def test_sinks_are_exact_and_do_not_widen_their_key_group():
    cfg = kj.KiviConfig(2, 2, group_size=32, residual_length=32, sinks=4)
    k, v = (jax.random.normal(jax.random.key(i), (1, 1, 1, 300, 64)) for i in (0, 1))
    k = k.at[..., :4, :].mul(1000.0)  # huge first tokens, as attention sinks are
    cache = kj.KiviCache.init(
        cfg, num_layers=1, batch=1, kv_heads=1, head_dim=64, max_len=300, dtype=jnp.float32
    ).prefill(k, v, jnp.array([300], jnp.int32))
    got_k, got_v = (np.asarray(x[0, :300, 0]) for x in cache.layer_kv(0))
    np.testing.assert_array_equal(got_k[:4], np.asarray(k[0, 0, 0, :4]))
    np.testing.assert_array_equal(got_v[:4], np.asarray(v[0, 0, 0, :4]))
    # the rest of group 0 is quantized over its own range: 2-bit error within (max - min) / 6
    rest = np.asarray(k[0, 0, 0, 4:32])
    bound = (rest.max(0) - rest.min(0)) / 6 + 1e-2
    assert (np.abs(got_k[4:32] - rest) <= bound).all()
    without = kj.KiviCache.init(
        kj.KiviConfig(2, 2, group_size=32, residual_length=32), num_layers=1, batch=1,
        kv_heads=1, head_dim=64, max_len=300, dtype=jnp.float32,
    ).prefill(k, v, jnp.array([300], jnp.int32))  # fmt: skip
    assert not (np.abs(np.asarray(without.layer_kv(0)[0][0, 4:32, 0]) - rest) <= bound).all()


ATTENTION_CONFIGS = [
    kj.KiviConfig(2, 2, 32, 32, sinks=5, rotation="both"),
    kj.KiviConfig(8, 8, 32, 32, key_format="fp8", value_format="fp8", key_axis="token"),
    kj.KiviConfig(
        4,
        4,
        32,
        0,
        key_format="nvfp4",
        value_format="mxfp4",
        key_axis="token",
        sinks=40,
        rotation="keys",
    ),  # fmt: skip
    kj.KiviConfig(2, 2, 32, 32, sinks=3, outlier_channels=3),
    kj.KiviConfig(2, 2, 32, 32, sinks=3, rotation="both", pre_rope=True),
]
ROPE = 1.0 / 10000 ** (np.arange(0, 64, 2) / 64)  # RoPE frequencies at D = 64


def _filled(cfg, lengths, seed=0, d=64, hkv=2):
    b, s = len(lengths), max(lengths)
    k, v = (jax.random.normal(jax.random.key(seed + i), (2, b, hkv, s, d)) for i in (0, 1))
    cache = kj.KiviCache.init(
        cfg, num_layers=2, batch=b, kv_heads=hkv, head_dim=d, max_len=s + 8, dtype=jnp.float32,
        rope_frequencies=ROPE,
    )  # fmt: skip
    return cache.prefill(k, v, jnp.asarray(lengths, jnp.int32)), k, v


def _held_model_basis(cache, layer, n):
    """K, V [B, Hkv, T, D] float64 as attention must see them: what the cache holds, rotated
    back into the model's basis."""
    k, v = (np.asarray(x, np.float64).swapaxes(1, 2) for x in cache.layer_kv(layer, jnp.float32))
    r = np.diag(rotation.signs(k.shape[-1])) @ _hadamard(k.shape[-1]) / np.sqrt(k.shape[-1])
    if cache.config.rotates_keys and not cache.config.pre_rope:  # pre-RoPE: read unrotated
        k = k @ r.T
    if cache.config.rotates_values:
        v = v @ r.T
    return k, v


@pytest.mark.parametrize("cfg", ATTENTION_CONFIGS, ids=str)
def test_decode_attention_is_softmax_over_what_the_cache_holds(cfg):
    lengths = [300, 37, 0]
    cache, _, _ = _filled(cfg, lengths)
    q = jax.random.normal(jax.random.key(9), (3, 4, 64))
    got = np.asarray(kj.decode_attention(q, cache, 1, implementation="reference"))
    k, v = _held_model_basis(cache, 1, lengths)
    for row, n in enumerate(lengths):
        for h in range(4):
            if n == 0:
                np.testing.assert_array_equal(got[row, h], 0)
                continue
            s = k[row, h // 2, :n] @ np.asarray(q[row, h], np.float64) / 8
            p = np.exp(s - s.max())
            np.testing.assert_allclose(got[row, h], p @ v[row, h // 2, :n] / p.sum(), atol=2e-5)
    for impl in ("folded", "pallas"):  # the integer-only forms decline, by name
        if impl == "pallas" and cfg.fp8_kernel_layout:  # the fp8 kernel reads it (fp16 operands)
            o = kj.decode_attention(q, cache, 1, implementation=impl, interpret=True)
            np.testing.assert_allclose(np.asarray(o), got, atol=2e-3 * np.abs(got).max())
        elif impl == "pallas" and cfg.prerope_kernel_layout:  # the pre-RoPE kernel (fp16 keys)
            o = kj.decode_attention(q, cache, 1, implementation=impl, interpret=True)
            np.testing.assert_allclose(np.asarray(o), got, atol=4e-3 * np.abs(got).max())
        elif not cfg.plain_kivi:
            with pytest.raises(NotImplementedError):
                kj.decode_attention(q, cache, 1, implementation=impl, interpret=True)


def test_fp8_attention_is_close_to_exact():
    cfg = kj.cache_config("fp8", 64, 0)
    cache, k, v = _filled(cfg, [400, 250])
    dense = kj.DenseCache.init(
        num_layers=2, batch=2, kv_heads=2, head_dim=64, max_len=408, dtype=jnp.float32
    ).prefill(k, v, jnp.array([400, 250], jnp.int32))
    q = jax.random.normal(jax.random.key(3), (2, 4, 64))
    got = kj.decode_attention(q, cache, 0, implementation="reference")
    want = kj.decode_attention(q, dense, 0, implementation="reference")
    # E4M3 keeps 3 mantissa bits: a relative error of at most 2^-4 per element
    np.testing.assert_allclose(got, want, atol=0.03, rtol=0)


@pytest.mark.parametrize("cfg", ATTENTION_CONFIGS, ids=str)
def test_chunk_attention_over_every_format(cfg):
    past = [120, 0]
    cache, _, _ = _filled(cfg, past, seed=4)
    c = 5
    q = jax.random.normal(jax.random.key(5), (2, c, 4, 64))
    k, v = (jax.random.normal(jax.random.key(i), (2, c, 2, 64)) for i in (6, 7))
    counts = jnp.array([5, 2], jnp.int32)
    got = np.asarray(kj.chunk_attention(q, k, v, counts, cache, 1, implementation="reference"))
    hk, hv = _held_model_basis(cache, 1, past)
    for row, h in itertools.product(range(2), range(4)):
        n = past[row]
        for i in range(int(counts[row])):
            keys = np.concatenate([hk[row, h // 2, :n], np.asarray(k[row, : i + 1, h // 2])])
            vals = np.concatenate([hv[row, h // 2, :n], np.asarray(v[row, : i + 1, h // 2])])
            s = keys @ np.asarray(q[row, i, h], np.float64) / 8
            p = np.exp(s - s.max())
            np.testing.assert_allclose(got[row, i, h], p @ vals / p.sum(), atol=2e-5)


@pytest.mark.parametrize(
    "cfg",
    [
        kj.KiviConfig(
            4,
            4,
            32,
            0,
            key_format="nvfp4",
            value_format="mxfp4",
            key_axis="token",
            sinks=3,
            rotation="both",
        ),  # fmt: skip
        kj.KiviConfig(2, 2, 32, 0, sinks=3, rotation="keys", outlier_channels=2),
        kj.KiviConfig(2, 2, 32, 0, sinks=3, rotation="both", pre_rope=True),
    ],
    ids=str,
)
def test_simulated_transform_equals_the_caches_quantization(cfg):
    # The simulated protocol's quantize-dequantize image of a prompt is what a cache with no
    # window stores (per-token formats, sinks, a rotation, outlier key channels): per channel
    # the keys' newest block is still in its window (W = G), so it is compared before that.
    from models.eval.ppl import qdq_transform

    cache, k, v = _filled(cfg, [256], seed=11)
    sk, sv = qdq_transform(cfg, ROPE)(k[0], v[0])  # [B, Hkv, S, D] of layer 0
    hk, hv = _held_model_basis(cache, 0, [256])
    nk = int(cache.keys.num_quantized(jnp.array([256]))[0])
    assert nk == (256 if cfg.key_axis == "token" else 224)
    np.testing.assert_allclose(np.asarray(sk)[:, :, :nk], hk[:, :, :nk], atol=2e-5)
    np.testing.assert_allclose(np.asarray(sv), hv[:, :, :256], atol=2e-5)


def test_best_named_caches_fix_their_group_and_bits():
    best3, best25 = kj.cache_config("best3"), kj.cache_config("best25")
    assert best3.bits_per_element() <= 3.0 and best25.bits_per_element() <= 2.5
    assert (best3.sinks, best3.rotation, best25.group_size) == (8, "both", 64)
    assert best3.pre_rope and best25.pre_rope and not best3.kernel_layout  # not the kernel's
    assert kj.cache_config("best25", 64) == best25  # the same G is accepted
    with pytest.raises(ValueError, match="defined with group_size=64"):
        kj.cache_config("best25", 32)
    with pytest.raises(ValueError, match="defined with sinks=8"):
        kj.cache_config("best3", sinks=4)
    assert kj.cache_config("kivi2").group_size == 32  # names without their own: the default


# ---------------------------------------------------------------------------------------------
# Outlier key channels (dense-and-sparse)


def test_outlier_channels_are_the_widest_of_each_group():
    from kivi_jax.quant import outlier_channels, overlay_outliers

    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 32, 64)).astype(np.float32)  # 3 groups of 32 tokens
    x[0, :, 7] *= 40
    x[0, :, 50] *= 20
    x[1, 3, 9] = 1e6  # beyond float16: saturates at 65504
    x[2, 5, 60] = np.nan  # a non-finite channel ranks first and stays non-finite
    x[2, :, 2] *= 30
    idx, vals = outlier_channels(jnp.asarray(x), 3, jnp.float16)
    span = x.max(1) - x.min(1)
    span = np.where(np.isnan(x).any(1), np.inf, span)
    want = np.argsort(-span, axis=-1, kind="stable")[:, :3]  # ties: the lower channel
    np.testing.assert_array_equal(np.asarray(idx), want)
    assert want[0, 0] == 7 and want[0, 1] == 50 and want[1, 0] == 9 and want[2, 0] == 60
    picked = np.take_along_axis(x, want[:, None, :], axis=-1)
    np.testing.assert_array_equal(
        np.asarray(vals), np.clip(picked, -65504, 65504).astype(np.float16)
    )
    # the overlay puts them back over a reconstruction, channel by channel
    y = overlay_outliers(jnp.zeros_like(x), idx[:, None, :], vals)
    y = np.asarray(y)
    np.testing.assert_array_equal(y[0, :, 7], x[0, :, 7].astype(np.float16))
    assert np.isnan(y[2, 5, 60]) and y[1, 3, 9] == 65504
    assert (y[0][:, np.setdiff1d(np.arange(64), want[0])] == 0).all()


def test_outlier_channels_in_a_cache_are_exact_and_leave_the_codes_alone():
    base = kj.KiviConfig(2, 2, group_size=32, residual_length=32, sinks=2)
    with_outliers = kj.KiviConfig(
        2, 2, group_size=32, residual_length=32, sinks=2, outlier_channels=2
    )
    k, v = (jax.random.normal(jax.random.key(i), (1, 1, 1, 300, 64)) for i in (0, 1))
    k = k.at[..., 11].mul(50.0).at[..., 40].mul(25.0)  # two wide channels, as SmolLM2's keys have
    n = jnp.array([300], jnp.int32)
    made = lambda cfg: kj.KiviCache.init(
        cfg, num_layers=1, batch=1, kv_heads=1, head_dim=64, max_len=300, dtype=jnp.float32
    ).prefill(k, v, n)
    plain, kept = made(base), made(with_outliers)
    got, ref = (np.asarray(c.layer_kv(0)[0][0, :256, 0]) for c in (plain, kept))
    exact = np.asarray(k[0, 0, 0, :256])
    wide = [11, 40]
    np.testing.assert_array_equal(
        ref[2:, wide], exact[2:, wide].astype(np.float16).astype(np.float32)
    )
    others = np.setdiff1d(np.arange(64), wide)
    np.testing.assert_array_equal(ref[:, others], got[:, others])  # the same codes and scales
    assert np.abs(got[2:, wide] - exact[2:, wide]).max() > 1.0  # without: the wide ones suffer
    np.testing.assert_array_equal(  # the values are not touched
        np.asarray(plain.layer_kv(0)[1]), np.asarray(kept.layer_kv(0)[1])
    )
    nb_plain, nb_kept = plain.nbytes(), kept.nbytes()
    groups = kept.keys.capacity // 32  # each: 2 channels of 32 fp16 values, 2 one-byte indices
    assert nb_kept.scales - nb_plain.scales == groups * 2 * (32 * 2 + 1)


def test_bits_per_element_of_outlier_channels_needs_head_dim():
    cfg = kj.KiviConfig(2, 2, 64, outlier_channels=2)
    with pytest.raises(ValueError, match="needs head_dim"):
        cfg.bits_per_element()
    with pytest.raises(ValueError, match=r"needs head_dim in \(8, 256\]"):
        kj.KiviConfig(2, 2, 8, outlier_channels=8).check_head_dim(8)
    assert kj.cache_config("best25", outlier_channels=1).outlier_channels == 1
    with pytest.raises(ValueError, match="no sinks, rotation, outlier channels or pre_rope"):
        kj.cache_config("fp16", outlier_channels=1)


# ---------------------------------------------------------------------------------------------
# Keys quantized before RoPE


def _rope_np(x, t, inv):
    """float64 RoPE of x [..., T, D] at positions t [T] (half-split layout)."""
    ang = t[:, None] * inv
    x1, x2 = np.split(np.asarray(x, np.float64), 2, axis=-1)
    return np.concatenate(
        [x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1
    )


def test_rope_is_the_half_split_rotation():
    x = np.random.default_rng(0).standard_normal((2, 40, 64)).astype(np.float32)
    t = np.arange(40)
    got = rotation.rope(jnp.asarray(x), jnp.asarray(t)[None], ROPE)
    np.testing.assert_allclose(np.asarray(got), _rope_np(x, t, ROPE), atol=2e-5)
    back = rotation.rope(got, -jnp.asarray(t)[None], ROPE)
    np.testing.assert_allclose(np.asarray(back), x, atol=2e-5)


def test_pre_rope_keys_quantize_each_channel_not_its_rotation():
    # Keys whose channels are steady before RoPE (as real keys are, largely): RoPE turns each
    # channel pair by the position, so per channel a group of post-RoPE keys spans the whole
    # circle; before RoPE it spans the noise only.
    rng = np.random.default_rng(1)
    t = np.arange(512)
    pre = rng.standard_normal((1, 1, 1, 1, 64)) * 3 + rng.standard_normal((1, 1, 1, 512, 64)) * 0.1
    k = jnp.asarray(_rope_np(pre, t, ROPE), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, 1, 1, 512, 64)), jnp.float32)
    n = jnp.array([512], jnp.int32)
    made = lambda pre_rope: kj.KiviCache.init(
        kj.KiviConfig(2, 2, 32, 32, pre_rope=pre_rope), num_layers=1, batch=1, kv_heads=1,
        head_dim=64, max_len=512, dtype=jnp.float32, rope_frequencies=ROPE,
    ).prefill(k, v, n)  # fmt: skip
    err = {
        p: np.abs(np.asarray(made(p).layer_kv(0)[0][0, :480, 0]) - np.asarray(k[0, 0, 0, :480]))
        for p in (False, True)
    }
    assert err[True].mean() * 5 < err[False].mean()  # both read back post-RoPE
    # attention reads them at their positions: 8-bit pre-RoPE keys attend as the exact ones
    cache8 = kj.KiviCache.init(
        kj.KiviConfig(8, 8, 32, 32, pre_rope=True), num_layers=1, batch=1, kv_heads=1,
        head_dim=64, max_len=512, dtype=jnp.float32, rope_frequencies=ROPE,
    ).prefill(k, v, n)  # fmt: skip
    dense = kj.DenseCache.init(
        num_layers=1, batch=1, kv_heads=1, head_dim=64, max_len=512, dtype=jnp.float32
    ).prefill(k, v, n)
    q = jax.random.normal(jax.random.key(2), (1, 2, 64)) * 3
    got = kj.decode_attention(q, cache8, 0, implementation="reference")
    want = kj.decode_attention(q, dense, 0, implementation="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=0.02)
    for impl in ("folded", "pallas"):  # they read post-RoPE keys, and decline by name
        with pytest.raises(NotImplementedError):
            kj.decode_attention(q, cache8, 0, implementation=impl, interpret=True)


def test_pre_rope_needs_the_models_frequencies():
    cfg = kj.KiviConfig(2, 2, 32, 32, pre_rope=True)
    dims = dict(num_layers=1, batch=1, kv_heads=1, head_dim=64, max_len=64)
    with pytest.raises(ValueError, match="needs the model's rope_frequencies"):
        kj.KiviCache.init(cfg, **dims)
    with pytest.raises(ValueError, match=r"shaped \[head_dim / 2\] = \[32\]"):
        kj.KiviCache.init(cfg, **dims, rope_frequencies=ROPE[:8])
    with pytest.raises(ValueError, match="pre_rope must be a bool"):
        kj.KiviConfig(pre_rope=1)
    assert kj.KiviCache.init(kj.KiviConfig(), **dims, rope_frequencies=ROPE).key_rope is None
    assert not cfg.kernel_layout

"""Quantize / pack transforms: exact round trips, error bounds, axes, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kivi_jax as kj
from kivi_jax.quant import (
    cache_slot,
    default_plane,
    minmax_quantize,
    pack,
    pack_tokens,
    stored_byte,
    swapped_byte,
    swaps_bytes,
    to_cache_order,
    unpack,
    unpack_tokens,
)


@given(
    bits=st.sampled_from([2, 4, 8]),
    blocks=st.integers(1, 5),
    plane=st.sampled_from([1, 2, 16, 64]),
    rows=st.integers(1, 3),
    axis=st.sampled_from([0, 1]),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_unpack_round_trip_is_exact(bits, blocks, plane, rows, axis, seed):
    n = blocks * plane * (8 // bits)
    shape = (n, rows) if axis == 0 else (rows, n)
    codes = np.random.default_rng(seed).integers(0, 2**bits, shape, dtype=np.uint8)
    packed = pack(codes, bits, axis=axis, plane=plane)
    assert packed.dtype == jnp.uint8
    assert packed.shape[axis] == n // (8 // bits)
    np.testing.assert_array_equal(unpack(packed, bits, axis=axis, plane=plane), codes)


def test_planar_layout_matches_the_documented_rule():
    bits, per, plane = 2, 4, 64
    codes = np.random.default_rng(0).integers(0, 4, (1024,), dtype=np.uint8)
    packed = np.asarray(pack(codes, bits, plane=plane))
    for t in (0, 1, 63, 64, 65, 200, 255, 256, 700, 1023):
        byte = (t // (per * plane)) * plane + t % plane
        j = (t // plane) % per
        assert (packed[byte] >> (bits * j)) & 3 == codes[t]


def test_cache_order_is_an_involution_giving_each_warp_consecutive_tokens():
    """Within each 256-token block token 64a + 16b + c sits in slot 64b + 16a + c: the map is
    its own inverse, keeps blocks, and the rows 16w .. 16w + 15 of the block's four 64-slot
    planes (what warp w of a warpgroup holds) are the 64 consecutive tokens 64w .. 64w + 63."""
    t = np.arange(1024)
    s = cache_slot(t)
    np.testing.assert_array_equal(np.sort(s), t)
    np.testing.assert_array_equal(cache_slot(s), t)
    np.testing.assert_array_equal(s // 256, t // 256)
    assert [cache_slot(x) for x in (0, 15, 16, 63, 64, 255, 256 + 17)] == [
        0,
        15,
        64,
        207,
        16,
        255,
        256 + 65,
    ]
    for w in range(4):
        rows = [256 + 64 * p + 16 * w + r for p in range(4) for r in range(16)]
        assert sorted(cache_slot(np.array(rows)) - 256) == list(range(64 * w, 64 * w + 64))
    x = np.random.default_rng(1).standard_normal((3, 512)).astype(np.float32)
    np.testing.assert_array_equal(to_cache_order(to_cache_order(x, 1), 1), x)
    with pytest.raises(ValueError, match="multiple of 256"):
        to_cache_order(np.zeros((3, 128)), 1)


@pytest.mark.parametrize("bits", [2, 4])
def test_token_packing_is_the_cache_order_then_token_planar(bits):
    """Token t sits in slot cache_slot(t), packed token-planar; in every stored row (the last
    axis) the middle bytes of each four are swapped."""
    per = 8 // bits
    codes = np.random.default_rng(bits).integers(0, 2**bits, (512, 8), dtype=np.uint8)
    packed = np.asarray(pack_tokens(codes, bits, axis=0))
    cols = [0, 2, 1, 3, 4, 6, 5, 7]  # where column c of a row is stored
    assert [int(swapped_byte(c)) for c in range(8)] == cols
    for t in (0, 1, 15, 16, 17, 63, 64, 100, 255, 256, 300, 511):
        s = int(cache_slot(t))
        byte = (s // (per * 64)) * 64 + s % 64
        j = (s // 64) % per
        np.testing.assert_array_equal((packed[byte, cols] >> (bits * j)) & (2**bits - 1), codes[t])
    np.testing.assert_array_equal(unpack_tokens(packed, bits, axis=0), codes)
    # values: the packed axis is the row
    packed_t = np.asarray(pack_tokens(codes.T, bits, axis=1))
    for t in (0, 1, 17, 300):
        s = int(cache_slot(t))
        byte = (s // (per * 64)) * 64 + s % 64
        np.testing.assert_array_equal(
            (packed_t[:, int(swapped_byte(byte))] >> (bits * ((s // 64) % per))) & (2**bits - 1),
            codes[t],
        )
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_tokens(codes[:, :3], bits, axis=0)


def test_8_bit_rows_are_stored_unswapped():
    """8-bit elements (fp8) are stored in the cache order without the byte swap, so the key row
    of a slot and the V^T column of that slot hold the same token (pallas_kernels.layout)."""
    codes = np.random.default_rng(8).integers(0, 256, (512, 8), dtype=np.uint8)
    assert not swaps_bytes(8) and swaps_bytes(4) and swaps_bytes(2)
    slots = cache_slot(np.arange(512))
    packed = np.asarray(pack_tokens(codes, 8, axis=0))  # keys: token-major rows
    np.testing.assert_array_equal(packed[slots], codes)
    packed_t = np.asarray(pack_tokens(codes.T, 8, axis=1))  # values: V^T, tokens on the row
    np.testing.assert_array_equal(packed_t[:, slots], codes.T)
    np.testing.assert_array_equal(unpack_tokens(packed, 8, axis=0), codes)
    assert [int(stored_byte(c, 8)) for c in range(8)] == list(range(8))
    assert [int(stored_byte(c, 2)) for c in range(8)] == [0, 2, 1, 3, 4, 6, 5, 7]


@given(
    bits=st.sampled_from([2, 4, 8]),
    group=st.sampled_from([8, 16, 32, 64]),
    groups=st.integers(1, 4),
    other=st.sampled_from([8, 16, 64]),
    axis=st.sampled_from(["channel", "token"]),
    scale_dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_dequantization_error_is_at_most_half_a_step(
    bits, group, groups, other, axis, scale_dtype, seed
):
    rng = np.random.default_rng(seed)
    shape = (2, group * groups, other) if axis == "channel" else (2, other, group * groups)
    x = (rng.standard_normal(shape) * rng.uniform(0.1, 10)).astype(np.float32)
    q = kj.quantize(x, bits, group, axis, scale_dtype)
    xh = np.asarray(kj.dequantize(q, jnp.float32))
    assert q.shape == x.shape and xh.shape == x.shape
    scale = np.asarray(q.scale, np.float32)
    step = np.repeat(scale, group, axis=-2 if axis == "channel" else -1)
    # Half a step, plus float32 rounding of the reconstruction code * scale + min itself
    # (whose terms are as large as the group's range).
    bound = step / 2 + 8 * np.finfo(np.float32).eps * np.abs(x).max()
    assert np.all(np.abs(xh - x) <= bound)


def test_constant_group_round_trips_exactly_without_nan():
    x = jnp.concatenate([jnp.full((1, 32, 8), 0.375), jnp.full((1, 32, 8), -2.0)], axis=1)
    for bits in (2, 4, 8):
        for axis in ("channel", "token"):
            q = kj.quantize(x.astype(jnp.float16), bits, 32 if axis == "channel" else 8, axis)
            xh = kj.dequantize(q, jnp.float32)
            assert np.all(np.isfinite(xh))
            np.testing.assert_array_equal(xh, x)


def test_keys_are_per_channel_and_values_per_token():
    cfg = kj.KiviConfig(group_size=32)
    x = jax.random.normal(jax.random.key(0), (3, 128, 64))
    qk, qv = kj.quantize_keys(x, cfg), kj.quantize_values(x, cfg)
    assert qk.scale.shape == (3, 128 // 32, 64)  # one per channel per 32 tokens
    assert qv.scale.shape == (3, 128, 64 // 32)  # one per token per 32 channels
    assert qk.codes.shape == (3, 128 // 4, 64) and qv.codes.shape == (3, 128, 64 // 4)


def test_per_channel_keys_beat_per_token_keys_with_outlier_channels():
    rng = np.random.default_rng(1)
    k = rng.standard_normal((4, 256, 64)).astype(np.float32)
    outliers = [3, 17, 40]
    k[..., outliers] *= 25.0  # fixed outlier channels, as KIVI observes in real keys
    normal = np.setdiff1d(np.arange(64), outliers)
    q = rng.standard_normal((4, 8, 64)).astype(np.float32)
    logits = q @ k.transpose(0, 2, 1)
    for bits in (2, 4):
        mse, logit_err = {}, {}
        for axis in ("channel", "token"):
            kh = np.asarray(kj.dequantize(kj.quantize(k, bits, 32, axis)))
            mse[axis] = float(np.mean((kh - k)[..., normal] ** 2))
            logit_err[axis] = float(
                np.linalg.norm(q @ kh.transpose(0, 2, 1) - logits) / np.linalg.norm(logits)
            )
        # Per-token groups stretch every channel's step to the outliers' range; per-channel
        # groups confine the damage to the outlier channels themselves.
        assert mse["channel"] < 0.1 * mse["token"], mse
        assert logit_err["channel"] < logit_err["token"], logit_err


def test_minmax_quantize_is_jit_and_vmap_safe():
    x = jax.random.normal(jax.random.key(3), (5, 4, 32))
    f = jax.jit(jax.vmap(lambda a: minmax_quantize(a, 2, axis=-1)))
    codes, scale, mn = f(x)
    c2, s2, m2 = minmax_quantize(x, 2, axis=-1)
    np.testing.assert_array_equal(codes, c2)
    np.testing.assert_array_equal(scale, s2)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(key_bits=3), "key_bits"),
        (dict(value_bits=1), "value_bits"),
        (dict(group_size=48), "group_size"),
        (dict(group_size=32, residual_length=100), "residual_length"),
        (dict(residual_length=-32), "residual_length"),
        (dict(scale_dtype="int8"), "scale_dtype"),
        (dict(key_axis="row"), "key_axis"),
    ],
)
def test_bad_config_raises_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        kj.KiviConfig(**kwargs)


def test_config_is_hashable_and_frozen():
    a, b = kj.KiviConfig(), kj.KiviConfig()
    assert hash(a) == hash(b) and a == b
    with pytest.raises(AttributeError):
        a.key_bits = 4


def test_bad_transform_inputs_raise():
    cfg = kj.KiviConfig(group_size=32)
    with pytest.raises(ValueError, match="T=40"):
        kj.quantize_keys(jnp.ones((40, 64)), cfg)
    with pytest.raises(ValueError, match="D=48"):
        kj.quantize_values(jnp.ones((32, 48)), cfg)
    with pytest.raises(ValueError, match="floating"):
        kj.quantize_keys(jnp.ones((32, 64), jnp.int32), cfg)
    with pytest.raises(ValueError, match="bits"):
        pack(jnp.zeros((8,), jnp.uint8), 3)
    with pytest.raises(ValueError, match="plane"):
        pack(jnp.zeros((8,), jnp.uint8), 2, plane=64)
    assert default_plane(1024, 2) == 64 and default_plane(32, 2) == 8


def _group_mask(bad: np.ndarray, group: int, axis: str) -> np.ndarray:
    """Elements of [..., T, D] sharing a quantization group with a True element of `bad`."""
    *lead, t, d = bad.shape
    if axis == "channel":
        g = bad.reshape(*lead, t // group, group, d).any(axis=-2, keepdims=True)
        return np.broadcast_to(g, (*lead, t // group, group, d)).reshape(bad.shape)
    g = bad.reshape(*lead, t, d // group, group).any(axis=-1, keepdims=True)
    return np.broadcast_to(g, (*lead, t, d // group, group)).reshape(bad.shape)


@given(
    bits=st.sampled_from([2, 4, 8]),
    group=st.sampled_from([8, 16, 32]),
    groups=st.integers(1, 3),
    other=st.sampled_from([8, 16]),
    lead=st.integers(1, 3),
    axis=st.sampled_from(["channel", "token"]),
    scale_dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
    bad=st.sampled_from([np.nan, np.inf, -np.inf]),
    nbad=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_a_non_finite_group_dequantizes_to_nan_and_leaves_the_others_alone(
    bits, group, groups, other, lead, axis, scale_dtype, bad, nbad, seed
):
    """docs/what_happens_when.md: at every shape, a group holding a NaN or an infinity gets NaN
    scale and minimum and codes 0 (all of it dequantizes to NaN); every other group's codes,
    scale and minimum are those of the same tensor without the bad values."""
    rng = np.random.default_rng(seed)
    shape = (lead, group * groups, other) if axis == "channel" else (lead, other, group * groups)
    x = rng.standard_normal(shape).astype(np.float32)
    y = x.copy()
    flat = rng.choice(x.size, nbad, replace=False)
    y.reshape(-1)[flat] = bad
    want = _group_mask(~np.isfinite(y), group, axis)
    qx = kj.quantize(x, bits, group, axis, scale_dtype)
    qy = kj.quantize(y, bits, group, axis, scale_dtype)
    yh = np.asarray(kj.dequantize(qy, jnp.float32))
    np.testing.assert_array_equal(np.isnan(yh), want)
    np.testing.assert_array_equal(yh[~want], np.asarray(kj.dequantize(qx, jnp.float32))[~want])
    gax = 1 if axis == "channel" else 2
    codes = np.asarray(unpack(qy.codes, bits, axis=gax, plane=qy.plane))
    np.testing.assert_array_equal(codes[want], 0)
    np.testing.assert_array_equal(
        codes[~want], np.asarray(unpack(qx.codes, bits, axis=gax, plane=qx.plane))[~want]
    )
    per_group = want[:, ::group] if axis == "channel" else want[..., ::group]
    for got, ref in ((qy.scale, qx.scale), (qy.minimum, qx.minimum)):
        got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
        np.testing.assert_array_equal(np.isnan(got), per_group)
        np.testing.assert_array_equal(got[~per_group], ref[~per_group])


# Finite float32 values of every magnitude, with ordinary ones mixed in so that groups hold both
# (one outlier among small values is the case that overflowed float16 scales).
_ANY_FINITE = st.one_of(
    st.floats(width=32, allow_nan=False, allow_infinity=False),
    st.floats(-10, 10, width=32),
)


@given(
    bits=st.sampled_from([2, 4, 8]),
    group=st.sampled_from([8, 16]),
    axis=st.sampled_from(["channel", "token"]),
    scale_dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
    data=st.data(),
)
def test_finite_input_never_gives_nan_or_inf_and_saturates_within_the_bound(
    bits, group, axis, scale_dtype, data
):
    """docs/what_happens_when.md: scales and minimums of finite input are finite; an element
    reconstructs within scale / 2 of itself clipped to the scale dtype's range +-M (plus float32
    rounding, float32 subnormals flushed to zero, and for a constant group the rounding of its
    value to the scale dtype)."""
    from hypothesis.extra.numpy import arrays

    shape = (2, 2 * group, 8) if axis == "channel" else (2, 8, 2 * group)
    x = data.draw(arrays(np.float32, shape, elements=_ANY_FINITE))
    q = kj.quantize(x, bits, group, axis, scale_dtype)
    scale = np.asarray(q.scale, np.float64)
    assert np.all(np.isfinite(scale)) and np.all(np.isfinite(np.asarray(q.minimum, np.float32)))
    xh = np.asarray(kj.dequantize(q, jnp.float32), np.float64)
    assert np.all(np.isfinite(xh))
    fi = jnp.finfo(scale_dtype)
    c = np.clip(x.astype(np.float64), -float(fi.max), float(fi.max))
    step = np.repeat(scale, group, axis=-2 if axis == "channel" else -1)
    rounding = np.where(step == 0, float(fi.eps) * np.abs(c) + float(fi.smallest_subnormal), 0)
    # XLA flushes float32 subnormals (|x| < 1.2e-38) to zero: an absolute error below that
    ftz = float(np.finfo(np.float32).tiny)
    bound = step / 2 + 8 * np.finfo(np.float32).eps * np.abs(c).max() + rounding + ftz
    assert np.all(np.abs(xh - c) <= bound)

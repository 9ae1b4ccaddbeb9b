"""Bad input to the library, case by case (docs/what_happens_when.md, "Library"): every row
either raises a ValueError naming the argument, or checks the documented non-silent outcome
(NaN exactly where the bad value reaches, the overflow flag, a saturated value within its
bound). Nothing here may pass by producing a plausible finite answer."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import kivi_jax as kj

B, H, HQ, D = 3, 2, 4, 64
F16_MAX = 65504.0


@functools.cache
def _empty(name: str, num_layers: int = 1, max_len: int = 256):
    return kj.make_cache(
        name,
        num_layers=num_layers,
        batch=B,
        kv_heads=H,
        head_dim=D,
        max_len=max_len,
        dtype=jnp.float32,
        residual_length=32,
    )


def _kv(seed: int, s: int, num_layers: int = 1):
    k1, k2 = jax.random.split(jax.random.key(seed))
    shape = (num_layers, B, H, s, D)
    return np.array(jax.random.normal(k1, shape)), np.array(jax.random.normal(k2, shape))


def _q(seed: int = 9):
    return jax.random.normal(jax.random.key(seed), (B, HQ, D))


def _x(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Errors: (call, the argument the message must name). Every one is a ValueError.


def _attend(name, layer, **kw):
    return lambda: kj.decode_attention(_q(), _empty(name), layer, **kw)


ERRORS = [
    # kj.quantize's own arguments (it used to skip KiviConfig's checks)
    ("quantize group_size=0", lambda: kj.quantize(_x((1, 64, 64)), 2, 0, "channel"), "group_size"),
    (
        "quantize group_size<0",
        lambda: kj.quantize(_x((1, 64, 64)), 2, -32, "channel"),
        "group_size",
    ),
    (
        "quantize group_size=32.",
        lambda: kj.quantize(_x((1, 64, 64)), 2, 32.0, "token"),
        "group_size",
    ),
    (
        "quantize group_size=True",
        lambda: kj.quantize(_x((1, 64, 64)), 2, True, "token"),
        "group_size",
    ),
    ("quantize bits=3", lambda: kj.quantize(_x((1, 64, 64)), 3, 32, "channel"), "bits"),
    ("quantize bits=2.", lambda: kj.quantize(_x((1, 64, 64)), 2.0, 32, "channel"), "bits"),
    ("quantize axis", lambda: kj.quantize(_x((1, 64, 64)), 2, 32, "row"), "axis"),
    (
        "quantize scale_dtype=int8",
        lambda: kj.quantize(_x((1, 64, 64)), 2, 32, "channel", "int8"),
        "scale_dtype",
    ),
    (
        "quantize scale_dtype=abc",
        lambda: kj.quantize(_x((1, 64, 64)), 2, 32, "channel", "abc"),
        "scale_dtype",
    ),
    (
        "dequantize dtype=int8",
        lambda: kj.dequantize(kj.quantize(_x((1, 64, 64)), 2, 32, "channel"), jnp.int8),
        "dtype",
    ),
    # KiviConfig: bit widths and sizes are Python ints (2.0 and True used to pass)
    ("config key_bits=2.", lambda: kj.KiviConfig(key_bits=2.0), "key_bits"),
    ("config value_bits=True", lambda: kj.KiviConfig(value_bits=True), "value_bits"),
    ("config group_size=32.", lambda: kj.KiviConfig(group_size=32.0), "group_size"),
    (
        "config residual_length=False",
        lambda: kj.KiviConfig(residual_length=False),
        "residual_length",
    ),
    (
        "config residual_length=128.",
        lambda: kj.KiviConfig(residual_length=128.0),
        "residual_length",
    ),
    ("config scale_dtype type", lambda: kj.KiviConfig(scale_dtype=jnp.float16), "scale_dtype"),
    # decode_attention: the softmax scale
    ("attention scale=abc", _attend("kivi2", 0, scale="abc"), "scale"),
    ("attention scale=0", _attend("kivi2", 0, scale=0.0), "scale"),
    ("attention scale<0", _attend("kivi2", 0, scale=-0.125), "scale"),
    ("attention scale=nan", _attend("kivi2", 0, scale=float("nan")), "scale"),
    ("attention scale=inf", _attend("fp16", 0, scale=float("inf")), "scale"),
    ("attention scale=True", _attend("fp16", 0, scale=True), "scale"),
    ("attention scale=array", _attend("fp16", 0, scale=np.ones(2)), "scale"),
    (
        "attention scale traced",
        lambda: jax.jit(lambda s: kj.decode_attention(_q(), _empty("fp16"), 0, scale=s))(0.1),
        "scale",
    ),
    # decode_attention: a concrete layer outside [0, L) (it used to answer for layer 0)
    ("attention layer=7 reference", _attend("kivi2", 7, implementation="reference"), "layer"),
    ("attention layer=7 folded", _attend("kivi2", 7, implementation="folded"), "layer"),
    ("attention layer=7 dense", _attend("fp16", 7), "layer"),
    ("attention layer=-1", _attend("kivi2", -1, implementation="reference"), "layer"),
    ("attention layer=np.int64(1)", _attend("kivi2", np.int64(1)), "layer"),
    ("attention layer=jnp.int32(3)", _attend("fp16", jnp.int32(3)), "layer"),
    ("attention layer=0.", _attend("kivi2", 0.0), "layer"),
    ("attention layer=True", _attend("fp16", True), "layer"),
    # write: numpy integers are concrete too (only Python ints used to be checked)
    (
        "write layer=np.int64(1)",
        lambda: (
            _empty("kivi2").advance().write(np.int64(1), jnp.ones((B, H, D)), jnp.ones((B, H, D)))
        ),
        "layer",
    ),
    (
        "write layer=-1",
        lambda: _empty("fp16").advance().write(-1, jnp.ones((B, H, D)), jnp.ones((B, H, D))),
        "layer",
    ),
    # prefill: concrete lengths outside [0, S]
    (
        "prefill lengths<0",
        lambda: _empty("kivi2").prefill(*map(jnp.asarray, _kv(0, 100)), jnp.array([-3, 5, 5])),
        "lengths",
    ),
    (
        "prefill lengths>S",
        lambda: _empty("fp16").prefill(*map(jnp.asarray, _kv(0, 100)), jnp.array([150, 5, 5])),
        "lengths",
    ),
]


@pytest.mark.parametrize("call, argument", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_bad_argument_raises_a_value_error_naming_it(call, argument):
    with pytest.raises(ValueError, match=rf"\b{argument}\b") as info:
        call()
    assert type(info.value) is ValueError  # not a subclass from deep inside jax or numpy


# ---------------------------------------------------------------------------------------------
# Quantization of non-finite and out-of-range values.


@pytest.mark.parametrize("shape", [(2, 64, 64), (1, 32, 64), (3, 96, 8)], ids=str)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=str)
def test_a_non_finite_value_makes_exactly_its_group_nan_at_every_shape(shape, bad):
    """XLA's CPU min/max skip NaN at some shapes: (2, 64, 64) used to give no NaN at all."""
    x = _x(shape)
    x[0, 5, 7] = bad
    xh = np.asarray(kj.dequantize(kj.quantize(x, 2, 32, "channel")))
    want = np.zeros(shape, bool)
    want[0, :32, 7] = True  # channel 7 of tokens 0..31: the group of token 5
    np.testing.assert_array_equal(np.isnan(xh), want)


def _error_bound(q, group, axis):
    step = np.repeat(np.asarray(q.scale, np.float64), group, axis=-2 if axis == "channel" else -1)
    return step / 2


def test_float16_scales_saturate_large_values_within_half_a_step_of_65504():
    """randn * 1e5 used to dequantize to all NaN (range / 3 > 65504 overflowed the scale)."""
    x = _x((1, 64, 64)) * 1e5
    q = kj.quantize(x, 2, 32, "channel")
    xh = np.asarray(kj.dequantize(q), np.float64)
    assert np.all(np.isfinite(xh))
    c = np.clip(x, -F16_MAX, F16_MAX)
    assert np.all(np.abs(xh - c) <= _error_bound(q, 32, "channel") + 1e-3)
    assert (np.abs(x) > F16_MAX).any()  # the case saturates: some element is beyond 65504
    # float32 scales hold the same data without saturating: within half a step of x itself
    q32 = kj.quantize(x, 2, 32, "channel", "float32")
    xh32 = np.asarray(kj.dequantize(q32), np.float64)
    assert np.all(np.abs(xh32 - x) <= _error_bound(q32, 32, "channel") * (1 + 1e-6))


@pytest.mark.parametrize("outlier", [1e30, -1e30])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_one_huge_outlier_saturates_its_group_and_touches_no_other(outlier, axis):
    """One 1e30 used to turn the 32 elements of its group into NaN."""
    x = _x((1, 64, 64), seed=3)
    y = x.copy()
    y[0, 3, 5] = outlier
    q, qx = kj.quantize(y, 2, 32, axis), kj.quantize(x, 2, 32, axis)
    yh = np.asarray(kj.dequantize(q), np.float64)
    assert np.all(np.isfinite(yh))
    bound = _error_bound(q, 32, axis)
    assert abs(yh[0, 3, 5] - np.sign(outlier) * F16_MAX) <= bound[0, 3, 5]
    assert np.all(np.abs(yh - np.clip(y, -F16_MAX, F16_MAX)) <= bound + 1e-3)
    group = np.zeros(x.shape, bool)
    if axis == "channel":
        group[0, :32, 5] = True
    else:
        group[0, 3, :32] = True
    np.testing.assert_array_equal(yh[~group], np.asarray(kj.dequantize(qx), np.float64)[~group])


@pytest.mark.parametrize("value", [1e30, -1e30, 7e4])
def test_a_constant_group_beyond_65504_comes_back_saturated_not_inf(value):
    x = np.full((1, 32, 8), value, np.float32)
    for axis, g in (("channel", 32), ("token", 8)):
        xh = np.asarray(kj.dequantize(kj.quantize(x, 2, g, axis)))
        np.testing.assert_array_equal(xh, np.sign(value) * F16_MAX)
        # bfloat16 and float32 scales reach 3.4e38: the value comes back as the scale dtype has it
        xb = np.asarray(kj.dequantize(kj.quantize(x, 2, g, axis, "bfloat16")))
        np.testing.assert_array_equal(xb, np.float32(jnp.asarray(value, jnp.bfloat16)))


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_a_group_spanning_the_float32_range_keeps_its_codes(axis, scale_dtype, bits):
    """Found by the thorough property run: a scale above 2^126 has a subnormal reciprocal,
    which XLA flushes to zero, so every code came out 0 (3e38 reconstructed as 0)."""
    x = np.zeros((1, 32, 32), np.float32)
    # group 0: [0, 3e38]; group 1: [-3e38, 3e38], whose max - min overflows float32 too
    idx = (
        [(0, 1, 0), (0, 1, 1), (0, 2, 1)]
        if axis == "channel"
        else [(0, 0, 1), (0, 1, 1), (0, 1, 2)]
    )
    for i, value in zip(idx, (3e38, 3e38, -3e38), strict=True):
        x[i] = value
    xh = np.asarray(kj.dequantize(kj.quantize(x, bits, 32, axis, scale_dtype)))
    assert np.all(np.isfinite(xh))
    for i in idx:
        np.testing.assert_allclose(xh[i], x[i], rtol=1e-2, err_msg=str(i))


def test_float16_data_at_the_edge_of_its_range_dequantizes_to_finite_float16():
    """The rounded-up scale puts the top code up to half a step past the group's max: 65536 in
    float32, which used to round to Inf on the way back to float16."""
    x = np.linspace(-F16_MAX, F16_MAX, 32 * 8, dtype=np.float32).reshape(1, 32, 8)
    x = x.astype(np.float16)
    q = kj.quantize(x, 2, 32, "channel")
    raw = np.asarray(q.scale, np.float32) * 3 + np.asarray(q.minimum, np.float32)
    assert (raw > F16_MAX).any()  # the reconstruction does overshoot 65504 here
    xh = np.asarray(kj.dequantize(q))
    assert xh.dtype == np.float16 and np.all(np.isfinite(xh))
    assert np.abs(xh.astype(np.float32)).max() == F16_MAX


# ---------------------------------------------------------------------------------------------
# Non-finite keys and values in the caches: NaN exactly in the rows, heads and channels that
# attend to them, whether prefilled or streamed, quantized or still in the residual window;
# every other output bit for bit as without them.

S0, N = 64, 40  # stream: prefill S0 tokens, then append N (final length 104)
BAD_ROW, BAD_HEAD, BAD_CHANNEL = 1, 1, 7
# at length 104 with R = G = 32: keys quantized up to 96, values up to 72
POSITIONS = {"quantized": 66, "residual": 100}

_attend_jit = jax.jit(kj.decode_attention, static_argnames=("implementation",))


@functools.cache
def _append():
    return jax.jit(lambda c, k, v: c.append(k, v))


def _fill(name, k, v, path):
    empty = _empty(name)
    total = S0 + N
    if path == "prefill":
        return empty.prefill(jnp.asarray(k), jnp.asarray(v), jnp.full((B,), total, jnp.int32))
    c = empty.prefill(jnp.asarray(k[..., :S0, :]), jnp.asarray(v[..., :S0, :]), jnp.full(B, S0))
    for t in range(S0, total):
        c = _append()(c, jnp.asarray(k[:, :, :, t]), jnp.asarray(v[:, :, :, t]))
    return c


def _impls(name):
    return ("reference", "folded") if name == "kivi2" else ("reference", "auto")


@functools.cache
def _clean_outputs(name, path):
    k, v = _kv(1, S0 + N)
    c = _fill(name, k, v, path)
    return {impl: np.asarray(_attend_jit(_q(), c, 0, implementation=impl)) for impl in _impls(name)}


def _expected_nan(name, which, where):
    """[B, Hq, D] mask of the non-finite outputs: the query heads of the bad row's bad kv
    head; a key reaches every channel (through the logits), a value only its own (residual,
    dense) or its group of G channels (quantized per token)."""
    want = np.zeros((B, HQ, D), bool)
    heads = slice(BAD_HEAD * HQ // H, (BAD_HEAD + 1) * HQ // H)
    if which == "k":
        want[BAD_ROW, heads] = True
    elif name == "kivi2" and where == "quantized":
        want[BAD_ROW, heads, :32] = True
    else:
        want[BAD_ROW, heads, BAD_CHANNEL] = True
    return want


NON_FINITE = [
    pytest.param(name, which, where, path, bad, id=f"{name}-{which}-{where}-{path}-{bad}")
    for name in ("kivi2", "fp16")
    for which in ("k", "v")
    for where in ("quantized", "residual")
    for path in ("prefill", "stream")
    for bad in ("nan", "inf")
    if not (name == "fp16" and where == "quantized")  # a dense cache has one region
]


@pytest.mark.parametrize("name, which, where, path, bad", NON_FINITE)
def test_a_non_finite_key_or_value_gives_nan_exactly_where_it_is_attended(
    name, which, where, path, bad
):
    k, v = _kv(1, S0 + N)
    (k if which == "k" else v)[0, BAD_ROW, BAD_HEAD, POSITIONS[where], BAD_CHANNEL] = (
        np.nan if bad == "nan" else -np.inf
    )
    c = _fill(name, k, v, path)
    want = _expected_nan(name, which, where)
    # A quantized group and a key (through the logits) give NaN; an infinite value held in
    # full precision (the residual window, a dense cache) gives a non-finite output channel.
    full_precision_inf = bad == "inf" and which == "v" and (name == "fp16" or where == "residual")
    clean = _clean_outputs(name, path)
    for impl in _impls(name):
        got = np.asarray(_attend_jit(_q(), c, 0, implementation=impl))
        np.testing.assert_array_equal(~np.isfinite(got), want, err_msg=impl)
        if not full_precision_inf:  # which passes through IEEE arithmetic: -inf or NaN
            assert np.all(np.isnan(got[want])), impl
        np.testing.assert_array_equal(got[~want], clean[impl][~want], err_msg=impl)
    if path == "stream":  # streaming still equals bulk prefill bit for bit, NaN included
        bulk = _fill(name, k, v, "prefill")
        for a, b in zip(jax.tree.leaves(c), jax.tree.leaves(bulk), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", ["kivi2", "fp16"])
def test_nan_in_prompt_padding_past_a_rows_length_is_never_stored(name):
    k, v = _kv(2, 128)
    lengths = jnp.array([128, 40, 100], jnp.int32)
    k[0, 1, :, 40:] = np.nan  # row 1 holds 40 tokens: the rest is padding
    v[0, 1, :, 40:] = np.nan
    c = _empty(name).prefill(jnp.asarray(k), jnp.asarray(v), lengths)
    for impl in _impls(name):
        assert np.all(np.isfinite(_attend_jit(_q(), c, 0, implementation=impl))), impl


def test_the_pallas_kernel_reads_a_nan_scale_as_nan():
    """The kernel folds the key scale into q and takes log2 of the value scale: a NaN group
    reaches its output as in the reference. Under the GPU interpreter on CPU; natively (PTX
    max/min semantics) on a Hopper GPU."""
    from kivi_jax.attention import pallas_available

    on_gpu = pallas_available()
    if not on_gpu and jax.default_backend() != "cpu":
        pytest.skip("needs a Hopper GPU or the CPU interpreter")
    cache = kj.make_cache(
        "kivi2", num_layers=1, batch=2, kv_heads=1, head_dim=D, max_len=512, dtype=jnp.bfloat16
    )
    q = jax.random.normal(jax.random.key(3), (2, 4, D)).astype(jnp.bfloat16)
    for which in ("k", "v"):
        k, v = (a[:, :2, :1] for a in _kv(4, 512))
        (k if which == "k" else v)[0, 0, 0, 5, 7] = np.nan
        c = cache.prefill(
            jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16), jnp.full(2, 512)
        )
        ref = np.asarray(kj.decode_attention(q, c, 0, implementation="reference"), np.float32)
        got = kj.decode_attention(q, c, 0, implementation="pallas", interpret=not on_gpu)
        got = np.asarray(got, np.float32)
        assert np.isnan(ref[0]).any() and not np.isnan(ref[1]).any()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg=which)


# ---------------------------------------------------------------------------------------------
# Traced arguments that cannot raise: prefill lengths and layer indices under jit.


@functools.cache
def _prefill_jit():
    return jax.jit(lambda c, k, v, l: c.prefill(k, v, l))


@pytest.mark.parametrize("name", ["kivi2", "fp16"])
def test_prefill_under_jit_flags_rows_with_lengths_outside_0_to_s(name):
    """[-3, 150] with S = 100 used to be accepted: the row claimed tokens never written and
    `overflowed` stayed False."""
    k, v = map(jnp.asarray, _kv(5, 100))
    c = _empty(name)
    got = _prefill_jit()(c, k, v, jnp.array([-3, 150, 60], jnp.int32))
    np.testing.assert_array_equal(got.overflowed, [True, True, False])
    with pytest.raises(ValueError, match=r"rows \[0, 1\].*lengths outside \[0, S\]"):
        kj.check_capacity(got)
    # the valid row is what a host prefill stores
    host = c.prefill(k, v, jnp.array([0, 100, 60], jnp.int32))
    for impl in _impls(name):
        a = _attend_jit(_q(), got, 0, implementation=impl)
        b = _attend_jit(_q(), host, 0, implementation=impl)
        np.testing.assert_array_equal(a[2], b[2], err_msg=impl)
    # a flagged row stays flagged: its later tokens are dropped, as past capacity
    tok = jnp.ones((1, B, H, D))
    np.testing.assert_array_equal(_append()(got, tok, tok).overflowed, [True, True, False])
    err, _ = checkify.checkify(_prefill_jit(), errors=checkify.user_checks)(
        c, k, v, jnp.array([-3, 150, 60], jnp.int32)
    )
    with pytest.raises(Exception, match="lengths"):
        err.throw()
    # valid traced lengths: no error, and bit for bit the host prefill
    err, ok = checkify.checkify(_prefill_jit(), errors=checkify.user_checks)(
        c, k, v, jnp.array([0, 100, 60], jnp.int32)
    )
    assert err.get() is None
    for a, b in zip(jax.tree.leaves(ok), jax.tree.leaves(host), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", ["kivi2", "fp16"])
def test_prefill_under_jit_checks_lengths_closed_over_as_constants(name):
    """Lengths captured by the jitted function (not passed to it) are concrete: they are
    checked, and the check itself must not be traced (it raised TracerBoolConversionError)."""
    k, v = map(jnp.asarray, _kv(5, 100))
    c = _empty(name)
    good = jnp.array([0, 100, 60], jnp.int32)
    got = jax.jit(lambda c, k, v: c.prefill(k, v, good))(c, k, v)
    host = c.prefill(k, v, good)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(host), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    bad = jnp.array([-3, 150, 60], jnp.int32)
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, S=100\]"):
        jax.jit(lambda c, k, v: c.prefill(k, v, bad))(c, k, v)


@pytest.mark.parametrize(
    "name, impl", [("kivi2", "reference"), ("kivi2", "folded"), ("fp16", "auto")]
)
def test_a_traced_layer_out_of_range_gives_nan_never_another_layers_answer(name, impl):
    k, v = map(jnp.asarray, _kv(6, 100, num_layers=2))
    c = _empty(name, num_layers=2).prefill(k, v, jnp.array([100, 50, 70], jnp.int32))
    f = jax.jit(lambda q, c, l: kj.decode_attention(q, c, l, implementation=impl))
    for bad in (2, 7, -1):
        assert np.all(np.isnan(f(_q(), c, bad))), bad
    # in range, the traced layer is that layer (eager and jitted differ in float32 rounding)
    got, eager = f(_q(), c, 1), kj.decode_attention(_q(), c, 1, implementation=impl)
    np.testing.assert_allclose(got, eager, rtol=1e-5, atol=1e-6)
    assert not np.allclose(got, kj.decode_attention(_q(), c, 0, implementation=impl))
    err, _ = checkify.checkify(f, errors=checkify.user_checks)(_q(), c, 7)
    with pytest.raises(Exception, match="layer"):
        err.throw()


@pytest.mark.parametrize("window", [32, 64], ids=["tail-merged-outside", "windows-in-kernel"])
def test_a_traced_layer_out_of_range_gives_nan_through_the_kernel(window):
    """ "pallas" (under the interpreter) applies the layer policy inside the kernel, with no
    launch around it: NaN for a layer outside [0, L), that layer's answer in range."""
    c = kj.make_cache(
        "kivi2",
        num_layers=2,
        batch=B,
        kv_heads=H,
        head_dim=D,
        max_len=256,
        dtype=jnp.bfloat16,
        residual_length=window,
        group_size=32,
    )
    k, v = (jnp.asarray(x, jnp.bfloat16) for x in _kv(6, 200, num_layers=2))
    c = c.prefill(k, v, jnp.array([200, 50, 0], jnp.int32))
    q = _q().astype(jnp.bfloat16)
    attend = functools.partial(kj.decode_attention, implementation="pallas", interpret=True)
    f = jax.jit(lambda q, c, l: attend(q, c, l))
    for bad in (2, -1):
        assert np.all(np.isnan(np.asarray(f(q, c, bad), np.float32))), bad
    got = np.asarray(f(q, c, 1), np.float32)
    np.testing.assert_array_equal(got, np.asarray(attend(q, c, 1), np.float32))
    ref = kj.decode_attention(q, c, 1, implementation="reference")
    np.testing.assert_allclose(got, np.asarray(ref, np.float32), atol=3e-2, rtol=0)


@pytest.mark.parametrize("name", ["kivi2", "fp16"])
def test_a_traced_write_to_a_layer_out_of_range_is_dropped_in_every_layer(name):
    """Clamped, the write used to land in part of the last layer (the key window only)."""
    c = _empty(name, num_layers=2).advance()
    tok = jnp.full((B, H, D), 3.0)
    w = jax.jit(lambda c, l: c.write(l, tok, tok))
    for bad in (2, -1):
        for a, b in zip(jax.tree.leaves(w(c, bad)), jax.tree.leaves(c), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    wrote = w(c, 1)
    assert any(
        not np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(wrote), jax.tree.leaves(c), strict=True)
    )
    err, _ = checkify.checkify(w, errors=checkify.user_checks)(c, 2)
    with pytest.raises(Exception, match="layer"):
        err.throw()


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", ["kivi2", "fp16"])
def test_a_non_finite_query_gives_nan_in_its_own_head_only(name, bad):
    k, v = map(jnp.asarray, _kv(7, 100))
    c = _empty(name).prefill(k, v, jnp.array([100, 50, 70], jnp.int32))
    q = np.array(_q())
    q[1, 2, 3] = float(bad)
    want = np.zeros(q.shape, bool)
    want[1, 2] = True
    for impl in _impls(name):
        got = np.asarray(_attend_jit(jnp.asarray(q), c, 0, implementation=impl))
        np.testing.assert_array_equal(np.isnan(got), want, err_msg=impl)

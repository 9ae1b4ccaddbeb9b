"""KiviCache / DenseCache: streaming equals bulk prefill, memory accounting, capacity, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import kivi_jax as kj

L, H, D = 2, 2, 64
ROPE = 1.0 / 10000 ** (np.arange(0, D, 2) / D)  # RoPE frequencies, for the pre-RoPE caches


def _init(config, **kw):
    """KiviCache.init with the RoPE frequencies a pre-RoPE config needs (others ignore them)."""
    return kj.KiviCache.init(config, **kw, rope_frequencies=ROPE)


def _random_kv(seed, b, s, d=D):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return jax.random.normal(k1, (L, b, H, s, d)), jax.random.normal(k2, (L, b, H, s, d)) * 2 + 0.5


@functools.cache
def _append_fn():
    return jax.jit(lambda c, k, v: c.append(k, v), donate_argnums=0)


def _assert_trees_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


CONFIGS = [
    kj.KiviConfig(2, 2, group_size=32, residual_length=128),
    kj.KiviConfig(4, 2, group_size=64, residual_length=64),
    kj.KiviConfig(2, 4, group_size=32, residual_length=0),
    kj.KiviConfig(8, 8, group_size=16, residual_length=32),
    kj.KiviConfig(2, 2, group_size=32, residual_length=32, key_axis="token"),
    kj.KiviConfig(2, 2, group_size=32, residual_length=64, value_axis="channel"),
    # element formats, sinks (within a group, and past one with no window) and rotations
    kj.KiviConfig(2, 2, group_size=32, residual_length=128, sinks=5, rotation="both"),
    kj.KiviConfig(2, 4, group_size=32, residual_length=0, sinks=40, rotation="keys"),
    kj.KiviConfig(8, 8, 64, 64, key_format="fp8", value_format="fp8", key_axis="token"),
    kj.KiviConfig(
        4, 4, 32, 32, key_format="nvfp4", value_format="nvfp4", key_axis="token", sinks=3
    ),
    kj.KiviConfig(4, 2, 32, 0, key_format="mxfp4", key_axis="token", rotation="values"),
    # outlier key channels, with sinks in the first group, and with no window
    kj.KiviConfig(2, 2, group_size=32, residual_length=64, sinks=3, outlier_channels=2),
    kj.KiviConfig(4, 2, group_size=64, residual_length=0, outlier_channels=5, rotation="keys"),
    # keys quantized before RoPE, rotated or with outlier channels
    kj.KiviConfig(2, 2, group_size=32, residual_length=64, sinks=3, rotation="both", pre_rope=True),
    kj.KiviConfig(4, 2, group_size=64, residual_length=0, outlier_channels=1, pre_rope=True),
]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_streaming_appends_equal_bulk_prefill_bit_for_bit(config):
    # Ragged rows start at lengths on both sides of group and residual boundaries, then stream
    # enough tokens to cross several flushes; the result must equal one bulk prefill.
    starts = np.array([0, 31, 128, 161])
    steps = 140
    b = len(starts)
    total = int(starts.max()) + steps
    k, v = _random_kv(0, b, total)
    empty = _init(
        config, num_layers=L, batch=b, kv_heads=H, head_dim=D, max_len=total + 5, dtype=jnp.float32
    )
    cache = empty.prefill(k, v, jnp.asarray(starts, jnp.int32))
    rows = jnp.arange(b)
    for i in range(steps):
        pos = jnp.asarray(starts + i)
        kt = k[:, rows, :, pos].transpose(1, 0, 2, 3)  # [L, B, H, D]
        vt = v[:, rows, :, pos].transpose(1, 0, 2, 3)
        cache = _append_fn()(cache, kt, vt)
    # Bulk: each row's own token sequence, right-aligned to its length.
    ends = starts + steps
    bulk = empty.prefill(k, v, jnp.asarray(ends, jnp.int32))
    _assert_trees_equal(cache, bulk)


@pytest.mark.parametrize("config", [*CONFIGS, None], ids=str)
def test_chunked_extends_equal_bulk_prefill_bit_for_bit(config):
    # Ragged rows, chunks of several sizes (one token, less than a group, more than a window),
    # some rows taking fewer tokens than the chunk or none: the result must equal one prefill of
    # each row's whole sequence, which equals streaming it (the test above).
    starts = np.array([0, 31, 128, 161])
    b = len(starts)
    chunks = [(1, [1, 1, 0, 1]), (7, [7, 3, 7, 0]), (64, [64, 64, 5, 64]), (150, [150, 9, 150, 80])]
    total = int(starts.max()) + sum(c for c, _ in chunks)
    k, v = _random_kv(1, b, total)
    kw = dict(num_layers=L, batch=b, kv_heads=H, head_dim=D, max_len=total + 3)
    if config is None:
        empty = kj.DenseCache.init(**kw, dtype=jnp.float32)
    else:
        empty = _init(config, **kw, dtype=jnp.float32)
    cache = empty.prefill(k, v, jnp.asarray(starts, jnp.int32))
    ends = starts.copy()
    for size, counts in chunks:
        idx = jnp.asarray(np.minimum(ends[:, None] + np.arange(size), total - 1))[None, :, None]
        kc, vc = (jnp.take_along_axis(x, idx[..., None], axis=3) for x in (k, v))  # [.., C, D]
        cache = cache.extend(kc, vc, jnp.asarray(counts, jnp.int32))
        ends = ends + np.asarray(counts)
    bulk = empty.prefill(k, v, jnp.asarray(ends, jnp.int32))
    _assert_trees_equal(cache, bulk)


@pytest.mark.parametrize("window", [32, 0])
def test_sinks_are_stored_as_their_positions_are_quantized(window):
    # Sink j holds position j once its row has quantized it and zeros before (readers take
    # unquantized positions from the window): with a window the buffer is written when a
    # position leaves it (`flush`, per token for values, per block of W for keys), not by
    # each layer's write; with none, at once.
    config = kj.KiviConfig(2, 2, group_size=32, residual_length=window, sinks=5)
    k, v = _random_kv(3, 2, 80)
    starts = np.array([0, 20])
    empty = _init(config, num_layers=L, batch=2, kv_heads=H, head_dim=D, max_len=80)
    cache = empty.prefill(k, v, jnp.asarray(starts, jnp.int32))
    rows = jnp.arange(2)
    stored = set()
    for i in range(50):
        n = starts + i
        for store, x in ((cache.keys, k), (cache.values, v)):
            quantized = np.asarray(store.num_quantized(jnp.asarray(n)))
            held = np.arange(5)[None, :] < quantized[:, None]  # [B, N]
            first = np.asarray(x[:, :, :, :5].astype(store.sink.dtype), np.float32)
            want = np.where(held[None, :, None, :, None], first, 0)
            np.testing.assert_array_equal(np.asarray(store.sink, np.float32), want)
            stored.add(int(held.sum()))
        pos = jnp.asarray(n)
        kt, vt = (x[:, rows, :, pos].transpose(1, 0, 2, 3) for x in (k, v))  # [L, B, H, D]
        cache = _append_fn()(cache, kt, vt)
    assert {0, 10} <= stored  # none, then both rows' five


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_layer_kv_reads_what_gather_reads(config):
    # The one-pass dequantization of a layer (chunked prefill's past) against the per-position
    # gather, at every position each row holds (quantized, window, across block boundaries).
    k, v = _random_kv(2, 3, 600)
    n = jnp.array([600, 301, 5], jnp.int32)
    cache = _init(
        config, num_layers=L, batch=3, kv_heads=H, head_dim=D, max_len=600, dtype=jnp.float32
    ).prefill(k, v, n)
    got_k, got_v = cache.layer_kv(1)
    t = jnp.broadcast_to(jnp.arange(cache.keys.capacity), (3, cache.keys.capacity))
    held = np.asarray(t < n[:, None])
    gathered = (
        cache.read_keys(cache.keys.gather(1, t, n), t[:, None]),
        cache.values.gather(1, t, n),
    )
    for got, want in zip((got_k, got_v), gathered, strict=True):
        want = np.asarray(want.swapaxes(1, 2))
        np.testing.assert_array_equal(np.asarray(got)[held], want[held])


def test_extend_past_capacity_raises_outside_jit_and_flags_the_row_inside():
    cache = kj.make_cache("kivi2", num_layers=1, batch=2, kv_heads=1, head_dim=64, max_len=40)
    k = jnp.ones((1, 2, 1, 32, 64), jnp.bfloat16)
    cache = cache.extend(k, k, jnp.array([32, 8], jnp.int32))
    with pytest.raises(ValueError, match="cache is full"):
        cache.extend(k, k, jnp.array([9, 0], jnp.int32))
    with pytest.raises(ValueError, match="counts must lie in"):
        cache.extend(k, k, jnp.array([-1, 0], jnp.int32))
    out = jax.jit(lambda c, n: c.extend(k, k, n))(cache, jnp.array([9, 5], jnp.int32))
    np.testing.assert_array_equal(np.asarray(out.overflowed), [True, False])
    np.testing.assert_array_equal(np.asarray(out.lengths), [41, 13])
    with pytest.raises(ValueError, match="overflow in rows \\[0\\]"):
        kj.check_capacity(out)
    with pytest.raises(ValueError, match="counts"):
        cache.extend(k, k, jnp.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        cache.extend(k, k[..., :16, :], jnp.array([1, 1], jnp.int32))


def test_prefill_leaves_the_kivi_split_of_full_and_residual_tokens():
    config = kj.KiviConfig(2, 2, group_size=32, residual_length=128)
    k, v = _random_kv(1, 3, 300)
    lengths = jnp.array([300, 127, 256], jnp.int32)
    c = _init(
        config, num_layers=L, batch=3, kv_heads=H, head_dim=D, max_len=300, dtype=jnp.float32
    ).prefill(k, v, lengths)
    # keys: the whole blocks of R before the newest token's block are quantized (a full block
    # waits for the next token); values: all but the newest R.
    np.testing.assert_array_equal(c.keys.num_quantized(c.lengths), [256, 0, 128])
    np.testing.assert_array_equal(c.values.num_quantized(c.lengths), [172, 0, 128])
    # Attention reads the newest R of both from the windows, the rest from the codes.
    np.testing.assert_array_equal(c.quantized_split(), [172, 0, 128])
    # Both windows hold the newest tokens exactly (full precision), token p in slot p % R.
    for store, x in ((c.keys, k), (c.values, v)):
        for row, n in enumerate((300, 127, 256)):
            t = np.arange(max(n - 128, 0), n)
            np.testing.assert_array_equal(
                np.asarray(store.window_tokens())[:, row][:, :, t % 128],
                np.asarray(x)[:, row][:, :, t],
            )


def test_quantized_tokens_sit_in_the_documented_layout():
    """docs/layout.md: the packed codes are `pack_tokens` of each token's codes (the cache order,
    token-planar; the value codes in blocks of 64 byte columns), key scales per group in token
    order, value scales per token in the cache order; both dequantize to the tokens through
    `gather`."""
    from kivi_jax.quant import block_columns, cache_slot, minmax_quantize, pack_tokens

    config = kj.KiviConfig(2, 4, group_size=32, residual_length=32)
    k, v = _random_kv(1, 1, 512)
    c = _init(
        config, num_layers=L, batch=1, kv_heads=H, head_dim=D, max_len=512, dtype=jnp.float32
    ).prefill(k, v, jnp.array([512], jnp.int32))
    kc, ks, _ = minmax_quantize(k.reshape(L, 1, H, 16, 32, D), 2, axis=-2)
    # keys: 15 whole groups; the 16th, the newest block, waits for the next token
    kq = int(c.keys.num_quantized(c.lengths)[0])
    assert kq == 480
    kc = jnp.where((jnp.arange(512) < kq)[:, None], kc.reshape(L, 1, H, 512, D), 0)
    np.testing.assert_array_equal(c.keys.codes, pack_tokens(kc, 2, axis=-2))
    np.testing.assert_array_equal(c.keys.scale[..., :15, :], ks[..., :15, 0, :])
    np.testing.assert_array_equal(c.keys.scale[..., 15:, :], 0)
    nq = int(c.values.num_quantized(c.lengths)[0])  # 480: the newest 32 stay in full precision
    vc, vs, _ = minmax_quantize(v.reshape(L, 1, H, 512, D // 32, 32), 4, axis=-1)
    vc = jnp.where((jnp.arange(512) < nq)[:, None], vc.reshape(L, 1, H, 512, D), 0)
    # 4-bit value codes: unblocked V^T rows
    np.testing.assert_array_equal(c.values.codes, pack_tokens(vc.swapaxes(-1, -2), 4, axis=-1))
    t = np.array([0, 17, 100, 300, nq - 1])
    np.testing.assert_array_equal(
        c.values.scale[..., cache_slot(t)], vs[..., 0].swapaxes(-1, -2)[..., t]
    )
    got = c.values.gather(0, jnp.asarray(t)[None], c.lengths)
    want = np.asarray(v)[0][:, :, t].astype(np.float32)
    np.testing.assert_allclose(got, want, atol=0.2 * np.abs(want).max())
    # 2-bit value codes: V^T in blocks of 64 byte columns
    c2 = kj.KiviCache.init(
        kj.KiviConfig(2, 2, group_size=32, residual_length=32),
        num_layers=L,
        batch=1,
        kv_heads=H,
        head_dim=D,
        max_len=512,
        dtype=jnp.float32,
    ).prefill(k, v, jnp.array([512], jnp.int32))
    vc2, _, _ = minmax_quantize(v.reshape(L, 1, H, 512, D // 32, 32), 2, axis=-1)
    vc2 = jnp.where((jnp.arange(512) < nq)[:, None], vc2.reshape(L, 1, H, 512, D), 0)
    packed = pack_tokens(vc2.swapaxes(-1, -2), 2, axis=-1)  # [L, 1, H, D, 128]
    assert c2.values.blocked and c2.values.codes.shape == (L, 1, H, 128 // 64, D, 64)
    np.testing.assert_array_equal(c2.values.codes, block_columns(packed))
    # block k holds byte columns 64 k .. 64 k + 63 of every channel
    np.testing.assert_array_equal(c2.values.codes[:, :, :, 1, 5], packed[:, :, :, 5, 64:128])
    got = c2.values.gather(0, jnp.asarray(t)[None], c2.lengths)
    np.testing.assert_allclose(got, want, atol=0.4 * np.abs(want).max())


@pytest.mark.parametrize("config", CONFIGS[:4], ids=str)
def test_nbytes_matches_the_formula(config):
    b, max_len = 3, 1000
    c = _init(
        config, num_layers=4, batch=b, kv_heads=8, head_dim=D, max_len=max_len, dtype=jnp.bfloat16
    )
    tq = c.keys.capacity
    assert tq >= max_len and tq % 256 == 0
    g = config.group_size
    bits = (config.key_bits + config.value_bits) / 2
    per_token = 2 * 4 * 8 * D * (bits + 2 * 16 / g) / 8  # bytes per quantized token, K and V
    window = max(config.residual_length, g) + config.residual_length
    residual = 4 * b * 8 * window * D * 2
    nb = c.nbytes()
    assert nb.codes + nb.scales == per_token * tq * b
    assert nb.residual == residual
    assert nb.total == per_token * tq * b + residual + b * 4
    dense = kj.DenseCache.init(
        num_layers=4, batch=b, kv_heads=8, head_dim=D, max_len=max_len, dtype=jnp.float16
    )
    assert dense.nbytes().total == 2 * 4 * b * 8 * max_len * D * 2 + b * 4


def test_decode_steps_do_not_recompile():
    config = kj.KiviConfig(2, 2, group_size=32, residual_length=32)
    c = _init(config, num_layers=L, batch=2, kv_heads=H, head_dim=D, max_len=200, dtype=jnp.float32)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(cache, k, v, q):
        cache = cache.advance()
        cache = jax.lax.fori_loop(0, L, lambda l, c: c.write(l, k[l], v[l]), cache)
        return cache, kj.decode_attention(q, cache, 1, implementation="reference")

    k, v = _random_kv(2, 2, 70)
    q = jax.random.normal(jax.random.key(9), (2, 4, D))
    for t in range(70):
        c, out = step(c, k[:, :, :, t], v[:, :, :, t], q)
    assert step._cache_size() == 1
    assert np.all(np.isfinite(out))


def test_appending_past_capacity_raises_outside_jit():
    c = kj.make_cache("kivi2", num_layers=1, batch=1, kv_heads=1, head_dim=D, max_len=3)
    tok = jnp.ones((1, 1, 1, D))
    for _ in range(3):
        c = c.append(tok, tok)
    with pytest.raises(ValueError, match="max_len=3"):
        c.append(tok, tok)
    with pytest.raises(ValueError, match="max_len"):
        kj.make_cache("fp16", num_layers=1, batch=1, kv_heads=1, head_dim=D, max_len=3).prefill(
            jnp.ones((1, 1, 1, 4, D)), jnp.ones((1, 1, 1, 4, D)), jnp.array([4])
        )


@pytest.mark.parametrize("name", ["kivi2", "fp16"])
def test_overflow_inside_jit_drops_tokens_and_flags_the_row(name):
    c = kj.make_cache(
        name,
        num_layers=1,
        batch=2,
        kv_heads=H,
        head_dim=D,
        max_len=40,
        dtype=jnp.float32,
        residual_length=32,
    )
    k, v = _random_kv(3, 2, 40)
    c = c.prefill(k[:1], v[:1], jnp.array([40, 10], jnp.int32))
    before = c
    step = jax.jit(lambda c, k, v: c.append(k, v))
    tok = jnp.full((1, 2, H, D), 7.0)
    after = step(c, tok, tok)
    np.testing.assert_array_equal(after.overflowed, [True, False])
    with pytest.raises(ValueError, match="rows \\[0\\]"):
        kj.check_capacity(after)
    # Row 0's stored tokens are untouched; row 1 took the token.
    q = jax.random.normal(jax.random.key(0), (2, H, D))
    o_before = kj.decode_attention(q, before, 0, implementation="reference")
    o_after = kj.decode_attention(q, after, 0, implementation="reference")
    np.testing.assert_array_equal(o_before[0], o_after[0])
    assert not np.allclose(o_before[1], o_after[1])
    err, _ = checkify.checkify(step, errors=checkify.user_checks)(c, tok, tok)
    with pytest.raises(Exception, match="overflow"):
        err.throw()


@pytest.mark.parametrize("name", ["kivi2", "kivi4", "fp16", "fp8"])
@pytest.mark.parametrize("per_layer", [False, True])
def test_one_row_past_capacity_keeps_its_cache_inside_jit(name, per_layer):
    """One row takes the one-row write (`put_dropped`'s dynamic_update_slice) in every store:
    past capacity it changes nothing but the length, as the scatter of several rows does;
    below capacity the token lands."""
    kw = dict(num_layers=L, batch=1, kv_heads=H, head_dim=D, max_len=40, dtype=jnp.float32)
    c = kj.make_cache(name, per_layer=per_layer, residual_length=32, **kw)
    k, v = _random_kv(3, 1, 40)

    def step(c, k, v):  # a decode step's writes: each layer's index a Python int
        c = c.advance()
        for layer in range(L):
            c = c.write(layer, k[layer], v[layer])
        return c

    step = jax.jit(step)
    tok = jnp.full((L, 1, H, D), 7.0)
    full = c.prefill(k, v, jnp.array([40], jnp.int32))
    after = step(full, tok, tok)
    np.testing.assert_array_equal(after.overflowed, [True])
    stored = lambda c: [x for x in jax.tree.leaves(c) if x.dtype != jnp.int32 or x.ndim > 1]
    for x, y in zip(stored(full), stored(after), strict=True):  # all but the lengths
        np.testing.assert_array_equal(x, y)
    short = c.prefill(k[..., :10, :], v[..., :10, :], jnp.array([10], jnp.int32))
    q = jax.random.normal(jax.random.key(0), (1, H, D))
    o = [
        kj.decode_attention(q, x, 1, implementation="reference")
        for x in (short, step(short, tok, tok))
    ]
    assert not np.allclose(o[0], o[1])


@pytest.mark.parametrize("add", [False, True])
def test_put_dropped_one_row_equals_the_scatter(add):
    """The one-row path against `.at[index].set/add(x, mode="drop")`: in-bounds, negative
    (wrapped) and out-of-bounds positions, on the index forms the stores use."""
    buf = jax.random.randint(jax.random.key(1), (3, 1, 4, 6, 5), 0, 50).astype(jnp.int32)
    x = jax.random.randint(jax.random.key(2), (1, 4, 5), 0, 50).astype(jnp.int32)
    xt = jax.random.randint(jax.random.key(3), (1, 4, 6), 0, 50).astype(jnp.int32)
    b, W = jnp.arange(1), slice(None)
    cases = [((1, b, W, jnp.array([2])), x), ((-1, b, W, jnp.array([5])), x)]
    cases += [((jnp.int32(2), b, W, jnp.array([6])), x), ((0, b, W, jnp.array([-2])), x)]
    cases += [((jnp.int32(3), b, W, jnp.array([0])), x), ((2, b, W, W, jnp.array([4])), xt)]
    cases += [((2, b, W, W, jnp.array([9])), xt)]
    for index, val in cases:
        at = buf.at[index]
        want = at.add(val, mode="drop") if add else at.set(val, mode="drop")
        got = jax.jit(lambda buf, val, index=index: kj.cache.put_dropped(buf, index, val, add))
        np.testing.assert_array_equal(got(buf, val), want, err_msg=str(index))
    assert not np.array_equal(kj.cache.put_dropped(buf, cases[0][0], x, add), buf)


def test_bad_shapes_and_dtypes_raise_naming_the_argument():
    cfg = kj.KiviConfig()
    with pytest.raises(ValueError, match="head_dim"):
        kj.KiviCache.init(cfg, num_layers=1, batch=1, kv_heads=1, head_dim=48, max_len=8)
    with pytest.raises(ValueError, match="max_len"):
        kj.KiviCache.init(cfg, num_layers=1, batch=1, kv_heads=1, head_dim=64, max_len=0)
    with pytest.raises(ValueError, match="dtype"):
        kj.KiviCache.init(
            cfg, num_layers=1, batch=1, kv_heads=1, head_dim=64, max_len=8, dtype=jnp.int8
        )
    with pytest.raises(ValueError, match="config"):
        kj.KiviCache.init(
            {"key_bits": 2}, num_layers=1, batch=1, kv_heads=1, head_dim=64, max_len=8
        )
    c = kj.KiviCache.init(cfg, num_layers=2, batch=2, kv_heads=2, head_dim=64, max_len=64)
    good = jnp.ones((2, 2, 2, 8, 64))
    with pytest.raises(ValueError, match="^k "):
        c.prefill(jnp.ones((2, 2, 3, 8, 64)), good, jnp.array([8, 8]))
    with pytest.raises(ValueError, match="^v "):
        c.prefill(good, jnp.ones((2, 2, 2, 8)), jnp.array([8, 8]))
    with pytest.raises(ValueError, match="lengths"):
        c.prefill(good, good, jnp.array([8.0, 8.0]))
    with pytest.raises(ValueError, match="lengths"):
        c.prefill(good, good, jnp.array([9, 8]))
    with pytest.raises(ValueError, match="floating"):
        c.prefill(good.astype(jnp.int32), good, jnp.array([8, 8]))
    with pytest.raises(ValueError, match="^k "):
        c.advance().write(0, jnp.ones((2, 2, 32)), jnp.ones((2, 2, 64)))
    with pytest.raises(ValueError, match="layer"):
        c.advance().write(5, jnp.ones((2, 2, 64)), jnp.ones((2, 2, 64)))
    with pytest.raises(ValueError, match="unknown cache name 'kivi3'"):
        kj.make_cache("kivi3", num_layers=1, batch=1, kv_heads=1, head_dim=64, max_len=8)


def test_named_caches():
    assert kj.cache_config("fp16") is None
    assert kj.cache_config("kivi2") == kj.KiviConfig(2, 2, 32, 128)
    assert kj.cache_config("k4v2", 64, 0) == kj.KiviConfig(4, 2, 64, 0)
    assert kj.cache_config("pertoken2").key_axis == "token"
    assert kj.cache_config("valchannel2").value_axis == "channel"
    dims = dict(num_layers=1, batch=1, kv_heads=1, head_dim=64, max_len=8)
    for name in kj.CACHE_NAMES:  # the model's RoPE frequencies: what pre-RoPE caches need
        assert kj.make_cache(name, **dims, rope_frequencies=ROPE).nbytes().total > 0
    with pytest.raises(ValueError, match="pre_rope=True needs the model's rope_frequencies"):
        kj.make_cache("best3", **dims)


def test_cache_is_a_pytree_with_static_config():
    c = kj.make_cache("kivi4", num_layers=1, batch=1, kv_heads=1, head_dim=64, max_len=8)
    leaves, tree = jax.tree.flatten(c)
    assert len(leaves) == 9  # 4 arrays per store, plus lengths
    again = jax.tree.unflatten(tree, leaves)
    assert again.config == c.config and again.max_len == 8

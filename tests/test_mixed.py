"""Per-layer cache formats (`kivi_jax.MixedCache`): each layer as the KiviCache of its config."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kivi_jax
from kivi_jax import KiviCache, KiviConfig, MixedCache, chunk_attention, decode_attention
from kivi_jax.mixed import layer_configs, mean_bits, parse_layers, parse_override

BASE = KiviConfig(group_size=32, residual_length=32, sinks=4, rotation="both")
OVERRIDES = [((1, 3), dict(key_bits=4)), ((2,), dict(group_size=64, residual_length=64))]
DIMS = dict(batch=2, kv_heads=2, head_dim=64, max_len=300, dtype=jnp.float32)
L, S = 4, 200


def _kv(seed, shape):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return jax.random.normal(k1, shape), jax.random.normal(k2, shape)


@pytest.fixture(scope="module")
def filled():
    """(configs, a prefilled MixedCache, each distinct config's KiviCache of all L layers
    prefilled with the same K/V)."""
    configs = layer_configs(BASE, L, OVERRIDES)
    k, v = _kv(0, (L, 2, 2, S, 64))
    lengths = jnp.array([S, 150], jnp.int32)
    mixed = MixedCache.init(configs, **DIMS).prefill(k, v, lengths)
    whole = {
        c: KiviCache.init(c, num_layers=L, **DIMS).prefill(k, v, lengths) for c in set(configs)
    }
    return configs, mixed, whole


def test_parse_layers_and_overrides():
    assert parse_layers("0-2,7") == (0, 1, 2, 7)
    assert parse_layers(" 5 ", 6) == (5,)
    for bad in ("", "a", "3-1", "-1", "1,1", "0-2,2"):
        with pytest.raises(ValueError):
            parse_layers(bad)
    with pytest.raises(ValueError, match=r"within \[0, 4\)"):
        parse_layers("2-4", 4)
    assert parse_override("17-18,20 key_bits=4 pre_rope=true rotation=keys") == (
        (17, 18, 20),
        dict(key_bits=4, pre_rope=True, rotation="keys"),
    )
    for bad in ("3", "3 bits=4", "3 key_bits=four", "3 pre_rope=yes", "3 key_bits"):
        with pytest.raises(ValueError):
            parse_override(bad)


def test_layer_configs():
    configs = layer_configs(BASE, L, OVERRIDES)
    assert [c.key_bits for c in configs] == [2, 4, 2, 4]
    assert [c.group_size for c in configs] == [32, 32, 64, 32]
    assert configs[0] is BASE and all(c.sinks == 4 and c.rotation == "both" for c in configs)
    assert layer_configs(BASE, 2) == (BASE, BASE)
    with pytest.raises(ValueError, match="two overrides"):
        layer_configs(BASE, L, [((1,), dict(key_bits=4)), ((1, 2), dict(value_bits=4))])
    with pytest.raises(ValueError, match="outside"):
        layer_configs(BASE, L, [((4,), dict(key_bits=4))])
    with pytest.raises(ValueError, match="unknown KiviConfig fields"):
        layer_configs(BASE, L, [((0,), dict(bits=4))])
    with pytest.raises(ValueError, match="key_bits"):  # KiviConfig's own check
        layer_configs(BASE, L, [((0,), dict(key_bits=3))])
    with pytest.raises(ValueError, match="residual_length"):
        layer_configs(BASE, L, [((0,), dict(group_size=64))])  # R = 32 is not a multiple


def test_parts_hold_each_config_once(filled):
    configs, mixed, _ = filled
    assert mixed.groups == ((0,), (1, 3), (2,))
    assert [p.num_layers for p in mixed.parts] == [1, 2, 1]
    assert mixed.configs == configs and mixed.num_layers == L
    assert (mixed.batch, mixed.kv_heads, mixed.head_dim, mixed.max_len) == (2, 2, 64, 300)
    np.testing.assert_array_equal(mixed.lengths, [S, 150])
    assert mixed.part(3)[0] is mixed.parts[1] and mixed.part(3)[1] == 1


def test_bits_and_bytes_are_the_layers_own(filled):
    configs, mixed, _ = filled
    bits = [c.bits_per_element(64) for c in configs]
    assert bits == [3.0, 4.0, 2.5, 4.0]
    assert mixed.bits_per_element() == mean_bits(configs, 64) == pytest.approx(3.375)
    want = [KiviCache.init(p.config, num_layers=p.num_layers, **DIMS).nbytes() for p in mixed.parts]
    assert mixed.nbytes() == tuple(sum(x) for x in zip(*want, strict=True))


@pytest.mark.parametrize("layer", range(L))
def test_decode_attention_is_the_layer_configs(filled, layer):
    configs, mixed, whole = filled
    q = jax.random.normal(jax.random.key(2), (2, 4, 64))
    got = decode_attention(q, mixed, layer, implementation="reference")
    want = decode_attention(q, whole[configs[layer]], layer, implementation="reference")
    np.testing.assert_array_equal(got, want)


def test_chunk_attention_is_the_layer_configs(filled):
    configs, mixed, whole = filled
    q = jax.random.normal(jax.random.key(3), (2, 5, 4, 64))
    k, v = _kv(4, (2, 5, 2, 64))
    counts = jnp.array([5, 3], jnp.int32)
    for layer in (0, 2, 3):
        got = chunk_attention(q, k, v, counts, mixed, layer, implementation="reference")
        want = chunk_attention(
            q, k, v, counts, whole[configs[layer]], layer, implementation="reference"
        )
        np.testing.assert_array_equal(got, want)


def test_streaming_under_scan_equals_unrolled_and_the_configs(filled):
    """Decode steps with the layer index traced (lax.scan: a switch over the parts) and
    static (unrolled) store and attend the same; each layer's stores equal its config's
    cache after the same steps, and so does chunked extend."""
    configs, mixed, whole = filled
    q = jax.random.normal(jax.random.key(5), (2, 4, 64))
    kn, vn = _kv(6, (60, L, 2, 2, 64))  # past a block of 64 in both rows

    def scanned(cache, k, v):
        def step(cache, kv):
            cache = cache.advance()

            def layer(cache, xs):
                l, kl, vl = xs
                cache = cache.write(l, kl, vl)
                return cache, decode_attention(q, cache, l, implementation="reference")

            return jax.lax.scan(layer, cache, (jnp.arange(L), *kv))

        return jax.lax.scan(step, cache, (k, v))

    def unrolled(cache, k, v):  # the steps scanned, the layers unrolled (static indices)
        def step(cache, kv):
            cache, row = cache.advance(), []
            for layer in range(L):
                cache = cache.write(layer, kv[0][layer], kv[1][layer])
                row.append(decode_attention(q, cache, layer, implementation="reference"))
            return cache, jnp.stack(row)

        return jax.lax.scan(step, cache, (k, v))

    a, oa = jax.jit(scanned)(mixed, kn, vn)
    b, ob = jax.jit(unrolled)(mixed, kn, vn)
    np.testing.assert_allclose(oa, ob, rtol=1e-6, atol=1e-6)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    chunked = mixed.extend(
        kn.transpose(1, 2, 3, 0, 4), vn.transpose(1, 2, 3, 0, 4), jnp.full((2,), 60)
    )
    for config in set(configs):
        ref = jax.jit(unrolled)(whole[config], kn, vn)[0]
        for part, group in zip(b.parts, b.groups, strict=True):
            if part.config != config:
                continue
            for name in ("keys", "values"):
                for field in ("codes", "scale", "residual"):
                    want = getattr(getattr(ref, name), field)[np.asarray(group)]
                    np.testing.assert_array_equal(getattr(getattr(part, name), field), want)
        for part, c_part in zip(b.parts, chunked.parts, strict=True):
            for x, y in zip(jax.tree.leaves(part), jax.tree.leaves(c_part), strict=True):
                np.testing.assert_array_equal(x, y)


def test_traced_layer_out_of_range_drops_the_write_and_gives_nan(filled):
    _, mixed, _ = filled
    q = jax.random.normal(jax.random.key(7), (2, 4, 64))
    k, v = _kv(8, (2, 2, 64))
    cache = mixed.advance()
    out = jax.jit(lambda c, l: decode_attention(q, c, l, implementation="reference"))(
        cache, jnp.int32(L)
    )
    assert bool(jnp.all(jnp.isnan(out)))
    written = jax.jit(lambda c, l: c.write(l, k, v))(cache, jnp.int32(-1))
    for x, y in zip(jax.tree.leaves(written), jax.tree.leaves(cache), strict=True):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="layer must be in"):
        cache.write(L, k, v)


def test_make_cache_and_errors():
    cache = kivi_jax.make_cache(
        "kivi2", num_layers=3, **DIMS, layer_overrides=[((2,), dict(key_bits=4))]
    )
    assert isinstance(cache, MixedCache)
    assert [c.key_bits for c in cache.configs] == [2, 2, 4]
    plain = kivi_jax.make_cache("kivi2", num_layers=3, **DIMS)
    assert isinstance(plain, KiviCache)
    with pytest.raises(ValueError, match="dense"):
        kivi_jax.make_cache("fp16", num_layers=3, **DIMS, layer_overrides=[((2,), {})])
    with pytest.raises(ValueError, match="one per layer"):
        MixedCache.init([], **DIMS)
    with pytest.raises(ValueError, match="must be a KiviCache, MixedCache or DenseCache"):
        decode_attention(jnp.zeros((2, 4, 64)), object(), 0)
    mixed = MixedCache.init((BASE, dataclasses.replace(BASE, key_bits=4)), **DIMS)
    with pytest.raises(ValueError, match="k must have shape"):
        mixed.prefill(*_kv(9, (3, 2, 2, 8, 64)), jnp.array([8, 8], jnp.int32))

"""Sharding by logical axis names, on 8 fake CPU devices (tests/conftest.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding

import kivi_jax as kj
from kivi_jax.sharding import (
    LONG_CONTEXT_RULES,
    cache_shardings,
    logical_to_mesh,
    shard_cache,
)

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def _same_shardings(tree, want):
    got = jax.tree.map(lambda a: a.sharding, tree)
    for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(want), strict=True):
        assert a.sharding.is_equivalent_to(s, a.ndim), (a.shape, a.sharding, s)
    return got


@pytest.mark.parametrize("name", ["kivi2", "k4v2", "fp16"])
def test_jitted_append_keeps_batch_and_head_shardings(name):
    mesh = _mesh((2, 4), ("data", "model"))
    c = kj.make_cache(
        name,
        num_layers=2,
        batch=4,
        kv_heads=4,
        head_dim=64,
        max_len=300,
        dtype=jnp.float32,
        residual_length=32,
    )
    k = jax.random.normal(jax.random.key(0), (2, 4, 4, 100, 64))
    c = c.prefill(k, k, jnp.array([100, 64, 31, 0], jnp.int32))
    want = cache_shardings(c, mesh)
    sharded = shard_cache(c, mesh)
    _same_shardings(sharded, want)
    assert sharded.lengths.sharding.spec == jax.P("data")
    codes = sharded.keys.codes if name != "fp16" else sharded.k
    assert codes.sharding.spec[1:3] == ("data", "model")

    step = jax.jit(lambda c, k, v: c.append(k, v), donate_argnums=0)
    tok = jax.random.normal(jax.random.key(1), (2, 4, 4, 64))
    out = sharded
    for _ in range(40):  # crosses a key flush (R=32) for every row
        out = step(out, tok, tok)
    _same_shardings(out, want)
    assert step._cache_size() == 1
    # Same numbers as the unsharded cache.
    ref, plain_step = c, jax.jit(lambda c, k, v: c.append(k, v))
    for _ in range(40):
        ref = plain_step(ref, tok, tok)
    q = jax.random.normal(jax.random.key(2), (4, 8, 64))
    attend = jax.jit(kj.decode_attention, static_argnames="implementation")
    np.testing.assert_allclose(attend(q, out, 1), attend(q, ref, 1), atol=1e-6)


def test_long_context_rules_shard_the_token_axes():
    mesh = _mesh((2, 4), ("data", "seq"))
    rules = {k: v for k, v in LONG_CONTEXT_RULES.items() if k != "kv_heads"}
    c = kj.make_cache(
        "kivi2", num_layers=1, batch=2, kv_heads=2, head_dim=64, max_len=1024, dtype=jnp.float32
    )
    k = jax.random.normal(jax.random.key(3), (1, 2, 2, 1000, 64))
    c = c.prefill(k, k, jnp.array([1000, 700], jnp.int32))
    s = shard_cache(c, mesh, rules)
    assert s.keys.codes.sharding.spec == jax.P(None, "data", None, "seq")
    assert s.values.scale.sharding.spec == jax.P(None, "data", None, None, "seq")
    # the value codes' blocks of 64 byte columns (docs/layout.md) split over "seq"
    assert s.values.codes.sharding.spec == jax.P(None, "data", None, "seq")
    assert s.values.codes.addressable_shards[0].data.shape == (1, 1, 2, 1, 64, 64)
    q = jax.random.normal(jax.random.key(4), (2, 4, 64))
    attend = jax.jit(kj.decode_attention, static_argnames="implementation")
    np.testing.assert_allclose(attend(q, s, 0), attend(q, c, 0), atol=1e-6)


def test_rules_are_validated():
    mesh = _mesh((2, 4), ("data", "model"))
    c = kj.make_cache("kivi2", num_layers=1, batch=2, kv_heads=4, head_dim=64, max_len=8)
    with pytest.raises(ValueError, match="no axis 'tensor'"):
        cache_shardings(c, mesh, {"kv_heads": "tensor"})
    with pytest.raises(ValueError, match="unknown logical axis 'heads'"):
        logical_to_mesh(jax.P("batch"), {"heads": "model"})
    assert isinstance(jax.tree.leaves(cache_shardings(c, mesh))[0], NamedSharding)

"""Sequence-parallel decode attention (`kivi_jax.parallel`) on 8 fake CPU devices
(tests/conftest.py): equal to the unsharded call, and nothing of the cache crosses devices."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import kivi_jax as kj
from kivi_jax.sharding import LONG_CONTEXT_RULES, shard_cache

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")

L, HKV, HQ, D = 2, 2, 8, 128
# ragged rows: long, all tokens on the first of 4 shards, empty, just past the window
LENGTHS = [1900, 300, 0, 129]


def _mesh(data, model, seq, explicit=False):
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(
        (data, model, seq),
        ("data", "model", "seq"),
        axis_types=(kind,) * 3,
        devices=jax.devices()[: data * model * seq],
    )


def _cache(name, group_size, max_len=2048, residual=128, lengths=LENGTHS, seed=0, **knobs):
    c = kj.make_cache(
        name,
        num_layers=L,
        batch=len(lengths),
        kv_heads=HKV,
        head_dim=D,
        max_len=max_len,
        dtype=jnp.float32,
        residual_length=residual,
        group_size=group_size,
        **knobs,
    )
    s = max(max(lengths), 1)
    k, v = (
        jax.random.normal(jax.random.key(seed + i), (L, len(lengths), HKV, s, D)) for i in (0, 1)
    )
    return c.prefill(k, v, jnp.asarray(lengths, jnp.int32))


def _query(batch, seed=7):
    return jax.random.normal(jax.random.key(seed), (batch, HQ, D), jnp.float32)


CASES = [
    ("kivi2", 32, (2, 1, 4)),
    ("kivi4", 64, (1, 2, 4)),
    ("k4v2", 128, (1, 1, 8)),
    ("kivi2", 128, (2, 2, 2)),
    ("kivi2", 32, (1, 1, 1)),  # a mesh of one: the same program on one device
]


@pytest.mark.parametrize("name,group,mesh_shape", CASES, ids=str)
def test_sharded_equals_unsharded(name, group, mesh_shape):
    mesh = _mesh(*mesh_shape)
    cache = _cache(name, group)
    q = _query(cache.batch)
    want = kj.decode_attention(q, cache, 1, implementation="reference")
    sharded = shard_cache(cache, mesh, LONG_CONTEXT_RULES)
    f = jax.jit(
        lambda q, c: kj.sequence_parallel_attention(q, c, 1, mesh=mesh, implementation="folded")
    )
    got = f(q, sharded)
    # float32 rounding of the folded form and of the merge: ~1e-6 of max |o|
    np.testing.assert_allclose(got, want, atol=2e-5 * float(jnp.abs(want).max()), rtol=0)
    assert np.all(np.asarray(got)[2] == 0)  # the empty row


def test_explicit_mesh_and_a_traced_layer():
    mesh = _mesh(2, 1, 4, explicit=True)
    cache = _cache("kivi2", 32)
    q = _query(cache.batch)
    sharded = shard_cache(cache, mesh, LONG_CONTEXT_RULES)
    f = jax.jit(lambda q, c, layer: kj.sequence_parallel_attention(q, c, layer, mesh=mesh))
    for layer in (0, 1):
        want = kj.decode_attention(q, cache, layer, implementation="reference")
        got = f(q, sharded, jnp.int32(layer))
        np.testing.assert_allclose(got, want, atol=2e-5 * float(jnp.abs(want).max()), rtol=0)
    assert np.isnan(np.asarray(f(q, sharded, jnp.int32(5)))).all()  # out of range: NaN


def test_no_cache_bytes_cross_devices_and_each_holds_its_share():
    mesh = _mesh(2, 1, 4)
    cache = _cache("kivi2", 32)
    sharded = shard_cache(cache, mesh, LONG_CONTEXT_RULES)
    tq = cache.keys.capacity
    for store in (sharded.keys, sharded.values):
        shard = store.scale.addressable_shards[0].data
        assert store.scale.shape[-2 if store.axis == "channel" else -1] == (
            tq // (32 if store.axis == "channel" else 1)
        )
        # 1/4 of the token axis of every quantized array per device (rows over "data")
        assert shard.size * 8 == store.scale.size
        assert store.codes.addressable_shards[0].data.size * 8 == store.codes.size
    q = _query(cache.batch)
    f = jax.jit(lambda q, c: kj.sequence_parallel_attention(q, c, 1, mesh=mesh))
    hlo = f.lower(q, sharded).compile().as_text()
    assert not re.search(r"all-gather|all-to-all|collective-permute|reduce-scatter", hlo)
    # the merge: all-reduces of the partial outputs and log-sum-exps only (rows 2, heads 8)
    for line in hlo.splitlines():
        if " all-reduce(" in line:
            shapes = re.findall(r"f32\[([\d,]+)\]", line.split("all-reduce(")[0])
            assert shapes and all(
                np.prod([int(x) for x in s.split(",")]) <= 2 * 8 * D for s in shapes
            )


def test_errors():
    mesh = _mesh(2, 1, 4)
    q = _query(4)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        kj.sequence_parallel_attention(
            q, _cache("kivi2", 32, max_len=1280, lengths=[900, 1, 0, 5]), 0, mesh=mesh
        )
    with pytest.raises(NotImplementedError, match="R >= G"):
        kj.sequence_parallel_attention(q, _cache("kivi2", 32, residual=0), 0, mesh=mesh)
    no_seq = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    with pytest.raises(ValueError, match="not an axis"):
        kj.sequence_parallel_attention(q, _cache("kivi2", 32), 0, mesh=no_seq)
    with pytest.raises(ValueError, match="implementation"):
        kj.sequence_parallel_attention(q, _cache("kivi2", 32), 0, mesh=mesh, implementation="x")


def _append_and_extend(got, want, mesh, seed, counts):
    """A token appended, then a chunk of counts[b] tokens per row, into a sharded cache (got,
    sequence-parallel) and its unsharded twin (want); both equal bit for bit after."""
    c = max(counts)
    kt, vt = (jax.random.normal(jax.random.key(seed + j), (L, 4, HKV, D)) for j in (0, 1))
    got, want = kj.sequence_parallel_append(got, kt, vt, mesh=mesh), want.append(kt, vt)
    kc, vc = (jax.random.normal(jax.random.key(seed + 10 + j), (L, 4, HKV, c, D)) for j in (0, 1))
    counts = jnp.asarray(counts, jnp.int32)
    got = kj.sequence_parallel_extend(got, kc, vc, counts, mesh=mesh)
    want = want.extend(kc, vc, counts)
    _gathered_equal(got, want)
    return got, want


def _gathered_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name,group,mesh_shape", CASES[:3], ids=str)
def test_sharded_prefill_and_appends_equal_unsharded_bit_for_bit(name, group, mesh_shape):
    """Prefill and appends where the tokens are: equal to the unsharded cache in every array,
    across key-block flushes and per-token value flushes, rows crossing a shard boundary (512
    per shard at seq=4) during the appends."""
    mesh = _mesh(*mesh_shape)
    lengths = [400, 500, 0, 127]
    c0 = kj.make_cache(
        name,
        num_layers=L,
        batch=4,
        kv_heads=HKV,
        head_dim=D,
        max_len=2048,
        dtype=jnp.float32,
        residual_length=128,
        group_size=group,
    )
    k, v = (jax.random.normal(jax.random.key(i), (L, 4, HKV, 500, D)) for i in (3, 4))
    n = jnp.asarray(lengths, jnp.int32)
    want = c0.prefill(k, v, n)
    sharded = shard_cache(c0, mesh, LONG_CONTEXT_RULES)
    prefill = jax.jit(lambda c, k, v, n: kj.sequence_parallel_prefill(c, k, v, n, mesh=mesh))
    got = prefill(sharded, k, v, n)
    _gathered_equal(got, want)
    append = jax.jit(lambda c, k, v: kj.sequence_parallel_append(c, k, v, mesh=mesh))
    plain = jax.jit(lambda c, k, v: c.append(k, v))
    for i in range(140):  # past a key flush of every row; row 0 and 1 cross position 512
        kt, vt = (
            jax.random.normal(jax.random.key(100 + 2 * i + j), (L, 4, HKV, D)) for j in (0, 1)
        )
        got, want = append(got, kt, vt), plain(want, kt, vt)
    _gathered_equal(got, want)
    hlo = append.lower(got, kt, vt).compile().as_text()
    assert not re.search(r"all-gather|all-to-all|collective-permute|reduce-scatter|all-reduce", hlo)


@pytest.mark.parametrize("name,group,mesh_shape", CASES[:2], ids=str)
def test_sharded_chunk_extends_equal_unsharded_bit_for_bit(name, group, mesh_shape):
    """Chunks appended where their positions live (chunked prefill's write), ragged counts,
    chunks crossing a shard boundary (512 per shard at seq=4): equal to the unsharded
    extends in every array, with no collective at all."""
    mesh = _mesh(*mesh_shape)
    c0 = kj.make_cache(
        name,
        num_layers=L,
        batch=4,
        kv_heads=HKV,
        head_dim=D,
        max_len=2048,
        dtype=jnp.float32,
        residual_length=128,
        group_size=group,
    )
    extend = jax.jit(lambda c, k, v, n: kj.sequence_parallel_extend(c, k, v, n, mesh=mesh))
    plain = jax.jit(lambda c, k, v, n: c.extend(k, v, n))
    got, want = shard_cache(c0, mesh, LONG_CONTEXT_RULES), c0
    for i, counts in enumerate(([200, 300, 0, 1], [200, 250, 7, 300], [200, 0, 100, 300])):
        k, v = (
            jax.random.normal(jax.random.key(10 + 2 * i + j), (L, 4, HKV, 300, D)) for j in (0, 1)
        )
        n = jnp.asarray(counts, jnp.int32)
        got, want = extend(got, k, v, n), plain(want, k, v, n)
    _gathered_equal(got, want)
    hlo = extend.lower(got, k, v, n).compile().as_text()
    assert not re.search(r"all-gather|all-to-all|collective-permute|reduce-scatter|all-reduce", hlo)


def test_decode_attention_inside_a_users_shard_map():
    """A cache that knows its shard (`seq_axis`, inside shard_map) makes `decode_attention`
    itself sequence-parallel: what a model's layer code calls, unchanged."""
    import dataclasses

    mesh = _mesh(1, 1, 4)
    cache = _cache("kivi2", 32)
    q = _query(cache.batch)
    want = kj.decode_attention(q, cache, 1, implementation="reference")
    specs = kj.sharding.cache_specs(cache, LONG_CONTEXT_RULES)

    def step(q, c):
        c = dataclasses.replace(c, seq_axis="seq")
        return kj.decode_attention(q, c, 1, implementation="reference")

    sm = jax.shard_map(
        step, mesh=mesh, in_specs=(jax.P(), specs), out_specs=jax.P(), check_vma=False
    )
    f = jax.jit(sm)
    got = f(q, shard_cache(cache, mesh, LONG_CONTEXT_RULES))
    np.testing.assert_allclose(got, want, atol=2e-5 * float(jnp.abs(want).max()), rtol=0)


@pytest.mark.parametrize(
    "cfg",
    [
        kj.KiviConfig(
            4,
            4,
            32,
            128,
            key_format="nvfp4",
            value_format="mxfp4",
            key_axis="token",
            sinks=5,
            rotation="both",
        ),  # fmt: skip
        kj.KiviConfig(2, 2, 32, 128, sinks=5, outlier_channels=2),
    ],
    ids=str,
)
def test_formats_sinks_rotation_and_outliers_on_token_shards(cfg):
    """Per-token float formats, sinks (all on the first shard), a rotation and outlier key
    channels: prefill, appends and chunks written where the tokens are (bit for bit), and the
    attention merged across the shards equal to the unsharded reference."""
    mesh = _mesh(1, 1, 4)
    c0 = kj.KiviCache.init(
        cfg, num_layers=L, batch=4, kv_heads=HKV, head_dim=D, max_len=2048, dtype=jnp.float32
    )
    k, v = (jax.random.normal(jax.random.key(i), (L, 4, HKV, 600, D)) for i in (3, 4))
    n = jnp.asarray([600, 500, 0, 3], jnp.int32)
    want = c0.prefill(k, v, n)
    sharded = shard_cache(c0, mesh, LONG_CONTEXT_RULES)
    got = jax.jit(lambda c, k, v, n: kj.sequence_parallel_prefill(c, k, v, n, mesh=mesh))(
        sharded, k, v, n
    )
    _gathered_equal(got, want)
    got, want = _append_and_extend(got, want, mesh, 30, [40, 0, 9, 2])
    q = _query(4)
    ref = kj.decode_attention(q, want, 1, implementation="reference")
    out = jax.jit(lambda q, c: kj.sequence_parallel_attention(q, c, 1, mesh=mesh))(q, got)
    np.testing.assert_allclose(out, ref, atol=2e-5 * float(jnp.abs(ref).max()), rtol=0)


ROPE = 1.0 / 10000 ** (np.arange(0, D, 2) / D)  # the model's inverse frequencies


@pytest.mark.parametrize("sinks,mesh_shape", [(8, (1, 1, 4)), (300, (1, 2, 2))], ids=str)
def test_the_kernel_on_token_shards_of_a_cache_with_sinks(sinks, mesh_shape, monkeypatch):
    """KIVI-2 with sinks, keys and values rotated: "pallas" on token shards skips every
    shard's first N slots in the kernel and attends them beside it (the first shard's are the
    sinks, from their buffers, counted once), equal to the unsharded reference; 300 sinks
    reach past a whole block of the first shard. The kernel's float32 twin runs in its place
    (the GPU interpreter runs one device at a time; the kernel against its twin, skip and
    sinks included, is tests/test_kivi_decode_numerics.py's)."""
    from pallas_kernels import kivi_decode

    monkeypatch.setattr(kivi_decode, "kivi_decode", kivi_decode.kivi_decode_reference)
    mesh = _mesh(*mesh_shape)
    cache = _cache("kivi2", 32, sinks=sinks, rotation="both")
    q = _query(cache.batch).astype(jnp.float16)  # what the kernel takes
    want = np.asarray(
        kj.decode_attention(q.astype(jnp.float32), cache, 1, implementation="reference")
    )
    got = jax.jit(
        lambda q, c: kj.sequence_parallel_attention(q, c, 1, mesh=mesh, implementation="pallas")
    )(q, shard_cache(cache, mesh, LONG_CONTEXT_RULES))
    # float32 inside, the output rounded to q's fp16 (2^-11 of each value)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), want, atol=1e-3 * float(np.abs(want).max()), rtol=0
    )
    assert np.all(np.asarray(got)[2] == 0)  # the empty row


def test_keys_before_rope_on_token_shards(monkeypatch):
    """`best3`, keys quantized before RoPE (8 sinks, keys and values rotated): written where
    the tokens are (bit for bit), and attended with each shard's keys turned by RoPE at that
    shard's positions, the sinks and the windows once, on the first shard: "folded" (the
    layer dequantized in XLA) and "pallas" equal the unsharded reference. On the shards
    "pallas" runs the kernel's float32 twin in the kernel's place (the GPU interpreter runs
    one device at a time); the kernel itself against its twin, an origin included, is
    tests/test_prerope_decode.py's, and on a mesh of one it runs below."""
    from pallas_kernels import prerope_decode

    mesh = _mesh(1, 1, 4)
    c0 = _cache("best3", None, lengths=[0, 0, 0, 0], rope_frequencies=ROPE)
    k, v = (jax.random.normal(jax.random.key(i), (L, 4, HKV, 1900, D)) for i in (3, 4))
    n = jnp.asarray(LENGTHS, jnp.int32)
    want = c0.prefill(k, v, n)
    sharded = shard_cache(c0, mesh, LONG_CONTEXT_RULES)
    got = jax.jit(lambda c, k, v, n: kj.sequence_parallel_prefill(c, k, v, n, mesh=mesh))(
        sharded, k, v, n
    )
    kt, vt = (jax.random.normal(jax.random.key(30 + j), (L, 4, HKV, D)) for j in (0, 1))
    got = kj.sequence_parallel_append(got, kt, vt, mesh=mesh)
    want = want.append(kt, vt)
    _gathered_equal(got, want)

    q = _query(4)
    ref = np.asarray(kj.decode_attention(q, want, 1, implementation="reference"))
    atol = 2e-5 * float(np.abs(ref).max())
    attend = lambda impl: jax.jit(
        lambda q, c: kj.sequence_parallel_attention(q, c, 1, mesh=mesh, implementation=impl)
    )(q, got)
    np.testing.assert_allclose(attend("folded"), ref, atol=atol, rtol=0)
    monkeypatch.setattr(prerope_decode, "prerope_decode", prerope_decode.prerope_decode_reference)
    np.testing.assert_allclose(attend("pallas"), ref, atol=atol, rtol=0)


def test_keys_before_rope_kernel_on_a_mesh_of_one():
    """The pre-RoPE kernel itself (GPU interpreter, race detection) under
    sequence_parallel_attention on a mesh of one, against the unsharded reference."""
    mesh = _mesh(1, 1, 1)
    lengths = [700, 3]
    c = _cache("best3", None, max_len=1024, lengths=lengths, rope_frequencies=ROPE)
    q = _query(len(lengths)).astype(jnp.float16)
    ref = np.asarray(kj.decode_attention(q.astype(jnp.float32), c, 0, implementation="reference"))
    out = kj.sequence_parallel_attention(
        q, shard_cache(c, mesh, LONG_CONTEXT_RULES), 0, mesh=mesh, implementation="pallas",
        interpret=True,
    )  # fmt: skip
    # q in fp16 and the kernel's fp16 / bf16 operands (test_prerope_decode's bound)
    np.testing.assert_allclose(
        np.asarray(out, np.float32), ref, atol=4e-3 * float(np.abs(ref).max()), rtol=0
    )


def test_a_mixed_cache_on_token_shards():
    """A MixedCache (per-layer configs: one part post-RoPE with 4-bit keys, one pre-RoPE,
    both with sinks and rotated) sharded part by part: prefill, appends and chunks written
    where the tokens are (bit for bit), and each layer attended in its part, a traced layer
    included, equal to the unsharded reference."""
    mesh = _mesh(1, 1, 4)
    base = kj.KiviConfig(2, 2, 32, 128, sinks=8, rotation="both")
    configs = [
        dataclasses.replace(base, key_bits=4),
        dataclasses.replace(base, group_size=64, pre_rope=True),
    ]
    c0 = kj.MixedCache.init(
        configs, batch=4, kv_heads=HKV, head_dim=D, max_len=1024, dtype=jnp.float32,
        rope_frequencies=ROPE,
    )  # fmt: skip
    k, v = (jax.random.normal(jax.random.key(i), (L, 4, HKV, 900, D)) for i in (5, 6))
    n = jnp.asarray([900, 300, 0, 129], jnp.int32)  # 256 positions per shard
    want = c0.prefill(k, v, n)
    got = kj.sequence_parallel_prefill(
        shard_cache(c0, mesh, LONG_CONTEXT_RULES), k, v, n, mesh=mesh
    )
    got, want = _append_and_extend(got, want, mesh, 50, [30, 0, 5, 1])
    q = _query(4)
    attend = jax.jit(lambda q, c, layer: kj.sequence_parallel_attention(q, c, layer, mesh=mesh))
    for layer in range(L):
        ref = np.asarray(kj.decode_attention(q, want, layer, implementation="reference"))
        atol = 2e-5 * float(np.abs(ref).max())
        np.testing.assert_allclose(attend(q, got, layer), ref, atol=atol, rtol=0)  # traced
    out = jax.jit(lambda q, c: kj.sequence_parallel_attention(q, c, 1, mesh=mesh))(q, got)
    np.testing.assert_allclose(out, ref, atol=atol, rtol=0)  # a concrete layer

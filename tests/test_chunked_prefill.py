"""Chunked prefill through the cache (`llama.prefill_chunked`, `chunk_attention`,
`generate(prefill_chunk=)`): equal to the one-piece prefill where nothing is quantized, equal to
streaming token by token where the past is quantized, sequence-parallel over a mesh, memory
independent of the prompt's length, and named errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kivi_jax as kj
from kivi_jax.attention import chunk_attention
from models import generate as G
from models import llama
from models.presets import ModelConfig

CFG = ModelConfig(
    name="tiny-chunk",
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    max_position_embeddings=8192,
)


@pytest.fixture(scope="module")
def params():
    return llama.init_params(CFG, jax.random.key(0), jnp.float32)


def _cache(name, batch, max_len, **kw):
    return kj.make_cache(
        name,
        num_layers=CFG.num_layers,
        batch=batch,
        kv_heads=CFG.num_kv_heads,
        head_dim=CFG.head_dim,
        max_len=max_len,
        dtype=jnp.float32,
        **kw,
    )


def _chunked(params, tokens, lengths, cache, chunk, impl="reference"):
    f = lambda p, t, n, c: llama.prefill_chunked(p, CFG, t, n, c, chunk=chunk, implementation=impl)
    return jax.jit(f)(params, tokens, lengths, cache)


TOKENS = jax.random.randint(jax.random.key(1), (3, 300), 1, 97)
LENGTHS = jnp.array([300, 137, 1], jnp.int32)


@pytest.mark.parametrize(
    "name,kw", [("fp16", {}), ("kivi2", dict(residual_length=512, group_size=32))], ids=str
)
@pytest.mark.parametrize("chunk", [64, 100, 299])
def test_equals_one_piece_prefill_where_nothing_is_quantized(params, name, kw, chunk):
    # A dense cache, or a window longer than the prompts: every chunk sees its past exactly.
    want, cw = llama.prefill(params, CFG, TOKENS, LENGTHS, _cache(name, 3, 320, **kw))
    got, cg = _chunked(params, TOKENS, LENGTHS, _cache(name, 3, 320, **kw), chunk)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(cg.lengths), np.asarray(LENGTHS))
    for a, b in zip(jax.tree.leaves(cg), jax.tree.leaves(cw), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=0)


@pytest.mark.parametrize("name", ["kivi2", "fp16"])
def test_a_chunk_as_long_as_the_prompt_is_the_one_piece_prefill_bit_for_bit(params, name):
    kw = dict(residual_length=32, group_size=32) if name == "kivi2" else {}
    want = llama.prefill(params, CFG, TOKENS, LENGTHS, _cache(name, 3, 320, **kw))
    for chunk in (300, 512):
        got = _chunked(params, TOKENS, LENGTHS, _cache(name, 3, 320, **kw), chunk)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", ["kivi2", "fp16"])
def test_chunk_attention_is_softmax_over_the_held_past_and_the_causal_chunk(name):
    # Independent float64 definition: the keys and values the cache holds (dequantized where
    # quantized, `gather`), then the chunk's own exactly, query i seeing chunk keys <= i and
    # < counts; ragged past lengths and counts.
    b, hkv, r, d, c = 3, 2, 2, 32, 5
    kw = dict(residual_length=32, group_size=32) if name == "kivi2" else {}
    cache = kj.make_cache(
        name, num_layers=2, batch=b, kv_heads=hkv, head_dim=d, max_len=256,
        dtype=jnp.float32, **kw,
    )  # fmt: skip
    past = jnp.array([150, 0, 77], jnp.int32)
    kp, vp = (jax.random.normal(jax.random.key(i), (2, b, hkv, 150, d)) for i in (3, 4))
    cache = cache.prefill(kp, vp, past)
    q = jax.random.normal(jax.random.key(5), (b, c, hkv * r, d))
    k, v = (jax.random.normal(jax.random.key(i), (b, c, hkv, d)) for i in (6, 7))
    counts = jnp.array([5, 3, 1], jnp.int32)
    got = np.asarray(chunk_attention(q, k, v, counts, cache, 1, implementation="reference"))
    t = jnp.broadcast_to(jnp.arange(150), (b, 150))
    if name == "kivi2":
        held_k = np.asarray(cache.keys.gather(1, t, past))  # [B, H, 150, D]
        held_v = np.asarray(cache.values.gather(1, t, past))
    else:
        held_k, held_v = (np.asarray(x[1]) for x in (kp, vp))
    scale = 1 / np.sqrt(d)
    for row in range(b):
        n, m = int(past[row]), int(counts[row])
        for i in range(m):
            for h in range(hkv * r):
                kv = h // r
                keys = np.concatenate([held_k[row, kv, :n], np.asarray(k[row, : i + 1, kv])])
                vals = np.concatenate([held_v[row, kv, :n], np.asarray(v[row, : i + 1, kv])])
                s = keys.astype(np.float64) @ np.asarray(q[row, i, h], np.float64) * scale
                p = np.exp(s - s.max())
                want = p @ vals / p.sum()
                np.testing.assert_allclose(got[row, i, h], want, atol=2e-5, rtol=0)


def test_a_quantized_past_changes_later_chunks(params):
    # The measured effect, in miniature: with G = R = 32 the first chunk's K/V are quantized
    # when the second attends to them, unlike the one-piece prefill.
    cfg = dict(residual_length=32, group_size=32)
    want, _ = llama.prefill(params, CFG, TOKENS, LENGTHS, _cache("kivi2", 3, 320, **cfg))
    got, _ = _chunked(params, TOKENS, LENGTHS, _cache("kivi2", 3, 320, **cfg), 64)
    diff = np.abs(np.asarray(got) - np.asarray(want)).max(axis=-1)
    assert diff[0] > 1e-3 and diff[2] < 1e-5  # row 2 is one token: nothing quantized


@pytest.mark.slow
def test_kernel_folding_the_chunk_into_query_rows_matches_the_reference():
    # The decode kernel, interpreted, with 16 queries x 4 heads = 64 rows per kv head (several
    # launches of KERNEL_QUERY_ROWS), windows and a ragged batch.
    b, hkv, d, c, r = 2, 2, 128, 16, 4
    cache = kj.make_cache(
        "kivi2", num_layers=1, batch=b, kv_heads=hkv, head_dim=d, max_len=1024,
        dtype=jnp.bfloat16, residual_length=128, group_size=128,
    )  # fmt: skip
    k = jax.random.normal(jax.random.key(0), (1, b, hkv, 700, d)).astype(jnp.bfloat16)
    cache = cache.prefill(k, k * 0.5, jnp.array([700, 300], jnp.int32))
    q = jax.random.normal(jax.random.key(1), (b, c, hkv * r, d)).astype(jnp.bfloat16)
    kk = jax.random.normal(jax.random.key(2), (b, c, hkv, d)).astype(jnp.bfloat16)
    counts = jnp.array([16, 9], jnp.int32)
    ref = chunk_attention(q, kk, kk, counts, cache, 0, implementation="reference")
    run = lambda q: chunk_attention(
        q, kk, kk, counts, cache, 0, implementation="pallas", interpret=True
    )
    got = jax.jit(run)(q)
    err = np.abs(np.asarray(got, np.float32) - np.asarray(ref, np.float32))
    assert err[0].max() < 4e-3 and err[1, :9].max() < 4e-3  # bf16 output rounding


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
@pytest.mark.parametrize("shape,names", [((4,), ("seq",)), ((2, 4), ("data", "seq"))], ids=str)
def test_generate_with_chunks_over_a_seq_mesh_equals_one_device(params, shape, names):
    mesh = jax.make_mesh(
        shape,
        names,
        axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
        devices=jax.devices()[: int(np.prod(shape))],
    )
    prompts = [list(range(1, 90)), list(range(5, 40)), list(range(3, 70))]
    kw = dict(cache="kivi2", max_new_tokens=12, residual_length=32, group_size=32)
    want = G.generate(params, CFG, prompts, prefill_chunk=16, **kw)
    got = G.generate(params, CFG, prompts, prefill_chunk=16, mesh=mesh, **kw)
    assert got.tokens == want.tokens


def test_peak_memory_does_not_grow_with_the_prompt(params):
    # The compiled chunked prefill's temporaries are one chunk's (and one PAST_BLOCK of the
    # past's) whatever S: no copy of the cache; the one-piece prefill's grow with S (its
    # attention and the prompt's dense K/V).
    def temp(fn, s):
        cache = jax.eval_shape(lambda: _cache("kivi2", 1, s, residual_length=32, group_size=32))
        args = (params, jax.ShapeDtypeStruct((1, s), jnp.int32), jnp.ones((1,), jnp.int32))
        compiled = jax.jit(fn, donate_argnums=3).lower(*args, cache).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    chunked = lambda p, t, n, c: llama.prefill_chunked(p, CFG, t, n, c, chunk=64)
    whole = lambda p, t, n, c: llama.prefill(p, CFG, t, n, c)
    small, large = temp(chunked, 8192), temp(chunked, 32768)
    assert large < 1.1 * small, (small, large)
    assert temp(whole, 32768) > 3 * temp(whole, 8192)


def test_named_errors(params):
    cache = _cache("kivi2", 3, 320, residual_length=32, group_size=32)
    with pytest.raises(ValueError, match="chunk must be a positive int"):
        llama.prefill_chunked(params, CFG, TOKENS, LENGTHS, cache, chunk=0)
    with pytest.raises(ValueError, match="prefill_chunk must be a positive int"):
        G.generate(params, CFG, [[1, 2]], prefill_chunk=0)
    q = jnp.zeros((3, 4, 4, 32))
    kv = jnp.zeros((3, 4, 2, 32))
    n = jnp.ones((3,), jnp.int32)
    with pytest.raises(ValueError, match="implementation must be one of"):
        chunk_attention(q, kv, kv, n, cache, 0, implementation="folded")
    with pytest.raises(ValueError, match=r"k and v must be \[B, C, Hkv, D\]"):
        chunk_attention(q, kv[:, :2], kv, n, cache, 0)
    with pytest.raises(ValueError, match="q must have shape"):
        chunk_attention(q[:, 0], kv, kv, n, cache, 0)
    with pytest.raises(ValueError, match="counts must be"):
        chunk_attention(q, kv, kv, n[:2], cache, 0)
    with pytest.raises(NotImplementedError, match="quantized caches only"):
        chunk_attention(q, kv, kv, n, _cache("fp16", 3, 320), 0, implementation="pallas")


@pytest.mark.skipif(not kj.attention.pallas_available(), reason="needs an H200 (sm_90) GPU")
@pytest.mark.parametrize("impl", ["cudnn", "pallas"])
@pytest.mark.parametrize("name", ["kivi2", "kivi4", "fp16"])
def test_gpu_paths_match_the_reference(impl, name):
    # Natively: cuDNN over the dequantized past and the kernel with folded queries, against
    # the float32 reference; ragged past lengths (one empty) and counts.
    if impl == "pallas" and name == "fp16":
        pytest.skip("the kernel reads quantized caches only")
    b, hkv, r, d, c = 3, 8, 4, 128, 64
    kw = dict(residual_length=128, group_size=128) if name != "fp16" else {}
    cache = kj.make_cache(
        name, num_layers=2, batch=b, kv_heads=hkv, head_dim=d, max_len=5000,
        dtype=jnp.bfloat16, **kw,
    )  # fmt: skip
    kp, vp = (jax.random.normal(jax.random.key(i), (2, b, hkv, 4000, d)) for i in (3, 4))
    cache = cache.prefill(
        kp.astype(jnp.bfloat16), vp.astype(jnp.bfloat16), jnp.array([4000, 0, 1234], jnp.int32)
    )
    q = jax.random.normal(jax.random.key(5), (b, c, hkv * r, d)).astype(jnp.bfloat16)
    k, v = (
        jax.random.normal(jax.random.key(i), (b, c, hkv, d)).astype(jnp.bfloat16) for i in (6, 7)
    )
    counts = jnp.array([64, 17, 1], jnp.int32)
    run = lambda impl: np.asarray(
        jax.jit(lambda q: chunk_attention(q, k, v, counts, cache, 1, implementation=impl))(q),
        np.float32,
    )
    want, got = run("reference"), run(impl)
    for row, m in enumerate(np.asarray(counts)):  # bf16 outputs (and cuDNN's bf16 P)
        bound = 2e-2 * np.abs(want[row, :m]).max()
        np.testing.assert_allclose(got[row, :m], want[row, :m], atol=bound, rtol=0)


@pytest.mark.parametrize("seq", [1, 4])
def test_dequantized_past_path_on_token_shards_equals_the_reference(seq, monkeypatch):
    # The "cudnn" algorithm (the layer's past dequantized in one pass, attended with its
    # log-sum-exp, the chunk causally) with cuDNN's float32 twin in its place, so that it runs
    # here: on 1 and on 4 token shards (each its own positions, the windows where they fall,
    # the chunk once) against the reference on the whole cache.
    import dataclasses

    from kivi_jax import attention as A
    from kivi_jax.sharding import LONG_CONTEXT_RULES, cache_specs, shard_cache

    monkeypatch.setattr(A, "_cudnn_with_lse", A.dense_with_lse_reference)
    b, hkv, r, d, c = 3, 2, 2, 32, 5
    cache = kj.make_cache(
        "kivi2", num_layers=2, batch=b, kv_heads=hkv, head_dim=d, max_len=2048,
        dtype=jnp.float32, residual_length=32, group_size=32,
    )  # fmt: skip
    kp, vp = (jax.random.normal(jax.random.key(i), (2, b, hkv, 1500, d)) for i in (3, 4))
    cache = cache.prefill(kp, vp, jnp.array([1500, 0, 530], jnp.int32))  # 512 per shard at 4
    q = jax.random.normal(jax.random.key(5), (b, c, hkv * r, d))
    k, v = (jax.random.normal(jax.random.key(i), (b, c, hkv, d)) for i in (6, 7))
    counts = jnp.array([5, 3, 1], jnp.int32)
    want = np.asarray(chunk_attention(q, k, v, counts, cache, 1, implementation="reference"))
    mesh = jax.make_mesh(
        (1, 1, seq), ("data", "model", "seq"),
        axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=jax.devices()[:seq],
    )  # fmt: skip
    specs = cache_specs(cache, LONG_CONTEXT_RULES)

    def local(q, k, v, n, c):
        c = dataclasses.replace(c, seq_axis="seq")
        return chunk_attention(q, k, v, n, c, 1, implementation="cudnn")

    P = jax.P()
    run = jax.shard_map(
        local, mesh=mesh, in_specs=(P, P, P, P, specs), out_specs=P, check_vma=False
    )
    got = np.asarray(jax.jit(run)(q, k, v, counts, shard_cache(cache, mesh, LONG_CONTEXT_RULES)))
    for row, m in enumerate(np.asarray(counts)):
        np.testing.assert_allclose(got[row, :m], want[row, :m], atol=2e-5, rtol=0)
    whole = chunk_attention(q, k, v, counts, cache, 1, implementation="cudnn")
    for row, m in enumerate(np.asarray(counts)):
        np.testing.assert_allclose(np.asarray(whole)[row, :m], want[row, :m], atol=2e-5, rtol=0)

"""pallas_kernels.fp8_decode: the fp8 kernel against its float32 twin (under the GPU interpreter
here, natively on an sm_90 GPU), its sm_90 lowering, its input checks, and `decode_attention`'s
"pallas" path over a real fp8 cache against "reference"."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
from jax.experimental.pallas import mosaic_gpu as plgpu

import kivi_jax as kj
from pallas_kernels.fp8_decode import choose_splits, fp8_decode, fp8_decode_reference

ON_GPU = kj.attention.pallas_available()
TOL = 2e-3  # of max |o|: the fp16 operands (q, the widened values, P) against float32


def stores(seed, L, B, H, Tq, D, G, scale_dtype=jnp.float16):
    """Random fp8 stores as a cache holds them: E4M3 bytes (finite), one scale per slot and
    channel block (a spread of magnitudes, as per-token amax / 448 gives)."""
    r = np.random.default_rng(seed)
    e4m3 = lambda shape: jax.lax.bitcast_convert_type(
        jnp.asarray(np.clip(r.normal(size=shape) * 60, -440, 440), jnp.float8_e4m3fn), jnp.uint8
    )
    scales = lambda: jnp.asarray(10 ** r.uniform(-3.5, -1.5, (L, B, H, D // G, Tq)), scale_dtype)
    return e4m3((L, B, H, Tq, D)), scales(), e4m3((L, B, H, D, Tq)), scales()


def query(seed, B, Hq, D, dtype=jnp.bfloat16):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(B, Hq, D)), dtype)


def compare(got, want, tol=TOL):
    (o, lse), (ro, rlse) = got, want
    assert np.isfinite(np.asarray(o)).all()
    # q is an fp16 operand (2^-11 of each logit): lse within 2e-3
    np.testing.assert_allclose(np.asarray(lse), np.asarray(rlse), atol=2e-3, rtol=0)
    err = float(jnp.abs(o - ro).max() / jnp.abs(ro).max())
    assert err < tol, err


CASES = [
    # L, B, Hkv, Hq, Tq, D, G, lengths, splits, stages
    (2, 2, 2, 8, 512, 128, 64, (500, 0), 2, 2),  # a row with no positions
    (1, 1, 1, 3, 768, 64, 32, (700,), 1, 1),  # heads padded 3 -> 8, one stage
    (1, 2, 1, 8, 512, 128, 128, (77, 512), None, 3),  # a partial block; the chosen splits
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"D{c[5]}G{c[6]}Hq{c[3]}")
def test_kernel_equals_twin_under_the_interpreter(case):
    """Race detection on: the copies of a slot are not overwritten while it is read."""
    L, B, H, Hq, Tq, D, G, lengths, splits, stages = case
    k, ks, v, vs = stores(0, L, B, H, Tq, D, G)
    q = query(1, B, Hq, D)
    args = (q, k, ks, v, vs, jnp.asarray(lengths, jnp.int32), L - 1)
    kw = dict(group_size=G, sm_scale=D**-0.5, splits=splits, stages=stages)
    got = fp8_decode(*args, **kw, interpret=plgpu.InterpretGPUParams(detect_races=True))
    got = jax.block_until_ready(got)
    # the interpreter records races rather than raising
    assert not ipc.get_races().races_found, "GPU interpreter detected a data race"
    want = fp8_decode_reference(*args, **kw)
    compare(got, want)
    empty = np.asarray(lengths) == 0
    assert (np.asarray(got[0])[empty] == 0).all() and np.isneginf(np.asarray(got[1])[empty]).all()


def test_twin_is_attention_over_the_dequantized_positions():
    """The twin against plain softmax attention over the dequantized K/V in position order
    (slot i holds position cache_slot(i)): what the kernel must equal."""
    L, B, H, Hq, Tq, D, G = 1, 1, 2, 4, 256, 64, 32
    k, ks, v, vs = stores(2, L, B, H, Tq, D, G, jnp.float32)
    q = query(3, B, Hq, D, jnp.float32)
    n = 100
    o, lse = fp8_decode_reference(q, k, ks, v, vs, jnp.array([n]), 0, group_size=G, sm_scale=0.3)
    f8 = lambda x: np.asarray(jax.lax.bitcast_convert_type(x, jnp.float8_e4m3fn), np.float32)
    slots = np.asarray(kj.quant.cache_slot(np.arange(n)))  # the slot of each position
    per_channel = lambda s: np.repeat(np.asarray(s)[0, 0][:, :, slots], G, axis=1)  # [H, D, n]
    kd = f8(k)[0, 0][:, slots] * per_channel(ks).swapaxes(1, 2)  # [H, n, D]
    vd = (f8(v)[0, 0][:, :, slots] * per_channel(vs)).swapaxes(1, 2)
    qg = np.asarray(q)[0].reshape(H, Hq // H, D) * 0.3
    s = np.einsum("hgd,htd->hgt", qg, kd)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    want = np.einsum("hgt,htd->hgd", p, vd) / p.sum(-1)[..., None]
    np.testing.assert_allclose(np.asarray(o)[0].reshape(H, -1, D), want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(lse)[0], (m[..., 0] + np.log(p.sum(-1))).ravel(), rtol=1e-5
    )


def test_layer_out_of_range_gives_nan():
    k, ks, v, vs = stores(4, 2, 1, 1, 256, 64, 64)
    q = query(5, 1, 4, 64)
    run = jax.jit(functools.partial(fp8_decode, group_size=64, sm_scale=0.125, interpret=True))
    o, _ = run(q, k, ks, v, vs, jnp.array([200]), jnp.int32(2))
    assert np.isnan(np.asarray(o)).all()
    o, _ = run(q, k, ks, v, vs, jnp.array([200]), jnp.int32(1))
    assert np.isfinite(np.asarray(o)).all()


def test_bad_inputs_raise():
    k, ks, v, vs = stores(6, 1, 1, 1, 256, 64, 64)
    q, n = query(7, 1, 4, 64), jnp.array([10])
    call = functools.partial(fp8_decode, sm_scale=0.1, interpret=True)
    with pytest.raises(ValueError, match="group_size"):
        call(q, k, ks, v, vs, n, 0, group_size=48)
    with pytest.raises(ValueError, match="v_codes"):
        call(q, k, ks, v[..., :128], vs, n, 0, group_size=64)
    with pytest.raises(ValueError, match="q must be"):
        call(q[:, :, :32], k, ks, v, vs, n, 0, group_size=64)
    with pytest.raises(ValueError, match="splits"):
        call(q, k, ks, v, vs, n, 0, group_size=64, splits=2)
    with pytest.raises(ValueError, match="uint8"):
        call(q, k.astype(jnp.int32), ks, v, vs, n, 0, group_size=64)


def test_splits_fill_the_gpu_and_stay_within_the_blocks():
    assert choose_splits(1, 8, 131072) == 264  # 16 units per SM of 132, over 8 kv heads
    assert choose_splits(8, 8, 131072) == 33
    assert choose_splits(64, 8, 131072) == 5
    assert choose_splits(256, 8, 131072) == 2
    assert choose_splits(1, 1, 512) == 2  # no more splits than 256-slot blocks


@pytest.mark.parametrize("d, g", [(128, 64), (64, 32), (128, 128)])
def test_kernel_lowers_for_sm90(d, g):
    """Mosaic GPU's sm_90 lowering of the launch on any machine (no GPU needed)."""
    k, ks, v, vs = stores(8, 2, 2, 8, 1024, d, g)
    q = query(9, 2, 32, d)
    f = functools.partial(fp8_decode, group_size=g, sm_scale=0.1)
    lowered = jax.jit(f).trace(q, k, ks, v, vs, jnp.array([1000, 3]), jnp.int32(1))
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


# ---- through decode_attention on an fp8 cache -----------------------------------------------


def fp8_cache(rotation="none", lengths=(700, 130), G=64, per_layer=False):
    L, B, H, D, T = 2, len(lengths), 2, 64, 1024
    cache = kj.make_cache(
        "fp8",
        num_layers=L,
        batch=B,
        kv_heads=H,
        head_dim=D,
        max_len=T,
        group_size=G,
        residual_length=128,
        rotation=rotation,
        per_layer=per_layer,
    )
    r = np.random.default_rng(11)
    k, v = (jnp.asarray(r.normal(size=(L, B, H, T, D)), jnp.bfloat16) for _ in range(2))
    return cache.prefill(k, v, jnp.asarray(lengths, jnp.int32))


@pytest.mark.parametrize("rotation", ["none", "both"])
def test_decode_attention_pallas_equals_reference_on_an_fp8_cache(rotation):
    """The kernel over the quantized slots merged with the windows beside it, the rotation
    around it (q before, the output after)."""
    cache = fp8_cache(rotation)
    q = query(12, 2, 8, 64)
    for layer in (0, 1):
        got = kj.decode_attention(q, cache, layer, implementation="pallas", interpret=True)
        want = kj.decode_attention(q, cache, layer, implementation="reference")
        err = float(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max())
        assert err < 1e-2 * float(jnp.abs(want.astype(jnp.float32)).max()), err  # bf16 output


def test_decode_attention_pallas_on_a_per_layer_fp8_cache():
    cache = fp8_cache(per_layer=True, lengths=(300,))
    q = query(13, 1, 4, 64)
    got = kj.decode_attention(q, cache, 1, implementation="pallas", interpret=True)
    want = kj.decode_attention(q, cache, 1, implementation="reference")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=4e-3)


def test_fp8_kernel_declines_sinks_and_pre_rope():
    q = query(14, 1, 4, 64)
    for kw in (dict(sinks=8), dict(pre_rope=True, rope_frequencies=jnp.ones(32))):
        cache = kj.make_cache(
            "fp8", num_layers=1, batch=1, kv_heads=1, head_dim=64, max_len=512, **kw
        )
        assert not cache.config.fp8_kernel_layout
        with pytest.raises(NotImplementedError):
            kj.decode_attention(q, cache, 0, implementation="pallas", interpret=True)


# ---- natively on an sm_90 GPU ------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (sm_90)")
@pytest.mark.parametrize("B, T, g", [(1, 8192, 4), (4, 32768, 4), (2, 4096, 8)])
def test_native_kernel_equals_twin_and_repeats_its_bits(B, T, g):
    H, D, G = 8, 128, 64
    k, ks, v, vs = stores(15, 2, B, H, T, D, G)
    q = query(16, B, H * g, D)
    lengths = jnp.asarray(np.linspace(T, T // 3, B).astype(np.int32))
    args = (q, k, ks, v, vs, lengths, jnp.int32(1))
    run = jax.jit(functools.partial(fp8_decode, group_size=G, sm_scale=D**-0.5))
    got = run(*args)
    again = run(*args)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(again[0]))
    compare(got, fp8_decode_reference(*args, group_size=G, sm_scale=D**-0.5))


def test_chunk_attention_pallas_folds_the_chunk_into_the_fp8_kernel():
    """A chunk's queries folded into query rows (KERNEL_QUERY_ROWS per launch) on an fp8 cache,
    ragged rows, against "reference"."""
    cache = fp8_cache(lengths=(700, 300))
    b, c, hkv, d = 2, 12, 2, 64
    q = jax.random.normal(jax.random.key(1), (b, c, hkv * 4, d)).astype(jnp.bfloat16)
    kk = jax.random.normal(jax.random.key(2), (b, c, hkv, d)).astype(jnp.bfloat16)
    counts = jnp.array([12, 5], jnp.int32)
    ref = kj.chunk_attention(q, kk, kk, counts, cache, 1, implementation="reference")
    got = kj.chunk_attention(q, kk, kk, counts, cache, 1, implementation="pallas", interpret=True)
    err = np.abs(np.asarray(got, np.float32) - np.asarray(ref, np.float32))
    assert err[0].max() < 4e-3 and err[1, :5].max() < 4e-3  # bf16 outputs (|o| <= 0.5)

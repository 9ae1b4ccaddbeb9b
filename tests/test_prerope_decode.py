"""pallas_kernels.prerope_decode: the pre-RoPE kernel against its float32 twin (under the GPU
interpreter here, natively on an sm_90 GPU), its sm_90 lowering and input checks, and
`decode_attention` / `chunk_attention`'s "pallas" path over real caches of keys quantized before
RoPE (`best3`, `best25`) against "reference"."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import kivi_jax as kj
from kivi_jax import rotation
from pallas_kernels.layout import CODE_BLOCK, codes_per_byte, value_codes_blocked
from pallas_kernels.prerope_decode import (
    choose_splits,
    prerope_decode,
    prerope_decode_reference,
)

ON_GPU = kj.attention.pallas_available()
# of max |o|: fp16 keys after dequantizing and after RoPE, bf16 P times the value scales
TOL = 4e-3


def stores(seed, L, B, H, Tq, D, G, kb, vb):
    """Random stores as a cache holds them (any bytes are valid codes): key codes, scales and
    minimums per channel group, V^T codes (blocked at 2 bits), value scales and minimums."""
    r = np.random.default_rng(seed)
    u8 = lambda shape: jnp.asarray(r.integers(0, 256, shape), jnp.uint8)
    f16 = lambda shape, lo, hi: jnp.asarray(r.uniform(lo, hi, shape), jnp.float16)
    vshape = (L, B, H, D, Tq // codes_per_byte(vb))
    if value_codes_blocked(vb):
        vshape = (L, B, H, Tq // (CODE_BLOCK * codes_per_byte(vb)), D, CODE_BLOCK)
    return (
        u8((L, B, H, Tq // codes_per_byte(kb), D)),
        f16((L, B, H, Tq // G, D), 0.05, 0.5),
        f16((L, B, H, Tq // G, D), -1.5, 1.0),
        u8(vshape),
        f16((L, B, H, D // G, Tq), 0.05, 0.5),
        f16((L, B, H, D // G, Tq), -1.0, 0.5),
    )


def rope_frequencies(D, base=10000.0):
    return jnp.asarray(1.0 / base ** (np.arange(0, D, 2) / D), jnp.float32)


def query(seed, B, Hq, D, dtype=jnp.bfloat16):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(B, Hq, D)), dtype)


def full_precision(seed, L, B, H, D, window, sinks):
    """Random windows (k [L, B, H, W, D], v [L, B, H, D, W]) and sink buffers (k, v [L, B, H,
    N, D], the keys larger as attention sinks are) in bf16, or None where W or N is 0."""
    r = np.random.default_rng(seed)
    bf = lambda shape, std=1.0: jnp.asarray(std * r.normal(size=shape), jnp.bfloat16)
    windows = (bf((L, B, H, window, D)), bf((L, B, H, D, window))) if window else None
    buffers = (bf((L, B, H, sinks, D), 3.0), bf((L, B, H, sinks, D))) if sinks else None
    return windows, buffers


def interpreted(*args, **kw):
    """The kernel under the GPU interpreter with race detection, which records races rather
    than raising: checked here."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc

    got = jax.block_until_ready(
        prerope_decode(*args, **kw, interpret=plgpu.InterpretGPUParams(detect_races=True))
    )
    assert not ipc.get_races().races_found, "GPU interpreter detected a data race"
    return got


def compare(got, want, tol=TOL):
    (o, lse), (ro, rlse) = got, want
    o, ro = np.asarray(o), np.asarray(ro)
    np.testing.assert_array_equal(np.isinf(np.asarray(lse)), np.isinf(np.asarray(rlse)))
    finite = np.isfinite(np.asarray(rlse))
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(rlse)[finite], atol=5e-3)
    err = float(np.abs(o - ro).max() / np.abs(ro).max())
    assert err < tol, err


CASES = [
    # bits (k, v), G, L, B, Hkv, Hq, Tq, D, lengths, rotated, skip, origin, splits, stages,
    # (W, N): the windows' slots and the sink buffers' in the launch (lengths then the rows')
    ((2, 2), 32, 2, 2, 1, 3, 512, 64, (500, 0), True, 8, 0, None, 1, (0, 0)),  # an empty row
    ((4, 4), 64, 1, 1, 2, 4, 768, 64, (700,), False, 0, 300, 2, 2, (0, 0)),  # an origin
    ((4, 2), 32, 1, 2, 1, 8, 512, 128, (77, 512), True, 0, 0, 1, 1, (0, 0)),  # a partial block
    # windows and sinks: rows past the windows, inside them (no sink quantized yet), with
    # two sinks quantized; a row past max_len = Tq + W (capped)
    ((2, 2), 32, 2, 3, 1, 3, 512, 64, (600, 70, 130), True, 8, 0, None, 1, (128, 8)),
    ((4, 2), 64, 1, 2, 2, 8, 512, 128, (141, 700), False, 0, 0, 1, 1, (64, 0)),
    ((2, 2), 32, 1, 2, 1, 4, 256, 64, (5, 200), True, 8, 0, None, 1, (0, 8)),  # sinks alone
]


@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_twin_under_the_interpreter(case):
    (kb, vb), G, L, B, H, Hq, Tq, D, lengths, rotated, skip, origin, splits, stages, full = case
    arrays = stores(1, L, B, H, Tq, D, G, kb, vb)
    windows, sinks = full_precision(3, L, B, H, D, *full)
    basis = jnp.asarray(rotation.matrix(D).T) if rotated else None
    args = (query(2, B, Hq, D), *arrays, jnp.asarray(lengths), L - 1, rope_frequencies(D), basis)
    kw = dict(
        key_bits=kb,
        value_bits=vb,
        group_size=G,
        sm_scale=D**-0.5,
        basis_scale=D**-0.5 if rotated else 1.0,
        skip=skip,
        origin=origin,
        windows=windows,
        sinks=sinks,
        max_len=Tq + full[0] if windows else 0,
        splits=splits,
        stages=stages,
    )
    compare(interpreted(*args, **kw), prerope_decode_reference(*args, **kw))


def test_twin_reads_windows_and_sinks_at_their_positions():
    """The twin with windows and sinks, against the twin over the codes alone merged with the
    full-precision part written out here: window slot s holds the newest position p < n with
    p = s (mod W) (none if p < 0), sink j is read where the codes hold it (j < n - W), keys
    turned to the model's basis and rotated by RoPE at their positions."""
    D, G, Tq, W, N, L = 64, 32, 256, 64, 8, 1
    lengths = np.array([40, 75, 300])
    B = len(lengths)
    arrays = stores(16, L, B, 1, Tq, D, G, 2, 2)
    windows, sinks = full_precision(17, L, B, 1, D, W, N)
    q, inv = query(18, B, 2, D), rope_frequencies(D)
    basis = np.asarray(rotation.matrix(D).T)
    kw = dict(key_bits=2, value_bits=2, group_size=G, sm_scale=0.2, skip=N)
    args = (q, *arrays, jnp.asarray(lengths))
    o, lse = prerope_decode_reference(
        *args, 0, inv, jnp.asarray(basis), windows=windows, sinks=sinks, **kw
    )
    held = np.maximum(lengths - W, 0)
    o1, lse1 = prerope_decode_reference(
        q, *arrays, jnp.asarray(held), 0, inv, jnp.asarray(basis), **kw
    )
    f32 = lambda x: np.asarray(x, np.float32)[0, :, 0]  # layer 0, head 0: [B, ..., D]
    for b, n in enumerate(lengths):
        p = n - 1 - (n - 1 - np.arange(W)) % W
        keys = [(f32(windows[0])[b, s], f32(windows[1])[b, :, s], p[s]) for s in range(W)]
        keys = [x for x in keys if x[2] >= 0]
        keys += [(f32(sinks[0])[b, j], f32(sinks[1])[b, j], j) for j in range(N) if j < n - W]
        pos = np.array([x[2] for x in keys], np.int32)
        k = np.asarray(rotation.rope(np.stack([x[0] for x in keys]) @ basis, pos, inv))
        v = np.stack([x[1] for x in keys])
        for h in range(2):
            s2 = k @ np.asarray(q[b, h], np.float32) * 0.2
            lse2 = s2.max() + np.log(np.exp(s2 - s2.max()).sum())
            o2 = np.exp(s2 - lse2) @ v
            total = np.logaddexp(float(lse1[b, h]), lse2)
            want = np.nan_to_num(np.exp(float(lse1[b, h]) - total)) * np.asarray(o1[b, h])
            want = want + np.exp(lse2 - total) * o2
            np.testing.assert_allclose(np.asarray(o[b, h]), want, rtol=2e-4, atol=2e-4)
            np.testing.assert_allclose(float(lse[b, h]), total, rtol=1e-5)


def test_twin_is_rope_attention_over_the_dequantized_keys():
    """The twin, written out independently at one row and head: key t dequantized, turned to
    the model's basis, rotated at position origin + t; positions below the sinks and past
    num_tokens not attended."""
    D, G, Tq, origin, n, sinks = 64, 32, 256, 5, 200, 3
    kc, ks, km, vc, vs, vm = stores(3, 1, 1, 1, Tq, D, G, 4, 4)
    q = query(4, 1, 1, D)
    basis = jnp.asarray(rotation.matrix(D).T)
    inv = rope_frequencies(D)
    kw = dict(key_bits=4, value_bits=4, group_size=G, sm_scale=0.1, skip=sinks, origin=origin)
    o, lse = prerope_decode_reference(
        q, kc, ks, km, vc, vs, vm, jnp.array([n]), 0, inv, basis, **kw
    )
    keys = kj.quant.unpack_tokens(kc[0, 0, 0], 4, axis=-2).astype(np.float32)  # [Tq, D]
    keys = keys * np.repeat(np.asarray(ks[0, 0, 0], np.float32), G, 0)
    keys = keys + np.repeat(np.asarray(km[0, 0, 0], np.float32), G, 0)
    values = kj.quant.unpack_tokens(
        kj.quant.unblock_columns(vc[0, 0, 0]) if vc.ndim == 6 else vc[0, 0, 0], 4, axis=-1
    ).astype(np.float32)  # [D, Tq]
    order = kj.quant.to_cache_order
    values = values * order(np.repeat(np.asarray(vs[0, 0, 0], np.float32), G, 0), -1)
    values = (values + order(np.repeat(np.asarray(vm[0, 0, 0], np.float32), G, 0), -1)).T
    t = np.arange(Tq)
    k = np.asarray(rotation.rope(keys @ np.asarray(basis), origin + t, inv))
    s = k @ np.asarray(q[0, 0], np.float32) * 0.1
    s = np.where((t < n) & (origin + t >= sinks), s, -np.inf)
    p = np.exp(s - s.max())
    np.testing.assert_allclose(np.asarray(o[0, 0]), p @ values / p.sum(), rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(float(lse[0, 0]), s.max() + np.log(p.sum()), rtol=1e-5)


def test_layer_out_of_range_gives_nan():
    arrays = stores(5, 2, 1, 1, 256, 64, 32, 2, 2)
    args = (query(6, 1, 2, 64), *arrays, jnp.array([200]), 2, rope_frequencies(64))
    kw = dict(key_bits=2, value_bits=2, group_size=32, sm_scale=0.1)
    for run in (prerope_decode_reference, functools.partial(prerope_decode, interpret=True)):
        assert np.isnan(np.asarray(run(*args, **kw)[0])).all()


def test_bad_inputs_raise():
    kc, ks, km, vc, vs, vm = stores(7, 1, 1, 1, 256, 64, 32, 2, 2)
    q, n, inv = query(8, 1, 2, 64), jnp.array([100]), rope_frequencies(64)
    kw = dict(key_bits=2, value_bits=2, group_size=32, sm_scale=0.1)
    run = lambda *a, **k: prerope_decode(*a, **{**kw, **k})
    with pytest.raises(ValueError, match="key_bits"):
        run(q, kc, ks, km, vc, vs, vm, n, 0, inv, key_bits=8)
    with pytest.raises(ValueError, match="group_size"):
        run(q, kc, ks, km, vc, vs, vm, n, 0, inv, group_size=16)
    with pytest.raises(ValueError, match="k_scale"):
        run(q, kc, ks[..., :4, :], km, vc, vs, vm, n, 0, inv)
    with pytest.raises(ValueError, match="inv_freq"):
        run(q, kc, ks, km, vc, vs, vm, n, 0, inv[:8])
    with pytest.raises(ValueError, match="q must be"):
        run(jnp.concatenate([q, q]), kc, ks, km, vc, vs, vm, n, 0, inv)
    with pytest.raises(ValueError, match="uint8"):
        run(q, kc.astype(jnp.int32), ks, km, vc, vs, vm, n, 0, inv)
    with pytest.raises(ValueError, match="splits"):
        run(q, kc, ks, km, vc, vs, vm, n, 0, inv, splits=2)
    cache = (q, kc, ks, km, vc, vs, vm, n, 0, inv)
    windows, sinks = full_precision(0, 1, 1, 1, 64, 64, 8)
    with pytest.raises(ValueError, match="multiple of 64"):
        run(*cache, windows=full_precision(0, 1, 1, 1, 64, 32, 0)[0])
    wide = full_precision(0, 1, 1, 1, 64, 128, 0)[0]
    with pytest.raises(ValueError, match="v_window"):
        run(*cache, windows=(wide[0], wide[0]))  # keys' layout for the values
    with pytest.raises(ValueError, match="origin must be 0"):
        run(*cache, windows=windows, origin=64)
    with pytest.raises(ValueError, match="multiple of 8"):
        run(*cache, sinks=full_precision(0, 1, 1, 1, 64, 0, 4)[1], skip=4)
    with pytest.raises(ValueError, match="skip must be"):
        run(*cache, sinks=sinks)
    with pytest.raises(ValueError, match="16-bit dtype"):
        run(*cache, windows=windows, sinks=tuple(x.astype(jnp.float16) for x in sinks), skip=8)


def test_splits_fill_the_gpu_and_stay_within_the_blocks():
    assert choose_splits(1, 8, 8192) == 32  # capped by the 256-token blocks
    assert choose_splits(8, 8, 131072) == 9
    assert choose_splits(64, 8, 32768) == 2
    assert choose_splits(1, 1, 512) == 2


@pytest.mark.parametrize(
    "bits, G, D, full", [((2, 2), 32, 128, (128, 8)), ((4, 2), 64, 64, (0, 0))], ids=str
)
def test_kernel_lowers_for_sm90(bits, G, D, full):
    """Mosaic GPU's sm_90 lowering of the launch on any machine (no GPU needed), with the
    windows and sinks in it (their TMA copies included) and without."""
    (kb, vb), Tq = bits, 1024
    arrays = stores(9, 2, 2, 2, Tq, D, G, kb, vb)
    windows, sinks = full_precision(9, 2, 2, 2, D, *full)

    def f(*args):
        *args, windows, sinks = args
        kw = dict(key_bits=kb, value_bits=vb, group_size=G, sm_scale=0.1, skip=8)
        return prerope_decode(*args, **kw, windows=windows, sinks=sinks, max_len=Tq + full[0])

    args = (query(10, 2, 8, D), *arrays, jnp.array([1000, 3]), jnp.int32(1))
    args = (*args, rope_frequencies(D), jnp.eye(D), windows, sinks)
    lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


# ---- through decode_attention on caches of keys before RoPE ------------------------------------


def prerope_cache(name, lengths=(900, 300), G=None, **kw):
    L, H, D, T = 2, 2, 64, 900
    cache = kj.make_cache(
        name,
        num_layers=L,
        batch=len(lengths),
        kv_heads=H,
        head_dim=D,
        max_len=1024,
        group_size=G,
        rope_frequencies=rope_frequencies(D),
        **kw,
    )
    k = jax.random.normal(jax.random.key(0), (L, len(lengths), H, T, D))
    k = k + 3.0 * (jnp.arange(D) % 17 == 0)  # outlier channels
    v = jax.random.normal(jax.random.key(1), (L, len(lengths), H, T, D))
    return cache.prefill(k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), jnp.asarray(lengths))


@pytest.mark.parametrize(
    "name, kw",
    [
        ("best3", {}),  # 8 sinks, keys and values rotated, G = 32
        ("best25", {}),  # G = 64
        ("kivi4", dict(pre_rope=True, sinks=4, G=64)),  # no rotation, 4-bit
    ],
)
def test_decode_attention_pallas_equals_reference(name, kw):
    cache = prerope_cache(name, lengths=(900, 5), **kw)  # a row inside its sinks
    assert cache.config.prerope_kernel_layout
    q = query(11, 2, 8, 64)
    got = kj.decode_attention(q, cache, 1, implementation="pallas", interpret=True)
    want = kj.decode_attention(q, cache, 1, implementation="reference")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=1e-2)


def test_decode_attention_attends_windows_and_sinks_in_the_launch(monkeypatch):
    """best3 (8 sinks, windows of 128): the one launch attends the sinks and the windows, and
    nothing is attended beside it; rows past, inside and at the edge of the windows."""
    cache = prerope_cache("best3", lengths=(900, 100, 136))
    assert kj.attention.kernel_window(cache) == 128

    def beside(*a, **k):
        raise AssertionError("attended beside the kernel")

    monkeypatch.setattr(kj.attention, "_prerope_beside", beside)
    monkeypatch.setattr(kj.attention, "tail_attention", beside)
    q = query(19, 3, 8, 64)
    got = kj.decode_attention(q, cache, 0, implementation="pallas", interpret=True)
    want = kj.decode_attention(q, cache, 0, implementation="reference")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=1e-2)


def test_decode_attention_pallas_on_a_per_layer_cache():
    """best3's per-layer form (4-bit keys in one layer, another G in the other): each layer's
    part through the kernel."""
    cache = kj.make_cache(
        "best3",
        num_layers=2,
        batch=1,
        kv_heads=2,
        head_dim=64,
        max_len=1024,
        rope_frequencies=rope_frequencies(64),
        layer_overrides=[([0], dict(key_bits=4)), ([1], dict(group_size=64))],
    )
    k = jax.random.normal(jax.random.key(2), (2, 1, 2, 700, 64)).astype(jnp.bfloat16)
    cache = cache.prefill(k, k * 0.5, jnp.array([700]))
    q = query(12, 1, 4, 64)
    for layer in (0, 1):
        got = kj.decode_attention(q, cache, layer, implementation="pallas", interpret=True)
        want = kj.decode_attention(q, cache, layer, implementation="reference")
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), atol=1e-2
        )


def test_chunk_attention_pallas_folds_the_chunk_into_the_kernel():
    cache = prerope_cache("best3")
    b, c, hkv, d = 2, 12, 2, 64
    q = jax.random.normal(jax.random.key(3), (b, c, hkv * 4, d)).astype(jnp.bfloat16)
    kk = jax.random.normal(jax.random.key(4), (b, c, hkv, d)).astype(jnp.bfloat16)
    counts = jnp.array([12, 5], jnp.int32)
    ref = kj.chunk_attention(q, kk, kk, counts, cache, 1, implementation="reference")
    got = kj.chunk_attention(q, kk, kk, counts, cache, 1, implementation="pallas", interpret=True)
    err = np.abs(np.asarray(got, np.float32) - np.asarray(ref, np.float32))
    assert err[0].max() < 1e-2 and err[1, :5].max() < 1e-2


def test_auto_takes_the_kernel_on_small_caches_only(monkeypatch):
    """ "auto" tries the pre-RoPE kernel where rows x capacity <= PRE_ROPE_KERNEL_TOKENS (on a
    Hopper GPU, which the test pretends to be)."""
    monkeypatch.setattr(kj.attention, "pallas_available", lambda: True)
    q = query(13, 2, 8, 64)
    small = prerope_cache("best3")  # 2 rows x 1024 slots
    assert kj.attention._kernel_applies(q, small)
    monkeypatch.setattr(kj.attention, "PRE_ROPE_KERNEL_TOKENS", 1024)
    assert not kj.attention._kernel_applies(q, small)


# ---- natively on an sm_90 GPU ------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (sm_90)")
@pytest.mark.parametrize(
    "bits, G, rotated, full",
    [((2, 2), 32, True, (0, 0)), ((4, 2), 64, False, (0, 0)), ((2, 2), 32, True, (128, 8))],
    ids=str,
)
def test_native_kernel_equals_twin_and_repeats_its_bits(bits, G, rotated, full):
    (kb, vb), B, H, D, T = bits, 2, 8, 128, 32768
    arrays = stores(14, 2, B, H, T, D, G, kb, vb)
    windows, sinks = full_precision(16, 2, B, H, D, *full)
    basis = jnp.asarray(rotation.matrix(D).T) if rotated else None
    args = (query(15, B, H * 4, D), *arrays, jnp.array([32000, 1000]), 1, rope_frequencies(D, 5e5))
    kw = dict(
        key_bits=kb,
        value_bits=vb,
        group_size=G,
        sm_scale=D**-0.5,
        basis_scale=D**-0.5 if rotated else 1.0,
        skip=8,
        windows=windows,
        sinks=sinks,
        max_len=T + full[0] if windows else 0,
    )
    got = prerope_decode(*args, basis, **kw)
    again = prerope_decode(*args, basis, **kw)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(again[0]))
    compare(got, prerope_decode_reference(*args, basis, **kw))

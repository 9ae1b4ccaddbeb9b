"""kivi_jax.memory against the hand numbers and the layout formulas."""

import pytest

from kivi_jax.config import KiviConfig
from kivi_jax.memory import (
    CacheBytes,
    KVShape,
    bits_per_element,
    bytes_per_token,
    cache_bytes,
    format_bytes,
    llama_param_count,
    max_batch,
    max_tokens,
    parse_bytes,
    weight_bytes,
)

LLAMA3_70B = KVShape(num_layers=80, kv_heads=8, head_dim=128)
MI = 1 << 20


def test_llama3_70b_fp16_hand_numbers():
    assert bytes_per_token(LLAMA3_70B, None) == 327_680
    total = cache_bytes(LLAMA3_70B, None, tokens=MI).total
    assert total == 327_680 * MI + 4
    assert format_bytes(total) == "343.6 GB"


def test_kivi2_g32_is_three_bits():
    cfg = KiviConfig(key_bits=2, value_bits=2, group_size=32, residual_length=128)
    assert bits_per_element(LLAMA3_70B, cfg) == 3.0
    assert bytes_per_token(LLAMA3_70B, cfg) == 327_680 * 3 / 16
    cfg128 = KiviConfig(2, 2, group_size=128, residual_length=128)
    assert bits_per_element(LLAMA3_70B, cfg128) == 2.25
    assert bits_per_element(LLAMA3_70B, KiviConfig(4, 2, 32, 128)) == 4.0


@pytest.mark.parametrize(
    "kb,vb,g,r", [(2, 2, 32, 128), (4, 4, 64, 0), (4, 2, 32, 32), (2, 2, 64, 0)]
)
def test_cache_bytes_follow_layout(kb, vb, g, r):
    shape = KVShape(num_layers=3, kv_heads=2, head_dim=64, dtype_bytes=2)
    cfg = KiviConfig(kb, vb, g, r)
    b, t = 2, 300
    got = cache_bytes(shape, cfg, tokens=t, batch=b)
    tq = 512  # 300 rounded up to 256
    lh = 3 * b * 2
    assert got.codes == lh * (tq * 64 * kb // 8 + tq * 64 * vb // 8)
    assert got.scales == lh * 4 * (tq // g) * 64 * 2  # K scale+min per (group, channel), same for V
    assert got.residual == lh * (max(r, g) + r) * 64 * 2
    assert got.lengths == 4 * b
    assert got.total == got.codes + got.scales + got.residual + got.lengths
    # In steady state the codes and scales are exactly bytes_per_token per token.
    assert got.codes + got.scales == bytes_per_token(shape, cfg) * tq * b


def test_max_tokens_and_batch_are_tight():
    shape = LLAMA3_70B
    budget = 50e9
    for cfg in (None, KiviConfig(2, 2, 32, 128), KiviConfig(4, 4, 128, 0)):
        t = max_tokens(shape, cfg, budget)
        assert cache_bytes(shape, cfg, tokens=t).total <= budget
        step = 1 if cfg is None else 256
        assert cache_bytes(shape, cfg, tokens=t + step).total > budget
        b = max_batch(shape, cfg, budget, tokens=8192)
        assert cache_bytes(shape, cfg, tokens=8192, batch=b).total <= budget
        assert cache_bytes(shape, cfg, tokens=8192, batch=b + 1).total > budget
    assert max_tokens(shape, None, -1.0) == 0 and max_batch(shape, None, 0, tokens=10) == 0
    # KIVI-2 (3 bits) holds about 16/3 times the tokens of fp16.
    ratio = max_tokens(shape, KiviConfig(2, 2, 32, 128), budget) / max_tokens(shape, None, budget)
    assert 5.2 < ratio < 16 / 3


def test_llama3_70b_params_and_weights():
    n = llama_param_count(
        num_layers=80,
        hidden_size=8192,
        intermediate_size=28672,
        num_heads=64,
        kv_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_embeddings=False,
    )
    assert 70.5e9 < n < 70.6e9
    assert weight_bytes(n, "bf16") == 2 * n and weight_bytes(n, "int4") == n / 2
    with pytest.raises(ValueError, match="weights must be one of"):
        weight_bytes(n, "int3")


def test_parse_bytes():
    assert parse_bytes("141GB") == 141 * 10**9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("1.5 TB") == 1_500_000_000_000
    assert parse_bytes("1024") == 1024
    for bad in ("", "GB", "12XB", "-3GB", "0GB"):
        with pytest.raises(ValueError, match="memory size"):
            parse_bytes(bad)


def test_bad_shapes_and_configs():
    with pytest.raises(ValueError, match="kv_heads"):
        KVShape(num_layers=2, kv_heads=0, head_dim=64)
    with pytest.raises(ValueError, match="tokens"):
        cache_bytes(LLAMA3_70B, None, tokens=0)
    # per-token value groups of 128 channels cannot tile head_dim 64
    with pytest.raises(ValueError, match="head_dim"):
        cache_bytes(KVShape(30, 3, 64), KiviConfig(2, 2, 128, 128), tokens=10)
    assert isinstance(cache_bytes(KVShape(30, 3, 64), None, tokens=10), CacheBytes)


@pytest.mark.parametrize(
    "name,g,r",
    [
        ("fp16", 32, 128),
        ("kivi2", 32, 128),
        ("kivi4", 64, 0),
        ("k4v2", 32, 32),
        ("pertoken2", 32, 0),
        ("valchannel2", 64, 64),
        ("pertoken4", 32, 128),
        ("fp8", 64, 128),
        ("nvfp4", 32, 32),
        ("mxfp4", 32, 0),
        ("kivi2-sinks", 32, 128),
        ("kivi2-outliers", 64, 128),
    ],
)
def test_cache_bytes_match_make_cache(name, g, r):
    import jax.numpy as jnp

    import kivi_jax

    shape = KVShape(num_layers=2, kv_heads=3, head_dim=64, dtype_bytes=2)
    knobs = dict(
        sinks=4 if name.endswith("-sinks") else 0,
        outlier_channels=3 if name.endswith("-outliers") else 0,
    )
    name = name.removesuffix("-sinks").removesuffix("-outliers")
    for tokens, batch in ((100, 1), (300, 2)):
        cache = kivi_jax.make_cache(
            name,
            **knobs,
            num_layers=2,
            batch=batch,
            kv_heads=3,
            head_dim=64,
            max_len=tokens,
            dtype=jnp.bfloat16,
            group_size=g,
            residual_length=r,
        )
        want = cache.nbytes()
        cfg = kivi_jax.cache_config(name, g, r, **knobs)
        got = cache_bytes(shape, cfg, tokens=tokens, batch=batch)
        assert (got.codes, got.scales, got.residual, got.lengths) == tuple(want)
        assert got.total == want.total

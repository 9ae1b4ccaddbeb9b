"""The compiled decode loop holds the cache once: XLA's memory analysis of
`models.generate.decode_loop_jit` for a model whose cache dominates, dense and KIVI.

A second copy of the cache (a while-loop carry copied, a cache update not in place, the cache
carried in another physical layout) shows as temporaries of the order of the cache; what is
allowed is a layer's worth (a layer's slice or its float32 dequantization) and activations.
"""

import jax
import jax.numpy as jnp
import pytest

import kivi_jax
from models import generate as G
from models import llama
from models.presets import ModelConfig

# 32 layers so that one layer's temporaries are small beside the cache; tiny weights.
CONFIG = ModelConfig(
    name="cache-heavy",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    max_position_embeddings=1 << 16,
)
B, T = 2, 4096


# KIVI off a Hopper GPU attends through the reference, which dequantizes one layer's K and V
# to float32: 16x the size of a 2-bit layer, a third of this cache.
# Per-layer weights (the GPUs' decode layout) with a per-layer dense cache: each layer is read
# where it lies, so not even a layer's slice is copied (0.002 of the cache here, against 0.033
# for the stacked cache, whose layer slice is copied).
@pytest.mark.parametrize(
    "name, fraction, per_layer",
    [("fp16", 0.25, False), ("fp16", 0.01, True), ("kivi2", 0.4, False)],
)
def test_decode_loop_temporaries_are_well_below_the_cache(name, fraction, per_layer):
    params = llama.init_params(CONFIG, jax.random.key(0), jnp.bfloat16)
    kw = dict(per_layer=True) if per_layer else {}
    if per_layer:
        params = llama.unstack_layers(params)
    cache = G.new_cache(name, CONFIG, B, T, jnp.bfloat16, **kw)
    lowered = G.decode_loop_jit.lower(
        params,
        jnp.zeros((B, CONFIG.vocab_size), jnp.float32),
        cache,
        jax.random.key(0),
        jnp.int32(4),
        G._pad_stops([]),
        config=CONFIG,
        num_slots=16,
        sampling=G.GREEDY,
        implementation="auto",
    )
    # the loop compiles with the options that keep the kernel out of XLA's CUDA graphs
    assert dict(lowered._lowering._compiler_options_kvs) == kivi_jax.compiler_options()
    mem = lowered.compile().memory_analysis()
    cache_bytes = cache.nbytes().total
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    assert cache_bytes > 4 * weights  # the cache dominates, or the bound says nothing
    assert mem.temp_size_in_bytes < fraction * cache_bytes, (mem.temp_size_in_bytes, cache_bytes)

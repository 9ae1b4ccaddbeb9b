"""The tiny Gemma 3 that tests/test_gemma3.py and tests/test_gemma3_integration.py run on: small
enough to compile in seconds on a CPU, shaped so that every code path is taken (window 5 and
pattern 3: prompts outgrow the local layers' rings, layers 2 and 5 are global; 4 query heads on
2 KV heads: grouped-query attention; query_pre_attn_scalar unlike head_dim: a scale that is
not the default)."""

from __future__ import annotations

import jax

from models import gemma3 as g

TINY = g.Gemma3Config(
    name="tiny",
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_layers=6,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    sliding_window=5,
    sliding_window_pattern=3,
    query_pre_attn_scalar=24.0,
)


def tiny_params(config: g.Gemma3Config = TINY) -> dict:
    """Random params of `config` (key 0), their norm weights away from the identity (std 0.3)
    so that a norm applied wrongly, or not at all, changes the logits."""
    return g.init_params(config, jax.random.key(0), norm_std=0.3)

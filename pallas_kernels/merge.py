"""The log-sum-exp merge of partial attentions, defined once: the kernels merge their splits
with it, and `kivi_jax.attention` merges the quantized region with the residual window; with
it the rule that masks logits. Pure jnp, importing only jax."""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array


def mask_logits(s: Array, held: Array) -> Array:
    """Logits s at held positions (`held`, broadcasting against s), -inf elsewhere. A held
    logit of -inf (an infinite key, or a q.k overflowing float32) becomes NaN: as -inf it
    would weigh 0, the key silently ignored, while +inf already ends in NaN (inf / inf)."""
    return jnp.where(held, jnp.where(s == -jnp.inf, jnp.nan, s), -jnp.inf)


def merge_partials(
    o_parts: Array, lse_parts: Array, axis: int = 0, keys: tuple[Array, Array] | None = None
) -> tuple[Array, Array]:
    """Merge normalized partial attentions over disjoint key sets.

    o_parts [..., P, ..., D] and lse_parts [..., P, ...] hold the P parts along `axis` (a
    non-negative axis, the same in both; o's last axis is the head dim) -> (o [..., D],
    lse [...]). Parts with lse = -inf (no keys) weigh nothing; where every part is empty, o = 0
    and lse = -inf.

    `keys`: (logits [..., N, ...], values [..., N, ..., D]) of N single keys joined in the same
    pass, N along `axis` too (values broadcasting against o_parts there, logits against
    lse_parts; masked with `mask_logits`): key n is a part whose o is values[n] and whose lse
    is logits[n], so the result is that of merging them as parts, without the stacking that
    would copy them (a cache's sinks beside the kernel's splits: one max and one sum).
    """
    m = jnp.max(lse_parts, axis=axis)
    if keys is not None:
        m = jnp.maximum(m, jnp.max(keys[0], axis=axis))
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    weights = lambda lse: jnp.exp(lse - jnp.expand_dims(m_safe, axis))  # exp(-inf) = 0: empty
    w = weights(lse_parts)
    total = jnp.sum(w, axis=axis)
    o = jnp.sum(jnp.expand_dims(w, -1) * o_parts, axis=axis)
    if keys is not None:
        p = weights(keys[0])
        total = total + jnp.sum(p, axis=axis)
        o = o + jnp.sum(jnp.expand_dims(p, -1) * keys[1], axis=axis)
    ok = total > 0
    o = o / jnp.where(ok, total, 1.0)[..., None]
    return o, jnp.where(ok, m_safe + jnp.log(jnp.where(ok, total, 1.0)), -jnp.inf)

"""`fp8_decode_reference`: the kernel's twin in float32 jnp.

The same call as `fp8_decode`, computed plainly: every slot dequantized (element times its
block scale), softmax over the held positions, float32 throughout. The kernel differs by its
fp16 operands (the widened values and P); the tests bound the difference.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.fp8_decode.kernel import F8, STAGES, check_inputs
from pallas_kernels.layout import cache_slot


def fp8_decode_reference(
    q,
    k_codes,
    k_scale,
    v_codes,
    v_scale,
    num_tokens,
    layer,
    *,
    group_size: int,
    sm_scale: float,
    splits: int | None = None,
    stages: int = STAGES,
    interpret=False,
):
    """`fp8_decode` in float32 (`splits`, `stages` and `interpret` are the kernel's launch
    and are ignored): (o [B, Hq, D], lse [B, Hq]); o = 0 and lse = -inf for a row with no
    positions; NaN for a layer outside [0, L)."""
    del splits, stages, interpret
    check_inputs(q, k_codes, k_scale, v_codes, v_scale, num_tokens, group_size)
    L, B, H, Tq, D = k_codes.shape
    layer = jnp.asarray(layer, jnp.int32)
    at = jnp.clip(layer, 0, L - 1)
    f32 = lambda x: (x if x.dtype == F8 else lax.bitcast_convert_type(x, F8)).astype(jnp.float32)
    per_channel = lambda s: jnp.repeat(s[at].astype(jnp.float32), group_size, axis=-2)
    k = f32(k_codes[at]) * per_channel(k_scale).swapaxes(-1, -2)  # [B, H, Tq, D]
    v = (f32(v_codes[at]) * per_channel(v_scale)).swapaxes(-1, -2)  # [B, H, Tq, D]
    g = q.shape[1] // H
    qg = q.astype(jnp.float32).reshape(B, H, g, D) * sm_scale
    s = jnp.einsum("bhgd,bhtd->bhgt", qg, k, precision="highest")
    held = jnp.clip(num_tokens, 0, Tq)
    mask = cache_slot(np.arange(Tq))[None, :] < held[:, None]  # [B, Tq]
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe)
    total = p.sum(-1)
    o = jnp.einsum("bhgt,bhtd->bhgd", p, v, precision="highest")
    o = o / jnp.where(total > 0, total, 1.0)[..., None]
    lse = jnp.where(total > 0, m_safe[..., 0] + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    o = jnp.where((layer >= 0) & (layer < L), o, jnp.nan)
    return o.reshape(B, H * g, D), lse.reshape(B, H * g)

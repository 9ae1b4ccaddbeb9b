"""Quantize and dequantize: pure jnp, jit- and vmap-safe, no state.

The cache's bit layout (token-planar packing, the cache order, the byte swap, the blocked value
codes) is defined once, in `pallas_kernels.layout`, and re-exported here: the library and the
kernels share it (docs/layout.md).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import Array

from kivi_jax.config import KiviConfig
from pallas_kernels.layout import (  # noqa: F401  (re-exported: the cache's bit layout)
    CACHE_BLOCK,
    CACHE_PLANE,
    CODE_BLOCK,
    block_columns,
    cache_slot,
    codes_per_byte,
    default_plane,
    pack,
    pack_tokens,
    swap_bytes,
    swapped_byte,
    to_cache_order,
    unblock_columns,
    unpack,
    unpack_tokens,
    value_codes_blocked,
)


def _round_toward(x: Array, dtype, direction: float) -> Array:
    """Cast float32 `x` to `dtype`, rounding toward -inf (direction < 0) or +inf (> 0)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return x
    c = x.astype(dtype)
    back = c.astype(jnp.float32)
    wrong = back > x if direction < 0 else back < x
    return jnp.where(wrong, jnp.nextafter(c, jnp.array(direction * jnp.inf, dtype)), c)


def minmax_quantize(x: Array, bits: int, axis: int, scale_dtype=jnp.float16):
    """Asymmetric min/max quantization of x with one group spanning `axis`.

    Returns (codes uint8 shaped like x, scale, minimum), scale and minimum in `scale_dtype` with
    `axis` kept at size 1; x ~= codes * scale + minimum. The stored minimum is rounded down and
    the scale up, so the grid of the rounded values still covers [min, max] and every element is
    within scale / 2 of its reconstruction. A constant group gets scale 0 and gives its value back
    (exactly, when that value is representable in `scale_dtype`), never NaN or Inf.
    """
    xf = x.astype(jnp.float32)
    lo = jnp.min(xf, axis=axis, keepdims=True)
    hi = jnp.max(xf, axis=axis, keepdims=True)
    qmax = (1 << bits) - 1
    const = hi == lo
    mn = _round_toward(lo, scale_dtype, -1.0)
    scale = _round_toward((hi - mn.astype(jnp.float32)) / qmax, scale_dtype, 1.0)
    mn = jnp.where(const, lo.astype(scale_dtype), mn)
    scale = jnp.where(const, jnp.zeros_like(scale), scale)
    sf = scale.astype(jnp.float32)
    safe = jnp.where(sf > 0, sf, 1.0)
    q = jnp.where(sf > 0, jnp.round((xf - mn.astype(jnp.float32)) / safe), 0.0)
    return jnp.clip(q, 0, qmax).astype(jnp.uint8), scale, mn


def dequantize_codes(codes: Array, scale: Array, minimum: Array, dtype=jnp.float32) -> Array:
    """codes * scale + minimum in float32, cast to `dtype` (scale/minimum broadcast)."""
    out = codes.astype(jnp.float32) * scale.astype(jnp.float32) + minimum.astype(jnp.float32)
    return out.astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    """A quantized [..., T, D] array: packed codes plus one (scale, minimum) per group.

    For axis="channel" (keys): groups of G along T; for axis="token" (values): groups of G along
    D. Codes are packed planar (module doc) along the grouped axis.
    """

    codes: Array  # channel: [..., T / P, D]; token: [..., T, D / P]   uint8
    scale: Array  # channel: [..., T / G, D]; token: [..., T, D / G]   scale_dtype
    minimum: Array  # same shape as scale
    bits: int = dataclasses.field(metadata=dict(static=True))
    group_size: int = dataclasses.field(metadata=dict(static=True))
    axis: str = dataclasses.field(metadata=dict(static=True))
    plane: int = dataclasses.field(metadata=dict(static=True))
    dtype: str = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        per = codes_per_byte(self.bits)
        *lead, t, d = self.codes.shape
        return (*lead, t * per, d) if self.axis == "channel" else (*lead, t, d * per)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + self.minimum.nbytes


def _check_tensor(x: Array, name: str, group_axis: int, group_size: int) -> None:
    if not hasattr(x, "ndim") or x.ndim < 2:
        raise ValueError(
            f"{name} must be an array of shape [..., T, D], got {getattr(x, 'shape', x)}"
        )
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating-point array, got dtype {x.dtype}")
    n = x.shape[group_axis]
    if n % group_size:
        which = "T" if group_axis == x.ndim - 2 else "D"
        raise ValueError(
            f"{name}: {which}={n} (shape {x.shape}) is not a multiple of group_size={group_size}"
        )


def quantize(
    x: Array, bits: int, group_size: int, axis: str, scale_dtype="float16"
) -> QuantizedTensor:
    """Quantize x [..., T, D] in groups of `group_size` along T (axis="channel") or D ("token")."""
    if axis not in ("channel", "token"):
        raise ValueError(f"axis must be 'channel' or 'token', got {axis!r}")
    codes_per_byte(bits)
    x = jnp.asarray(x)
    gax = x.ndim - 2 if axis == "channel" else x.ndim - 1
    _check_tensor(x, "x", gax, group_size)
    return _quantize(x, bits, group_size, axis, jnp.dtype(scale_dtype).name)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _quantize(x: Array, bits: int, group_size: int, axis: str, scale_dtype: str):
    gax = x.ndim - 2 if axis == "channel" else x.ndim - 1
    *lead, t, d = x.shape
    if axis == "channel":
        xg = x.reshape(*lead, t // group_size, group_size, d)
        codes, scale, mn = minmax_quantize(xg, bits, axis=-2, scale_dtype=scale_dtype)
        codes = codes.reshape(*lead, t, d)
        scale, mn = scale[..., 0, :], mn[..., 0, :]
    else:
        xg = x.reshape(*lead, t, d // group_size, group_size)
        codes, scale, mn = minmax_quantize(xg, bits, axis=-1, scale_dtype=scale_dtype)
        codes = codes.reshape(*lead, t, d)
        scale, mn = scale[..., 0], mn[..., 0]
    plane = default_plane(x.shape[gax], bits)
    packed = pack(codes, bits, axis=gax, plane=plane)
    return QuantizedTensor(
        packed, scale, mn, bits, group_size, axis, plane, jnp.dtype(x.dtype).name
    )


def quantize_keys(k: Array, config: KiviConfig) -> QuantizedTensor:
    """KIVI keys k [..., T, D]: per-channel, groups of G tokens along T (T % G == 0)."""
    return quantize(k, config.key_bits, config.group_size, config.key_axis, config.scale_dtype)


def quantize_values(v: Array, config: KiviConfig) -> QuantizedTensor:
    """KIVI values v [..., T, D]: per-token, groups of G channels along D (D % G == 0)."""
    return quantize(v, config.value_bits, config.group_size, config.value_axis, config.scale_dtype)


def dequantize(q: QuantizedTensor, dtype=None) -> Array:
    """Reconstruct [..., T, D] from a QuantizedTensor, in `dtype` (default: the input's dtype)."""
    return _dequantize(q, jnp.dtype(q.dtype if dtype is None else dtype).name)


@functools.partial(jax.jit, static_argnums=1)
def _dequantize(q: QuantizedTensor, dtype: str) -> Array:
    gax = q.codes.ndim - 2 if q.axis == "channel" else q.codes.ndim - 1
    codes = unpack(q.codes, q.bits, axis=gax, plane=q.plane)
    *lead, t, d = codes.shape
    g = q.group_size
    if q.axis == "channel":
        c = codes.reshape(*lead, t // g, g, d)
        out = dequantize_codes(c, q.scale[..., None, :], q.minimum[..., None, :])
    else:
        c = codes.reshape(*lead, t, d // g, g)
        out = dequantize_codes(c, q.scale[..., None], q.minimum[..., None])
    return out.reshape(*lead, t, d).astype(dtype)

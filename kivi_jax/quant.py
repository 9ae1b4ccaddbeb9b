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

from kivi_jax.config import SUPPORTED_BITS, KiviConfig, is_int, scale_dtype_name
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
    stored_byte,
    swap_bytes,
    swapped_byte,
    swaps_bytes,
    to_cache_order,
    to_stored_bytes,
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
    # The barrier keeps the round trip: XLA may drop a convert pair (f32 -> f16 -> f32) as
    # "excess precision" (the GPU backend does), and `back` would then be x, never "wrong".
    c = jax.lax.optimization_barrier(x.astype(dtype))
    back = c.astype(jnp.float32)
    wrong = back > x if direction < 0 else back < x
    return jnp.where(wrong, jnp.nextafter(c, jnp.array(direction * jnp.inf, dtype)), c)


def minmax_quantize(x: Array, bits: int, axis: int, scale_dtype=jnp.float16):
    """Asymmetric min/max quantization of x with one group spanning `axis`.

    Returns (codes uint8 shaped like x, scale, minimum), scale and minimum in `scale_dtype` with
    `axis` kept at size 1; x ~= codes * scale + minimum. The stored minimum is rounded down and
    the scale up, so the grid of the rounded values still covers [min, max] and every element is
    within scale / 2 of its reconstruction. A constant group gets scale 0 and gives its value back
    (exactly, when that value is representable in `scale_dtype`).

    Edges (docs/what_happens_when.md): a group holding a NaN or an infinity gets NaN scale and
    minimum and codes 0, so all of it dequantizes to NaN, at every shape. A finite group never
    gets a NaN or infinite scale or minimum: its min and max saturate at the finite range +-M of
    `scale_dtype` (M = 65504 for float16), so an element beyond +-M reconstructs within scale / 2
    of +-M, and every other element within scale / 2 of itself.
    """
    xf = x.astype(jnp.float32)
    # An explicit flag: XLA's CPU min/max reductions skip NaN at some shapes and not at others.
    bad = jnp.any(~jnp.isfinite(xf), axis=axis, keepdims=True)
    big = float(jnp.finfo(scale_dtype).max)
    # Saturating the group's ends (not x: codes clip to [0, qmax] anyway) keeps both the
    # minimum and, since (M - -M) / qmax < M for qmax >= 3, the scale representable.
    lo = jnp.clip(jnp.min(xf, axis=axis, keepdims=True), -big, big)
    hi = jnp.clip(jnp.max(xf, axis=axis, keepdims=True), -big, big)
    qmax = (1 << bits) - 1
    const = hi == lo
    mn = _round_toward(lo, scale_dtype, -1.0)
    span = hi - mn.astype(jnp.float32)
    # hi - mn overflows float32 only for float32 or bfloat16 scales of groups spanning most of
    # the float32 range; dividing first is the same step without the overflow.
    step = jnp.where(jnp.isfinite(span), span / qmax, hi / qmax - mn.astype(jnp.float32) / qmax)
    scale = _round_toward(step, scale_dtype, 1.0)
    mn = jnp.where(const, lo.astype(scale_dtype), mn)
    scale = jnp.where(const, jnp.zeros_like(scale), scale)
    mn = jnp.where(bad, jnp.full_like(mn, jnp.nan), mn)
    scale = jnp.where(bad, jnp.full_like(scale, jnp.nan), scale)
    # The codes are computed against the stored (rounded) scale and minimum, not against a
    # float32 value XLA kept in their place as excess precision: the barrier pins them.
    scale, mn = jax.lax.optimization_barrier((scale, mn))
    sf, mnf = scale.astype(jnp.float32), mn.astype(jnp.float32)
    # XLA divides by a per-group value through its reciprocal, which for a scale above 2^126
    # (float32 or bfloat16 scales) is subnormal and flushed to zero: every code would be 0.
    # All operands are scaled by an exact power of two there (by 1, exactly, elsewhere), which
    # also keeps x - minimum finite for a group spanning the float32 range.
    r = jnp.where(sf > 2.0**64, 2.0**-64, 1.0)
    safe = jnp.where(sf > 0, sf * r, 1.0)
    # a NaN scale fails sf > 0: a non-finite group's codes are 0, never a cast of NaN
    q = jnp.where(sf > 0, jnp.round((xf * r - mnf * r) / safe), 0.0)
    return jnp.clip(q, 0, qmax).astype(jnp.uint8), scale, mn


def dequantize_codes(codes: Array, scale: Array, minimum: Array, dtype=jnp.float32) -> Array:
    """codes * scale + minimum in float32, cast to `dtype` (scale/minimum broadcast).

    Saturates at `dtype`'s finite range: a reconstruction may lie up to scale / 2 past the
    group's max (the scale is rounded up), which for a float16 group reaching 65504 would
    otherwise round to Inf. NaN (a non-finite group's) stays NaN.
    """
    s, z = scale.astype(jnp.float32), minimum.astype(jnp.float32)
    # codes * scale alone overflows float32 for a group spanning most of its range (3 * 2e38)
    # unless the backend fuses the multiply-add (XLA's CPU backend does, its GPU backend does
    # not): such groups are computed at a quarter, exactly, and scaled back (by 1 elsewhere).
    big_scale = jnp.abs(s) > 2.0**100
    r, back = jnp.where(big_scale, 0.25, 1.0), jnp.where(big_scale, 4.0, 1.0)
    out = (codes.astype(jnp.float32) * (s * r) + z * r) * back
    big = float(jnp.finfo(dtype).max)
    out = jnp.where(jnp.abs(out) > big, jnp.copysign(big, out), out)
    return out.astype(dtype)


def outlier_channels(xg: Array, k: int, dtype) -> tuple[Array, Array]:
    """Dense-and-sparse keys: the K channels of widest range in each group of G tokens, kept
    in `dtype` beside the group's codes.

    xg [..., G, D] -> (channel indices [..., K] uint8, their values [..., G, K] in `dtype`).
    Per channel a group's reconstruction error grows with its range (the scale is range /
    qmax), so the widest channels are the ones whose errors dominate q.k. Ties go to the lower
    channel. A channel holding a NaN or an infinity ranks first and keeps its values as they
    are (it reads back non-finite, as it would without); finite values saturate at `dtype`'s
    finite range, as minimums do (`minmax_quantize`).
    """
    xf = xg.astype(jnp.float32)
    bad = jnp.any(~jnp.isfinite(xf), axis=-2)  # explicit: XLA's CPU max may skip a NaN
    span = jnp.where(bad, jnp.inf, jnp.max(xf, axis=-2) - jnp.min(xf, axis=-2))
    _, idx = jax.lax.top_k(span, k)
    vals = jnp.take_along_axis(xf, idx[..., None, :], axis=-1)
    big = float(jnp.finfo(dtype).max)
    vals = jnp.where(jnp.isfinite(vals), jnp.clip(vals, -big, big), vals)
    return idx.astype(jnp.uint8), vals.astype(dtype)


def overlay_outliers(x: Array, idx: Array, vals: Array) -> Array:
    """x [..., D] (float32) with channels idx [..., K] replaced by vals [..., K]
    (`outlier_channels`; the indices of one token are distinct)."""
    hit = idx[..., :, None].astype(jnp.int32) == jnp.arange(x.shape[-1])  # [..., K, D]
    exact = jnp.sum(jnp.where(hit, vals[..., :, None].astype(jnp.float32), 0.0), axis=-2)
    return jnp.where(jnp.any(hit, axis=-2), exact, x)


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
    """Quantize x [..., T, D] in groups of `group_size` along T (axis="channel") or D ("token").

    bits: an int in (2, 4, 8); group_size: a positive int dividing the grouped axis;
    scale_dtype: one of "float16", "bfloat16", "float32" (or the dtype). Raises ValueError
    naming the argument otherwise. Non-finite and out-of-range values: `minmax_quantize`.
    """
    if axis not in ("channel", "token"):
        raise ValueError(f"axis must be 'channel' or 'token', got {axis!r}")
    if not is_int(bits) or bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be an int in {SUPPORTED_BITS}, got {bits!r}")
    if not is_int(group_size) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    scale_dtype = scale_dtype_name(scale_dtype)
    x = jnp.asarray(x)
    gax = x.ndim - 2 if axis == "channel" else x.ndim - 1
    _check_tensor(x, "x", gax, group_size)
    return _quantize(x, bits, group_size, axis, scale_dtype)


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
    """Reconstruct [..., T, D] from a QuantizedTensor, in the floating `dtype` (default: the
    input's dtype), saturated at its finite range; a non-finite group comes back as NaN."""
    if not isinstance(q, QuantizedTensor):
        raise ValueError(f"q must be a QuantizedTensor, got {type(q).__name__}")
    try:
        out = jnp.dtype(q.dtype if dtype is None else dtype)
    except TypeError:
        out = None
    if out is None or not jnp.issubdtype(out, jnp.floating):
        raise ValueError(f"dtype must be a floating dtype, got {dtype!r}")
    return _dequantize(q, out.name)


@functools.partial(jax.jit, static_argnums=1)
def _dequantize(q: QuantizedTensor, dtype: str) -> Array:
    gax = q.codes.ndim - 2 if q.axis == "channel" else q.codes.ndim - 1
    codes = unpack(q.codes, q.bits, axis=gax, plane=q.plane)
    *lead, t, d = codes.shape
    g = q.group_size
    if q.axis == "channel":
        c = codes.reshape(*lead, t // g, g, d)
        out = dequantize_codes(c, q.scale[..., None, :], q.minimum[..., None, :], dtype)
    else:
        c = codes.reshape(*lead, t, d // g, g)
        out = dequantize_codes(c, q.scale[..., None], q.minimum[..., None], dtype)
    return out.reshape(*lead, t, d)

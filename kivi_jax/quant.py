"""Quantize, dequantize, pack and unpack: pure jnp, jit- and vmap-safe, no state.

The packed layout (the one place it is defined)
-----------------------------------------------
Codes of `bits` bits are packed P = 8 // bits to a byte, *planar* along one axis with a plane
length p: element i of that axis goes to

    byte  (i // (P * p)) * p + i % p,   bits [bits * j, bits * (j + 1)) with j = (i // p) % P.

So a block of P * p consecutive elements fills p bytes; byte r of the block holds elements
r, r + p, ..., r + (P - 1) p. With p = 1 this is ordinary little-endian packing (KIVI's own
int32 packing, but in bytes).

The KV cache packs its token axis with p = 64 ("token-planar": a 64-token plane sits in one bit
field of 64 consecutive byte rows, 64 rows on a tensor-core M tile) after putting the tokens in
the *cache order* (`cache_slot`): within each block of 256 tokens, token 64a + 16b + c (a, b <
4, c < 16) sits in slot 64b + 16a + c. A kernel's warp that holds rows 16a .. 16a + 15 of every
plane of a block then holds the 64 consecutive tokens 64a .. 64a + 63, one key group (G >= 64)
or two (G = 32) instead of one per plane (`pack_tokens`, `unpack_tokens`; docs/layout.md).
Last, in every stored row of code bytes (keys: along D; values: along the packed token
columns) the two middle bytes of each 4-byte group are swapped (`swap_bytes`): a kernel then
widens a 32-bit word of codes into fp16 pairs (b0, b2), (b1, b3) as the word itself and the
word shifted right by 8, the code field masks clearing the other byte, and those pairs are the
elements (4k, 4k + 1), (4k + 2, 4k + 3) of the row.

2-bit value codes (V^T: [..., D, T/P], tokens along the columns) are stored in blocks of 64
columns, [..., T/256, D, 64] (`block_columns`, `value_codes_blocked`): the 256 tokens of a
block, which a kernel step copies for all D channels, are one contiguous 64 D-byte run instead
of D rows of 64 bytes T/4 bytes apart (docs/performance.md runs 109-110: the 2-bit kernel's
load pipeline 0.193 -> 0.164 ms at B=8 T=128k, the kernel 4-10% faster). 4-bit value codes
stay in rows: their kernel, with 512-token copies, was 2-3% slower over the blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from kivi_jax.config import SUPPORTED_BITS, KiviConfig

CACHE_PLANE = 64  # tokens per plane in the KV cache (= wgmma M tile)
CACHE_BLOCK = 256  # tokens per block of the cache order (four planes)
CODE_BLOCK = 64  # byte columns per stored block of the value codes (`block_columns`)


def codes_per_byte(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    return 8 // bits


def default_plane(n: int, bits: int) -> int:
    """The largest power-of-two plane <= 64 that tiles an axis of n elements."""
    per = codes_per_byte(bits)
    if n % per:
        raise ValueError(f"axis of length {n} cannot be packed {per} codes per byte ({bits}-bit)")
    return math.gcd(CACHE_PLANE, n // per)


def pack(codes: Array, bits: int, *, axis: int = -1, plane: int = 1) -> Array:
    """Pack uint8 codes in [0, 2**bits) P to a byte, planar along `axis` (see module doc).

    The packed axis shrinks by P; it must be a multiple of P * plane.
    """
    per = codes_per_byte(bits)
    codes = jnp.moveaxis(jnp.asarray(codes), axis, -1)
    n = codes.shape[-1]
    if n % (per * plane):
        raise ValueError(f"pack: axis length {n} is not a multiple of {per} * plane={plane}")
    c = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], n // (per * plane), per, plane)
    out = c[..., 0, :]
    for j in range(1, per):
        out = out | (c[..., j, :] << jnp.uint8(bits * j))
    return jnp.moveaxis(out.reshape(*codes.shape[:-1], n // per), -1, axis)


def unpack(packed: Array, bits: int, *, axis: int = -1, plane: int = 1) -> Array:
    """Inverse of `pack`: uint8 codes, the packed axis grown by P."""
    per = codes_per_byte(bits)
    packed = jnp.moveaxis(jnp.asarray(packed), axis, -1)
    m = packed.shape[-1]
    if packed.dtype != jnp.uint8:
        raise ValueError(f"unpack: packed codes must be uint8, got {packed.dtype}")
    if m % plane:
        raise ValueError(f"unpack: axis length {m} is not a multiple of plane={plane}")
    p = packed.reshape(*packed.shape[:-1], m // plane, 1, plane)
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits).reshape(per, 1)
    c = (p >> shifts) & jnp.uint8((1 << bits) - 1)
    return jnp.moveaxis(c.reshape(*packed.shape[:-1], m * per), -1, axis)


def cache_slot(t):
    """The slot of token t in the KV cache's token order, and the token in slot t (the map is
    its own inverse): within each block of 256, token 64a + 16b + c <-> slot 64b + 16a + c
    (a, b < 4, c < 16). Works on Python ints and integer arrays."""
    return t - t % 256 + 64 * (t // 16 % 4) + 16 * (t // 64 % 4) + t % 16


def to_cache_order(x, axis: int):
    """x with its token `axis` (a multiple of 256 long) in the cache order: slot i holds token
    `cache_slot(i)`. Its own inverse: applied to a slot-ordered axis it gives the tokens back."""
    x = jnp.asarray(x)
    n = x.shape[axis]
    if n % CACHE_BLOCK:
        raise ValueError(f"a cache token axis must be a multiple of {CACHE_BLOCK} long, got {n}")
    return jnp.take(x, cache_slot(np.arange(n)), axis=axis)


def swapped_byte(i):
    """Where byte i of a stored code row sits (and which byte sits at i: an involution): the
    two middle bytes of every 4-byte group swapped, 4k + 1 <-> 4k + 2. Ints or int arrays."""
    return i + (i & 1) - ((i >> 1) & 1)


def swap_bytes(x, axis: int = -1):
    """x with bytes 4k + 1 and 4k + 2 of `axis` (a multiple of 4 long) swapped (an involution):
    the byte order of the KV cache's stored code rows (module doc)."""
    x = jnp.moveaxis(jnp.asarray(x), axis, -1)
    n = x.shape[-1]
    if n % 4:
        raise ValueError(f"a stored code row must be a multiple of 4 bytes long, got {n}")
    # slices, not a gather: no index constant (usable inside a Pallas kernel's interpreter)
    q = x.reshape(*x.shape[:-1], n // 4, 4)
    q = jnp.stack([q[..., 0], q[..., 2], q[..., 1], q[..., 3]], axis=-1)
    return jnp.moveaxis(q.reshape(x.shape), -1, axis)


def pack_tokens(codes: Array, bits: int, *, axis: int) -> Array:
    """Codes [..., T, ...] (T % 256 == 0, tokens in order along `axis`; the last axis of the
    packed array a multiple of 4) packed as the KV cache holds them: in the cache order,
    token-planar with 64-token planes, the middle bytes of every 4-byte group of a row (the
    last axis) swapped (module doc)."""
    return swap_bytes(pack(to_cache_order(codes, axis), bits, axis=axis, plane=CACHE_PLANE), -1)


def unpack_tokens(packed: Array, bits: int, *, axis: int) -> Array:
    """Inverse of `pack_tokens`: uint8 codes with the tokens in order along `axis`."""
    return to_cache_order(unpack(swap_bytes(packed, -1), bits, axis=axis, plane=CACHE_PLANE),
                          axis)


def value_codes_blocked(bits: int) -> bool:
    """Whether the KV cache stores `bits`-bit value codes in blocks of 64 byte columns
    (`block_columns`; module doc): at 2 bits (runs 109-110: the kernel 4-10% faster), not at 4
    (2-3% slower)."""
    return codes_per_byte(bits) == 4


def block_columns(x: Array) -> Array:
    """[..., D, C] (C a multiple of 64) -> [..., C/64, D, 64]: the stored form of the value
    codes, one contiguous block of D rows per 64 byte columns (module doc)."""
    *lead, d, c = x.shape
    if c % CODE_BLOCK:
        raise ValueError(f"block_columns: {c} columns are not a multiple of {CODE_BLOCK}")
    return jnp.moveaxis(jnp.reshape(x, (*lead, d, c // CODE_BLOCK, CODE_BLOCK)), -2, -3)


def unblock_columns(x: Array) -> Array:
    """Inverse of `block_columns`: [..., C/64, D, 64] -> [..., D, C]."""
    *lead, nb, d, w = x.shape
    return jnp.reshape(jnp.moveaxis(x, -3, -2), (*lead, d, nb * w))


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

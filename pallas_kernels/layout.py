"""The bit layout of the KIVI cache, defined once: packing, the cache order, the byte swap and the
blocked value codes. Pure jnp (jit- and vmap-safe), importing only jax and numpy, so that the
library (`kivi_jax.quant`, `kivi_jax.cache`) and the kernels (`pallas_kernels.kivi_decode`)
share it without either importing the other.

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
Last, in every stored row of sub-byte codes (keys: along D; values: along the packed token
columns) the two middle bytes of each 4-byte group are swapped (`swap_bytes`): a kernel then
widens a 32-bit word of codes into fp16 pairs (b0, b2), (b1, b3) as the word itself and the
word shifted right by 8, the code field masks clearing the other byte, and those pairs are the
elements (4k, 4k + 1), (4k + 2, 4k + 3) of the row. Rows of 8-bit elements (fp8) are not
swapped (`swaps_bytes`): there is no field to widen, and unswapped, the key row of a slot and
the V^T column of that slot hold the same token, which the fp8 kernel's two products need.

2-bit value codes (V^T: [..., D, T/P], tokens along the columns) are stored in blocks of 64
columns, [..., T/256, D, 64] (`block_columns`, `value_codes_blocked`): the 256 tokens of a
block, which a kernel step copies for all D channels, are one contiguous 64 D-byte run instead
of D rows of 64 bytes T/4 bytes apart (the 2-bit kernel's loads are faster
over blocks: docs/kernel.md). 4-bit value codes stay in rows, where blocks did not pay.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import Array

SUPPORTED_BITS = (2, 4, 8)  # code widths the layout packs (the kernels take 2 and 4)
CACHE_PLANE = 64  # tokens per plane in the KV cache (= wgmma M tile)
CACHE_BLOCK = 256  # tokens per block of the cache order (four planes)
CODE_BLOCK = 64  # byte columns per stored block of the value codes (`block_columns`)


def codes_per_byte(bits: int) -> int:
    """Codes per byte at `bits` bits (2 or 4)."""
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
    packed = jnp.asarray(packed)
    axis %= packed.ndim
    m = packed.shape[axis]
    if packed.dtype != jnp.uint8:
        raise ValueError(f"unpack: packed codes must be uint8, got {packed.dtype}")
    if m % plane:
        raise ValueError(f"unpack: axis length {m} is not a multiple of plane={plane}")
    if per == 1:  # one code per byte: the bytes themselves (no shift for XLA to materialize)
        return packed
    # reshapes around the axis, no transpose: XLA then fuses an unpack into its consumer
    lead, tail = packed.shape[:axis], packed.shape[axis + 1 :]
    p = packed.reshape(*lead, m // plane, 1, plane, *tail)
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits).reshape(per, 1, *(1,) * len(tail))
    c = (p >> shifts) & jnp.uint8((1 << bits) - 1)
    return c.reshape(*lead, m * per, *tail)


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


def swaps_bytes(bits: int) -> bool:
    """Whether stored rows of `bits`-bit codes have the middle bytes of every 4 swapped: rows of
    sub-byte codes do, rows of 8-bit elements do not (module doc)."""
    return codes_per_byte(bits) > 1


def stored_byte(i, bits: int):
    """Where byte i of a stored row of `bits`-bit codes sits, and which byte sits at i (an
    involution): `swapped_byte` where the rows are swapped (`swaps_bytes`), else i."""
    return swapped_byte(i) if swaps_bytes(bits) else i


def to_stored_bytes(x, bits: int, axis: int = -1):
    """x's `axis`, a row of `bits`-bit code bytes, in the stored byte order, and back (an
    involution): `swap_bytes` where the rows are swapped (`swaps_bytes`), else x."""
    return swap_bytes(x, axis) if swaps_bytes(bits) else jnp.asarray(x)


def pack_tokens(codes: Array, bits: int, *, axis: int) -> Array:
    """Codes [..., T, ...] (T % 256 == 0, tokens in order along `axis`; the last axis of the
    packed array a multiple of 4) packed as the KV cache holds them: in the cache order,
    token-planar with 64-token planes, in the stored byte order of a row (the last axis;
    `to_stored_bytes`, module doc)."""
    packed = pack(to_cache_order(codes, axis), bits, axis=axis, plane=CACHE_PLANE)
    return to_stored_bytes(packed, bits)


def unpack_tokens(packed: Array, bits: int, *, axis: int) -> Array:
    """Inverse of `pack_tokens`: uint8 codes with the tokens in order along `axis`."""
    codes = unpack(to_stored_bytes(packed, bits), bits, axis=axis, plane=CACHE_PLANE)
    return to_cache_order(codes, axis)


def value_codes_blocked(bits: int) -> bool:
    """Whether the KV cache stores `bits`-bit value codes in blocks of 64 byte columns
    (`block_columns`; module doc): at 2 bits, where the kernel's loads are faster over blocks,
    not at 4."""
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

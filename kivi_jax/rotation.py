"""The orthogonal rotations of keys and values: the Hadamard rotation before quantization
(`KiviConfig.rotation`), and RoPE, which the models apply and a cache of pre-RoPE keys
(`KiviConfig.pre_rope`) undoes before quantizing and redoes when read.

R = diag(s) H / sqrt(D): H the D x D Sylvester Hadamard matrix, s a fixed pattern of signs
(seeded by D, so every cache of a head size rotates alike). R is orthogonal, so rotating both q
and k leaves q.k unchanged, and the output of attention over rotated values is rotated back by
R^T. A key channel with outliers is spread over all D channels, which is what per-token
quantization groups need (QuaRot, QuIP#).

What the cache stores is rotated by the fast Walsh-Hadamard transform (`rotate`, `unrotate`):
log2(D) stages of sums and differences, each element by the same operations whatever the array's
shape, so a token rotates to the same bits streamed one at a time or prefilled with the rest (the
cache's bit-for-bit promise). Attention's side, the queries and the outputs of a step, is
rotated by the matrix itself (`rotate_rows`, `unrotate_rows`): XLA fuses the product summed
over D into one reduction, where the transform's stages become slice and concatenate fusions of
their own (two GPU launches each side, on every layer of every decode step).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import Array

from pallas_kernels.rotation import hadamard_rotation
from pallas_kernels.rotation import rotate_rows as kernel_rotate_rows
from pallas_kernels.rotation import unrotate_rows as kernel_unrotate_rows


@functools.cache
def signs(head_dim: int) -> np.ndarray:
    """The fixed +-1 pattern of size D (float32)."""
    return np.random.default_rng(head_dim).choice([-1.0, 1.0], head_dim).astype(np.float32)


def _walsh_hadamard(x: Array) -> Array:
    """x [..., D] times the Sylvester Hadamard matrix H (D a power of two), unnormalized."""
    *lead, d = x.shape
    sign = np.array([1.0, -1.0], np.float32)[:, None]  # the pair's sum, then its difference
    h = 1
    while h < d:
        y = x.reshape(*lead, d // (2 * h), 2, h)
        x = (y[..., :1, :] + sign * y[..., 1:, :]).reshape(*lead, d)
        h *= 2
    return x


def rotate(x: Array) -> Array:
    """x [..., D] -> x R in float32."""
    d = x.shape[-1]
    _check(d)
    return _walsh_hadamard(x.astype(jnp.float32) * signs(d)) * np.float32(1 / np.sqrt(d))


def unrotate(x: Array) -> Array:
    """x [..., D] -> x R^T in float32 (the inverse of `rotate`: H is symmetric, H H = D I)."""
    d = x.shape[-1]
    _check(d)
    return _walsh_hadamard(x.astype(jnp.float32)) * np.float32(1 / np.sqrt(d)) * signs(d)


def sign_tuple(head_dim: int) -> tuple[float, ...]:
    """`signs` as a tuple: the rotation as the kernels take it (a static argument)."""
    _check(head_dim)
    return tuple(signs(head_dim).tolist())


def matrix(head_dim: int) -> np.ndarray:
    """R = diag(s) H / sqrt(D) as a float32 [D, D] array (`rotate` is x R, `unrotate` x R^T;
    `pallas_kernels.rotation.hadamard_rotation` of these signs)."""
    return hadamard_rotation(sign_tuple(head_dim))


def rotate_rows(x: Array) -> Array:
    """x [..., D] -> x R in float32, as one product summed over D (module doc: for the queries
    of a step; equal to `rotate` up to float32 rounding, not bit for bit)."""
    return kernel_rotate_rows(x, sign_tuple(x.shape[-1]))


def unrotate_rows(x: Array) -> Array:
    """x [..., D] -> x R^T in float32, as one product summed over D (for attention outputs)."""
    return kernel_unrotate_rows(x, sign_tuple(x.shape[-1]))


def _check(d: int) -> None:
    if d < 1 or d & (d - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two head_dim, got {d}")


def rope(x: Array, positions: Array, inv_freq) -> Array:
    """RoPE: x [..., D] rotated at integer `positions` (broadcasting to x.shape[:-1]) by the
    inverse frequencies `inv_freq` [D/2], in x's dtype. Half-split layout, the HF
    `rotate_half` convention: (x1 cos - x2 sin, x2 cos + x1 sin), angles in float32. The
    rotation by -positions undoes it (up to rounding)."""
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)

"""The Hadamard rotation of a sign pattern, defined once: R = diag(s) H / sqrt(D), H the D x D
Sylvester Hadamard matrix and s a pattern of D signs. `kivi_jax.rotation` rotates the cache's
keys and values by it (with its fixed signs); the decode kernel rotates q by it in its prologue
(`kivi_decode(..., q_signs=s)`), and its reference twin and XLA's side of the launch by the
product below. Imports only jax and numpy."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import Array, lax


@functools.cache
def hadamard_rotation(signs: tuple[float, ...]) -> np.ndarray:
    """R = diag(signs) H / sqrt(D) as a float32 [D, D] array (D = len(signs), a power of two)."""
    d = len(signs)
    if d < 1 or d & (d - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two head_dim, got {d}")
    if any(s not in (-1.0, 1.0) for s in signs):
        raise ValueError("the rotation's signs must each be +1 or -1")
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return (np.asarray(signs)[:, None] * h / np.sqrt(d)).astype(np.float32)


def rotate_rows(x: Array, signs: tuple[float, ...]) -> Array:
    """x [..., D] -> x R in float32, as one product summed over D (XLA fuses it into one
    reduction with its consumers, where the transform's stages would be fusions of their own)."""
    r = hadamard_rotation(tuple(signs))
    return jnp.sum(x.astype(jnp.float32)[..., :, None] * r, axis=-2)


def unrotate_rows(x: Array, signs: tuple[float, ...]) -> Array:
    """x [..., D] -> x R^T in float32 (the inverse of `rotate_rows`: R is orthogonal), as one
    product summed over D (for attention's outputs over rotated values)."""
    r = hadamard_rotation(tuple(signs))
    return jnp.sum(x.astype(jnp.float32)[..., :, None] * r.T, axis=-2)


def sign_bits(signs: tuple[float, ...], width: int) -> list[int]:
    """The sign pattern as `width`-bit words: bit j of word w set where signs[width w + j] is
    negative (a kernel selects a thread's word and moves each bit into a float's sign bit)."""
    return [
        sum(1 << j for j, s in enumerate(signs[w : w + width]) if s < 0)
        for w in range(0, len(signs), width)
    ]


def unrotate_stages(x: Array, signs: tuple[float, ...]) -> Array:
    """`unrotate_rows` without array constants, for a kernel body under the interpreter (which
    closes over scalars only): x [..., D] float32 -> (x H / sqrt(D)) * signs, the Walsh-
    Hadamard transform's log2(D) stages of sums and differences, then each channel's sign from
    32-bit words of the pattern."""
    *lead, d = x.shape
    h = 1
    while h < d:
        y = x.reshape(*lead, d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = jnp.stack([a + b, a - b], axis=-2).reshape(*lead, d)
        h *= 2
    c = lax.broadcasted_iota(jnp.uint32, x.shape, x.ndim - 1)
    word = jnp.uint32(0)
    for w, bits in enumerate(sign_bits(signs, 32)):
        word = jnp.where(c >> 5 == w, jnp.uint32(bits), word)
    negative = (word >> (c & 31)) & 1 == 1
    return jnp.where(negative, -x, x) * np.float32(1 / np.sqrt(d))

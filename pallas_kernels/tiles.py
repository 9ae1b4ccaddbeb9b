"""Shared-memory tiles, tensor-core products and the flash-decoding steps of the plain Pallas
Mosaic GPU kernels (`pallas_kernels.fp8_decode`, `pallas_kernels.prerope_decode`), defined
once: the swizzle of a tile, a tile's allocation, wgmma's N for a group of query heads, a
product of two shared-memory operands, the interpreter option of a launch, a tile's online
softmax step and a unit's normalized partial."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def padded_heads(group: int) -> int:
    """wgmma's N for a kv group of `group` query heads: a multiple of 8."""
    return -(-group // 8) * 8


def swizzled(dtype, minor: int):
    """Tiling and swizzle of a shared-memory tile whose rows are `minor` elements of `dtype`."""
    row = minor * jnp.dtype(dtype).itemsize
    swizzle = next(s for s in (128, 64, 32) if row % s == 0)
    return (
        plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )


def smem(shape, dtype, minor: int | None = None):
    """A shared-memory tile of `shape`, swizzled for rows of `minor` elements (none: plain)."""
    return plgpu.SMEM(shape, dtype, transforms=swizzled(dtype, minor) if minor else ())


def interpret_option(interpret) -> dict:
    """`plgpu.kernel`'s keyword for a launch's `interpret`: False runs the kernel compiled,
    True under the GPU interpreter's defaults, a `plgpu.InterpretGPUParams` under those."""
    if not interpret:
        return {}
    return {"interpret": plgpu.InterpretGPUParams() if interpret is True else interpret}


def smem_product(a_ref, b_ref, shape):
    """float32 `shape` = a_ref . b_ref on wgmma (both operands in shared memory)."""

    def run(acc):
        plgpu.wgmma(acc, a_ref, b_ref)
        return acc[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def online_softmax_step(m, l, logits):
    """One tile of the online softmax over axis 0 of logits [T, N] (log2 units), with the
    running max m [N] and sum l [N]: (P, alpha, m, l) after it, alpha rescaling what came
    before. A finite floor for m (-1e30, not -inf) makes a tile of masked slots add 0."""
    m_new = jnp.maximum(m, logits.max(axis=0))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(logits - m_new[None, :])
    return p, alpha, m_new, l * alpha + p.sum(axis=0)


def write_partial(o_s, lse_s, o_dst, lse_dst, o, m, l):
    """A unit's normalized partial through shared memory (o_s, lse_s) to its GMEM slices:
    o^T [D, N] / l and lse = m + log2 l (log2 units); o = 0, lse = -inf where l = 0 (no
    position attended)."""
    empty = l == 0.0
    norm = jnp.where(empty, 1.0, l)
    o_s[...] = o / norm[None, :]
    lse_s[...] = jnp.where(empty, -jnp.inf, m + jnp.log2(norm))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, o_dst)
    plgpu.copy_smem_to_gmem(lse_s, lse_dst)
    plgpu.wait_smem_to_gmem(0)

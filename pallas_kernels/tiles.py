"""Shared-memory tiles and tensor-core products of the plain Pallas Mosaic GPU kernels
(`pallas_kernels.fp8_decode`, `pallas_kernels.prerope_decode`), defined once: the swizzle of a
tile, a tile's allocation, wgmma's N for a group of query heads, a product of two shared-memory
operands, and the interpreter option of a launch."""

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

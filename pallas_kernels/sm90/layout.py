"""Tile geometry, layouts, token maps and the kernel's numeric constants.

Conventions shared by the modules of `pallas_kernels.sm90`:

- A plane is `PLANE` = 64 tokens (or value channels), the M extent of one tile. Register tiles
  are (64, N) arrays in the WGMMA layout (`WG_LAYOUT`): warp w of the warpgroup holds rows
  16 w .. 16 w + 15, lane (g, c) = (lane // 4, lane % 4) rows g and g + 8 and columns
  8 i + 2 c, 8 i + 2 c + 1 of every 8-column block. Column vectors (N,) are in
  `WG_LAYOUT.reduce(0)`, row vectors (64,) in `WG_LAYOUT.reduce(1)`.
- Per-warp values: arrays whose warps (or lanes) hold different vectors, e.g. each warp the
  scale of the group its 16 rows lie in. Valid only under a broadcast along rows and
  elementwise use, never under a Mosaic reduction or relayout.
- The widen8 code path keeps the contraction axis of its fp16 tiles in the `PERM16` order
  (what two byte permutes of the 8-bit fragment give); `permute_contraction` puts q into it.
- The cache order (`kivi_jax.quant.cache_slot`): slot 64 p + 16 w + c of a `CACHE_BLOCK`
  holds token 64 w + 16 p + c, so that warp w's rows of the block's four planes are its 64
  consecutive tokens (`warp_groups`, `plane_tokens`).
- SMEM tiles are tiled and swizzled by `swizzle_transforms`.

The scaling constants. fold_v on mma.sync (vsub) puts B = P * s_t * 2^(VSUB_C - bits j) into
the value product, which stays <= 2^14 (fp16 range) relative to the running max of P * s_t and
normal down to 2^-22 (2-bit) / 2^-24 (4-bit) of it. fold_v_warp stores P as
P * 2^(VW_C - bits j), so that with subnormal code fields (weight 2^(bits j - 24)) every
plane's product weighs 2^(VW_C - 24); B = P * s * 2^(VW_C - bits j) <= 2^VW_C s stays finite
for value scales below 2^(16 - VW_C) and normal down to P * s = 2^-14 (2^-12 at the 2-bit
field 3). A running max that lags the true one by at most `RESCALE_SLACK` (log2 units) keeps
the softmax exact and bounds the weights by 2^slack, so B's bounds above take the slack off.

Everything here is plain Python or jnp and works under the interpreter too.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

PLANE = 64  # tokens per packed plane = wgmma M tile (docs/layout.md)
# Tokens per block of the cache order (kivi_jax.quant.cache_slot): slot 64 p + 16 w + c of a
# block holds token 64 w + 16 p + c, so warp w's rows of the block's four planes are its 64
# consecutive tokens 64 w .. 64 w + 63. Steps and sub-steps are whole blocks.
CACHE_BLOCK = 256
WG_LAYOUT = plgpu.Layout.WGMMA  # the register layout of every (64, N) tile here

# vsub (fold_v on mma.sync): B's exponent offset, so that B stays <= 2^14 of its running max
VSUB_C = 14
# fold_v_warp: P's exponent offset, so that every plane's value product weighs 2^(VW_C - 24)
VW_C = 4
# lazy_max: how far (log2) the running max may lag the true one before a rescale (still exact)
RESCALE_SLACK = 4.0
# choose_tuning: the per-warp softmax from this many steps per split (measured slower below)
WSM_MIN_STEPS = 16

# Permuted contraction order of the widen8 path: within each 16-wide block, position p of the
# fp16 operand holds element PERM16[p]. It is the order in which the 8-bit WGMMA fragment (four
# consecutive bytes per register) lands in the 16-bit fragment (two consecutive elements per
# register, at columns 2k and 8 + 2k) when each byte register is split by two byte permutes.
PERM16 = tuple(4 * (p % 8 // 2) + 2 * (p // 8) + p % 2 for p in range(16))


def swizzle_transforms(dtype, minor_elems):
    """The SMEM transforms of a tile of `dtype` with rows of `minor_elems` elements: the widest
    swizzle the row allows (`plgpu.find_swizzle`) and the (8, swizzle width) tiling it implies,
    so that the 8 rows of an 8x16-byte fragment fall into different banks."""
    bits = jnp.dtype(dtype).itemsize * 8
    sw = plgpu.find_swizzle(minor_elems * bits, "kivi")
    return (plgpu.TilingTransform((8, sw * 8 // bits)), plgpu.SwizzleTransform(sw))


def permute_contraction(x, axis=-1):
    """x with its `axis` (a multiple of 16) reordered into the widen8 contraction order."""
    n = x.shape[axis]
    idx = np.array([16 * (i // 16) + PERM16[i % 16] for i in range(n)])
    return jnp.take(x, idx, axis=axis)


def warp_groups(p: int, G: int) -> tuple[int, ...]:
    """The key groups (counted from the sub-step's first) of the rows 16 w .. 16 w + 15 of plane
    p, w = 0..3: in the cache order those rows hold the tokens 256 (p // 4) + 64 w + 16 (p % 4)
    + (0..15) of the sub-step, so a warp's rows of a block's four planes lie in one group
    (G >= 64) or two (G = 32)."""
    return tuple((CACHE_BLOCK * (p // 4) + 64 * w + 16 * (p % 4)) // G for w in range(4))


def plane_tokens(p: int, rows):
    """Token offsets within the sub-step of rows (an int32 array of row indices < 64) of plane p
    in the cache order (`warp_groups`)."""
    return CACHE_BLOCK * (p // 4) + 16 * (p % 4) + rows + 48 * lax.div(rows, 16)

"""Code bytes -> tensor-core operands: the KIVI code fields as fp16 or fp8 values.

A code byte holds 8 / bits fields, field j at bits [bits j, bits (j + 1)). The cache stores
every four bytes of a row with the middle two swapped (`kivi_jax.quant.swap_bytes`), so that
byte permutes of an 8-bit WGMMA register give fp16 element pairs (`widen8`, `code_field8`);
`natural_bytes` undoes the swap in jnp. Three ways to a field as an exact tensor-core operand:

- magic-number fp16 (`widen_codes`, `field_raw`, `field_to_f16`): the byte widened with the
  fp16 exponent bits (`EXP_BITS`) set; one and-mask leaves the field with its lowest bit
  weighing 1 on top of the offset `field_offset`, which `field_to_f16` subtracts exactly;
- subnormal fp16 (`field_sub`, `field_sub_weight`): the field masked in place and read as the
  subnormal code * 2^(bits j - 24) (tensor cores take fp16 subnormals as they are), no offset;
- e4m3 subnormal (`f8_field_spec`, `code_field8`): the field shifted and masked into a byte
  <= 15, code * weight * 2^-9.

`widen8` widens a whole SMEM code tile into the WGMMA layout (`layout.WG_LAYOUT`) with the
contraction axis in the `layout.PERM16` order. `widen8` and `code_field8` are inline Mosaic GPU
(native only); `code_field8_reference` is `code_field8` in jnp, and the field functions and
`natural_bytes` are jnp: they run anywhere.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.sm90.inline import const_i32, lane_warp
from pallas_kernels.sm90.layout import PLANE, WG_LAYOUT

EXP_BITS = 0x7C00  # the five exponent bits of an fp16 bit pattern (`widen_codes` sets them)


def widen_codes(x8):
    """Code bytes (uint8) -> uint16 with all five exponent bits set, ready for `field_to_f16`.

    One or per byte here instead of one per code field there: the field's exponent is then
    selected by the and-mask alone (ptxas does not fuse and + or with two constants into one
    LOP3, so this saves an instruction per element pair and plane).
    """
    return x8.astype(jnp.uint16) | jnp.uint16(EXP_BITS)


def field_offset(bits: int, j: int) -> float:
    """The fp16 offset 2^(10 - bits*j) of code field j under the magic-number trick."""
    return float(2 ** (10 - bits * j))


def field_raw(y16, bits: int, j: int):
    """Code field j of bytes widened by `widen_codes` as the fp16 number
    `field_offset(bits, j) + code` (exact): one and, the offset left to the caller.

    Keeping the field (bits [bits*j, bits*(j+1))) and the exponent bits of 2^(10 - bits*j)
    makes the field's lowest bit weigh exactly 1.
    """
    mask = ((1 << bits) - 1) << (bits * j)
    magic = (25 - bits * j) << 10  # fp16 bit pattern of the offset (a subset of EXP_BITS)
    return lax.bitcast_convert_type(y16 & jnp.uint16(mask | magic), jnp.float16)


def field_to_f16(y16, bits: int, j: int):
    """Code field j of bytes widened by `widen_codes` as exact fp16 integers: `field_raw`
    less its offset (an exact subtraction)."""
    return field_raw(y16, bits, j) - jnp.float16(field_offset(bits, j))


def field_sub(y16, bits: int, j: int):
    """Code field j of code bytes widened *without* exponent bits (`widen8(...,
    exponent=False)`, or a plain u8 -> u16) masked in place: the fp16 bit pattern code *
    2^(bits*j) read as the subnormal number code * 2^(bits*j - 24), exact and without an
    offset (tensor cores take fp16 subnormals as they are). One and per element pair."""
    mask = ((1 << bits) - 1) << (bits * j)
    return lax.bitcast_convert_type(y16 & jnp.uint16(mask), jnp.float16)


def field_sub_weight(bits: int, j: int) -> float:
    """What a product over `field_sub(..., bits, j)` operands is multiplied by to weigh the
    codes 1: 2^(24 - bits*j)."""
    return float(2 ** (24 - bits * j))


def widen8(codes_ref, transforms, exponent: bool = True, warp_rows=None):
    """(64, X) uint8 code tile in SMEM -> (64, X) uint16 in the WGMMA layout, every byte widened
    with the exponent bits set (as `widen_codes`; exponent=False: the high bytes undefined, for
    `field_sub`), columns in the `PERM16` order.

    The bytes are loaded in the 8-bit WGMMA layout (four consecutive bytes of a row per
    register, stored as the cache stores them, the middle two swapped: `kivi_jax.quant.
    swap_bytes`), so a register's fp16 pairs (b0, b2) and (b1, b3) are the row's elements
    (4k, 4k + 1) and (4k + 2, 4k + 3): one `prmt` per output register interleaves them with the
    exponent byte, or, without exponent bits, the register itself and the register shifted
    right by 8 are the pairs (the other byte of each 16-bit lane is left there: every code
    field mask clears it, `field_sub`): one instruction per two output registers.
    Mosaic's own u8 -> u16 relayout into the natural order costs about three byte permutes and
    an or per output register (in SASS). `transforms`: the tile's SMEM
    tiling and swizzle (unswizzled 64- or 128-byte rows put the eight rows of an 8x16-byte
    fragment into the same banks: measured 6x the ideal shared-memory wavefronts). Not
    interpretable.

    warp_rows (a, b): codes_ref holds more than 64 rows and warp w's 16 rows of the tile are
    its rows a w + b .. a w + b + 15 (multiples of 8), by a per-warp slice of the tiled ref.
    """
    swizzle = transforms[1].swizzle
    X = codes_ref.shape[-1]

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(transforms=transforms),),
        return_type=plgpu.ShapeDtypeStruct((PLANE, X), jnp.uint16, layout=WG_LAYOUT),
    )
    def widen(_, ref):
        if warp_rows is not None:  # rows a w + b - 16 w .. + 63: warp w's 16 at a w + b
            # A per-warp base pointer under a static 64-row memref type, so that every load's
            # address is that register plus a constant (a memref subview with a dynamic
            # offset costs ~100 IMAD and LDS more per step).
            a, b = warp_rows
            _, warp = lane_warp()
            ty = ir.MemRefType(ref.type)
            strides, _ = ty.get_strides_and_offset()
            t0 = arith.addi(arith.muli(warp, const_i32((a - 16) // 8)), const_i32(b // 8))
            off = arith.muli(t0, const_i32(strides[0]))  # bytes: u8 elements
            ptr = mgpu_utils.getelementptr(
                mgpu_utils.memref_ptr(ref), [off], ir.IntegerType.get_signless(8)
            )
            ref = mgpu_utils.ptr_as_memref(
                ptr,
                ir.MemRefType.get(
                    (PLANE // 8, *ty.shape[1:]),
                    ty.element_type,
                    ir.StridedLayoutAttr.get(0, strides),
                    ty.memory_space,
                ),
            )
        x = mgpu_fa.FragmentedArray.load_tiled(
            ref, swizzle, layout=mgpu_fa.WGMMA_LAYOUT_8BIT, is_signed=False, optimized=False
        )
        i32 = ir.IntegerType.get_signless(32)
        pair_ty = ir.VectorType.get((2,), ir.IntegerType.get_signless(16))
        high = 0x7C7C7C7C if exponent else 0
        regs = x.registers
        out = np.empty((1, X // 8, *regs.shape[2:]), dtype=object)
        for idx in np.ndindex(regs.shape):
            w = mgpu_utils.bitcast(regs[idx], i32)
            for half, sel in ((0, 0x4240), (1, 0x4341)):  # stored bytes (0, 2) / (1, 3) of w
                if exponent:
                    r = mgpu_utils.inline_ptx(
                        "prmt.b32 $0, $1, $2, $3;",
                        w,
                        const_i32(high),
                        const_i32(sel),
                        result_types=i32,
                    )
                else:  # bytes 0, 2 in place; bytes 1, 3 shifted into place
                    r = w if half == 0 else arith.shrui(w, const_i32(8))
                out[(idx[0], 2 * idx[1] + half, *idx[2:])] = mgpu_utils.bitcast(r, pair_ty)
        return mgpu_fa.FragmentedArray(
            _registers=out, _layout=mgpu_fa.WGMMA_LAYOUT, _is_signed=False
        )

    return widen(codes_ref)


def f8_field_spec(bits: int, j: int):
    """(shift, mask, weight) of value code field j as an e4m3 subnormal: (byte >> shift) & mask
    is a byte b <= 15, which e4m3 reads as b * 2^-9 = code * weight * 2^-9 (the subnormals and
    the first binade share the spacing 2^-9, so bytes 0..15 are exactly linear). Fields of the
    upper nibble are shifted down by four first."""
    lo = bits * j
    shift = lo - lo % 4
    return shift, ((1 << bits) - 1) << (lo - shift), 1 << (lo - shift)


def code_field8(x8, spec, dtype):
    """Code field (shift, mask, _) = spec (`f8_field_spec`) of a (64, X) uint8 tile in the
    8-bit WGMMA layout (as stored: the middle bytes of every four swapped) as the float8_e4m3fn
    A operand in the natural column order: one byte permute, one and (plus one shift for a
    shifted field) per register of four bytes. Not interpretable (inline Mosaic GPU)."""
    shift, mask, _ = spec
    W8 = plgpu.Layout.WGMMA_8BIT

    @plgpu.inline_mgpu(
        arg_types=(W8,), return_type=plgpu.ShapeDtypeStruct(x8.shape, dtype, layout=W8)
    )
    def field(_, xa):
        i32 = ir.IntegerType.get_signless(32)
        elt = ir.Float8E4M3FNType.get()
        out = np.empty(xa.registers.shape, dtype=object)
        for idx in np.ndindex(xa.registers.shape):
            reg = xa.registers[idx]
            w = mgpu_utils.inline_ptx(
                "prmt.b32 $0, $1, 0, 0x3120;", mgpu_utils.bitcast(reg, i32), result_types=i32
            )
            if shift:
                w = arith.shrui(w, const_i32(shift))
            w = arith.andi(w, const_i32(mask * 0x01010101))
            out[idx] = mgpu_utils.bitcast(w, ir.VectorType.get(ir.VectorType(reg.type).shape, elt))
        return mgpu_fa.FragmentedArray(_registers=out, _layout=xa.layout, _is_signed=None)

    return field(x8)


def code_field8_reference(x8, spec, dtype):
    """`code_field8` in jnp (the interpreter's path): x8 (64, X) uint8 as stored."""
    shift, mask, _ = spec
    x8 = natural_bytes(x8)
    return lax.bitcast_convert_type(
        ((x8.astype(jnp.int32) >> shift) & mask).astype(jnp.uint8), dtype
    )


def natural_bytes(x8):
    """A code tile's last axis from the cache's stored byte order (`kivi_jax.quant.swap_bytes`)
    to the natural one, in jnp: the interpreter's paths and the natural-order ones."""
    from kivi_jax.quant import swap_bytes

    return swap_bytes(x8, -1)

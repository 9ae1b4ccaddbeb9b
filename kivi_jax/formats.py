"""Element formats of a quantized cache: how one group of G elements becomes codes and scales.

Every format quantizes groups of G elements along the grouped axis, which callers move last
(`encode` takes xg [..., G]). A group yields codes (one uint8 per element, `code_bits` bits
used, packed by the cache's own rule), `scale` ([..., G / block]: one per block of the group)
and `aux` ([..., aux_count]: side values per group).

  "int"    KIVI's asymmetric min/max integers of `bits` (2, 4, 8) bits: block = G, the scale
           and the minimum in `scale_dtype` (aux = the minimum). `kivi_jax.quant.minmax_quantize`.
  "fp8"    OCP FP8 E4M3 (e4m3fn: finite range +-448, no infinities) codes, one symmetric scale
           per group in `scale_dtype`, amax / 448 rounded up, so no element clips. No aux.
  "nvfp4"  NVIDIA NVFP4: FP4 E2M1 codes (+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}) in blocks of 16, each
           with an FP8 E4M3 scale, under a second-level FP32 scale. The FP32 scale covers one
           group of G elements (the "tensor" of a streamed cache, which has no calibration
           pass): amax_group / (448 * 6), so that block scales use E4M3's whole range. Block
           scales round to nearest (E4M3), elements round to nearest even and saturate at +-6:
           the quantization recipe of NVIDIA's Transformer Engine.
  "mxfp4"  OCP Microscaling MXFP4 (MX specification v1.0, section 6.3): FP4 E2M1 codes in
           blocks of 32 with an E8M0 (power of two) shared scale X = 2^(floor(log2(amax)) - 2),
           2 being E2M1's largest exponent; elements V / X round to nearest even and clamp at
           the largest normal, +-6. No aux.

Edges, as for "int" (docs/what_happens_when.md): a group holding a NaN or an infinity
decodes to NaN whole (its scale is NaN); a group of zeros decodes to zeros; finite inputs never
decode to a non-finite value (scales saturate at their dtype's finite range and codes clip).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

FORMATS = ("int", "fp8", "nvfp4", "mxfp4")
FLOAT_FORMATS = ("fp8", "nvfp4", "mxfp4")
FP8_MAX = 448.0  # E4M3's largest finite value
FP4_MAX = 6.0  # E2M1's largest value
FP4_BLOCK = {"nvfp4": 16, "mxfp4": 32}
# E2M1 values by code: bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa.
_FP4_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def code_bits(fmt: str, bits: int) -> int:
    """Bits per stored code: `bits` for "int", 8 for "fp8", 4 for the FP4 formats."""
    return {"int": bits, "fp8": 8}.get(fmt, 4)


def block_size(fmt: str, group_size: int) -> int:
    """Elements per scale: G for "int" and "fp8", 16 for "nvfp4", 32 for "mxfp4"."""
    return FP4_BLOCK.get(fmt, group_size)


def block_scale_dtype(fmt: str, scale_dtype) -> jnp.dtype:
    """The dtype of the per-block scales: the config's for "int" and "fp8", FP8 E4M3 for
    "nvfp4", E8M0 for "mxfp4"."""
    fixed = {"nvfp4": jnp.float8_e4m3fn, "mxfp4": jnp.float8_e8m0fnu}
    return jnp.dtype(fixed.get(fmt, scale_dtype))


def empty_scale(dtype) -> float:
    """The scale stored where nothing is: 0, or 1 for E8M0, which has no zero (zero bits are
    2^-127, a float32 subnormal that backends flush; a cast of 0 is its NaN). Unheld slots
    then decode to finite values, which masked attention needs (0 * NaN is NaN)."""
    return 1.0 if jnp.dtype(dtype) == jnp.float8_e8m0fnu else 0.0


def aux_count(fmt: str) -> int:
    """Side values per group: 1 for "int" (the minimum) and "nvfp4" (the FP32 group scale),
    else 0."""
    return 1 if fmt in ("int", "nvfp4") else 0


def aux_dtype(fmt: str, scale_dtype) -> jnp.dtype:
    return jnp.dtype(jnp.float32 if fmt == "nvfp4" else scale_dtype)


def group_bits(fmt: str, bits: int, group_size: int, scale_dtype) -> int:
    """Stored bits of one group of G elements: codes, block scales and side values."""
    scales = (
        group_size // block_size(fmt, group_size) * block_scale_dtype(fmt, scale_dtype).itemsize
    )
    aux = aux_count(fmt) * aux_dtype(fmt, scale_dtype).itemsize
    return group_size * code_bits(fmt, bits) + 8 * (scales + aux)


def check_group(fmt: str, group_size: int) -> None:
    """Raise ValueError unless groups of `group_size` hold whole blocks of `fmt`."""
    block = block_size(fmt, group_size)
    if group_size % block:
        raise ValueError(
            f"{fmt} needs group_size a multiple of its block of {block}, got {group_size}"
        )


# ---------------------------------------------------------------------------------------------
# Scalar conversions


def _fp4_codes(y: Array) -> Array:
    """Codes of float32 values y already on the E2M1 grid (|y| in {0, 0.5, ..., 6})."""
    a = jnp.abs(y)
    mag = jnp.where(a < 2, a * 2, jnp.where(a < 4, a + 2, a / 2 + 4)).astype(jnp.uint8)
    return mag | (jnp.signbit(y).astype(jnp.uint8) << 3)


def fp4_decode(codes: Array) -> Array:
    """E2M1 values (float32) of 4-bit codes."""
    return jnp.asarray(_FP4_VALUES, jnp.float32)[codes.astype(jnp.int32) & 15]


def _to_fp4(x: Array) -> Array:
    """float32 x rounded to nearest even on the E2M1 grid, saturating at +-6."""
    return jnp.clip(x, -FP4_MAX, FP4_MAX).astype(jnp.float4_e2m1fn).astype(jnp.float32)


def _round_up_to(x: Array, dtype) -> Array:
    """Non-negative float32 x cast to `dtype`, rounded up (to the finite max at most)."""
    dtype = jnp.dtype(dtype)
    c = jax.lax.optimization_barrier(x.astype(dtype))  # barrier: keep the round trip (quant.py)
    up = jnp.where(c.astype(jnp.float32) < x, jnp.nextafter(c, jnp.array(jnp.inf, dtype)), c)
    return jnp.minimum(up, jnp.finfo(dtype).max)


# ---------------------------------------------------------------------------------------------
# Encode and decode


def _finite_amax(xf: Array, axis: int = -1) -> tuple[Array, Array]:
    """(max |x| over `axis` with infinities saturated to float32's max, keepdims; a flag of
    groups holding a non-finite value). The flag is explicit: XLA's CPU reductions skip NaN
    at some shapes."""
    bad = jnp.any(~jnp.isfinite(xf), axis=axis, keepdims=True)
    big = float(jnp.finfo(jnp.float32).max)
    return jnp.max(jnp.abs(jnp.clip(xf, -big, big)), axis=axis, keepdims=True), bad


def encode(fmt: str, xg: Array, bits: int, scale_dtype) -> tuple[Array, Array, Array]:
    """Quantize groups xg [..., G] -> (codes uint8 [..., G], scale [..., G / block],
    aux [..., aux_count] or None where aux_count is 0) in the dtypes above (module doc)."""
    if fmt == "int":
        from kivi_jax.quant import minmax_quantize

        codes, scale, mn = minmax_quantize(xg, bits, axis=-1, scale_dtype=scale_dtype)
        return codes, scale, mn
    xf = xg.astype(jnp.float32)
    if fmt == "fp8":
        return _encode_fp8(xf, scale_dtype)
    if fmt == "nvfp4":
        return _encode_nvfp4(xf)
    if fmt == "mxfp4":
        return _encode_mxfp4(xf)
    raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")


def _encode_fp8(xf: Array, scale_dtype) -> tuple[Array, Array, Array]:
    amax, bad = _finite_amax(xf)
    scale = _round_up_to(amax / FP8_MAX, scale_dtype)
    scale = jnp.where(bad, jnp.nan, scale).astype(scale_dtype)
    sf = scale.astype(jnp.float32)
    ok = sf > 0  # zero groups and NaN scales give codes 0
    y = jnp.where(ok, jnp.clip(xf / jnp.where(ok, sf, 1.0), -FP8_MAX, FP8_MAX), 0.0)
    codes = jax.lax.bitcast_convert_type(y.astype(jnp.float8_e4m3fn), jnp.uint8)
    return codes, scale, None


def _encode_blocks(xf: Array, block: int, block_scale, elem_scale) -> tuple[Array, Array]:
    """FP4 codes of xf [..., G] in blocks of `block`: block_scale(amax [..., G/b, 1]) -> the
    stored block scale; elem_scale(stored) -> the float32 divisor of the block's elements."""
    *lead, g = xf.shape
    xb = xf.reshape(*lead, g // block, block)
    amax, bad = _finite_amax(xb)
    stored = block_scale(amax)
    div = elem_scale(stored)
    ok = (div > 0) & ~bad
    y = jnp.where(ok, _to_fp4(xb / jnp.where(ok, div, 1.0)), 0.0)
    return _fp4_codes(y).reshape(*lead, g), stored[..., 0]


def _encode_nvfp4(xf: Array) -> tuple[Array, Array, Array]:
    amax, bad = _finite_amax(xf)
    big = float(jnp.finfo(jnp.float32).max)
    gscale = jnp.where(bad, jnp.nan, jnp.minimum(amax / (FP8_MAX * FP4_MAX), big))
    safe_g = jnp.where(gscale > 0, gscale, 1.0)[..., None]  # [..., 1, 1] over the blocks

    def block_scale(block_amax):
        s = jnp.clip(block_amax / FP4_MAX / safe_g, 0.0, FP8_MAX)
        return s.astype(jnp.float8_e4m3fn)

    def elem_scale(stored):
        return stored.astype(jnp.float32) * safe_g

    codes, scale = _encode_blocks(xf, FP4_BLOCK["nvfp4"], block_scale, elem_scale)
    # a NaN group scale makes the group NaN on decode; its codes are 0 (elem_scale saw 1.0)
    return jnp.where(jnp.isnan(gscale), 0, codes).astype(jnp.uint8), scale, gscale


def _encode_mxfp4(xf: Array) -> tuple[Array, Array, Array]:
    def block_scale(block_amax):
        # floor(log2(amax)) - emax(E2M1) = 2; E8M0 spans 2^-127 .. 2^127 (a zero block: the
        # smallest scale, its elements are zero anyway)
        e = jnp.floor(jnp.log2(jnp.maximum(block_amax, 2.0**-126))) - 2
        # built from its exponent bits (bias 127): scales below 2^-126 are float32 subnormals,
        # which XLA's CPU and GPU backends flush to zero (and zero is E8M0's NaN)
        bits = (jnp.clip(e, -127, 127) + 127).astype(jnp.uint8)
        return jax.lax.bitcast_convert_type(bits, jnp.float8_e8m0fnu)

    xb = xf.reshape(*xf.shape[:-1], -1, FP4_BLOCK["mxfp4"])
    bad = jnp.any(~jnp.isfinite(xb), axis=-1)
    codes, scale = _encode_blocks(
        xf, FP4_BLOCK["mxfp4"], block_scale, lambda s: s.astype(jnp.float32)
    )
    # E8M0's NaN (0xFF) marks a block holding a NaN or an infinity, as the MX spec does
    scale = jnp.where(bad, jnp.array(jnp.nan, scale.dtype), scale)
    return codes, scale, None


def decode(fmt: str, codes: Array, scale: Array, aux: Array, group_size: int) -> Array:
    """Float32 values of codes [..., G] with scale [..., G / block] and aux [..., aux_count]
    (the group's side values), unsaturated (callers cast)."""
    if fmt == "int":
        from kivi_jax.quant import dequantize_codes

        block = group_size
        s = jnp.repeat(scale, block, axis=-1)
        return dequantize_codes(codes, s, jnp.repeat(aux, group_size, axis=-1), jnp.float32)
    block = block_size(fmt, group_size)
    s = jnp.repeat(scale.astype(jnp.float32), block, axis=-1)
    if fmt == "fp8":
        y = jax.lax.bitcast_convert_type(codes.astype(jnp.uint8), jnp.float8_e4m3fn)
        return y.astype(jnp.float32) * s
    if fmt == "nvfp4":  # element x block scale x group scale ([..., 1] over the group)
        return fp4_decode(codes) * s * aux.astype(jnp.float32)
    return fp4_decode(codes) * s

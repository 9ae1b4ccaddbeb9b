"""Static, hashable configuration of a KIVI cache.

Shape letters used throughout kivi-jax: B batch, T cache length (tokens), S query/prompt length,
Hq query heads, Hkv key/value heads, D head dim, G group size, R residual length, L layers,
P codes per byte (8 // bits).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

from kivi_jax import formats

Axis = Literal["channel", "token"]
ROTATIONS = ("none", "keys", "values", "both")

SUPPORTED_BITS = (2, 4, 8)
SCALE_DTYPES = ("float16", "bfloat16", "float32")


def is_int(x) -> bool:
    """A Python int that is not a bool: sizes and bit widths are static, hashable Python ints
    (2.0 == 2 and True == 1 would pass a membership test and fail later, far from the cause)."""
    return isinstance(x, int) and not isinstance(x, bool)


def scale_dtype_name(scale_dtype) -> str:
    """The name in SCALE_DTYPES of `scale_dtype` (a name, a dtype or a scalar type); raise
    ValueError naming `scale_dtype` for anything else."""
    try:
        name = jnp.dtype(scale_dtype).name
    except TypeError:
        name = None
    if name not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype!r}")
    return name


@dataclasses.dataclass(frozen=True)
class KiviConfig:
    """How keys and values are quantized. Frozen and hashable: pass it as a static argument.

    key_bits / value_bits: 2, 4 or 8.
    group_size: G. Keys share one (scale, min) per channel over G tokens; values one per token
      over G channels (so G must divide head_dim).
    residual_length: R, the newest tokens kept in full precision (a multiple of G; 0 allowed).
    scale_dtype: storage dtype of scales and minimums ("float16" as in KIVI).
    key_axis / value_axis: "channel" quantizes along tokens (one scale per channel and token
      group), "token" along channels (one scale per token and channel group). KIVI is
      key_axis="channel", value_axis="token"; the other combinations exist for ablations.
    key_format / value_format: the element format (`kivi_jax.formats`): "int" (KIVI's), or a
      float format, per token.
    sinks: N, the first positions kept in full precision (attention sinks).
    rotation: "keys", "values" or "both": a Hadamard rotation of the head dim before
      quantizing (`kivi_jax.rotation`), undone by rotating q and the output.
    outlier_channels: K, per group of G tokens the K key channels of widest range kept in
      `scale_dtype` beside the codes (dense-and-sparse; `kivi_jax.quant.outlier_channels`).
      Integer per-channel keys only.
    pre_rope: keys quantized before RoPE (KVQuant): the cache takes post-RoPE keys as always,
      undoes RoPE before quantizing (per channel the groups then see each channel's own
      values, not their rotation by position) and redoes it when read. Needs the model's
      RoPE frequencies (`KiviCache.init(rope_frequencies=...)`); not read by the kernel.
    """

    key_bits: int = 2
    value_bits: int = 2
    group_size: int = 32
    residual_length: int = 128
    scale_dtype: str = "float16"
    key_axis: Axis = "channel"
    value_axis: Axis = "token"
    key_format: str = "int"
    value_format: str = "int"
    sinks: int = 0
    rotation: str = "none"
    outlier_channels: int = 0
    pre_rope: bool = False

    def __post_init__(self):
        for name in ("key_bits", "value_bits"):
            bits = getattr(self, name)
            if not is_int(bits) or bits not in SUPPORTED_BITS:
                raise ValueError(f"{name} must be an int in {SUPPORTED_BITS}, got {bits!r}")
        g = self.group_size
        if not is_int(g) or g < 8 or g > 256 or g & (g - 1):
            raise ValueError(f"group_size must be a power of two (int) in [8, 256], got {g!r}")
        for side in ("key", "value"):
            self._check_format(side)
        if not is_int(self.sinks) or self.sinks < 0:
            raise ValueError(f"sinks must be a non-negative int, got {self.sinks!r}")
        if self.rotation not in ROTATIONS:
            raise ValueError(f"rotation must be one of {ROTATIONS}, got {self.rotation!r}")
        k = self.outlier_channels
        if not is_int(k) or not 0 <= k < 256:  # < head_dim <= 256 (`check_head_dim`)
            raise ValueError(f"outlier_channels must be a non-negative int < 256, got {k!r}")
        if not isinstance(self.pre_rope, bool):
            raise ValueError(f"pre_rope must be a bool, got {self.pre_rope!r}")
        if k and (self.key_axis != "channel" or self.key_format != "int"):
            raise ValueError(
                "outlier_channels keeps key channels of integer per-channel groups: "
                f"set key_axis='channel' and key_format='int' (got {self.key_axis!r}, "
                f"{self.key_format!r})"
            )
        r = self.residual_length
        if not is_int(r) or r < 0 or r % g:
            raise ValueError(
                f"residual_length must be a non-negative multiple of group_size={g}, got {r!r}"
            )
        if not isinstance(self.scale_dtype, str) or self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {self.scale_dtype!r}")
        for name in ("key_axis", "value_axis"):
            if getattr(self, name) not in ("channel", "token"):
                raise ValueError(
                    f"{name} must be 'channel' or 'token', got {getattr(self, name)!r}"
                )

    def _check_format(self, side: str) -> None:
        fmt, bits = getattr(self, f"{side}_format"), getattr(self, f"{side}_bits")
        if fmt not in formats.FORMATS:
            raise ValueError(f"{side}_format must be one of {formats.FORMATS}, got {fmt!r}")
        if fmt == "int":
            return
        if bits != formats.code_bits(fmt, bits):
            raise ValueError(
                f"{side}_format={fmt!r} stores {formats.code_bits(fmt, bits)}-bit codes: "
                f"set {side}_bits={formats.code_bits(fmt, bits)}, got {bits}"
            )
        if getattr(self, f"{side}_axis") != "token":
            raise ValueError(f"{side}_format={fmt!r} quantizes per token: set {side}_axis='token'")
        formats.check_group(fmt, self.group_size)

    @property
    def scale_jnp_dtype(self):
        return jnp.dtype(self.scale_dtype)

    @property
    def is_kivi(self) -> bool:
        """True for KIVI's axes (per-channel keys, per-token values)."""
        return self.key_axis == "channel" and self.value_axis == "token"

    @property
    def kernel_layout(self) -> bool:
        """KIVI's axes and integer codes, no outlier channels, post-RoPE keys: what the Pallas
        kernel reads (the sinks and the rotation of q and of the output in it where it can,
        else beside it: `pallas_kernels.kivi_decode`'s sinks, q_signs and o_signs)."""
        ints = self.key_format == self.value_format == "int"
        return self.is_kivi and ints and not (self.outlier_channels or self.pre_rope)

    @property
    def prerope_kernel_layout(self) -> bool:
        """KIVI's axes, integer codes of 2 or 4 bits, no outlier channels, keys before RoPE:
        what the pre-RoPE Pallas kernel reads (`pallas_kernels.prerope_decode`; the sinks and
        the windows beside it, the values' rotation around it)."""
        ints = self.key_format == self.value_format == "int"
        widths = self.key_bits in (2, 4) and self.value_bits in (2, 4)
        return self.is_kivi and ints and widths and self.pre_rope and not self.outlier_channels

    @property
    def fp8_kernel_layout(self) -> bool:
        """fp8 keys and values (per token), post-RoPE, no sinks: what the fp8 Pallas kernel
        reads (`pallas_kernels.fp8_decode`; a rotation around it, the windows beside it)."""
        fp8 = self.key_format == self.value_format == "fp8"
        return fp8 and not (self.pre_rope or self.sinks)

    @property
    def plain_kivi(self) -> bool:
        """The kernel's layout (no outlier channels) and no sinks: what the folded form
        reads."""
        return self.kernel_layout and not self.sinks

    @property
    def rotates_keys(self) -> bool:
        return self.rotation in ("keys", "both")

    @property
    def rotates_values(self) -> bool:
        return self.rotation in ("values", "both")

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ValueError unless this config can quantize heads of size `head_dim`."""
        uses_channel_groups = "token" in (self.key_axis, self.value_axis)
        if uses_channel_groups and head_dim % self.group_size:
            raise ValueError(
                f"head_dim={head_dim} must be a multiple of group_size={self.group_size} "
                "(per-token quantization groups run along head_dim)"
            )
        if head_dim % 8:
            raise ValueError(f"head_dim must be a multiple of 8, got {head_dim}")
        if self.rotation != "none" and head_dim & (head_dim - 1):
            raise ValueError(f"rotation needs a power-of-two head_dim, got {head_dim}")
        k = self.outlier_channels
        if k and not k < head_dim <= 256:  # channel indices are stored as uint8
            raise ValueError(f"outlier_channels={k} needs head_dim in ({k}, 256], got {head_dim}")

    def bits_per_element(self, head_dim: int | None = None) -> float:
        """Average stored bits per cached K/V element in the quantized region: codes, scales,
        minimums and every side value per group, outlier channels included (which is why it
        needs `head_dim` when there are any). The fixed full-precision buffers (the residual
        windows and the sinks, the same size at any context) are not in it: they are in
        `KiviCache.nbytes()`."""
        g, s = self.group_size, self.scale_dtype
        k = formats.group_bits(self.key_format, self.key_bits, g, s)
        v = formats.group_bits(self.value_format, self.value_bits, g, s)
        if self.outlier_channels:
            if head_dim is None:
                raise ValueError(
                    "bits_per_element of a config with outlier channels needs head_dim"
                )
            self.check_head_dim(head_dim)
            # per group of G tokens: K channels of G values plus K one-byte channel indices,
            # spread over the group's G * D elements (k and v count bits per G elements)
            value_bits = 8 * jnp.dtype(s).itemsize
            k += self.outlier_channels * (g * value_bits + 8) / head_dim
        return (k + v) / (2 * g)

"""Static, hashable configuration of a KIVI cache.

Shape letters used throughout kivi-jax: B batch, T cache length (tokens), S query/prompt length,
Hq query heads, Hkv key/value heads, D head dim, G group size, R residual length, L layers,
P codes per byte (8 // bits).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

Axis = Literal["channel", "token"]

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
    """

    key_bits: int = 2
    value_bits: int = 2
    group_size: int = 32
    residual_length: int = 128
    scale_dtype: str = "float16"
    key_axis: Axis = "channel"
    value_axis: Axis = "token"

    def __post_init__(self):
        for name in ("key_bits", "value_bits"):
            bits = getattr(self, name)
            if not is_int(bits) or bits not in SUPPORTED_BITS:
                raise ValueError(f"{name} must be an int in {SUPPORTED_BITS}, got {bits!r}")
        g = self.group_size
        if not is_int(g) or g < 8 or g > 256 or g & (g - 1):
            raise ValueError(f"group_size must be a power of two (int) in [8, 256], got {g!r}")
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

    @property
    def scale_jnp_dtype(self):
        return jnp.dtype(self.scale_dtype)

    @property
    def is_kivi(self) -> bool:
        """True for KIVI's axes (per-channel keys, per-token values), the kernels' layout."""
        return self.key_axis == "channel" and self.value_axis == "token"

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

    def bits_per_element(self, head_dim: int) -> float:
        """Average stored bits per cached K/V element, scales and minimums included."""
        s = jnp.dtype(self.scale_dtype).itemsize * 8
        return (self.key_bits + self.value_bits) / 2 + 2 * s / self.group_size

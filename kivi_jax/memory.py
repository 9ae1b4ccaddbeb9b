"""KV-cache memory arithmetic: bytes per token, cache bytes, what fits beside the weights.

Pure integer arithmetic over (num_layers, kv_heads, head_dim, KiviConfig | None); no arrays, no
models. `None` is the dense cache (two full-precision tensors, K and V).

Two views of a quantized cache's size:
- steady state: `bytes_per_token` = 2 L Hkv D * bits_per_element / 8, the cost of one more
  quantized token (codes plus the fp16 scale and minimum amortized over the group). KIVI-2 with
  G=32 is 2 + 32/32 = 3 bits per element.
- as allocated: `cache_bytes` follows the layout of docs/layout.md (what `kivi_jax.make_cache`
  allocates for `max_len` tokens): codes and scales for Tq = max_len rounded up to 256 tokens,
  plus the full-precision residual windows (max(R, G) slots for a per-channel store such as
  KIVI's keys, R for a per-token store such as KIVI's values), the sinks (N slots per store)
  and the int32 lengths.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax.numpy as jnp

from kivi_jax import formats
from kivi_jax.config import KiviConfig

QUANT_CAPACITY_MULTIPLE = 256  # Tq = max_len rounded up to this (docs/layout.md)

WEIGHT_BYTES_PER_PARAM = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


@dataclasses.dataclass(frozen=True)
class KVShape:
    """What sizes a KV cache: L layers, Hkv kv heads, D head dim, full-precision element bytes."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    def __post_init__(self):
        for name in ("num_layers", "kv_heads", "head_dim", "dtype_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

    @property
    def elements_per_token(self) -> int:
        """K and V elements per token over all layers: 2 L Hkv D."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim


@dataclasses.dataclass(frozen=True)
class CacheBytes:
    """Bytes of a cache as allocated (all layers, whole batch)."""

    codes: int  # quantized codes (0 for dense)
    scales: int  # scales and minimums (0 for dense)
    residual: int  # full-precision tensors: the residual windows, or the whole dense cache
    lengths: int  # int32 per row

    @property
    def total(self) -> int:
        return self.codes + self.scales + self.residual + self.lengths


def bits_per_element(shape: KVShape, config: KiviConfig | None) -> float:
    """Stored bits per cached K/V element in steady state (dense: 8 * dtype_bytes)."""
    if config is None:
        return 8.0 * shape.dtype_bytes
    config.check_head_dim(shape.head_dim)
    return config.bits_per_element(shape.head_dim)


def bytes_per_token(shape: KVShape, config: KiviConfig | None) -> float:
    """Steady-state bytes per token over all layers, K and V, scales included, residual not."""
    return shape.elements_per_token * bits_per_element(shape, config) / 8


def quantized_capacity(max_len: int) -> int:
    """Tq: tokens of code storage a quantized cache allocates for `max_len` tokens."""
    m = QUANT_CAPACITY_MULTIPLE
    return -(-max_len // m) * m


def cache_bytes(
    shape: KVShape, config: KiviConfig | None, *, tokens: int, batch: int = 1
) -> CacheBytes:
    """Bytes allocated for a cache of `batch` rows of `tokens` (= max_len) tokens each.

    Raises ValueError for non-positive tokens or batch, or a config that cannot take head_dim.
    """
    if not isinstance(tokens, int) or tokens <= 0:
        raise ValueError(f"tokens must be a positive integer, got {tokens!r}")
    if not isinstance(batch, int) or batch <= 0:
        raise ValueError(f"batch must be a positive integer, got {batch!r}")
    lh = shape.num_layers * batch * shape.kv_heads  # (layer, row, head) slices
    d = shape.head_dim
    lengths = 4 * batch
    if config is None:
        return CacheBytes(0, 0, 2 * lh * tokens * d * shape.dtype_bytes, lengths)
    config.check_head_dim(d)
    tq = quantized_capacity(tokens)
    g = config.group_size
    sides = ((config.key_format, config.key_bits), (config.value_format, config.value_bits))
    codes = sum(lh * tq * d * formats.code_bits(f, b) // 8 for f, b in sides)
    # every group of G elements: its codes, block scales and side values (kivi_jax.formats)
    stored = sum(
        lh * tq * d // g * formats.group_bits(f, b, g, config.scale_dtype) // 8 for f, b in sides
    )
    # outlier key channels: per group of G tokens, K channels of G values and K indices
    value_bytes = jnp.dtype(config.scale_dtype).itemsize
    stored += lh * (tq // g) * config.outlier_channels * (g * value_bytes + 1)
    slots = (
        residual_slots(config, config.key_axis)
        + residual_slots(config, config.value_axis)
        + 2 * config.sinks
    )
    residual = lh * slots * d * shape.dtype_bytes
    return CacheBytes(codes, stored - codes, residual, lengths)


def residual_slots(config: KiviConfig, axis: str) -> int:
    """Full-precision slots of one store: a per-channel store quantizes whole groups of G tokens,
    so it keeps max(R, G); a per-token store keeps the newest R."""
    r = config.residual_length
    return max(r, config.group_size) if axis == "channel" else r


def per_row_bytes(shape: KVShape, config: KiviConfig | None, tokens: int) -> int:
    """Bytes one more row (sequence) of `tokens` tokens adds."""
    return cache_bytes(shape, config, tokens=tokens, batch=1).total


def max_tokens(shape: KVShape, config: KiviConfig | None, budget: float, *, batch: int = 1) -> int:
    """The largest max_len whose cache of `batch` rows fits in `budget` bytes (0 if none)."""
    if budget <= 0:
        return 0
    if config is None:
        per = 2 * shape.num_layers * shape.kv_heads * shape.head_dim * shape.dtype_bytes
        return max(int((budget - 4 * batch) // (batch * per)), 0)
    m = QUANT_CAPACITY_MULTIPLE
    fixed = cache_bytes(shape, config, tokens=1, batch=batch)
    fixed_bytes = fixed.residual + fixed.lengths
    block = cache_bytes(shape, config, tokens=m, batch=batch)
    per_block = block.codes + block.scales  # bytes of m tokens of codes and scales
    return max(int((budget - fixed_bytes) // per_block) * m, 0)


def max_batch(shape: KVShape, config: KiviConfig | None, budget: float, *, tokens: int) -> int:
    """The most rows of `tokens` tokens whose cache fits in `budget` bytes (0 if none)."""
    if budget <= 0:
        return 0
    return int(budget // per_row_bytes(shape, config, tokens))


def llama_param_count(
    *,
    num_layers: int,
    hidden_size: int,
    intermediate_size: int,
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    vocab_size: int,
    tie_embeddings: bool,
) -> int:
    """Parameters of a Llama-family decoder (no biases; RMSNorm weights counted)."""
    attn = hidden_size * head_dim * (2 * num_heads + 2 * kv_heads)
    mlp = 3 * hidden_size * intermediate_size
    norms = 2 * hidden_size
    embed = vocab_size * hidden_size * (1 if tie_embeddings else 2)
    return num_layers * (attn + mlp + norms) + embed + hidden_size


def weight_bytes(params: int, weights: str) -> float:
    """Bytes of `params` weights stored as `weights` (bf16, fp16, fp8, int8, int4; no scales)."""
    if weights not in WEIGHT_BYTES_PER_PARAM:
        raise ValueError(
            f"weights must be one of {sorted(WEIGHT_BYTES_PER_PARAM)}, got {weights!r}"
        )
    return params * WEIGHT_BYTES_PER_PARAM[weights]


def parse_bytes(text: str) -> int:
    """'141GB' -> 141e9, '80GiB' -> 80 * 2**30, '1.5TB', '1000' (bytes). Decimal units are 10**3."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(
            f"memory size must look like '141GB', '80GiB' or a byte count, got {text!r}"
        )
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return int(value)


def format_bytes(n: float) -> str:
    """Decimal units with one decimal: 343597383680 -> '343.6 GB'."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"

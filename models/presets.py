"""Shapes of the Llama family: a frozen, hashable `ModelConfig` and named presets.

A preset with random weights is how benchmarks get big shapes; real weights come from
`models.loader.load_model`, which builds its `ModelConfig` from the checkpoint's metadata.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

RopeKind = Literal["llama3", "linear"]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling. kind="linear": every frequency divided by `factor`.

    kind="llama3" (Llama 3.1+): wavelengths longer than original_max_position_embeddings /
    low_freq_factor are divided by `factor`, shorter than .../high_freq_factor kept, and the band
    between interpolated smoothly.
    """

    kind: RopeKind
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.kind not in ("llama3", "linear"):
            raise ValueError(f"rope scaling kind must be 'llama3' or 'linear', got {self.kind!r}")
        if not self.factor > 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor!r}")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                "llama3 rope scaling needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static architecture of a Llama-family decoder. Frozen and hashable (a jit static arg).

    Hq = num_heads, Hkv = num_kv_heads (grouped-query attention when Hkv < Hq), D = head_dim.
    qkv_bias: q/k/v projections carry a bias (Qwen2). tie_embeddings: the output projection is
    the transposed token embedding (SmolLM2, Llama-3.2-1B).
    """

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int = 4096

    def __post_init__(self):
        for f in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelConfig.{f} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary pairs), got {self.head_dim}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"rope_scaling must be None or a RopeScaling, got {type(self.rope_scaling)}"
            )

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        d, f, dh = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * dh, self.num_kv_heads * dh
        attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_bias else 0)
        layer = attn + 3 * d * f + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.num_layers * layer + emb + d

    def kv_bytes_per_token(self, itemsize: int = 2) -> int:
        """Bytes of one token's K and V over all layers in a dense cache of `itemsize` bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


_LLAMA31_SCALING = RopeScaling(
    "llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)

PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        name="smollm2-135m",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_embeddings=True,
        max_position_embeddings=8192,
    ),
    "llama-2-7b": ModelConfig(
        name="llama-2-7b",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        head_dim=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
    ),
    # Llama 3.1 shapes (the 3.0 shapes plus llama3 rope scaling and a 128k window), so that the
    # long-context benchmarks stay inside the model's trained positions.
    "llama-3-8b": ModelConfig(
        name="llama-3-8b",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        rope_scaling=_LLAMA31_SCALING,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
    ),
    "llama-3-70b": ModelConfig(
        name="llama-3-70b",
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        rope_scaling=_LLAMA31_SCALING,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
    ),
    # Mistral-7B-Instruct-v0.2 (no sliding window, theta 1e6), the KIVI LongBench model.
    "mistral-7b": ModelConfig(
        name="mistral-7b",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=32768,
    ),
    "qwen2.5-7b": ModelConfig(
        name="qwen2.5-7b",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        qkv_bias=True,
        max_position_embeddings=32768,
    ),
}

ALIASES: dict[str, str] = {
    "smollm2": "smollm2-135m",
    "smollm2-135m-instruct": "smollm2-135m",
    "llama2-7b": "llama-2-7b",
    "llama3-8b": "llama-3-8b",
    "llama-3.1-8b": "llama-3-8b",
    "llama3-70b": "llama-3-70b",
    "llama-3.1-70b": "llama-3-70b",
    "mistral": "mistral-7b",
    "qwen2.5": "qwen2.5-7b",
    "qwen2.5-7b-instruct": "qwen2.5-7b",
}


def canonical_name(name: str) -> str:
    """The PRESETS key for `name` or one of its aliases (case-insensitive)."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in PRESETS:
        raise ValueError(
            f"unknown model {name!r}; valid presets: {', '.join(sorted(PRESETS))} "
            f"(aliases: {', '.join(sorted(ALIASES))})"
        )
    return key


def get_preset(name: str) -> ModelConfig:
    """The preset `ModelConfig` named `name` (aliases such as "smollm2" accepted).

    Raises ValueError listing the valid names for an unknown name.
    """
    return PRESETS[canonical_name(name)]

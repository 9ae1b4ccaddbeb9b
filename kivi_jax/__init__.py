"""kivi-jax: KIVI 2/4-bit KV-cache quantization for JAX (arXiv 2402.02750)."""

from kivi_jax import formats, mixed, rotation
from kivi_jax.attention import (
    chunk_attention,
    compiler_options,
    decode_attention,
    merge_partials,
)
from kivi_jax.cache import (
    CACHE_NAMES,
    DENSE_NAMES,
    CacheBytes,
    DenseCache,
    KiviCache,
    QuantizedStore,
    cache_config,
    check_capacity,
    make_cache,
)
from kivi_jax.config import KiviConfig
from kivi_jax.mixed import MixedCache, layer_configs, parse_layers
from kivi_jax.parallel import (
    sequence_parallel_append,
    sequence_parallel_attention,
    sequence_parallel_extend,
    sequence_parallel_prefill,
)
from kivi_jax.quant import (
    QuantizedTensor,
    dequantize,
    pack,
    quantize,
    quantize_keys,
    quantize_values,
    unpack,
)

__all__ = [
    "CACHE_NAMES",
    "DENSE_NAMES",
    "CacheBytes",
    "DenseCache",
    "KiviCache",
    "KiviConfig",
    "MixedCache",
    "QuantizedStore",
    "QuantizedTensor",
    "cache_config",
    "check_capacity",
    "chunk_attention",
    "compiler_options",
    "decode_attention",
    "dequantize",
    "formats",
    "layer_configs",
    "make_cache",
    "merge_partials",
    "mixed",
    "pack",
    "parse_layers",
    "quantize",
    "quantize_keys",
    "quantize_values",
    "rotation",
    "sequence_parallel_append",
    "sequence_parallel_attention",
    "sequence_parallel_extend",
    "sequence_parallel_prefill",
    "unpack",
]
__version__ = "0.1.0"

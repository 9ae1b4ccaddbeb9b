"""Fused KIVI 2/4-bit dequantization + decode attention for Hopper (sm_90), Pallas Mosaic GPU.

One query token per row attends to the quantized part of a KIVI cache (docs/layout.md) of one
layer; the codes are unpacked in registers and both products run on tensor cores. The public
surface:

    kivi_decode(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, num_tokens, layer, *,
                key_bits, value_bits, group_size, sm_scale, tuning=None, interpret=False,
                low_precision=False, windows=None, max_len=0, skip=0, sinks=None,
                out_dtype=float32)
                -> (o [B, Hq, D] in out_dtype, lse [B, Hq] f32)
    kivi_decode_reference(...)   the same call in float32 jnp (the kernel's twin)
    TuningConfig, choose_tuning  the launch configuration and its per-shape choice
    call_tuning                  the launch a call left to choose runs (windows in or out)

Modules: `config` (the tuning and the per-launch `Plan`), `kernel` (the body, stage by stage),
`decode` (the call around it), `reference` (the twin); the register-level fragments are in
`pallas_kernels.sm90`. docs/kernel.md describes the design.
"""

from pallas_kernels.kivi_decode.config import (
    MAX_PADDED_HEADS,
    SMEM_LIMIT,
    SUPPORTED_BITS,
    SUPPORTED_GROUPS,
    SUPPORTED_HEAD_DIMS,
    TuningConfig,
    call_tuning,
    choose_tuning,
)
from pallas_kernels.kivi_decode.decode import kivi_decode
from pallas_kernels.kivi_decode.reference import kivi_decode_reference

__all__ = [
    "MAX_PADDED_HEADS",
    "SMEM_LIMIT",
    "SUPPORTED_BITS",
    "SUPPORTED_GROUPS",
    "SUPPORTED_HEAD_DIMS",
    "TuningConfig",
    "call_tuning",
    "choose_tuning",
    "kivi_decode",
    "kivi_decode_reference",
]

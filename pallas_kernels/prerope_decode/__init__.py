"""Fused decode attention over KIVI caches of keys quantized before RoPE, for Hopper (sm_90),
Pallas Mosaic GPU.

One query token per row attends to the quantized slots of one layer of an integer KIVI cache
(2- or 4-bit codes, keys per channel, values per token) whose keys were quantized before RoPE
(`KiviConfig.pre_rope`): each 64-slot plane of keys is dequantized in registers, taken to the
model's basis (the byte swap undone, a Hadamard rotation too) and rotated by RoPE at its
positions, then both products run on tensor cores:

    prerope_decode(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, num_tokens, layer,
                   inv_freq, key_basis=None, *, key_bits, value_bits, group_size, sm_scale,
                   basis_scale=1.0, skip=0, origin=0, windows=None, sinks=None, max_len=0,
                   splits=None, stages=STAGES, interpret=False)
        -> (o [B, Hq, D] float32, lse [B, Hq] float32)
    prerope_decode_reference(...)    the same call in float32 jnp (the kernel's twin)
    choose_splits                    the token splits a call left to choose runs
    takes_windows, takes_sinks       whether the launch attends a cache's residual windows and
                                     sink buffers itself (one more unit per row and kv head)

Modules: `kernel` (the body, stage by stage, and the call around it), `reference` (the twin).
docs/kernel.md ("The pre-RoPE kernel") describes the design.
"""

from pallas_kernels.prerope_decode.kernel import (
    MAX_GROUP_HEADS,
    STAGES,
    SUPPORTED_BITS,
    SUPPORTED_GROUPS,
    SUPPORTED_HEAD_DIMS,
    choose_splits,
    prerope_decode,
    takes_sinks,
    takes_windows,
)
from pallas_kernels.prerope_decode.reference import prerope_decode_reference

__all__ = [
    "MAX_GROUP_HEADS",
    "STAGES",
    "SUPPORTED_BITS",
    "SUPPORTED_GROUPS",
    "SUPPORTED_HEAD_DIMS",
    "choose_splits",
    "prerope_decode",
    "prerope_decode_reference",
    "takes_sinks",
    "takes_windows",
]

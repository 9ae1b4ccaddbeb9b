"""Fused fp8 (E4M3) decode attention for Hopper (sm_90), Pallas Mosaic GPU.

One query token per row attends to the quantized slots of one layer of an fp8 cache: keys and
values both per token, each block of G channels of a token one scale (`kivi_jax.formats`). The
elements stay fp8 in HBM and in the copies to shared memory; each 64-token tile is widened to
fp16 there (the conversion sm_90 has) and both products run on tensor cores:

    fp8_decode(q, k_codes, k_scale, v_codes, v_scale, num_tokens, layer, *, group_size,
               sm_scale, splits=None, stages=STAGES, interpret=False)
        -> (o [B, Hq, D] float32, lse [B, Hq] float32)
    fp8_decode_reference(...)    the same call in float32 jnp (the kernel's twin)
    choose_splits                the token splits a call left to choose runs

Modules: `kernel` (the body, stage by stage, and the call around it), `reference` (the twin).
docs/kernel.md ("The fp8 kernel") describes the design.
"""

from pallas_kernels.fp8_decode.kernel import (
    MAX_GROUP_HEADS,
    STAGES,
    SUPPORTED_GROUPS,
    SUPPORTED_HEAD_DIMS,
    TILE,
    choose_splits,
    fp8_decode,
)
from pallas_kernels.fp8_decode.reference import fp8_decode_reference

__all__ = [
    "MAX_GROUP_HEADS",
    "STAGES",
    "SUPPORTED_GROUPS",
    "SUPPORTED_HEAD_DIMS",
    "TILE",
    "choose_splits",
    "fp8_decode",
    "fp8_decode_reference",
]

"""Fused KIVI 2/4-bit dequantization + decode attention, Pallas Mosaic GPU, Hopper (sm_90).

One query token per row attends to the quantized part of a KIVI cache (docs/layout.md) of one
layer. Grid: (B, Hkv, num_splits) thread blocks, one warpgroup each (flash-decoding): block
(b, h, s) streams the s-th slice of the token axis through a TMA pipeline, unpacks the codes in
registers and runs both products on tensor cores with the 64 cached tokens (or channels) of a
plane on M and the padded query heads of the KV group on N:

    S^T[t, n]  = Khat[t, :] . q'[n, :]            (M = 64 tokens, K = D, N = heads)
    O^T[d, n] += Vhat^T[d, t] . P[n, t]            (M = 64 channels, K = 64 tokens, N = heads)

Partial (o, lse) of the splits are merged by log-sum-exp in a small jnp epilogue.

This module holds the launch configuration (`TuningConfig`, `choose_tuning`), the kernel body
(`_make_kernel`), its wrappers and the jnp twin (`kivi_decode_reference`); the register-level
building blocks it composes (the code fields, the mma.sync fragments, the reductions, the TMA
pipeline: inline Mosaic GPU, most of the underscored helpers named below) are in
`pallas_kernels/sm90_fragments.py`.

The tensor-core instruction (`TuningConfig.mma_sync`, docs/performance.md runs 38-44): by
default both products run as warp-level mma.sync (`plgpu.mma`, m16n8k16: each warp its 16 rows
of the 64-row tile, both operands in registers), which on the H200 retires this N = 8 tile in
about half the SM time of wgmma with A in registers (~20 clocks per m64n8k16 whatever N, runs
19-21): 2-bit G=128 at B=8 T=128k 0.350 -> 0.281 ms. The A tiles are built in the WGMMA
register fragment, which holds the same elements per thread as mma.sync's (`_as_mma_lhs`
relabels the registers); B (q, or P after a warpgroup barrier) is loaded from SMEM into
registers. wgmma remains for the 8-bit value product (fp8 mma.sync gains no K per clock over
fp16 mma.sync, while 8-bit wgmma doubles K) and with `mma_sync=""`; the text below says wgmma
for both.

On mma.sync the default takes no dequantization at all beyond one `and` per element pair
(docs/performance.md runs 46-51; 2-bit G=128 at B=8 T=128k 0.286 -> 0.257 ms with W = 4): the
code bytes are widened without exponent bits, so that a code field masked in place is the fp16
*subnormal* code * 2^(bits*j - 24) (`_field_sub`, exact, no offset; tensor cores take fp16
subnormals as they are). Keys (`fold_k`, `kfold_scores`): B = fp16(q * s_g) is one fp16x2
multiply per register of q's B operand (`_scale_rhs`) per group of the warp's rows (one per
256-token block at G >= 64 in the cache order, two at G = 32), q . z_g comes from one more
mma.sync per two such groups (`_rows_of`: rows 0-7 one group's minimums, rows 8-15 another's),
and the scores are acc * 2^(24 - bits*j) + q . z_g. Values (`subnormal_values`): B = P * s_t *
2^(14 - bits*j) against a running max over logit + log2 s_t (`val_prep`, as fp8_values does),
which weighs every plane's codes alike. At 2-bit G < D, where a token's channels span several
value groups, each warp takes the channels of one group (`fold_v_warp`, with its scale and
minimum vectors by 64-bit loads, `vec64`; runs 97-99: 2-bit G=32 at the anchor 0.272 -> 0.248
ms): B = P * s_{g_w,t} per warp and z . P from one more mma.sync per plane. The magic-number
fields below remain for wgmma and the opt-outs.

Around the products (runs 52-55; 2-bit G=128 0.249 -> 0.231 ms): a 256-token sub-step passes
two warpgroup barriers, the cross-warp max's (`_wg_max_open`) and the one before P is read
(`_wg_sync`); the kernel streams its blocks through its own pipeline (`_pipeline`) compiled
without Mosaic's auto barriers (`_no_auto_barriers`), so a step's six TMA copies share one
barrier, and one warp per warpgroup issues them (`copy_warp`, runs 68-72: 1-6% at the
anchor's 2-bit and 4-bit launches; with four warpgroups and unpacked planes the slots go back
to that warp through an mbarrier, `release_slots`; with three the copies are dealt over the
four warps, `spread_copies`, runs 73-76: 1-2%); at 2-bit G=128 with four warpgroups the
cross-warp max leaves the common sub-step (`lazy_max`, runs 132-136: the running max lags by
at most a slack, P's barrier ORs whether a score passed it, and only then is the max exchanged
and P redone; 3-6% at the anchor); the ragged-length mask runs only on a
row's last sub-step; P is transposed in registers (`movmatrix`) and stored as 32-bit words
(`_store_p_perm`).

The per-warp softmax (`TuningConfig.warp_softmax`, runs 59-65; `choose_tuning` takes it in
one-warpgroup blocks over 16 or more steps per split: 4-bit G=128 at B=8 T=128k 3-6% faster):
each warp keeps the online softmax of its own key rows (16 tokens per plane: `_warp_max`, three
shuffles) and computes the value product over those tokens for all D channels, P going from
the score registers into mma.sync's B operand by `movmatrix` (`_warp_rhs`) and the value code
bytes of its tokens loaded per warp (`_warp_value_codes`): no cross-warp hand-over in the loop.
The warps' partial outputs are merged once per split, in a fixed order (`_merge_warp_rows`).

Dequantization is elementwise in fp16 registers, right before the wgmma that consumes the tile:
the code bytes of a (64, X) tile are loaded from SMEM (swizzled by the TMA) in the 8-bit WGMMA
fragment layout and widened by one `prmt` per fp16 pair that also sets the five exponent bits
(`_widen8`); a code field is then an fp16 value by the magic-number trick (and-ing the field's
mask plus the exponent of 2^(10 - bits*j), whose unit in the last place is then exactly 1),
one exact subtraction, and one multiply-add with the group's scale and minimum: three
instructions per fp16 pair and plane (SASS, docs/performance.md runs 8-9); with the value scale
folded into P (G = D, below) the value fields take the `and` alone. The 8-bit fragment
delivers the columns of every 16-block in the `_PERM16` order, so both contraction axes are
permuted consistently: q's channels outside the kernel, P's tokens by the store that makes it
the B operand, scale vectors by their loads. The cache order (docs/layout.md) gives warp w the
16-token runs 64 w + 16 p + (0..15) of a 256-token block's planes p, so the rows of a 64-row
key tile lie in up to four key groups, one per warp: each warp loads the vectors of its own
(`_warp_groups`, `_vec_load` with rows). Both are inline Mosaic GPU and do not interpret: under
the interpreter the kernel widens with jnp (natural order) and selects the group per 16-row
block, the same function. Opt-in TuningConfig flags (off by default; measured on
the H200 in docs/performance.md, runs 6 to 9, none faster than this default):
`reload_codes` and `lean_values` keep fewer tiles live, `k_chunks` splits the key product over
the head dim, `sub_tokens` sets the tokens per softmax update.

Folded scales with the magic-number fields (the wgmma products; on mma.sync the subnormal fields
above): `fold_v` at G = D, on by default; `fold_k` at G >= 128, opt-in (measured slower,
docs/performance.md runs 13-14). Where the group structure leaves few distinct scale vectors per
sub-step, the scale goes into the other operand instead of into every element: keys, B = fp16(q *
s_g) per token group (at most two per 256-token sub-step); values, B = fp16(P * s_t) per token. A
code field then enters wgmma as the fp16 number 2^(10 - bits*j) + code (one `and` per element pair
and plane, no subtraction, no fma), and the field offsets and the minimums become per-row biases,
computed in f32 from the same rounded fp16 operands wgmma reads so that the offsets cancel up to
f32 rounding: keys, q . z_g - 2^(10 - bits*j) * sum_c fp16(q * s_g)_c per group and plane, added to
the scores; values, the offsets' sum_t subtracted after every sub-step (the accumulator never
carries them across steps) and sum_t P * z_t added at the end. |q * sm_scale * log2(e) * s| must
stay below 65504 (fp16 operand). `kivi_decode_reference` computes the same function in float32 in
the folded form (scales into q / p, minimums as biases), so kernel and twin are two different
factorizations of one formula.

fp8 value product (`fp8_values`, opt-in, G = D; docs/performance.md runs 24-30): the value code
field masked in place is an e4m3 subnormal (byte b <= 15 reads as b * 2^-9), so A takes one
`and` per four codes and no offset; B = e4m3(P * s_t * 256 / w), kept <= 256 by taking the
softmax's running max over logit + log2 s_t (logits in log2 units in this mode). Hopper's fp8
wgmma accumulates with ~14 significant bits, so each sub-step's product goes into fresh
accumulators, added in f32. The twin models the rounding against the kernel's own running max
(`kivi_decode_reference(..., fp8_values=True, tuning=...)`). With the keys exact on mma.sync
this is `kivi_decode(..., low_precision=True)` (2-bit G=128 0.260 ms, 4-bit 0.310 ms at B=8
T=128k, run 40: faster than int8 and fp8 products both on wgmma, 0.270 / 0.325 ms). The int8
key product (runs 21-28) was removed in stop 19: the cache order puts two key groups in a
64-row plane at G = 128, which one wgmma B operand per group cannot serve.

Warpgroups per block (`wg_per_block`): W > 1 puts W independent (b, h, split) units in one
block, each warpgroup with its own pipeline (`_pipeline`), SMEM and reduction scratch
(`_wg_reduce`), so that ptxas caps registers at 65536 / (128 W) (W = 3: 168, W = 4: 128) and
an SM holds W warpgroups; the default for 2-bit caches at large B * Hkv * T (measured,
`choose_tuning`: W = 4 at G = 128, W = 3 at G = 32). What bounds the 2-bit kernel now (runs
113-115): the H200's 700 W power cap. Its compute alone and its load pipeline alone each run
at 1980 MHz well under the cap; both at once draw the limit and the SM clock falls to ~1800
MHz, so the time is the instructions per step at that clock, and energy per step is the lever:
with packed planes the padding halves of both products' B are zero (`pack_zeros`: back to back
1800 -> 1860 MHz, 2% faster at 2-bit G=128).

Query heads: the Hq/Hkv heads of a KV group are padded to N = 8 (multiple of 8, at most 256)
and scaled by sm_scale * log2(e) (logits in log2 units) in float32 before the cast to fp16:
bf16 queries work as long as |q * sm_scale * log2(e)| < 65504, and with the key scale folded
(fold_k, the default on mma.sync) as long as |q * sm_scale * log2(e) * s_g| < 65504.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.sm90_fragments import (
    _CACHE_BLOCK,
    _MAX_CLUSTER,
    _RESCALE_SLACK,
    _VSUB_C,
    _VW_C,
    _WG,
    _WSM_MIN_STEPS,
    PLANE,
    _bias_rows,
    _code_field8,
    _code_field8_reference,
    _copy_stamp,
    _dense_rows,
    _exceed_barrier,
    _f8_field_spec,
    _field_offset,
    _field_raw,
    _field_sub,
    _field_sub_weight,
    _field_to_f16,
    _group_min_mma,
    _group_vecs,
    _halves,
    _halves_const,
    _lazy_rescale,
    _merge_splits,
    _merge_warp_rows,
    _mma,
    _mma_rhs,
    _natural_bytes,
    _pipeline,
    _plane_tokens,
    _q_tile,
    _red_scratch,
    _row_half,
    _row_halves_load,
    _rows_of,
    _scale_rhs,
    _stamp,
    _store_bias_rows,
    _store_p_perm,
    _swap_halves,
    _swz,
    _warp_group_sum,
    _warp_groups,
    _warp_max,
    _warp_rhs,
    _warp_sync,
    _warp_value_codes,
    _warp_vec_load,
    _wg_max_open,
    _wg_reduce,
    _wg_sync,
    _widen8,
    _widen_codes,
    _zero_smem,
    permute_contraction,
)

SUPPORTED_BITS = (2, 4)
SUPPORTED_GROUPS = (32, 64, 128)
SUPPORTED_HEAD_DIMS = (64, 128)
MAX_PADDED_HEADS = 256  # wgmma N limit
SMEM_LIMIT = 223 * 1024  # H200: 227 KiB per block, less a margin for Mosaic's own scratch
_WGT = plgpu.Layout.WGMMA_TRANSPOSED
_MMA_DTYPE = jnp.float16  # fp16 wgmma operands: 3 more mantissa bits than bf16 for the codes


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Static launch parameters of `kivi_decode`.

    block_tokens: tokens per TMA copy step (a multiple of 256, a block of the cache order, and
      of G); steps above 256 tokens are computed in 256-token sub-steps.
    num_splits: thread blocks per (b, h) along the token axis (flash-decoding).
    stages: TMA steps in flight.
    swizzle_codes: keep the code tiles swizzled in SMEM.
    overlap: dequantize plane p+1 while plane p's wgmma runs (wait(1) instead of wait(0)).
    p_direct: store P^T in the accumulator layout (N padded to 16 for the 32-byte swizzle)
      instead of transposing it through shuffles (N padded to 8).
    p_concat: transpose the P tiles of all planes of a sub-step in one store.
    skip: benchmark-only ablation: "" for the real kernel, "compute" keeps only the load
      pipeline, "values" drops the value product, "loads" computes every step on one of the
      split's first two blocks (the copies then hit L2: the compute floor), "copies" (the
      kernel's own pipeline only) computes every step on the slots the prologue filled,
      without copies or barrier waits in the loop (the compute floor without the copies'
      issue), "groups" (fold_k on mma.sync) scales every plane of a step by its first
      plane's per-warp key vectors (one group per warp and step: at G >= 64 what the kernel
      does anyway, at G = 32 one instead of two; wrong numbers there, the cost), "bias"
      (fold_k on mma.sync, native) drops the key bias q . z_g (its vector loads and mma;
      wrong numbers: its cost).
    trace: diagnostics (native only; `bench/tail_probe.py`): the last three columns of each
      unit's lse partial hold, instead of the log-sum-exp, the unit's start and end
      %globaltimer_lo in ns mod 2^24 (the end taken before its outputs' copy-out) and its SM
      id, as float32; the kernel is otherwise unchanged. Needs three padded query-head
      columns (at most NP - 3 query heads per kv head).
    fold_k: fold the key scale into q per token group, with the key product on mma.sync
      (`_folds_keys_mma`, any G; `choose_tuning` turns it on there; ignored with the keys on
      wgmma): code fields as fp16 subnormals, B = fp16(q * s_g) per register and warp (each
      warp's rows of a 256-token block lie in one group, G >= 64, or two, G = 32: the cache
      order), q . z_g by mma.sync (`kfold_scores`; run 46: 2-bit G=128 0.286 -> 0.264 ms,
      4-bit 0.357 -> 0.340, G=32 even). |q * sm_scale * log2(e) * s_g| must stay below 65504
      (an fp16 operand). (The wgmma variant through SMEM, slower in run 14, was removed in stop
      19 with the cache order: a 64-row plane then spans two groups at G = 128.)
    reload_codes: load each code byte tile from SMEM for every plane that uses it instead of
      keeping it in registers across the 8/bits planes it holds (fewer live registers, more
      SMEM loads).
    fold_v: fold the value scale into P per token where a token has one channel group (G = D;
      on by default, ignored otherwise): a value code field enters wgmma as the fp16
      number 2^(10 - bits*j) + code (one and per element pair, no subtraction, no fma), B is
      P * s_t (`_fold_values`); the offsets' sum 2^(10 - bits*j) * sum_t P * s_t is
      subtracted from the accumulator after every sub-step (so it never grows across steps)
      and the minimums' sum_t P * z_t is accumulated elementwise in f32 and added at the end.
      Costs precision: at 2 bits the output error against the f32 twin grows from ~4e-5 to
      ~6e-4 of max |o| (independent of the context length; docs/performance.md run 16).
    lean_values: in the value product wait after each 64-channel tile's wgmma until at most one
      is in flight (at most two dequantized V tiles live instead of 2 * D/64).
    k_chunks: split the key product over 1 or 2 chunks of D (K = D / k_chunks per wgmma; D = 64
      and a folded key product: always 1): a chunk's code bytes, scale and minimum vectors and
      dequantized tiles are live at a time instead of the whole head dim's (fewer registers,
      twice the wgmmas).
    sub_tokens: tokens per compute sub-step (256 or 512; at most block_tokens): one softmax
      update (cross-warp max, P through SMEM) per sub-step.
    warp_groups: a 64-row tile over several groups (keys: whenever G < 256, the cache order;
      values: G < 64 channels): each warp loads the scale and minimum vectors of its own group
      (`_vec_load`) instead of every group's vectors and a select per element. On by default;
      the interpreter always takes the selects.
    widen8: widen code bytes from the 8-bit fragment layout with one byte permute per fp16
      pair (`_widen8`): the contraction axes come out permuted within 16-blocks (`_PERM16`),
      matched by q permuted outside the kernel and P stored permuted; code tiles swizzled in
      SMEM. Native only (not with p_direct, p_concat, k_chunks=2), and natively required: it is
      what undoes the cache's stored byte order (`kivi_jax.quant.swap_bytes`), so the
      natural-order options (widen8=False, p_direct, p_concat, k_chunks=2) run only under the
      interpreter (`_kernel_call` raises NotImplementedError otherwise).
    fp8_values: the value product on fp8 tensor cores (wgmma K = 32: half the value wgmmas) at
      G = D, opt-in: A = the value code field as an e4m3 *subnormal* straight from the code
      bytes (byte b <= 15 is the e4m3 number b * 2^-9, so a field masked in place is
      code * weight * 2^-9: one and per four elements, one shift per word for the upper
      nibble, no offset), B = e4m3(P * s_t * 2^8 / weight). P * s_t stays <= 1 because the
      softmax's running max is taken over logit + log2 s_t (logits in log2 units; `val_prep`:
      P = B * weight / (256 s_t) for the sum and the minimums' term, one fma each). Each
      sub-step's product gets fresh accumulators (Hopper's fp8 accumulation keeps ~14 bits).
      Costs precision: B carries 4 significant bits (see docs/performance.md; the twin models
      it with `fp8_values=True`). Replaces fold_v.
    wg_per_block: warpgroups per thread block, each streaming its own (b, h, split) with its
      own TMA pipeline (`_pipeline`), SMEM and cross-warp reduction scratch (`_wg_reduce`).
      The point is the register cap: ptxas fits a block of W warpgroups in the register file
      (W = 3: 168 registers per thread, W = 4: 128, against 235 unconstrained), so an SM
      holds W warpgroups instead of the two that 235 registers allow. 1: one warpgroup per block
      through `plgpu.emit_pipeline`.
    mma_sync: which products run as warp-level mma.sync (`plgpu.mma`: each warp one m16n8k16
      or m16n8k32 per 16 rows of the 64-row tile) instead of wgmma: "" (none), "keys",
      "values" or "both". Both operands in registers: the B operand (q, q * s_g, P) is loaded
      from SMEM into registers (q once per split); P's hand-over between warps is a
      warpgroup barrier.
    subnormal_values: with fold_v and the value product on mma.sync, the value code fields
      enter as fp16 subnormals (`_field_sub`: code * 2^(bits j - 24), one and per element pair
      and no offset to subtract) and B = P * s_t * 2^(14 - bits j), taken against a running
      max over logit + log2 s_t as fp8_values does (`val_prep`), weighs every plane's codes
      alike. Off: the run-40 fold_v (fields with their offsets, whose sum is subtracted every
      sub-step through a cross-warp reduction).
    warp_softmax: with both products on mma.sync and the value scale folded into P
      (subnormal_values, G = D), each warp runs its own online softmax and value product over
      the tokens of its key rows (`_warp_softmax`): P stays in registers (`_warp_rhs`), the
      value codes are loaded per warp (`_warp_value_codes`), and the loop has no cross-warp
      max and no P hand-over; the warps' partial outputs are merged once per split
      (`_merge_warp_rows`). Native only, 256-token steps. `choose_tuning` turns it off with
      several warpgroups per block and below 16 steps per split (measured slower there, runs
      59-65).
    lazy_rescale: with warp_softmax, rescale a warp's accumulators only when its running max
      grows by more than _RESCALE_SLACK (`_lazy_rescale`); exact either way. Natively also in
      the shared softmax (several warpgroups per block), where the max is the warpgroup's, on
      the value paths whose B bound takes the slack (the subnormal value fold, the exact
      dequantization; not fp8 values, fold_v_warp or the run-40 fold).
    copy_warp: one warp of each warpgroup issues its TMA copies (`_pipeline`'s one_warp)
      instead of all four; one-warpgroup blocks then take the kernel's own pipeline, compiled
      without auto barriers where `_no_auto_barriers` allows, in place of plgpu.emit_pipeline
      (run 68: 2-bit G=128 with four warpgroups 2.5-4% faster, G=32 with three even to 1%;
      run 72, one warpgroup: 4-bit G=128 at B=8 T=128k 2.5-6%, B=1 T=128k 4-10%, B=1 T=8k
      even). Native only.
    release_slots: with copy_warp in a kernel without auto barriers, a slot is handed back to
      the issuing warp by an mbarrier every thread arrives on (only that warp waits) instead
      of a warpgroup barrier before the step's copies (`choose_tuning` took it with four
      warpgroups per block: run 69, 1-2.5% faster; with three even to 2.5% slower; with the
      packed planes it no longer pays, runs 96-98, and is off there). Native only.
    spread_copies: with copy_warp, a step's copies are dealt over the warpgroup's four warps
      (copy j from warp (issuer + j) % 4) instead of all issued by one: the warps meet at
      barriers every step, so the issuing warp's extra work (each copy's coordinates in
      uniform registers, its arrival) lengthens every warp's step. Native only.
    vec64: the key scale and minimum vectors of fold_k loaded two registers per 64-bit load
      (`_pairs64`) instead of one per 32-bit load; with fold_v_warp, also its per-warp value
      scale and minimum vectors (`_warp_vec_load`'s wide). Alone even (run 98); with
      fold_v_warp the pair that makes it pay (below).
    fold_v_warp: with the value product on mma.sync and several channel groups per token (G <
      D, where fold_v does not apply), fold the value scale into each warp's B operand: warp w
      takes the channels (D/4) w .. (D/4) (w + 1) - 1 of the value tiles (`_widen8` with
      warp_rows), which lie in one group g_w (G >= D/4), so its B is fp16(P * s_{g_w,t})
      (one fp16x2 multiply per register, `_scale_rhs`), the code fields enter as fp16
      subnormals (`_field_sub`: one and per element pair, no offset, no scale, no minimum),
      and q . z becomes sum_t z_{g_w,t} P_t: one more mma.sync per plane and warp over the
      warp's own 16 tokens whose A rows are the minimums of every group (`_group_min_mma`),
      the four warps' partials added once per split (`_warp_group_sum`). P is stored as P *
      2^(_VW_C - bits j) so that the subnormal fields of every plane weigh alike; B stays
      finite while s * P * 2^_VW_C < 65504, i.e. value scales below 4096 (a 2-bit group
      spanning 12288, a 4-bit one 61440). The output rows come out in that channel order and
      are put back by `_kivi_decode`. Native only.
      With 32-bit vector loads it was slower (run 90: 2-bit G=32 at the anchor 0.2961/0.2899
      -> 0.3029/0.3023 ms; run 91's profile: the HADD2/HFMA2 of the value dequantization gone,
      256 per step and warp, but 88 more LDS and 106 more IMAD; run 97 even); with vec64 it
      pays: 2-bit G=32 at the anchor 0.2716/0.2722/0.2716/0.2736 -> 0.2463/0.2500/0.2478/
      0.2503 ms (runs 97-98), 1-9% over (B, T) at 2-bit, mixed at 4-bit (-2.4..+8%), so
      `choose_tuning` sets both at 2-bit G < D (docs/performance.md runs 97-98).
    pack_planes: at most four query heads per kv head (mma's N = 8 then half padding), two
      planes per score tile: q's heads are duplicated into the padding columns 4-7, both
      planes' keys go against the same B = q * s_g, and the tile takes columns 0-3 of plane
      2t's product and 4-7 of plane 2t + 1's (`_halves`: one select per register), each half
      with its field's weight in the score epilogue; log2 s_t and the other per-token terms
      are computed once per tile (`_halves` with rows). The
      softmax (score epilogue, log2 s_t, max, exp2, running sums, P's conversion and store) runs
      once per tile instead of once per plane; P of a tile is the value product's B for both
      planes, whose products go to two accumulator sets (even, odd planes) with the valid halves
      added at the end (`_swap_halves`). With fold_v_warp (natively) a tile's B is scaled
      once for both planes (lanes 16-31, B's columns 4-7, load plane 2t + 1's value scales)
      and both planes' minimums' terms come from one mma (rows g + 8 of its A the odd
      plane's). With fold_k, both products on mma.sync, not with the per-warp softmax, fp8
      values or the run-40 value fold. The interpreter runs it too (its SMEM staging is for
      wgmma operands only; without fold_v_warp, which is native only). choose_tuning sets it
      at 2 bits (run 92: G=128 3-4% faster at the anchor; run 109, with fold_v_warp over the
      blocked value codes: G=32 2.5-4%).
    pack_zeros: with pack_planes, the padding columns of the key product's B and of the value
      product's B stay zero instead of repeating live data: q is not repeated into columns 4-7,
      so both planes' key products land in columns 0-3, the odd plane's moved to 4-7 by one
      shuffle per register (`_swap_halves`) and added (in place of `_halves`' select), as is
      the key bias; and a score tile's P is stored as two planes' B tiles (columns 0-3 of P^T
      to plane 2t's rows 0-3, columns 4-7 to plane 2t + 1's, `_store_p_perm` with split; their
      rows 4-7 zeroed once per split, `_zero_smem`), so every plane's value product runs
      against its own B in one accumulator set (half the accumulators, no swap at the end) at
      twice the B loads (not with fold_v_warp, whose scaled B and minimums' product take the
      packed tile). The same
      numbers; what changes is power: the kernel runs at the H200's 700 W cap, and the
      tensor cores spend less energy multiplying zeros than live data (run 114: zeroing those
      halves by selects raised the SM clock at the cap from 1800 to 1920 MHz).
    dense_bias: with fold_k on mma.sync, the key bias q . z_g of 16 key groups at once
      (`_dense_bias`): a 16-group block of the key minimums is copied (one TMA, its own
      barrier, single-buffered: refilled once every warp has read it) every 16 G / 256 steps,
      each warp takes all 16 groups in the rows of one mma.sync per 16 channels
      (`_dense_rows`: 8 per block at D = 128, instead of 8 per step and warp of which only
      rows 0-7 of one or two groups are used), stores the (16, N) products to its own SMEM
      rows (`_store_bias_rows`) and reads the row of its group at every step (`_bias_rows`:
      one 64-bit load). The key minimums then leave the step's copies. The same numbers
      (the same products in the same order). Native only, one sub-step per copy step, at
      least 16 groups in the cache. At 2-bit G=128 with four warpgroups 1.0-1.9% faster
      back to back at the power cap, even in bursts (runs 118-119; 760 -> ~724 instructions
      per step); at G = 32, whose block spans two steps, 5% slower: `choose_tuning` sets it
      at 2-bit G = 128 with four warpgroups.
    merge_splits: merge the splits of a row inside the kernel instead of in XLA after it
      (`merge_partials`' three fusions and their launches, ~4.6 us of a 0.19 ms call at the
      anchor, run 124): the S = C W splits of a row run as one cluster of C blocks of W
      warpgroups, each warpgroup leaves its partial in its own SMEM, and once all have
      arrived at a cluster barrier warpgroup 0 of block 0 merges them over distributed shared
      memory (`_merge_splits`) and writes the row's output; the other blocks wait for it at a
      second barrier before they exit (their SMEM must outlive the reads). Where W divides S
      and C <= 8 (the portable cluster size); elsewhere ignored (the XLA merge). The
      interpreter merges one block's splits only (C = 1), with jnp. Not with trace.
    pdl: launch with programmatic dependent launch: the kernel waits for the preceding
      kernels of its stream (griddepcontrol.wait) before its first global read, so that its
      launch and the blocks' set-up overlap their tail. Native only.
    q_prologue: the query's prologue (the scale in float32, the fp16 cast, the widen8
      contraction order, the padded heads) inside the kernel from the caller's q (`_q_tile`)
      instead of one XLA fusion before each launch (~1.8 us, run 124). Native only, on the
      widen8 path (one key chunk).
    lazy_max: in the shared softmax with the subnormal value fold (natively), no cross-warp max
      in the common step: the running max lags the true one by at most _RESCALE_SLACK (the
      B bound takes the slack, as lazy_rescale's), each thread compares its scores with it and
      the barrier that hands P over ORs the comparisons (`_exceed_barrier`), P having been
      computed against the running max; a step where some score passes it (the first, and
      where the max grows by more than the slack) takes the exact exchange (`_wg_max_open`),
      rescales, recomputes P and passes one more barrier. Exact either way (the sums and the
      output share the one reference max); one warpgroup barrier per step fewer. The
      pipeline's barrier then runs after every step (`_pipeline`'s sync_every).
    Not every default here is `choose_tuning`'s: it sets the flags that pay per shape (fold_k
    with the key product on mma.sync; release_slots, spread_copies, pack_planes, pack_zeros,
    dense_bias, lazy_max, fold_v_warp and vec64 by bits, G and warpgroups; merge_splits, pdl
    and q_prologue at 2-bit G=128 with four warpgroups in one wave; warp_softmax off where it
    does not pay);
    the launch parameters (num_splits, wg_per_block) are a generic starting point:
    `choose_tuning` sizes them per shape (at B=8, Hkv=8, T=128k, 2-bit G=128: W=4, S=8;
    docs/performance.md runs 40-42, 47).
    """

    block_tokens: int = 256
    num_splits: int = 8
    stages: int = 2
    swizzle_codes: bool = False
    overlap: bool = True
    p_direct: bool = False
    p_concat: bool = False
    skip: str = ""
    fold_k: bool = False
    reload_codes: bool = False
    lean_values: bool = False
    fold_v: bool = True
    k_chunks: int = 1
    sub_tokens: int = 256
    warp_groups: bool = True
    widen8: bool = True
    wg_per_block: int = 1
    fp8_values: bool = False
    mma_sync: str = "both"
    subnormal_values: bool = True
    warp_softmax: bool = True
    lazy_rescale: bool = False
    copy_warp: bool = True
    release_slots: bool = False
    spread_copies: bool = False
    vec64: bool = False
    fold_v_warp: bool = False
    pack_planes: bool = False
    pack_zeros: bool = False
    dense_bias: bool = False
    merge_splits: bool = False
    pdl: bool = False
    q_prologue: bool = False
    lazy_max: bool = False
    trace: bool = False

    def __post_init__(self):
        if self.k_chunks not in (1, 2):
            raise ValueError(f"k_chunks must be 1 or 2, got {self.k_chunks}")
        if self.sub_tokens not in (256, 512):
            raise ValueError(f"sub_tokens must be 256 or 512, got {self.sub_tokens}")
        if self.block_tokens <= 0 or self.block_tokens % _CACHE_BLOCK:
            raise ValueError(f"block_tokens must be a positive multiple of {_CACHE_BLOCK} (a "
                             f"block of the cache order), got {self.block_tokens}")
        if self.block_tokens > 1024:
            raise ValueError(f"block_tokens must be <= 1024, got {self.block_tokens}")
        if self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")
        if not 1 <= self.stages <= 8:
            raise ValueError(f"stages must be in [1, 8], got {self.stages}")
        if not 1 <= self.wg_per_block <= 4:
            raise ValueError(f"wg_per_block must be in [1, 4], got {self.wg_per_block}")
        if self.mma_sync not in ("", "keys", "values", "both"):
            raise ValueError(
                f"mma_sync must be '', 'keys', 'values' or 'both', got {self.mma_sync!r}")
        if self.skip not in ("", "compute", "values", "loads", "copies", "groups", "bias"):
            raise ValueError(f"skip must be '', 'compute', 'values', 'loads', 'copies', "
                             f"'groups' or 'bias', got {self.skip!r}")


def _uses_widen8(tuning: TuningConfig, interpret) -> bool:
    """Whether the kernel takes the widen8 path (`_widen8`): native only, not with the folded
    or alternative P layouts (their operands are in the natural order) nor with key chunks (a
    chunk would split the swizzled code rows). Both value-code layouts hold a plane's codes as
    64-byte rows, so the experimental one takes it too."""
    natural_order = tuning.p_direct or tuning.p_concat
    return bool(tuning.widen8 and not interpret and tuning.k_chunks == 1
                and not natural_order)


def _folds_values(tuning: TuningConfig, group_size: int, head_dim: int) -> bool:
    """Whether the value scale is folded into P (`TuningConfig.fold_v`): one channel group per
    token (G = D) and P stored in the default transposed layout. With two channel groups
    (D = 128, G = 64) the second set of P * s_t tiles and sums put the kernel at 255 registers
    and made it slower (H200, docs/performance.md run 13: 0.383 -> 0.421 ms)."""
    return bool(tuning.fold_v and group_size == head_dim and not tuning.p_direct
                and not tuning.p_concat)


def _fp8_values(tuning: TuningConfig, group_size: int, head_dim: int) -> bool:
    """Whether the value product runs on fp8 tensor cores (`TuningConfig.fp8_values`): one
    channel group per token (G = D, the value scale then folds into B per token) and P stored
    through the natural-order transposed store (not p_direct / p_concat)."""
    return bool(tuning.fp8_values and group_size == head_dim and not tuning.p_direct
                and not tuning.p_concat)


def _mma_keys(tuning: TuningConfig) -> bool:
    return tuning.mma_sync in ("keys", "both")


def _folds_keys_mma(tuning: TuningConfig, group_size: int = 128, head_dim: int = 128) -> bool:
    """Whether the key scale is folded into mma.sync's B operand in registers
    (`TuningConfig.fold_k` with the keys on mma.sync, any G): code fields as fp16 subnormals
    (`_field_sub`), B = fp16(q * s_g) per register (`_scale_rhs`), q . z_g from one mma.sync
    per two distinct group vectors (`_rows_of`)."""
    del group_size, head_dim  # any G and D
    return bool(tuning.fold_k and _mma_keys(tuning))


def _no_auto_barriers(tuning: TuningConfig, group_size: int, head_dim: int, interpret,
                      stage_smem: bool = False) -> bool:
    """Whether the kernel is compiled without Mosaic's auto barriers (one before every TMA
    copy, two around every SMEM store through a ref; `CompilerParams.unsafe_no_auto_barriers`):
    where every cross-warp hand-over in the loop has a barrier of its own. That is the
    kernel's own pipeline (`_pipeline`: one barrier before a step's copies; several warpgroups
    per block, or one with copy_warp, instead of `plgpu.emit_pipeline`) with both products
    on mma.sync, P stored by `_store_p_perm` (widen8) and no reduction between the loop max and
    `_wg_sync` (the loop max's barrier orders a sub-step's reads of P and of the reduction
    scratch before the next sub-step's writes; `_wg_sync` the writes of P before its reads);
    the epilogue's stores are ordered by its reductions and commit_smem. Not the wgmma,
    fp8 or SMEM-staged paths, whose stores through refs rely on the auto barriers."""
    fv = _folds_values(tuning, group_size, head_dim) and not _fp8_values(
        tuning, group_size, head_dim)
    return bool((tuning.wg_per_block > 1 or tuning.copy_warp) and tuning.mma_sync == "both"
                and not stage_smem
                and _uses_widen8(tuning, interpret)
                and (tuning.subnormal_values or not fv)
                and not _fp8_values(tuning, group_size, head_dim))


def _warp_softmax(tuning: TuningConfig, group_size: int, head_dim: int, interpret) -> bool:
    """Whether each warp runs its own softmax and value product (`TuningConfig.warp_softmax`):
    both products on mma.sync, the value scale folded into P with subnormal value fields (G =
    D, so that a token's B column needs no per-channel scale), the widen8 key path, and one
    compute sub-step per copy step (the per-warp code loads take static column offsets)."""
    fv = _folds_values(tuning, group_size, head_dim) and not _fp8_values(
        tuning, group_size, head_dim)
    return bool(tuning.warp_softmax and tuning.mma_sync == "both" and fv
                and tuning.subnormal_values and _uses_widen8(tuning, interpret)
                and tuning.block_tokens <= tuning.sub_tokens)


def _folds_values_warp(tuning: TuningConfig, group_size: int, head_dim: int, interpret,
                       stage_smem: bool = False) -> bool:
    """Whether each warp folds the value scale of its own channel group into its B operand
    (`TuningConfig.fold_v_warp`): the value product on mma.sync with the widen8 path, several
    channel groups per token (G < D) and each warp's D/4 channels in one (G >= D/4); not
    where the per-warp softmax or fold_v already fold it (G = D)."""
    return bool(tuning.fold_v_warp and tuning.mma_sync in ("values", "both")
                and _uses_widen8(tuning, interpret) and not stage_smem
                and head_dim // 4 <= group_size < head_dim)


def _packs_planes(tuning: TuningConfig, group_size: int, head_dim: int, heads: int,
                  interpret) -> bool:
    """Whether a score tile holds two planes (`TuningConfig.pack_planes`): `heads` query heads
    per kv head fit in half of mma's N = 8, the folded key product and the value product on
    mma.sync, in the shared (not per-warp) softmax; not with fp8 values, the run-40 value fold
    (fields with offsets) or the natural-order P layouts. With fold_v_warp a tile's B is
    scaled by both planes' value scales at once (`_vec_load`'s n_half) and both minimums'
    terms come from one mma (`_group_min_mma`'s z_odd)."""
    fv = _folds_values(tuning, group_size, head_dim)
    return bool(tuning.pack_planes and heads <= 4 and tuning.mma_sync == "both"
                and _folds_keys_mma(tuning, group_size, head_dim)
                and not _fp8_values(tuning, group_size, head_dim)
                and not _warp_softmax(tuning, group_size, head_dim, interpret)
                and (tuning.subnormal_values or not fv)
                and not tuning.p_direct and not tuning.p_concat)


def value_channel_order(tuning: TuningConfig, group_size: int, head_dim: int, interpret,
                        stage_smem: bool = False):
    """The channel of each output row of the kernel's partial outputs (None: the natural
    order): with `fold_v_warp`, row 64 m + 16 w + i of value tile m holds channel (D/4) w +
    16 m + i."""
    if not _folds_values_warp(tuning, group_size, head_dim, interpret, stage_smem):
        return None
    D = head_dim
    return np.array([(D // 4) * w + 16 * m + i for m in range(D // PLANE) for w in range(4)
                     for i in range(16)])


def _key_chunks(tuning: TuningConfig, head_dim: int, group_size: int) -> int:
    """Head-dim chunks of the key product: tuning.k_chunks where each chunk is a whole number of
    64-channel tiles (D = 64: always 1); the folded key product (fold_k) is not chunked."""
    if _folds_keys_mma(tuning, group_size, head_dim) or head_dim % (PLANE * tuning.k_chunks):
        return 1
    return tuning.k_chunks


_BIAS_ROWS = 16  # key groups per dense_bias block: mma.sync's M


def _dense_bias(tuning: TuningConfig, group_size: int, head_dim: int, interpret,
                tokens: int | None = None) -> bool:
    """Whether the key bias q . z_g comes from 16-group blocks (`TuningConfig.dense_bias`): the
    folded key product on mma.sync (whose bias it is), natively in the widen8 column order
    (`_dense_rows` loads the minimums in q's `_PERM16` order), in the kernel's own pipeline
    without auto barriers (the block's copy is one warp's; the value product's warpgroup
    barrier orders the block's reads before its refill), the shared softmax, one compute
    sub-step per copy step (a block spans whole steps), and (where `tokens` is given) at
    least 16 key groups in the cache (a block never runs past its end)."""
    return bool(tuning.dense_bias and _folds_keys_mma(tuning, group_size, head_dim)
                and _uses_widen8(tuning, interpret) and tuning.skip != "bias"
                and _no_auto_barriers(tuning, group_size, head_dim, interpret)
                and not _warp_softmax(tuning, group_size, head_dim, interpret)
                and tuning.block_tokens <= tuning.sub_tokens
                and _BIAS_ROWS * group_size % tuning.block_tokens == 0
                and (tokens is None or tokens // group_size >= _BIAS_ROWS))


def _merge_cluster(tuning: TuningConfig, interpret, alt_layout: bool = False) -> int:
    """Blocks per cluster of the in-kernel split merge (`merge_splits`): S / W where W divides
    S and at most `_MAX_CLUSTER` blocks hold a row (one under the interpreter, which has no
    distributed shared memory); 0 where the XLA merge (`merge_partials`) runs instead."""
    W, S = tuning.wg_per_block, tuning.num_splits
    if not tuning.merge_splits or tuning.trace or alt_layout or S % W:
        return 0
    C = S // W
    return C if C <= (1 if interpret else _MAX_CLUSTER) else 0


def _q_in_kernel(tuning: TuningConfig, interpret, group_size: int, head_dim: int) -> bool:
    """Whether the kernel takes the caller's q and runs its prologue itself (`q_prologue`):
    natively on the widen8 path with one key chunk."""
    return (tuning.q_prologue and _uses_widen8(tuning, interpret)
            and _key_chunks(tuning, head_dim, group_size) == 1)


def _min_block(key_bits: int, value_bits: int) -> int:
    return PLANE * max(8 // key_bits, 8 // value_bits)


def _padded_heads(q_heads: int) -> int:
    """The query heads of a kv head as the kernel pads them (mma's N: multiples of 8)."""
    return max(8, -(-q_heads // 8) * 8)


def smem_bytes(tuning: TuningConfig, *, key_bits: int, value_bits: int, group_size: int,
               head_dim: int = 128, padded_heads: int = 16) -> int:
    """Shared memory of one thread block (pipeline buffers + P, q, output tiles)."""
    TS, D, G = tuning.block_tokens, head_dim, group_size
    step = TS * D * (key_bits + value_bits) // 8 + 2 * 2 * (TS // G * D + D // G * TS)
    W = tuning.wg_per_block
    red = _red_scratch(padded_heads) * 4  # per-warpgroup reduction scratch (f32)
    p_bytes = 1 if _fp8_values(tuning, G, D) else 2  # P^T (B of the value product)
    per_wg = tuning.stages * step + p_bytes * TS * padded_heads + 2 * padded_heads * D * 3 + red
    if _dense_bias(tuning, G, D, False):  # the minimums' block and the warps' bias rows
        per_wg += _BIAS_ROWS * (2 * D + 4 * 4 * padded_heads) - tuning.stages * 2 * (TS // G * D)
    return W * per_wg + 4096


def choose_tuning(
    batch: int, kv_heads: int, max_tokens: int, *, key_bits: int = 2, value_bits: int = 2,
    group_size: int = 128, head_dim: int = 128, num_sms: int = 132,
    block_tokens: int | None = None, stages: int = 2, wg_per_block: int | None = None,
    fp8_values: bool = False, mma_sync: str | None = None, q_heads: int = 8,
) -> TuningConfig:
    """Heuristic launch parameters for (B, Hkv, Tq) on an H200 (132 SMs).

    Steps of 256 tokens, 2 stages. Splits: the grid is B * Hkv * S blocks run in waves of
    num_sms * (blocks per SM); S minimizes waves * (steps per split + 2), the 2 standing for a
    block's fixed cost (prologue, epilogue) in steps; near-ties go to more splits. Measured on
    the H200, B=8, Hkv=8, T=128k, 2-bit G=128 (docs/performance.md, run-to-run spread ~10%):
    S=4/6/8/12/16 gave 0.73/0.72/0.66-0.68/0.68/0.70 ms (v2); 512-token copies were slower
    than 256 (v2 0.80 vs 0.72 ms, v3 0.66 vs 0.555 ms); 4-bit: 256-token steps 0.755 ms vs
    128-token 0.83 ms. Rechecked with the run-9 kernel (docs/performance.md run 11): 3 stages,
    512-token copies and S=6/12 no faster at 2/4-bit G=128 and 2-bit G=32.
    `block_tokens`/`stages`/`wg_per_block` override the defaults; with W warpgroups per block
    an SM runs one block (the register file holds W warpgroups at ptxas's cap), so W splits
    are in flight per SM. Warpgroups per block (docs/performance.md run 20, Hq=32 grid, W=1
    against W=3 in one process): 2-bit G=32 with B * Hkv * T >= 2^22 takes W=3 (+5-7%: B=8
    T=128k 0.389 -> 0.361 ms, B=32 T=32k/128k); below that W=3 loses (up to -15% at B=8
    T=8k), and at G=128 (2/4-bit) it is even or slower, so those keep W=1.
    `fp8_values` sets that opt-in flag (where it applies). `q_heads`: query heads per kv head,
    which size P and the q / output tiles in shared memory (padded to 8; `kivi_decode` passes
    its own): past 8, fewer warpgroups per block or shorter steps where W pipelines do not fit.
    `mma_sync` (None: chosen here): each product runs on warp-level mma.sync unless it takes
    an 8-bit wgmma (fp8_values where it applies): on the H200 mma.sync did the
    fp16 products of both at B=8 T=128k faster than wgmma (2-bit G=128 0.350 -> 0.310 ms,
    W=3 0.281; 2-bit G=32 W=3 0.360 -> 0.321; 4-bit 0.377 -> 0.344; docs/performance.md runs
    39-40), while 8-bit mma.sync was slower than 8-bit wgmma (int8 and fp8 mma.sync retire
    no more K per clock than fp16 mma.sync, run 38). With mma.sync, 2-bit caches take W=3
    (where it fits the shared memory) at large B * Hkv * T, as 2-bit G=32 did before. fold_k
    is set with the key product on mma.sync (the register fold, run 46), and 2-bit G=128 then
    takes W=4 where four pipelines fit (0.263 -> 0.249 ms at B=8 T=128k, run 47).
    """
    if mma_sync is None:
        probe = TuningConfig(fp8_values=fp8_values)
        mma_sync = "keys" if _fp8_values(probe, group_size, head_dim) else "both"
    blk = max(block_tokens or 256, _min_block(key_bits, value_bits), group_size)
    while max_tokens % blk and blk > 256:
        blk //= 2
    if max_tokens % blk:
        raise ValueError(f"max_tokens={max_tokens} is not a multiple of {blk}")
    base = TuningConfig(block_tokens=blk, num_splits=1, stages=stages, fp8_values=fp8_values,
                        mma_sync=mma_sync)
    # the key scale folded into mma.sync's B in registers (run 46: 2-bit G=128 0.286 -> 0.264
    # ms, 4-bit 0.357 -> 0.340, G=32 even; the same error, run 47)
    base = dataclasses.replace(base, fold_k=_mma_keys(base))
    # P and the q / output tiles take the query heads of a kv head padded to mma's N = 8:
    # past 8 of them, fewer warpgroups or shorter steps may be all that fits
    size = functools.partial(smem_bytes, key_bits=key_bits, value_bits=value_bits,
                             group_size=group_size, head_dim=head_dim,
                             padded_heads=_padded_heads(q_heads))
    if wg_per_block is None:
        big = batch * kv_heads * max_tokens >= 1 << 22
        many = key_bits == 2 and big and (group_size == 32 or mma_sync in ("keys", "both"))
        # W = 4 (2-bit G=128 with fold_k: 0.263 -> 0.249 ms, run 47) where four pipelines fit
        # at this block size, else three (2-bit G=32: four do not fit), else one (4-bit: run 40)
        fits = [w for w in ((4, 3) if base.fold_k and group_size == 128 else (3,))
                if size(dataclasses.replace(base, wg_per_block=w)) <= SMEM_LIMIT]
        wg_per_block = fits[0] if many and fits else 1
    base = dataclasses.replace(base, wg_per_block=wg_per_block)
    floor = max(_min_block(key_bits, value_bits), group_size, _CACHE_BLOCK)
    while size(base) > SMEM_LIMIT and base.block_tokens > floor:  # W pipelines per block
        base = dataclasses.replace(base, block_tokens=base.block_tokens // 2)
    if size(base) > SMEM_LIMIT:
        raise ValueError(f"wg_per_block={wg_per_block} with stages={stages} needs {size(base)} "
                         f"bytes of shared memory at {base.block_tokens}-token steps (limit "
                         f"{SMEM_LIMIT}): fewer warpgroups or stages")
    steps = max_tokens // base.block_tokens
    smem = size(base)
    if wg_per_block > 1:  # one block per SM, W splits in it
        slots = num_sms * wg_per_block
    else:  # 199-248 registers per thread (ptxas, run 18) allow 2 blocks of 128 threads per SM
        slots = num_sms * max(1, min(2, (227 * 1024) // smem))
    bh = batch * kv_heads
    costs = {S: -(-bh * S // slots) * (-(-steps // S) + 2) for S in range(1, min(steps, 64) + 1)}
    best = min(costs.values())
    # Among near-ties prefer more splits: more blocks hide the tail of the last wave better.
    S = max(S for S, c in costs.items() if c <= 1.02 * best)
    # The per-warp softmax where one warpgroup streams a block over enough steps to repay its
    # epilogue (the warps' merge): 4-bit G=128 at B=8 T=128k, 64 steps per split, 0.317-0.338
    # -> 0.299-0.322 ms (runs 59-61, in one process each); 8 steps even; 1-4 steps 3-14% slower
    # (B=1 T=8k/32k, run 65). With W = 4 it is slower (2-bit G=128 at the anchor 0.229-0.232 ->
    # 0.232-0.240 ms, runs 59-60: 32 accumulator registers under ptxas's cap of 128).
    wsm = wg_per_block == 1 and -(-steps // S) >= _WSM_MIN_STEPS
    # Two planes per score tile where the query heads of a kv head fill at most half of mma's
    # N (the kernel checks that; the flag only allows it): 2-bit G=128 at the anchor, W = 4,
    # 0.1999/0.2051 -> 0.1935/0.1973 ms (run 92, one process); at 2-bit G < D with fold_v_warp
    # (one scaled B per tile) over the blocked value codes, G=32 0.2376 -> 0.2277/0.2317 (run
    # 109; over the unblocked ones even, run 108: the load pipeline bound it); 4-bit keeps its
    # per-warp softmax, which excludes it.
    # Slots handed back through an mbarrier with four warpgroups (2-bit G=128 at the anchor
    # 0.2258 -> 0.2200-0.2230 ms, B=32 T=32k 0.2238-0.2255 -> 0.2209-0.2229; run 69); with
    # three (2-bit G=32) even to 2.5% slower. With the packed planes the warpgroup barrier
    # is no slower: release_slots=0 at W = 4, 2-bit G=128, was even or faster in eight
    # A/B pairs (runs 96-98: B=8 T=128k -0.1..-3.4%, B=32 T=32k -0.2/-1.7%).
    pack = key_bits == value_bits == 2 and mma_sync == "both"
    release = wg_per_block == 4 and not pack
    # With three, the copies dealt over the warps instead (2-bit G=32 at the anchor, four A/B
    # pairs in runs 73 and 76: 0.3101/0.3087/0.2993/0.3044 -> 0.3068/0.3034/0.2926/0.3023 ms;
    # with four even, with release_slots slower; with one even).
    spread = wg_per_block == 3
    # The value scale folded per warp with 64-bit vector loads where several channel groups
    # share a token (G < D; the kernel checks D/4 <= G): 2-bit G=32 at the anchor 0.272 ->
    # 0.248-0.250 ms (four pairs, runs 97-98), B=32 -7..-8%, B=1 and B=8 with one warpgroup
    # -1..-8% (run 98); at 4 bits mixed (-2.4..+8%), so only 2-bit.
    fvw = key_bits == value_bits == 2 and group_size < head_dim
    # The packed planes' padding zero where both products take it (G = D, no fold_v_warp):
    # the kernel runs at the 700 W power cap, where zeros cost the tensor cores less energy
    # (run 115, 2-bit G=128 at the anchor back to back: SM clock 1800 -> 1860 MHz, 0.2143 ->
    # 0.2099 ms; in the benchmark's bursts even, 0.1962 -> 0.1969 ms over three pairs); at G <
    # D (the keys' padding only) even to slower (B=32 T=32k G=32 0.2241 -> 0.2322).
    pz = pack and group_size == head_dim
    out = dataclasses.replace(base, num_splits=S, warp_softmax=wsm, release_slots=release,
                              spread_copies=spread, pack_planes=pack, fold_v_warp=fvw,
                              vec64=fvw, pack_zeros=pz)
    # The key bias of 16 groups per mma.sync (a block of eight steps at G = 128): 2-bit G=128
    # with four warpgroups at the anchor, over four A/B pairs in two processes (runs 118-119),
    # back to back at the power cap 0.2036/0.2041/0.2081/0.2101 -> 0.2008/0.2003/0.2061/0.2074
    # ms (SM clock +15-45 MHz), in bursts even (median 0.1989 -> 0.1986 ms); at G = 32 (a
    # block of two steps) slower, 0.2275 -> 0.2390. The same outputs bit for bit.
    dense = (pz and group_size == 128 and wg_per_block == 4
             and size(dataclasses.replace(out, dense_bias=True)) <= SMEM_LIMIT)
    # The common step's cross-warp max a vote at the P barrier (`lazy_max`): 2-bit G=128 with
    # four warpgroups, in one process on card ce53e16b (run 132), three rounds each: the
    # anchor 0.2083/0.2111/0.1967 -> 0.2006/0.1937/0.2002 ms, B=32 T=32k 0.2062/0.2126/0.2082
    # -> 0.2039/0.2019/0.2048, back to back at the power cap 0.2127 -> 0.2067 (SM clock 1860
    # -> 1890 MHz); the twin's error on ragged rows unchanged (9.07e-5). Its vote in the P
    # barrier itself (`_exceed_barrier`, runs 135-136): B=32 +1-3%, the anchor even to +1.6%.
    lazy = pz and wg_per_block == 4
    out = dataclasses.replace(out, dense_bias=dense, lazy_max=lazy)
    # The splits merged in the kernel, with PDL and the query's prologue in it (the XLA work
    # of a call down to the caller's own): where four warpgroups hold a 2-bit G = 128 row in
    # at most two blocks of one wave, 2-bit G=128 at the anchor (clusters of two) in one
    # process, three rounds each on two cards (runs 125-126): 0.1986/0.1991/0.1954 ->
    # 0.1954/0.1918/0.1959 ms (merge and pdl), 0.1933/0.1946/0.1948 -> 0.1898/0.1925/0.1931
    # (all three); with three warpgroups (2-bit G=32, clusters of two) 3% slower (0.2277/
    # 0.2237 -> 0.2349/0.2302, merge and pdl), with one (clusters of four or eight, several
    # waves: a block that is done waits for its row) 1-18% slower (run 125).
    C = _merge_cluster(dataclasses.replace(out, merge_splits=True), False)
    fused = (key_bits == value_bits == 2 and group_size == 128 and wg_per_block == 4
             and 1 <= C <= 2 and -(-bh * S // wg_per_block) <= num_sms)
    return dataclasses.replace(out, merge_splits=fused, pdl=fused, q_prologue=fused)


def _make_kernel(
    *, B, Hkv, NP, D, Tq, L, key_bits, value_bits, G, tuning: TuningConfig, stage_smem: bool,
    interpret, alt_layout: bool = False, pack: bool = False, vblock: bool = False,
    nq: int = 0, q_scale: float | None = None,
):
    """The kernel for one launch shape. q_scale (with nq, the query heads per kv head): the
    kernel takes the caller's q [B, Hkv, nq, D] and runs its prologue itself (`q_prologue`);
    None: q comes prepared [B, Hkv, KCH, NP, D / KCH] fp16 (`_kernel_call`)."""
    TS, S, stages = tuning.block_tokens, tuning.num_splits, tuning.stages
    Pk, Pv = 8 // key_bits, 8 // value_bits
    SUB = min(TS, tuning.sub_tokens)  # tokens per compute sub-step (one fori_loop iteration)
    KCH = _key_chunks(tuning, D, G)
    DC = D // KCH  # head-dim chunk of the key product
    planes = SUB // PLANE
    total_steps = Tq // TS
    steps_per_split = -(-total_steps // S)
    mtiles = D // PLANE
    VCH = min(TS, 256)  # value-scale chunk (a TMA box is at most 256 wide)
    f16 = jnp.float16
    kfold = _folds_keys_mma(tuning, G, D)
    reload = tuning.reload_codes
    f8v = _fp8_values(tuning, G, D)
    fv = _folds_values(tuning, G, D) and not f8v
    mmv = tuning.mma_sync in ("values", "both")  # value product on mma.sync
    # fold_v on mma.sync: value code fields as fp16 subnormals (no offset), B = P * s_t scaled
    # per field against a running max over logit + log2 s_t (`val_prep`), as fp8_values does
    vsub = fv and mmv and tuning.subnormal_values
    lgmax = f8v or vsub  # the softmax's running max is over logit + log2 s_t
    wsm = _warp_softmax(tuning, G, D, interpret) and not alt_layout and not stage_smem
    # the value scale folded into each warp's B (G < D): one channel group per warp
    fvw = (_folds_values_warp(tuning, G, D, interpret, stage_smem) and not alt_layout
           and not wsm)
    vw_groups = tuple((D // 4) * w // G for w in range(4))  # (fvw) warp w's channel group
    # pack_planes: score tile t holds planes 2t (columns 0-3) and 2t + 1 (columns 4-7)
    pk = pack and not wsm and not alt_layout
    # pack_zeros: B's padding columns zero (q not repeated; pzv: P stored per plane)
    pz = pk and tuning.pack_zeros
    pzv = pz and not fvw and not tuning.p_direct and not tuning.p_concat
    tiles = planes // 2 if pk else planes
    # lazy_rescale in the shared softmax (natively; the vsub and exact value paths, whose B
    # bounds take the slack): the running max is the warpgroup's, so every warp takes the
    # same branch of `_lazy_rescale`
    lazy_sh = (tuning.lazy_rescale and not wsm and not interpret and mmv and not f8v
               and not fvw and not (fv and not vsub) and not alt_layout)
    per_warp = tuning.warp_groups and not interpret  # inline Mosaic GPU does not interpret
    w8 = _uses_widen8(tuning, interpret)
    # widen8: code tiles in the _PERM16 column order (q permuted to match outside the kernel)
    swizzle_codes = tuning.swizzle_codes or w8
    if w8:
        widen_k = functools.partial(_widen8, transforms=_swz(jnp.uint8, D))
        widen_v = functools.partial(_widen8, transforms=_swz(jnp.uint8, PLANE))
    else:
        widen_k = widen_v = lambda ref: _widen_codes(_natural_bytes(ref[...]))
    # kfold: the key code bytes widened without exponent bits (fields as fp16 subnormals)
    widen_k0 = (functools.partial(_widen8, transforms=_swz(jnp.uint8, D), exponent=False) if w8
                else lambda ref: _natural_bytes(ref[...]).astype(jnp.uint16))
    widen_v0 = (functools.partial(_widen8, transforms=_swz(jnp.uint8, PLANE), exponent=False)
                if w8 else lambda ref: _natural_bytes(ref[...]).astype(jnp.uint16))
    extra_names = ["vd8_s"] if f8v else []
    W = tuning.wg_per_block
    mmk = tuning.mma_sync in ("keys", "both")  # key product on mma.sync
    no_auto = _no_auto_barriers(tuning, G, D, interpret, stage_smem)
    own_pipe = W > 1 or no_auto  # `_pipeline`, else `plgpu.emit_pipeline`
    one_warp = tuning.copy_warp and not interpret  # in `_pipeline`
    release = one_warp and no_auto and tuning.release_slots  # `_pipeline`'s empty barriers
    # lazy_max: the common step's cross-warp max is a vote at the P barrier (the shared
    # softmax with the subnormal value fold, the kernel's own barriers)
    lazy_mx = (tuning.lazy_max and not interpret and mmv and vsub and not wsm and not fvw
               and not alt_layout and not lazy_sh and no_auto and tuning.skip != "values")
    slack = (_RESCALE_SLACK if (tuning.lazy_rescale and (wsm or lazy_sh)) or lazy_mx
             else 0.0)
    # dense_bias: the key minimums leave the pipeline for 16-group blocks of their own
    db = _dense_bias(tuning, G, D, interpret, Tq) and not alt_layout and not stage_smem
    n_g = TS // G  # key groups per step
    C = _merge_cluster(tuning, interpret, alt_layout)  # merge_splits: blocks per row
    bias_steps = _BIAS_ROWS * G // TS if db else 0  # steps per minimums block

    # Pipelined inputs: (block shape, dtype, SMEM transforms, axis of the block index).
    kc_rows, g_rows, v_cols = TS // Pk, TS // G, TS // Pv
    ktf = _swz(jnp.uint8, D) if swizzle_codes else ()
    # widen8: 64-byte tiles, so that a plane's 64 value columns are whole swizzle tiles
    vtf = _swz(jnp.uint8, PLANE if w8 or vblock else v_cols) if swizzle_codes else ()
    u8 = jnp.uint8
    if not alt_layout:
        pipe_blocks = [
            ((kc_rows, D), u8, ktf, 0), ((g_rows, D), f16, (), 0), ((g_rows, D), f16, (), 0),
            ((v_cols // PLANE, D, PLANE), u8, vtf, 0) if vblock else ((D, v_cols), u8, vtf, 1),
            # Value scales are viewed as [D/G, Tq/VCH, VCH]: a TMA box is at most 256 wide.
            ((D // G, TS // VCH, VCH), f16, (), 1), ((D // G, TS // VCH, VCH), f16, (), 1)]
    else:  # experimental layout: V codes in contiguous [D, 64] blocks, scale+min merged
        pipe_blocks = [
            ((kc_rows, D), u8, ktf, 0), ((g_rows, 2, D), f16, (), 0),
            ((v_cols // PLANE, D, PLANE), u8, (), 0), ((D // G, TS // VCH, 2, VCH), f16, (), 1)]

    def block_index(ndim, axis, blk, i):
        """Block indices of step i: `blk(i)` on `axis`, 0 elsewhere."""
        return tuple(blk(i) if d == axis else 0 for d in range(ndim))

    n_in = 4 if alt_layout else 6
    piped = [j for j in range(n_in) if not (db and j == 2)]  # the pipeline's inputs

    def kivi_decode_sm90(layer_g, nt_g, q_g, *refs):
        if tuning.pdl and not interpret:  # the preceding kernels' outputs are visible after it
            plgpu.griddepcontrol_wait()
        gmem = refs[:n_in]
        o_g, lse_g, *scratch_refs = refs[n_in:]
        sc = dict(zip(scratch_names, scratch_refs, strict=True))

        def unit(wg, b, h, s):
            # This warpgroup's own SMEM (W > 1: every scratch buffer has a leading wg axis).
            own = (lambda k: sc[k].at[wg]) if W > 1 else sc.__getitem__
            q_s, p_s, o_s, lse_s, kd_s, vd_s, bar = (
                own(k) for k in ("q_s", "p_s", "o_s", "lse_s", "kd_s", "vd_s", "bar"))
            ex = {k: own(k) for k in extra_names}
            red_s = None if interpret else own("red_s")  # cross-warp reduction scratch

            def red(x, kind):
                """x (64, N) reduced over its rows ("add" / "max"): per-warpgroup scratch when
                several warpgroups share the block (`_wg_reduce`)."""
                if W > 1 and not interpret:
                    return _wg_reduce(x, kind, red_s)
                return x.max(axis=0) if kind == "max" else x.sum(axis=0)

            def loop_max(x):
                """The sub-step's cross-warp max: with the value product on mma.sync, one
                barrier (`_wg_max_open`; the `_wg_sync` before P is read orders its reads
                before the next sub-step's writes). Not where a reduction through red_s
                (_fold_values) or no `_wg_sync` (the skip="values" ablation) follows it."""
                if (mmv and not interpret and not (fv and not vsub)
                        and tuning.skip != "values"):
                    return _wg_max_open(x, red_s)
                return red(x, "max")

            layer = layer_g[0]
            n = jnp.minimum(nt_g[b], Tq)
            first = s * steps_per_split
            start = first * TS
            nsteps = jnp.clip(
                lax.div(n - start + (TS - 1), jnp.int32(TS)), 0,
                jnp.minimum(steps_per_split, total_steps - first))

            # the copies' issuing warp (`_pipeline`'s and dense_bias's): wg % 4, so that a
            # block's W issuing warps sit on different schedulers; one-warpgroup blocks take
            # it from the block index, so that the blocks an SM holds tend to issue from
            # different schedulers too
            copy_warp = lax.rem(wg, 4) if W > 1 else lax.rem((b * Hkv + h) * S + s, 4)
            if db:  # the minimums block, the warps' bias rows and the block's barrier
                kzc_s, kb_s, kz_bar = own("kzc_s"), own("kb_s"), own("kz_bar")
            if tuning.trace:  # the unit's start (diagnostics)
                _stamp(own("trace_s"), 0)

            if q_scale is not None:  # q_prologue
                _q_tile(q_g.at[b, h], q_s.at[0], nq=nq, scale=q_scale,
                        dup=pack and not tuning.pack_zeros)
                _wg_sync(interpret)
                plgpu.commit_smem()
            else:
                plgpu.copy_gmem_to_smem(q_g.at[b, h], q_s, bar)
                plgpu.barrier_wait(bar)
            if mmk:  # q^T as mma.sync's B operand: registers, loop-invariant
                qb = [_mma_rhs(q_s.at[c].T, interpret) for c in range(KCH)]

            def views(refs, u, kb=None):
                """Accessors of sub-step u of one step's SMEM buffers (documented or alt
                layout). Scale and minimum accessors take a group g (one vector) or (g, n): the
                rows of n groups. kb (dense_bias): the step's first row of the bias rows."""
                grows = lambda g, n: g if n == 0 else pl.ds(g, n)
                kr, kg, vcol = u * (SUB // Pk), u * (SUB // G), u * (SUB // Pv)
                vchunk = lambda p: (u * SUB + p * PLANE) // VCH  # value scales: [D/G, TS/VCH, VCH]
                voff = lambda p: (u * SUB + p * PLANE) % VCH
                if not alt_layout:
                    if db:  # the minimums come as bias rows (`kbias`), not per step
                        refs = (*refs[:2], None, *refs[2:])
                    kc_s, ks_s, kz_s, vc_s, vs_s, vz_s = refs
                    return dict(
                        vc=vc_s,
                        kcodes=lambda r, c: kc_s.at[pl.ds(kr + r * PLANE, PLANE),
                                                    pl.ds(c * DC, DC)],
                        kscale=lambda g, n=0: ks_s.at[grows(kg + g, n)],
                        kmin=lambda g, n=0: kz_s.at[grows(kg + g, n)],
                        # dense_bias: the key bias of the groups gs (one per warp)
                        kbias=lambda gs: _bias_rows(kb_s.at[pl.ds(kb, n_g)], gs, dup_half=pz),
                        vcodes=(lambda r, m: vc_s.at[vcol // PLANE + r, pl.ds(m * PLANE, PLANE)])
                        if vblock else
                        (lambda r, m: vc_s.at[pl.ds(m * PLANE, PLANE),
                                              pl.ds(vcol + r * PLANE, PLANE)]),
                        vcodes_all=(lambda r: vc_s.at[vcol // PLANE + r]) if vblock else
                        (lambda r: vc_s.at[:, pl.ds(vcol + r * PLANE, PLANE)]),
                        vscale=lambda p: (lambda g, n=0: vs_s.at[grows(g, n), vchunk(p),
                                                                 pl.ds(voff(p), PLANE)]),
                        vmin=lambda p: (lambda g, n=0: vz_s.at[grows(g, n), vchunk(p),
                                                               pl.ds(voff(p), PLANE)]),
                        # planes p, p + 1 (p even; one value-scale chunk holds both)
                        vscale2=lambda p: (lambda g, n=0: vs_s.at[grows(g, n), vchunk(p),
                                                                  pl.ds(voff(p), 2 * PLANE)]),
                        vmin2=lambda p: (lambda g, n=0: vz_s.at[grows(g, n), vchunk(p),
                                                                pl.ds(voff(p), 2 * PLANE)]))
                kc_s, ksz_s, vc_s, vsz_s = refs
                vb = u * (SUB // (PLANE * Pv))
                return dict(
                    kcodes=lambda r, c: kc_s.at[pl.ds(kr + r * PLANE, PLANE), pl.ds(c * DC, DC)],
                    kscale=lambda g, n=0: ksz_s.at[grows(kg + g, n), 0],
                    kmin=lambda g, n=0: ksz_s.at[grows(kg + g, n), 1],
                    vcodes=lambda r, m: vc_s.at[vb + r, pl.ds(m * PLANE, PLANE), :],
                    vscale=lambda p: (lambda g, n=0: vsz_s.at[grows(g, n), vchunk(p), 0,
                                                              pl.ds(voff(p), PLANE)]),
                    vmin=lambda p: (lambda g, n=0: vsz_s.at[grows(g, n), vchunk(p), 1,
                                                            pl.ds(voff(p), PLANE)]))

            def k_codes(v, p, cache, c=0):
                """Key codes of plane p of the step, head-dim chunk c, as exact fp16 integers:
                (64 tokens, DC)."""
                r = p // Pk
                if reload:
                    x = widen_k(v["kcodes"](r, c))
                else:
                    if r not in cache:  # one SMEM load of a byte tile serves all its Pk planes
                        cache[r] = widen_k(v["kcodes"](r, c))
                    x = cache[r]
                return _field_to_f16(x, key_bits, p % Pk)

            def k_tile(v, p, cache, c=0):
                """Dequantized keys of plane p of the step, head-dim chunk c: (64 tokens, DC)
                fp16."""
                x = k_codes(v, p, cache, c)
                cols = pl.ds(c * DC, DC)
                at = lambda f: (lambda g, n=0: f(g, n).at[(slice(None), cols) if n else cols])
                sc, mn = _group_vecs(at(v["kscale"]), at(v["kmin"]), _warp_groups(p, G),
                                     (PLANE, DC), cache, "k", per_warp, w8)
                return x * sc + mn

            def v_codes(v, p, m, cache, raw=False):
                """Raw value codes of plane p, channel tile m: (64 channels, 64 tokens) fp16 (raw:
                plus the field's offset, `_field_raw`)."""
                r = (p // Pv, m)
                if reload:
                    x = widen_v(v["vcodes"](*r))
                else:
                    if r not in cache:
                        cache[r] = widen_v(v["vcodes"](*r))
                    x = cache[r]
                return (_field_raw if raw else _field_to_f16)(x, value_bits, p % Pv)

            def v_tile(v, p, m, cache):
                """Dequantized V^T of plane p, channel tile m: (64 channels, 64 tokens) fp16."""
                c = v_codes(v, p, m, cache)
                # channel groups of the tile's rows (the channels m * 64 + 16 w + ...)
                groups = tuple((m * PLANE + 16 * w) // G for w in range(4))
                sc, mn = _group_vecs(v["vscale"](p), v["vmin"](p), groups, (PLANE, PLANE),
                                     cache, ("v", p), per_warp, w8)
                return c * sc + mn

            def v_field8(v, p, m, cache):
                """fp8_values: value code field of plane p, channel tile m, as the e4m3 A
                operand (64 channels, 64 tokens) = code * weight * 2^-9 (`_f8_field_spec`)."""
                r = (p // Pv, m)
                spec = _f8_field_spec(value_bits, p % Pv)
                if interpret:
                    return _code_field8_reference(v["vcodes"](*r)[...], spec, jnp.float8_e4m3fn)
                if r not in cache:  # one SMEM load of a byte tile serves all its Pv planes
                    cache[r] = plgpu.load(v["vcodes"](*r), (), layout=plgpu.Layout.WGMMA_8BIT)
                return _code_field8(cache[r], spec, jnp.float8_e4m3fn)

            def b_shift(p):
                """lgmax: log2 of the constant c_p in the value product's B = P * s_t * c_p of
                plane p (field j): fp8_values 256 / w_j (the e4m3 field reads as code * w_j *
                2^-9); vsub 2^(_VSUB_C - bits j) (the subnormal field reads as code * 2^(bits j
                - 24)). Either way the product weighs every plane's codes alike (undone at the
                end) and B <= 2^shift: in e4m3, resp. fp16, range."""
                if f8v:
                    return 8.0 - float(np.log2(_f8_field_spec(value_bits, p % Pv)[2]))
                return float(_VSUB_C - slack - value_bits * (p % Pv))

            def vw_shift(p):
                """fvw: log2 of the factor P of plane p (field j) is stored with."""
                return float(_VW_C - value_bits * (p % Pv))

            def vw_const(t, inverse: bool, shape=None):
                """fvw: vw_shift (inverse: 2^-vw_shift) of score tile t; pk: the (NP,) vector
                of plane 2t's in columns 0-3 and 2t + 1's in 4-7 (`_halves_const`), broadcast
                to `shape` (rows) where given."""
                f = (lambda p: 2.0 ** -vw_shift(p)) if inverse else vw_shift
                if not pk:
                    return f(t)
                c = _halves_const(f(2 * t), f(2 * t + 1), NP, interpret)
                return c if shape is None else lax.broadcast_in_dim(c, shape, [1])

            def val_prep(v):
                """lgmax (logits in log2 units): per plane p, the (64, N) broadcasts of log2 s_t,
                u = 2^-b_shift(p) / s_t and z_t * u, with s_t clamped to 2^-24 so that a zero
                scale stays finite. The B operand is then B = 2^(logit + log2 s_t - m +
                b_shift(p)) = P * s_t * c_p, and P = B * u, P * z_t = B * (z_t * u): one fma
                each for the sums. pk: per tile, plane 2t's in columns 0-3 and 2t + 1's in 4-7
                (natively computed once per tile on lane-dependent row vectors, `_halves`)."""
                f32 = jnp.float32
                ld = lambda which, p: plgpu.load(v[which](p)(0), (), layout=_WG.reduce(1))
                bc = lambda x: lax.broadcast_in_dim(x, (PLANE, NP), [0])

                def terms(sv, zv, nb):
                    l2s = jnp.log2(jnp.maximum(sv.astype(f32), 2.0 ** -24))
                    # u from log2 s_t (two instructions) rather than a division, which
                    # compiles to ~8 with its range checks (SASS, docs/performance.md run 52)
                    u = jnp.exp2(nb - l2s)
                    return bc(l2s), bc(u), bc(zv.astype(f32) * u)

                if pk and not interpret:
                    out = []
                    for t in range(tiles):
                        pick = lambda f, t=t: _halves(f(2 * t), f(2 * t + 1), False,
                                                      rows=True)
                        nb = pick(lambda p: plgpu.layout_cast(
                            jnp.full((PLANE,), -b_shift(p), f32), _WG.reduce(1)))
                        # both planes' vectors from one ref (they share a chunk: VCH >= 128)
                        ld2 = lambda which, t=t: _row_halves_load(v[which](2 * t)(0), PLANE)
                        out.append(terms(ld2("vscale2"), ld2("vmin2"), nb))
                    return out
                out = [terms(ld("vscale", p), ld("vmin", p), -b_shift(p)) for p in range(planes)]
                if pk:
                    out = [tuple(_halves(a, b, interpret) for a, b in
                                 zip(out[2 * t], out[2 * t + 1], strict=True))
                           for t in range(tiles)]
                return out

            def v_codes_sub(v, p, m, cache):
                """vsub: value code field of plane p, channel tile m, as fp16 subnormals (64
                channels, 64 tokens) = code * 2^(bits j - 24) (`_field_sub`)."""
                r = (p // Pv, m, "sub")
                if r not in cache:  # one SMEM load of a byte tile serves all its Pv planes
                    cache[r] = widen_v0(v["vcodes"](p // Pv, m))
                return _field_sub(cache[r], value_bits, p % Pv)

            def v_codes_warp(v, p, m, cache):
                """fvw: value code field of plane p as the subnormal A operand (`_field_sub`)
                of channel tile m in the warp order: warp w's rows are the channels (D/4) w +
                16 m + (0..15) (`value_channel_order`)."""
                r = (p // Pv, m, "warp")
                if r not in cache:  # one SMEM load of a byte tile serves all its Pv planes
                    cache[r] = _widen8(v["vcodes_all"](p // Pv), vtf, exponent=False,
                                       warp_rows=(D // 4, 16 * m))
                return _field_sub(cache[r], value_bits, p % Pv)

            def kfold_scores(v):
                """fold_k on mma.sync (`_folds_keys_mma`): S^T of plane p (field j, group g)
                = (codes_j * 2^(bits j - 24)) . fp16(q * s_g) * 2^(24 - bits j) + q . z_g. The
                code fields enter as fp16 subnormals (`_field_sub`: one and per element pair,
                no offset, no fma), B = q * s_g is one fp16x2 multiply per register of q's B
                operand (`_scale_rhs`) per group, and q . z_g comes from one more mma.sync per
                two distinct group vectors, whose A rows are their minimums (`_rows_of`). Each
                warp scales by the vectors of its own 16 rows' group (`_warp_groups`,
                `_vec_load` with rows): one per 256-token block at G >= 64, two at G = 32."""
                f32 = jnp.float32
                zero = plgpu.layout_cast(jnp.zeros((PLANE, NP), f32), _WG)
                q = qb[0]  # (D, NP) B operand (registers natively, an array interpreted)
                if interpret:  # per warp's 16 rows (its own group), in jnp
                    out = []
                    for t in range(tiles):
                        # pk: the odd plane against B with q's heads in columns 4-7
                        ps_ = (2 * t, 2 * t + 1) if pk else (t,)
                        blocks = []
                        for w in range(4):
                            xs = []
                            for p in ps_:
                                g = _warp_groups(p, G)[w]
                                a = _field_sub(widen_k0(v["kcodes"](p // Pk, 0)), key_bits,
                                               p % Pk)
                                bq = (q * v["kscale"](g)[...][:, None]).astype(f16)
                                x = jnp.dot(a[16 * w:16 * (w + 1)], bq, preferred_element_type=f32)
                                xs.append(x * _field_sub_weight(key_bits, p % Pk))
                            bias = jnp.dot(v["kmin"](g)[...].astype(f32), q.astype(f32))
                            if pz:  # both planes' products in columns 0-3
                                x = xs[0] + _swap_halves(xs[1], interpret)
                                bias = bias + _swap_halves(bias, interpret)
                            else:
                                x = _halves(*xs, interpret) if pk else xs[0]
                            blocks.append(x + bias[None])
                        out.append(jnp.concatenate(blocks, axis=0))
                    return out
                vecs, codes, bqs = {}, {}, {}

                wide = w8 and tuning.vec64

                # one key per distinct per-warp group vector (G >= 64: one per 256-token
                # block), paired for the bias products
                key = [_warp_groups(p, G) for p in range(planes)]
                if tuning.skip == "groups":  # ablation: every plane on the first's vectors
                    key = [key[0]] * planes

                def vec(which, gs):
                    """The scale or minimum vector of the groups gs (one per warp)."""
                    if (which, gs) not in vecs:
                        vecs[which, gs] = _warp_vec_load(v[which], gs, perm=w8, wide=wide)
                    return vecs[which, gs]

                uniq = list(dict.fromkeys(key))
                bias = {}
                if tuning.skip == "bias":  # ablation: no key bias (no kmin loads, no mma)
                    bias = {k: zero for k in uniq}
                    uniq = []
                elif db:  # each warp's row of the block's products (`bias_step`)
                    bias = {k: v["kbias"](k) for k in uniq}
                    uniq = []
                for i in range(0, len(uniq), 2):
                    pair = uniq[i:i + 2]  # the last one alone: rows 8..15 left undefined
                    a = _rows_of(*(vec("kmin", k) for k in pair))
                    c = _mma(zero, a, q, interpret)
                    for h, k in enumerate(pair):
                        bias[k] = _row_half(c, h)
                        if pz:  # q in columns 0-3 only: the heads' bias into 4-7 too
                            bias[k] = bias[k] + _swap_halves(bias[k], interpret)
                if pk:  # planes 2t, 2t + 1 (one key group) into one tile
                    out = []
                    for t in range(tiles):
                        p0, p1 = 2 * t, 2 * t + 1
                        r, k = p0 // Pk, key[p0]
                        if r not in codes:
                            codes[r] = widen_k0(v["kcodes"](r, 0))
                        if k not in bqs:  # q (in both halves) * s_g
                            bqs[k] = _scale_rhs(q, vec("kscale", k))
                        x0 = _mma(zero, _field_sub(codes[r], key_bits, p0 % Pk), bqs[k],
                                  interpret)
                        x1 = _mma(zero, _field_sub(codes[r], key_bits, p1 % Pk), bqs[k],
                                  interpret)
                        # columns 0-3 of the even plane's, 4-7 of the odd's, each with its
                        # field's weight
                        wt = _halves_const(_field_sub_weight(key_bits, p0 % Pk),
                                           _field_sub_weight(key_bits, p1 % Pk), NP, interpret)
                        x = x0 + _swap_halves(x1, interpret) if pz else _halves(x0, x1, interpret)
                        out.append(x * lax.broadcast_in_dim(wt, (PLANE, NP), [1]) + bias[k])
                    return out
                out = []
                for p in range(planes):
                    r, k = p // Pk, key[p]
                    if r not in codes:  # one SMEM load of a byte tile serves its Pk planes
                        codes[r] = widen_k0(v["kcodes"](r, 0))
                    if k not in bqs:
                        bqs[k] = _scale_rhs(q, vec("kscale", k))
                    x = _mma(zero, _field_sub(codes[r], key_bits, p % Pk), bqs[k], interpret)
                    out.append(x * _field_sub_weight(key_bits, p % Pk) + bias[k])
                return out

            def mma_scores(v):
                """`scores` on mma.sync: each plane's tile against B in registers (q loaded
                once per split; fold_k: `kfold_scores`)."""
                if kfold:
                    return kfold_scores(v)
                out = [plgpu.layout_cast(jnp.zeros((PLANE, NP), jnp.float32), _WG)] * planes
                for c in range(KCH):
                    cache = {}
                    for p in range(planes):
                        out[p] = _mma(out[p], k_tile(v, p, cache, c), qb[c], interpret)
                return out

            def scores(v):
                """S^T tiles (64 tokens, NP) of all planes of the step, f32."""
                if mmk:
                    return mma_scores(v)
                a_tile = lambda p, cache, c: k_tile(v, p, cache, c)
                b_ref = lambda p, c: q_s.at[c].T
                if stage_smem:
                    def f(acc, p):
                        for c in range(KCH):
                            kd_s[...] = a_tile(p, {}, c)
                            plgpu.commit_smem()
                            plgpu.wgmma(acc, kd_s, b_ref(p, c))
                            plgpu.wgmma_wait(0)
                        return acc[...]
                    return [pl.run_scoped(functools.partial(f, p=p),
                                          plgpu.ACC((PLANE, NP), jnp.float32))
                            for p in range(planes)]

                def f(*accs):
                    # Dequantize the next tile on the CUDA cores while the previous wgmma runs;
                    # head-dim chunks outermost so that one chunk's code bytes and vectors are live.
                    first = True
                    for c in range(KCH):
                        cache = {}
                        for p in range(planes):
                            plgpu.wgmma(accs[p], a_tile(p, cache, c), b_ref(p, c))
                            if not first and tuning.overlap:
                                plgpu.wgmma_wait(1)
                            elif not tuning.overlap:
                                plgpu.wgmma_wait(0)
                            first = False
                    plgpu.wgmma_wait(0)
                    return [a[...] for a in accs]
                return pl.run_scoped(f, *[plgpu.ACC((PLANE, NP), jnp.float32)] * planes)

            def step(idx, *refs):
                *refs, carry = refs
                if tuning.skip == "compute":  # ablation: the TMA pipeline alone
                    return carry
                (i,) = idx
                if db:  # (one sub-step per step)
                    return bias_step(i, refs, carry)
                if TS == SUB:
                    return sub_step(refs, start + i * TS, 0, carry)
                # Big copies, small compute steps: a loop (not unrolled) keeps registers and code
                # size at one sub-step's.
                return lax.fori_loop(
                    0, TS // SUB, lambda u, c: sub_step(refs, start + i * TS + u * SUB, u, c),
                    carry)

            def bias_block(c):
                """dense_bias: the first key group of minimums block c of this split, clamped
                so that the block ends inside the cache (its steps' rows then start further
                in: `bias_step`)."""
                return jnp.minimum(first * n_g + _BIAS_ROWS * c, Tq // G - _BIAS_ROWS)

            def fetch_bias(c):
                """dense_bias: minimums block c into kzc_s (one TMA by the copy warp)."""
                def issue():
                    plgpu.copy_gmem_to_smem(srcs[2].at[pl.ds(bias_block(c), _BIAS_ROWS)],
                                            kzc_s, kz_bar)
                plgpu.warp_map(lambda w: pl.when(w == copy_warp)(issue))

            def bias_step(i, refs, carry):
                """dense_bias: step i, and at the first step of a minimums block, the bias of
                all its 16 groups, one mma.sync per 16 channels (`_dense_rows`), stored to the
                warp's rows of kb_s (only the warp reads them: a warp barrier; the previous
                block's reads are ordered before by the last step's warpgroup barrier). The
                next block is copied once every warp has read this one: after the step's
                warpgroup barrier (mmv)."""
                c, first_of = lax.div(i, bias_steps), lax.rem(i, bias_steps) == 0

                def block_bias():
                    plgpu.barrier_wait(kz_bar)
                    zero = plgpu.layout_cast(jnp.zeros((PLANE, NP), jnp.float32), _WG)
                    _store_bias_rows(_mma(zero, _dense_rows(kzc_s), qb[0], interpret), kb_s)
                    _warp_sync()

                pl.when(first_of)(block_bias)
                carry = sub_step(refs, start + i * TS, 0, carry,
                                 kb=(first + i) * n_g - bias_block(c))
                pl.when(first_of & (i + bias_steps < nsteps))(lambda: fetch_bias(c + 1))
                return carry

            def sub_step(refs, tok0, u, carry, kb=None):
                v = views(refs, u, kb)
                m_run, l_t, accs, zaccs = carry
                st = scores(v)

                def masked(xs):  # the tokens at and past n (ragged lengths, padding) drop out
                    rows = plgpu.broadcasted_iota(jnp.int32, (PLANE, NP), 0, layout=_WG)
                    if pk:  # columns 4-7 of tile t are plane 2t + 1's
                        odd = plgpu.broadcasted_iota(jnp.int32, (PLANE, NP), 1, layout=_WG) >= 4
                        tok = lambda t: jnp.where(odd, _plane_tokens(2 * t + 1, rows),
                                                  _plane_tokens(2 * t, rows))
                    else:
                        tok = lambda p: _plane_tokens(p, rows)
                    return [jnp.where(tok0 + tok(p) < n, x, -jnp.inf) for p, x in enumerate(xs)]

                # Only the last sub-step of a row can hold such tokens: the others skip the
                # compare and select per element (a branch per sub-step instead).
                st = lax.cond(tok0 + SUB <= n, list, masked, st)
                if lgmax:  # the running max over logit + log2 s_t keeps B = P * s_t * c_p small
                    pre = val_prep(v)  # (pk: per tile)
                    st = [x + pre[p][0] for p, x in enumerate(st)]
                if wsm:
                    return warp_sub_step(v, st, pre, (m_run, l_t, accs, zaccs))
                tmax = st[0]
                for x in st[1:]:
                    tmax = jnp.maximum(tmax, x)
                if lazy_mx:  # m_run: (m + slack, the tiles' m - b_shift) (`lazy_state`)
                    m_new, l_t, accs, zaccs = lazy_softmax(st, tmax, pre, m_run, l_t, accs,
                                                           zaccs)
                    return value_product(v, accs, zaccs, m_new, l_t, synced=True)
                mx = loop_max(tmax)
                if pk:  # a head's max over both halves (its even and odd planes)
                    mx = jnp.maximum(mx, _swap_halves(mx, interpret))
                if lazy_sh:  # rescaled only when the max grew by more than the slack
                    nz = len(zaccs)
                    m_new, (l_t, *rest) = _lazy_rescale(m_run, mx, [l_t, *zaccs, *accs], slack)
                    zaccs, accs = tuple(rest[:nz]), tuple(rest[nz:])
                    resc = lambda x: x
                else:
                    m_new = jnp.maximum(m_run, mx)
                    alpha = jnp.exp2(m_run - m_new)  # logits in log2 units (`_kivi_decode`)
                    ab = lax.broadcast_in_dim(alpha, (PLANE, NP), [1])
                    resc = lambda x: x * ab
                if lgmax:  # B = P * s_t * c_p (the scale folded into the exponent), f32 sums
                    bs = lg_weights(st, m_shifts(m_new))
                    l_t, zacc = lg_sums(resc(l_t), resc(zaccs[0]), bs, pre)
                    zaccs = (zacc,)
                elif fvw:  # P of plane p stored as P * 2^(_VW_C - bits j)
                    ps = [jnp.exp2(x - lax.broadcast_in_dim(m_new - vw_const(p, False),
                                                            (PLANE, NP), [1]))
                          for p, x in enumerate(st)]
                    l_t = resc(l_t)
                    for p, x in enumerate(ps):
                        l_t = l_t + x * vw_const(p, True, (PLANE, NP))
                    zaccs = tuple(resc(z) for z in zaccs)
                else:
                    mb = lax.broadcast_in_dim(m_new, (PLANE, NP), [1])
                    ps = [jnp.exp2(x - mb) for x in st]
                    l_t = resc(l_t)
                    for x in ps:
                        l_t = l_t + x
                accs = tuple(resc(a) for a in accs)
                if tuning.skip == "values":
                    return m_new, l_t, accs, zaccs
                corr = None
                if fv and not vsub:
                    corr, zaccs = _fold_values(v, ps, tuple(resc(z) for z in zaccs))
                if f8v:  # the B operand of every plane: e4m3 (through fp16) of B'
                    for p in range(planes):
                        x16 = plgpu.layout_cast(bs[p].astype(f16), _WGT)
                        p_s.at[p].T[...] = x16.astype(p_s.dtype)
                if vsub:
                    for p in range(tiles):
                        _store_tile(bs[p].astype(f16), p)
                # P^T tiles go to SMEM as wgmma's B operand (K = 64 tokens, N = heads): stored in
                # the accumulator's own layout (p_direct, N >= 16), or transposed to [N, tokens]
                # rows, one plane at a time or all planes in one store (p_concat); fv: P * s_t,
                # stored by _fold_values.
                if tuning.p_direct:
                    for p in range(planes):
                        p_s[p] = ps[p].astype(f16)
                    pb = lambda p: p_s.at[p]
                elif tuning.p_concat:
                    p_s.T[...] = plgpu.layout_cast(jnp.concatenate(ps, axis=0).astype(f16), _WGT)
                    pb = lambda p: p_s.at[:, pl.ds(p * PLANE, PLANE)].T
                else:
                    if not (fv or f8v):
                        for p in range(tiles):
                            _store_tile(ps[p].astype(f16), p)
                    pb = lambda p: p_s.at[p].T
                if not mmv:  # wgmma reads P through the async proxy; mma.sync's loads do not
                    plgpu.commit_smem()  # (they need only the warpgroup barrier below)
                return value_product(v, accs, zaccs, m_new, l_t, corr=corr, pb=pb)

            def value_product(v, accs, zaccs, m_new, l_t, corr=None, pb=None, synced=False):
                """The sub-step's value product over P in p_s (stored by every warp; synced:
                the warpgroup barrier after its stores has passed) into accs."""
                if pb is None:
                    pb = lambda p: p_s.at[p].T
                vt = (v_field8 if f8v else v_codes_sub if vsub else v_codes_warp if fvw else
                      functools.partial(v_codes, raw=True) if fv else v_tile)
                vd = ex["vd8_s"] if f8v else vd_s
                cache = {}
                if mmv:  # P (stored by every warp) as each warp's B operand, in registers
                    if not synced:
                        _wg_sync(interpret)
                    new = [zero() for _ in range(mtiles)] if f8v else list(accs)
                    vec = functools.partial(_warp_vec_load, groups=vw_groups, perm=True,
                                            wide=tuning.vec64, align4=True)
                    ng = max(vw_groups) + 1  # fvw: value groups per token
                    for p in range(planes):
                        if pk and not pzv:  # tile p // 2's P: B of both its planes, whose
                            # products go to the even (accs[:mtiles]) and odd (accs[mtiles:])
                            # sets
                            if p % 2 == 0:
                                t = p // 2
                                b = _mma_rhs(pb(t), interpret)
                                if fvw:  # both planes' minimums' terms, B's halves scaled
                                    # by their own plane's value scales
                                    c = _group_min_mma(v["vmin"](p)(0, ng), p_s.at[t],
                                                       v["vmin"](p + 1)(0, ng))
                                    zaccs = (zaccs[0] + c * vw_const(t, True, (PLANE, NP)),)
                                    b = _scale_rhs(b, vec(v["vscale2"](p), n_half=PLANE))
                            for mt in range(mtiles):
                                i = mt + mtiles * (p % 2)
                                new[i] = _mma(new[i], vt(v, p, mt, cache), b, interpret)
                            continue
                        b = _mma_rhs(pb(p), interpret)
                        if fvw:  # sum_t z_t P_t of the warp's group; B = P * s_t
                            # the minimums' term of all groups over the warp's own tokens
                            c = _group_min_mma(v["vmin"](p)(0, ng), p_s.at[p])
                            zaccs = (zaccs[0] + c * 2.0 ** -vw_shift(p),)
                            b = _scale_rhs(b, vec(v["vscale"](p)))
                        for mt in range(mtiles):
                            new[mt] = _mma(new[mt], vt(v, p, mt, cache), b, interpret)
                    # f8v: a sub-step's product in fresh accumulators, as for wgmma
                    accs = tuple(a + x for a, x in zip(accs, new, strict=True)) if f8v else \
                        tuple(new)
                elif stage_smem:
                    new = []
                    for mt in range(mtiles):
                        def pv(acc, mt=mt):
                            cache = {}  # values loaded in one scope must not leak into another
                            for p in range(planes):
                                vd[...] = vt(v, p, mt, cache)
                                plgpu.commit_smem()
                                plgpu.wgmma(acc, vd, pb(p))
                                plgpu.wgmma_wait(0)
                            return acc[...]
                        new.append(accs[mt] + pl.run_scoped(
                            pv, plgpu.ACC((PLANE, NP), jnp.float32)))
                    accs = tuple(new)
                else:
                    def pv(acc_refs):
                        for p in range(planes):
                            for mt in range(mtiles):
                                plgpu.wgmma(acc_refs[mt], vt(v, p, mt, cache), pb(p))
                                if tuning.lean_values:
                                    plgpu.wgmma_wait(1)
                            if tuning.lean_values:
                                pass
                            elif p and tuning.overlap:
                                plgpu.wgmma_wait(mtiles)
                            elif not tuning.overlap:
                                plgpu.wgmma_wait(0)
                        plgpu.wgmma_wait(0)
                    if f8v:
                        # Hopper's fp8 wgmma accumulates with ~14 significant bits (DeepSeek-V3,
                        # sec. 3.3.2; measured here: the error grew with the context, run 24):
                        # a sub-step's product goes into fresh accumulators, added in f32.
                        def fresh(*refs):
                            pv(refs)
                            return [a[...] for a in refs]
                        new = pl.run_scoped(fresh, *[plgpu.ACC((PLANE, NP), jnp.float32)] * mtiles)
                        accs = tuple(a + x for a, x in zip(accs, new, strict=True))
                    else:
                        accs = pl.run_state(pv)(tuple(plgpu.ACC.init(a) for a in accs))
                if corr is not None:  # the code fields' offsets, subtracted every sub-step
                    accs = tuple(a + corr for a in accs)
                return m_new, l_t, accs, zaccs

            def m_shifts(m):
                """lgmax: m - b_shift(p) of every score tile (pk: planes 2t and 2t + 1 in the
                tile's halves), for the running max m."""
                return [(_halves(m - b_shift(2 * t), m - b_shift(2 * t + 1), interpret)
                         if pk else m - b_shift(t)) for t in range(tiles)]

            def lg_weights(st, mps):
                """lgmax: the value product's B = 2^(logit + log2 s_t - m + b_shift(p)) of
                every score tile, from the running max's `m_shifts` mps."""
                return [jnp.exp2(x - lax.broadcast_in_dim(mv, (PLANE, NP), [1]))
                        for x, mv in zip(st, mps, strict=True)]

            def lazy_state(m):
                """lazy_max: the loop's running-max state for the running max m: m + slack (the
                vote's threshold) and the tiles' `m_shifts`, so that a common step forms
                neither; m itself is thr - slack (in f32, to ~2^-24 of |m| + slack)."""
                return (m + slack, *m_shifts(m))

            def lg_sums(l_t, zacc, bs, pre):
                """lgmax: the running sums of P = B * u and P * z_t = B * (z_t * u) (`val_prep`)
                over the tiles' weights bs."""
                for p, x in enumerate(bs):
                    l_t, zacc = l_t + x * pre[p][1], zacc + x * pre[p][2]
                return l_t, zacc

            def lazy_softmax(st, tmax, pre, mstate, l_t, accs, zaccs):
                """lazy_max: the sub-step's softmax update with P (B = P * s_t * c_p) computed
                against the running max m and stored before anything crosses the warps; the
                barrier that hands P over also ORs whether some score passes m + slack
                (`_exceed_barrier`). If none does (the common step): the sums, the state kept.
                Else: the exact cross-warp max (`_wg_max_open`), the rescale, P recomputed and
                stored again, one more barrier. mstate: `lazy_state(m)`, carried so that a
                common step forms neither the threshold nor the shifts. Returns (mstate,
                l_t, accs, zaccs) with P in p_s behind a barrier."""
                def store(bs):
                    for p in range(tiles):
                        _store_tile(bs[p].astype(f16), p)

                thr, *mps = mstate
                bs = lg_weights(st, mps)  # past thr (or m = -inf) redone below
                store(bs)
                exceed = _exceed_barrier(tmax, thr)  # the barrier after the stores

                def fast():
                    l2, z2 = lg_sums(l_t, zaccs[0], bs, pre)
                    return mstate, l2, accs, (z2,)

                def slow():
                    mx = loop_max(tmax)  # its barrier; the one below orders its reads
                    if pk:  # a head's max over both halves (its even and odd planes)
                        mx = jnp.maximum(mx, _swap_halves(mx, interpret))
                    m_run = thr - slack
                    m_new = jnp.maximum(m_run, mx)
                    ab = lax.broadcast_in_dim(jnp.exp2(m_run - m_new), (PLANE, NP), [1])
                    new = lazy_state(m_new)
                    bs2 = lg_weights(st, new[1:])
                    l2, z2 = lg_sums(l_t * ab, zaccs[0] * ab, bs2, pre)
                    store(bs2)
                    _wg_sync(interpret)
                    return new, l2, tuple(a * ab for a in accs), (z2,)

                return lax.cond(exceed > 0, slow, fast)

            def warp_sub_step(v, st, pre, carry):
                """The softmax update and value product of a sub-step per warp (wsm): each
                warp's running max, sums and (D/16 channel tiles of) output cover the tokens of
                its own key rows, 16 per plane; P goes from the score registers into the value
                product's B operand by `_warp_rhs`, each warp loads the value code bytes of its
                tokens for every channel (`_warp_value_codes`). No SMEM writes, no barrier."""
                m_run, l_t, accs, (zacc,) = carry
                tmax = st[0]
                for x in st[1:]:
                    tmax = jnp.maximum(tmax, x)
                mw = _warp_max(tmax)
                if slack:
                    m_new, (l_t, zacc, *accs) = _lazy_rescale(m_run, mw, [l_t, zacc, *accs],
                                                              slack)
                else:
                    m_new = jnp.maximum(m_run, mw)
                # a warp whose tokens are all masked so far keeps m = -inf: a finite stand-in
                # keeps the exponents at -inf (weights 0) rather than NaN
                ms = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                if not slack:
                    ab = lax.broadcast_in_dim(jnp.exp2(m_run - ms), (PLANE, NP), [1])
                    l_t, zacc = l_t * ab, zacc * ab
                    accs = [a * ab for a in accs]
                bs = [jnp.exp2(x - lax.broadcast_in_dim(ms - b_shift(p), (PLANE, NP), [1]))
                      for p, x in enumerate(st)]
                for p, x in enumerate(bs):
                    l_t, zacc = l_t + x * pre[p][1], zacc + x * pre[p][2]
                accs = list(accs)
                if tuning.skip != "values":  # (the ablation keeps the softmax, drops P . V)
                    rhs = [_warp_rhs(x.astype(f16)) for x in bs]
                    for m in range(D // 16):
                        for r in range(planes // Pv):
                            codes = _warp_value_codes(v["vc"], vtf, m, r * PLANE)
                            for j in range(Pv):
                                accs[m] = _mma(accs[m], _field_sub(codes, value_bits, j),
                                               rhs[r * Pv + j], interpret)
                return m_new, l_t, tuple(accs), (zacc,)

            def _store_tile(x16, t):
                """Score tile t's P (pk: planes 2t and 2t + 1) as the value product's B: pzv,
                one [N, 64] tile per plane (columns 0-3 into plane 2t's rows 0-3, 4-7 into
                plane 2t + 1's), else p_s[t]."""
                if not pzv:
                    return _store_p(x16, t)
                if w8:
                    return _store_p_perm(x16, p_s.at[pl.ds(2 * t, 2)], split=True)
                p_s[2 * t, 0:4, :] = x16[:, 0:4].T
                p_s[2 * t + 1, 0:4, :] = x16[:, 4:8].T

            def _store_p(x16, idx):
                """A (64 tokens, N) fp16 tile as the B operand p_s[idx] ([N, 64], tokens in the
                widen8 order when w8)."""
                if w8:
                    _store_p_perm(x16, p_s.at[idx])
                else:
                    p_s.at[idx].T[...] = plgpu.layout_cast(x16, _WGT)

            def _fold_values(v, ps, zaccs):
                """fv (one channel group per token): stores P * s_t (fp16) of every plane as the B
                operand and returns (corr, zaccs): corr the (64, N) broadcast of
                -sum_t offset_j * fp16(P * s_t) (the offsets the raw code fields carry into the
                product, from the rounded values wgmma sees, so they cancel up to the f32 sums),
                zaccs[0] += P * z_t elementwise (the minimums' term, reduced at the end)."""
                (zacc,) = zaccs
                coff = None
                for p in range(planes):
                    sv = plgpu.load(v["vscale"](p)(0), (), layout=_WG.reduce(1))
                    zv = plgpu.load(v["vmin"](p)(0), (), layout=_WG.reduce(1))
                    sb = lax.broadcast_in_dim(sv.astype(jnp.float32), (PLANE, NP), [0])
                    zb = lax.broadcast_in_dim(zv.astype(jnp.float32), (PLANE, NP), [0])
                    pp = (ps[p] * sb).astype(f16)
                    _store_p(pp, p)
                    c = pp.astype(jnp.float32) * -_field_offset(value_bits, p % Pv)
                    coff = c if coff is None else coff + c
                    zacc = zacc + ps[p] * zb
                return lax.broadcast_in_dim(red(coff, "add"), (PLANE, NP), [1]), (zacc,)

            m0 = plgpu.layout_cast(jnp.full((NP,), -jnp.inf, jnp.float32), _WG.reduce(0))
            l0 = plgpu.layout_cast(jnp.zeros((PLANE, NP), jnp.float32), _WG)
            zero = lambda: plgpu.layout_cast(jnp.zeros((PLANE, NP), jnp.float32), _WG)
            # pk: the value products of the even planes, then of the odd planes (pzv: one set,
            # every plane's product in columns 0-3)
            a0 = tuple(zero() for _ in range(D // 16 if wsm else
                                             mtiles * (2 if pk and not pzv else 1)))
            if pzv:  # the planes' B tiles: rows 4-7 stay zero (the stores write rows 0-3)
                if interpret:
                    p_s[...] = jnp.zeros(p_s.shape, p_s.dtype)
                else:
                    _zero_smem(p_s, _swz(f16, PLANE))
                    _wg_sync(interpret)
            z0 = (zero(),) if fv or f8v or fvw else ()  # fv, f8v, fvw: sum_t P * z_t
            # Block indices are offset by this split's first step (a traced value).
            if tuning.skip == "loads":  # ablation: two blocks over and over (L2-resident)
                blk = lambda i: first + lax.rem(i, 2)
            else:
                blk = lambda i: first + i
            specs = [plgpu.BlockSpec(shape, functools.partial(block_index, len(shape), axis, blk),
                                     transforms=tf)
                     for shape, _, tf, axis in pipe_blocks]
            srcs = [x.at[layer, b, h] for x in gmem]
            if db:  # the first minimums block (`bias_step` copies the others)
                pl.when(nsteps > 0)(lambda: fetch_bias(0))
            m_init = lazy_state(m0) if lazy_mx else m0
            if own_pipe:
                m_run, l_t, accs, zaccs = _pipeline(
                    step, [specs[j] for j in piped], [srcs[j] for j in piped],
                    [sc[f"buf{j}"].at[wg] for j in piped],
                    sc["pipe_bar"], wg, stages, nsteps, (m_init, l0, a0, z0), sync=no_auto,
                    one_warp=one_warp, empty=sc["empty_bar"] if release else None,
                    issuer=copy_warp, spread=tuning.spread_copies,
                    no_copies=tuning.skip == "copies", sync_every=lazy_mx)
            else:
                m_run, l_t, accs, zaccs = plgpu.emit_pipeline(
                    step, grid=(nsteps,), in_specs=specs, max_concurrent_steps=stages,
                    init_carry=(m_init, l0, a0, z0),
                )(*srcs)
            if lazy_mx:
                m_run = m_run[0] - slack
            if wsm:  # the warps' partial softmax states -> the warpgroup's
                m_all = red(lax.broadcast_in_dim(m_run, (PLANE, NP), [1]), "max")
                fw = lax.broadcast_in_dim(
                    jnp.exp2(m_run - jnp.where(m_all == -jnp.inf, 0.0, m_all)), (PLANE, NP), [1])
                m_run, l_t, zaccs = m_all, l_t * fw, (zaccs[0] * fw,)
            l = red(l_t, "add")
            if pk:  # columns 0-3: heads over the even planes; 4-7: over the odd ones
                l = l + _swap_halves(l, interpret)
                if not pzv:  # (pzv: every plane's value product in columns 0-3 already)
                    accs = [accs[mt] + _swap_halves(accs[mtiles + mt], interpret)
                            for mt in range(mtiles)]
            ok = l > 0
            inv = jnp.where(ok, 1.0 / jnp.where(ok, l, 1.0), 0.0)
            ib = lax.broadcast_in_dim(inv, (PLANE, NP), [1])
            if fv or f8v:  # the minimums' term; lgmax: the codes' product weighs 2^-1 (f8v)
                # or 2^(_VSUB_C - 24) (vsub)
                zs = red(zaccs[0], "add")
                if pk:
                    zs = zs + _swap_halves(zs, interpret)
                zs = lax.broadcast_in_dim(zs, (PLANE, NP), [1])
                cw = 2.0 if f8v else float(2 ** (24 - _VSUB_C + slack)) if vsub else 1.0
                if wsm:  # o = sum over warps of acc * fw * cw / l, plus zs / l
                    for mt in range(mtiles):
                        o_s[pl.ds(mt * PLANE, PLANE), :] = zs * ib
                    _wg_sync(interpret)
                    _merge_warp_rows([a * (fw * (cw * ib)) for a in accs], o_s)
                else:
                    accs = [(a * cw if cw != 1.0 else a) + zs for a in accs]
            if fvw:  # the codes' product weighs 2^(_VW_C - 24); the warp's minimums' term,
                # its group's sums over the four warps' tokens
                zt = _warp_group_sum(zaccs[0], vw_groups, red_s)
                if pk:  # columns 4-7: the odd planes' terms of heads 0-3
                    zt = zt + _swap_halves(zt, interpret)
                accs = [a * float(2 ** (24 - _VW_C)) + zt for a in accs]
            for mt in range(mtiles if not wsm else 0):
                o_s[pl.ds(mt * PLANE, PLANE), :] = accs[mt] * ib
            # log2 units -> natural log
            lse = (m_run + jnp.log2(jnp.where(ok, l, 1.0))) * float(np.log(2.0))
            lse_s[...] = jnp.where(ok, lse, -jnp.inf)
            if tuning.trace:  # start, end and SM id over the padded heads' columns
                _wg_sync(interpret)
                _copy_stamp(own("trace_s"), lse_s, NP - 3)
                _stamp(lse_s, NP - 2)
                _stamp(lse_s, NP - 1, smid=True)
            if C:
                merge(wg, b, h, lax.div(s, jnp.int32(W)), o_s, lse_s)
                return
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, o_g.at[b, h, s])
            plgpu.copy_smem_to_gmem(lse_s, lse_g.at[b, h, s])
            plgpu.wait_smem_to_gmem(0)

        def merge(wg, b, h, c, o_s, lse_s):
            """merge_splits: the row's partials meet in block 0 (c), warpgroup 0 merges them
            into its own tiles and writes the row; blocks c > 0 stay until it has read them."""
            _wg_sync(interpret)  # every thread's o_s / lse_s stores before the arrival
            plgpu.barrier_arrive(sc["ready"])
            lead = c == 0
            if W > 1:
                lead = lead & (wg == 0)

            @pl.when(lead)
            def _():
                plgpu.barrier_wait(sc["ready"])
                _merge_splits(sc["o_s"], sc["lse_s"], W=W, C=C, interpret=interpret)
                _wg_sync(interpret)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_s, o_g.at[b, h])
                plgpu.copy_smem_to_gmem(lse_s, lse_g.at[b, h])
                plgpu.wait_smem_to_gmem(0)

            if C > 1:  # each block's warpgroup 0 arrives once, block 0's after its reads
                pl.when(wg == 0)(lambda: plgpu.barrier_arrive(sc["done"]))
                pl.when(c != 0)(lambda: plgpu.barrier_wait(sc["done"]))

        if C:  # one cluster of C blocks per row (b, h); split s = c W + wg
            wg = lax.axis_index("wg") if W > 1 else 0
            r, c = lax.axis_index("row"), lax.axis_index("c")
            unit(wg, lax.div(r, jnp.int32(Hkv)), lax.rem(r, jnp.int32(Hkv)), c * W + wg)
        elif W > 1:  # unit u = (b, h, s) of this warpgroup; the last block may have idle ones
            wg = lax.axis_index("wg")
            u = lax.axis_index("blk") * W + wg
            b, h, s = lax.div(u, Hkv * S), lax.rem(lax.div(u, S), Hkv), lax.rem(u, S)
            pl.when(u < B * Hkv * S)(lambda: unit(wg, b, h, s))
        else:
            unit(0, lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s"))

    # W > 1: every buffer has a leading warpgroup axis.
    per_wg = lambda *shape: (W, *shape) if W > 1 else shape
    scratch = {
        "q_s": plgpu.SMEM(per_wg(KCH, NP, DC), f16, transforms=_swz(f16, DC)),
        "p_s": (plgpu.SMEM(per_wg(8, 64), f16) if wsm else  # P stays in registers
                plgpu.SMEM(per_wg(planes, NP, PLANE), jnp.float8_e4m3fn,
                           transforms=_swz(jnp.float8_e4m3fn, PLANE)) if f8v else
                plgpu.SMEM(per_wg(planes, PLANE, NP), f16, transforms=_swz(f16, NP))
                if tuning.p_direct else
                plgpu.SMEM(per_wg(NP, SUB), f16, transforms=_swz(f16, SUB)) if tuning.p_concat
                else plgpu.SMEM(per_wg(planes, NP, PLANE), f16, transforms=_swz(f16, PLANE))),
        "o_s": plgpu.SMEM(per_wg(D, NP), jnp.float32),
        "lse_s": plgpu.SMEM(per_wg(NP), jnp.float32),
        # Staging tiles for the interpreter's SMEM-only wgmma (tiny placeholders otherwise).
        "kd_s": plgpu.SMEM(per_wg(PLANE, DC) if stage_smem else per_wg(8, 64), f16,
                           transforms=_swz(f16, DC if stage_smem else 64)),
        "vd_s": plgpu.SMEM(per_wg(PLANE, PLANE) if stage_smem else per_wg(8, 64), f16,
                           transforms=_swz(f16, 64)),
        "bar": plgpu.Barrier(num_barriers=W) if W > 1 else plgpu.Barrier(),
    }
    if f8v:  # the interpreter's SMEM-staged e4m3 A operand (a placeholder natively)
        scratch["vd8_s"] = plgpu.SMEM(per_wg(PLANE, PLANE) if stage_smem else per_wg(8, 64),
                                      jnp.float8_e4m3fn, transforms=_swz(jnp.float8_e4m3fn, 64))
    if own_pipe:  # the pipeline's buffers and barriers, per warpgroup
        for j in piped:
            shape, dtype, tf, _ = pipe_blocks[j]
            scratch[f"buf{j}"] = plgpu.SMEM((W, stages, *shape), dtype, transforms=tf)
        scratch["pipe_bar"] = plgpu.Barrier(num_arrivals=len(piped), num_barriers=W * stages)
        if release:
            scratch["empty_bar"] = plgpu.Barrier(num_arrivals=1, num_barriers=W * stages)
    if db:  # dense_bias: a minimums block, the bias rows of its 16 groups (per warp), the
        # block's barrier
        scratch["kzc_s"] = plgpu.SMEM(per_wg(_BIAS_ROWS, D), f16)
        scratch["kb_s"] = plgpu.SMEM(per_wg(_BIAS_ROWS, 4, NP), jnp.float32)
        scratch["kz_bar"] = (plgpu.Barrier(num_arrivals=1, num_barriers=W) if W > 1 else
                             plgpu.Barrier(num_arrivals=1))
    if C:  # merge_splits: every warpgroup's partial ready; block 0's reads done
        scratch["ready"] = plgpu.ClusterBarrier(collective_axes=("c",), num_arrivals=W)
        if C > 1:
            scratch["done"] = plgpu.ClusterBarrier(collective_axes=("c",), num_arrivals=1)
    if tuning.trace:  # the unit's start stamp (diagnostics)
        scratch["trace_s"] = plgpu.SMEM(per_wg(8), jnp.float32)
    if not interpret:  # the cross-warp reductions' scratch (`_wg_reduce`, `_wg_max_open`)
        scratch["red_s"] = plgpu.SMEM(per_wg(_red_scratch(NP)), jnp.float32)
    scratch_names = list(scratch)
    threads = dict(num_threads=W, thread_name="wg") if W > 1 else {}
    if C:
        grid = dict(grid=(B * Hkv,), grid_names=("row",), cluster=(C,), cluster_names=("c",),
                    **threads)
        parts = ()  # the merged row
    elif W > 1:
        grid = dict(grid=(-(-B * Hkv * S // W),), grid_names=("blk",), **threads)
        parts = (S,)
    else:
        grid = dict(grid=(B, Hkv, S), grid_names=("b", "h", "s"))
        parts = (S,)
    return plgpu.kernel(
        kivi_decode_sm90,
        out_type=(jax.ShapeDtypeStruct((B, Hkv, *parts, D, NP), jnp.float32),
                  jax.ShapeDtypeStruct((B, Hkv, *parts, NP), jnp.float32)),
        **grid,
        scratch_types=list(scratch.values()),
        compiler_params=plgpu.CompilerParams(approx_math=True,
                                             unsafe_no_auto_barriers=no_auto),
        interpret=interpret,
    )



def _check_inputs(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, num_tokens, layer,
                  key_bits, value_bits, group_size):
    """Validates shapes and dtypes; returns (L, B, Hq, Hkv, D, Tq)."""
    for name, bits in (("key_bits", key_bits), ("value_bits", value_bits)):
        if bits not in SUPPORTED_BITS:
            raise NotImplementedError(f"{name}={bits}: only {SUPPORTED_BITS} are supported")
    if group_size not in SUPPORTED_GROUPS:
        raise NotImplementedError(f"group_size={group_size}: only {SUPPORTED_GROUPS} are supported")
    if q.ndim != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {q.shape}")
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise NotImplementedError(f"q dtype {q.dtype}: only bfloat16 and float16 are supported")
    B, Hq, D = q.shape
    if D not in SUPPORTED_HEAD_DIMS:
        raise NotImplementedError(f"head dim D={D}: only {SUPPORTED_HEAD_DIMS} are supported")
    if D % group_size:
        raise ValueError(f"group_size={group_size} must divide the head dim D={D} (value groups)")
    if k_codes.ndim != 5:
        raise ValueError(f"k_codes must be [L, B, Hkv, Tq/Pk, D], got shape {k_codes.shape}")
    L, _, Hkv, _, _ = k_codes.shape
    Pk, Pv = 8 // key_bits, 8 // value_bits
    Tq = k_codes.shape[3] * Pk
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"q heads Hq={Hq} must be a multiple of the kv heads Hkv={Hkv}")
    if Tq % 256 or Tq == 0:
        raise ValueError(
            f"quantized capacity Tq={Tq} (from k_codes) must be a positive multiple of 256")
    expect = {
        "k_codes": ((L, B, Hkv, Tq // Pk, D), jnp.uint8),
        "k_scale": ((L, B, Hkv, Tq // group_size, D), jnp.float16),
        "k_min": ((L, B, Hkv, Tq // group_size, D), jnp.float16),
        "v_codes": (((L, B, Hkv, Tq // Pv // PLANE, D, PLANE) if v_codes.ndim == 6 else
                     (L, B, Hkv, D, Tq // Pv)), jnp.uint8),
        "v_scale": ((L, B, Hkv, D // group_size, Tq), jnp.float16),
        "v_min": ((L, B, Hkv, D // group_size, Tq), jnp.float16),
    }
    got = dict(k_codes=k_codes, k_scale=k_scale, k_min=k_min, v_codes=v_codes, v_scale=v_scale,
               v_min=v_min)
    for name, (shape, dtype) in expect.items():
        x = got[name]
        if tuple(x.shape) != shape:
            raise ValueError(
                f"{name} must have shape {shape} (docs/layout.md), got {tuple(x.shape)}")
        if jnp.dtype(x.dtype) != jnp.dtype(dtype):
            raise ValueError(f"{name} must have dtype {jnp.dtype(dtype).name}, got {x.dtype}")
    nt_type = jnp.result_type(num_tokens)
    if tuple(jnp.shape(num_tokens)) != (B,) or not jnp.issubdtype(nt_type, jnp.integer):
        raise ValueError(f"num_tokens must be an int32 [B={B}] array, got {jnp.shape(num_tokens)}")
    if jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"layer must be an integer scalar, got {layer!r}")
    if Hq // Hkv > MAX_PADDED_HEADS:
        raise NotImplementedError(
            f"Hq/Hkv={Hq // Hkv} query heads per kv head (max {MAX_PADDED_HEADS})")
    return L, B, Hq, Hkv, D, Tq


def merge_partials(o_parts, lse_parts):
    """Log-sum-exp merge over the split axis. o_parts [..., S, D, N], lse_parts [..., S, N] ->
    (o [..., N, D], lse [..., N]); rows whose splits are all empty give o = 0, lse = -inf."""
    mx = lse_parts.max(axis=-2)
    safe = jnp.where(jnp.isfinite(mx), mx, 0.0)
    w = jnp.exp(lse_parts - safe[..., None, :])  # [..., S, N]; exp(-inf) = 0 for empty splits
    tot = w.sum(axis=-2)
    o = jnp.einsum("...sdn,...sn->...nd", o_parts, w)
    o = jnp.where((tot > 0)[..., None], o / jnp.where(tot > 0, tot, 1.0)[..., None], 0.0)
    lse = jnp.where(tot > 0, safe + jnp.log(jnp.where(tot > 0, tot, 1.0)), -jnp.inf)
    return o, lse


@functools.partial(
    jax.jit,
    static_argnames=("key_bits", "value_bits", "group_size", "sm_scale", "tuning", "interpret",
                     "stage_smem", "alt_layout"),
)
def _kivi_decode(q, cache, num_tokens, layer, *, key_bits, value_bits, group_size, sm_scale,
                 tuning, interpret, stage_smem, alt_layout=False):
    kern, args, nq = _kernel_call(
        q, cache, num_tokens, layer, key_bits=key_bits, value_bits=value_bits,
        group_size=group_size, sm_scale=sm_scale, tuning=tuning, interpret=interpret,
        stage_smem=stage_smem, alt_layout=alt_layout)
    o, lse = kern(*args)
    if _merge_cluster(tuning, interpret, alt_layout):  # merged in the kernel: [B, Hkv, D, NP]
        o = jnp.swapaxes(o, -1, -2)
    else:
        o, lse = merge_partials(o, lse)  # [B, Hkv, NP, D], [B, Hkv, NP]
    rows = value_channel_order(tuning, group_size, q.shape[-1], interpret, stage_smem)
    if rows is not None and not alt_layout:  # fold_v_warp: output rows in the warps' order
        o = jnp.take(o, np.argsort(rows), axis=-1)
    B, Hq, D = q.shape
    return o[:, :, :nq].reshape(B, Hq, D), lse[:, :, :nq].reshape(B, Hq)


def _q_operand(q, tuning, interpret, Hkv, NP, group_size, sm_scale, pack):
    """q [B, Hq, D] -> the key product's B tiles [B, Hkv, KCH, NP, D / KCH] fp16: times sm_scale
    in float32, the padded heads zero (pack_planes without pack_zeros: q's heads repeated in
    columns 4-7), the widen8 contraction order. What `_q_tile` does inside the kernel with
    q_prologue."""
    B, Hq, D = q.shape
    nq = Hq // Hkv
    qf = (q.astype(jnp.float32) * sm_scale).reshape(B, Hkv, nq, D)
    qf = jnp.pad(qf, ((0, 0), (0, 0), (0, NP - nq), (0, 0)))
    qf = qf.astype(_MMA_DTYPE)
    if _uses_widen8(tuning, interpret):  # key tile channels in the _PERM16 order
        qf = permute_contraction(qf)
    # Head-dim chunks of the key product as separate [NP, D/k] tiles (the wgmma B operands).
    kch = _key_chunks(tuning, D, group_size)
    qf = jnp.swapaxes(qf.reshape(B, Hkv, NP, kch, D // kch), 2, 3)
    if pack and not tuning.pack_zeros:  # q's heads also in columns 4-7 (zero padding): B
        qf = qf + jnp.roll(qf, 4, axis=3)  # for both planes
    return qf


def _kernel_call(q, cache, num_tokens, layer, *, key_bits, value_bits, group_size, sm_scale,
                 tuning, interpret, stage_smem, alt_layout=False):
    """The kernel of `_kivi_decode` and its operands: (kern, args, query heads per kv head);
    kern(*args) -> (o_parts [B, Hkv, S, D, NP], lse_parts [B, Hkv, S, NP]) before the merge
    (with merge_splits where it applies, the merged (o [B, Hkv, D, NP], lse [B, Hkv, NP]))
    (bench/overhead.py times it alone)."""
    if alt_layout:  # benchmark-only layout experiment; shapes as in `to_alt_layout`
        B, Hq, D = q.shape
        L, _, Hkv, rows, _ = cache[0].shape
        Tq = rows * (8 // key_bits)
    else:
        L, B, Hq, Hkv, D, Tq = _check_inputs(q, *cache, num_tokens, layer, key_bits, value_bits,
                                             group_size)
    if interpret is False and not _uses_widen8(tuning, False):
        raise NotImplementedError(
            f"tuning={tuning}: the natural-order paths (widen8=False, p_direct, p_concat, "
            "k_chunks=2) run only under the interpreter: natively only the widen8 path undoes "
            "the cache's stored byte order (kivi_jax.quant.swap_bytes)")
    nq = Hq // Hkv
    # wgmma N granularity is 8; storing P^T untransposed needs 32-byte rows (N >= 16).
    NP = max(16 if tuning.p_direct else 8, _padded_heads(nq))
    if tuning.trace and (interpret is not False or nq > NP - 3):
        raise NotImplementedError(
            f"tuning.trace (diagnostics) runs natively with at most {NP - 3} query heads per kv "
            f"head (got {nq}, interpret={interpret}): its stamps take three padded columns")
    # sm_scale is applied in float32 before the cast to the fp16 operand; the kernel works in
    # log2 units (exp2 without a multiply; ln s_t as log2 s_t), so log2(e) goes in with it.
    sm_scale = sm_scale * float(np.log2(np.e))
    pack = not alt_layout and _packs_planes(tuning, group_size, D, nq, interpret)
    if not alt_layout and _q_in_kernel(tuning, interpret, group_size, D):
        qf, q_scale = q.reshape(B, Hkv, nq, D), sm_scale  # the kernel's own prologue (`_q_tile`)
    else:
        qf, q_scale = _q_operand(q, tuning, interpret, Hkv, NP, group_size, sm_scale, pack), None
    # the layer and the row lengths as operands of their own: no concatenation to run per call
    layer1 = jnp.asarray(layer, jnp.int32).reshape(1)
    num_tokens = jnp.asarray(num_tokens, jnp.int32).reshape(B)
    if not alt_layout:
        k_codes, k_scale, k_min, v_codes, v_scale, v_min = cache
        vch = min(tuning.block_tokens, 256)
        v_scale = v_scale.reshape(*v_scale.shape[:-1], Tq // vch, vch)  # free: splits minor dim
        v_min = v_min.reshape(*v_min.shape[:-1], Tq // vch, vch)
        cache = (k_codes, k_scale, k_min, v_codes, v_scale, v_min)
    kern = _make_kernel(B=B, Hkv=Hkv, NP=NP, D=D, Tq=Tq, L=L, key_bits=key_bits,
                        value_bits=value_bits, G=group_size, tuning=tuning,
                        stage_smem=stage_smem, interpret=interpret, alt_layout=alt_layout,
                        pack=pack, vblock=not alt_layout and cache[3].ndim == 6,
                        nq=nq, q_scale=q_scale)
    return kern, (layer1, num_tokens, qf, *cache), nq


def to_alt_layout(k_codes, k_scale, k_min, v_codes, v_scale, v_min, *, value_bits, vch=256):
    """The experimental layout measured in docs/performance.md (not the project's layout):
    V codes as [L,B,Hkv,Tq/(64 Pv),D,64] (one contiguous block per 64*Pv tokens), key scale and
    minimum merged [L,B,Hkv,Tq/G,2,D], value scale and minimum merged [L,B,Hkv,D/G,Tq/vch,2,vch].
    """
    *lead, D, cols = v_codes.shape
    vc = v_codes.reshape(*lead, D, cols // PLANE, PLANE)
    vc = jnp.moveaxis(vc, -2, -3)
    ksz = jnp.stack([k_scale, k_min], axis=-2)
    *lead, dg, tq = v_scale.shape
    vs = v_scale.reshape(*lead, dg, tq // vch, vch)
    vz = v_min.reshape(*lead, dg, tq // vch, vch)
    vsz = jnp.stack([vs, vz], axis=-2)
    return k_codes, ksz, vc, vsz


def kivi_decode(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, num_tokens, layer, *,
                key_bits: int, value_bits: int, group_size: int, sm_scale: float,
                tuning: TuningConfig | None = None, interpret=False, low_precision: bool = False):
    """Decode attention of one query token per row over the quantized KIVI cache of one layer.

    q: [B, Hq, D] bf16/fp16. Cache arrays as docs/layout.md with the leading L axis:
    k_codes [L,B,Hkv,Tq/Pk,D] u8, k_scale/k_min [L,B,Hkv,Tq/G,D] f16, v_codes u8 as rows
    [L,B,Hkv,D,Tq/Pv] or in blocks of 64 byte columns [L,B,Hkv,Tq/(64 Pv),D,64]
    (`kivi_jax.quant.block_columns`; the cache blocks them at 2 bits, where the kernel is 4-10%
    faster over blocks, and keeps rows at 4; either form gives the same bits),
    v_scale/v_min [L,B,Hkv,D/G,Tq] f16. num_tokens [B] int32: attend to positions
    [0, num_tokens[b]) (clamped to Tq) of layer `layer` (int32 scalar, may be traced; the kernel
    reads both itself). Returns (o [B,Hq,D] f32 normalized, lse [B,Hq] f32 natural-log
    sum-exp of the scaled logits); rows with num_tokens == 0 give o = 0 and lse = -inf.

    `interpret`: False for the GPU; True or a `plgpu.InterpretGPUParams` runs the SMEM-staged
    variant under the Mosaic GPU interpreter (any backend). `low_precision`: turn on the opt-in
    fp8 value product (`TuningConfig.fp8_values`; it applies at G = D and changes nothing
    elsewhere) on `tuning` (its value product then on wgmma) or on choose_tuning's, the key
    product staying exact on mma.sync.
    Raises ValueError on bad shapes/dtypes or a tuning that does not fit, NotImplementedError
    on unsupported bits, group sizes, head dims or dtypes.
    """
    _, B, _, Hkv, D, Tq = _check_inputs(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min,
                                        num_tokens, layer, key_bits, value_bits, group_size)
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    elif interpret is None:
        interpret = False
    if tuning is None:
        tuning = choose_tuning(B, Hkv, Tq, key_bits=key_bits, value_bits=value_bits,
                               group_size=group_size, head_dim=D, fp8_values=low_precision,
                               q_heads=q.shape[1] // Hkv)
    elif low_precision:  # the fp8 value product on wgmma (fp8 mma.sync was slower, run 39)
        tuning = dataclasses.replace(
            tuning, fp8_values=True,
            mma_sync={"both": "keys", "values": ""}.get(tuning.mma_sync, tuning.mma_sync))
    need = max(_min_block(key_bits, value_bits), group_size)
    if tuning.block_tokens % need:
        raise ValueError(f"tuning.block_tokens={tuning.block_tokens} must be a multiple of {need} "
                         f"for key_bits={key_bits}, value_bits={value_bits}, G={group_size}")
    if Tq % tuning.block_tokens:
        raise ValueError(f"Tq={Tq} must be a multiple of tuning.block_tokens={tuning.block_tokens}")
    if tuning.block_tokens > 256 * (8 // key_bits):  # a TMA box is at most 256 rows
        raise ValueError(f"tuning.block_tokens={tuning.block_tokens} > {256 * (8 // key_bits)} "
                         f"(256 rows of {key_bits}-bit key codes per copy)")
    smem = smem_bytes(tuning, key_bits=key_bits, value_bits=value_bits, group_size=group_size,
                      head_dim=D, padded_heads=_padded_heads(q.shape[1] // Hkv))
    if smem > SMEM_LIMIT:
        raise ValueError(f"tuning={tuning} needs about {smem} bytes of shared memory "
                         f"(limit {SMEM_LIMIT}): fewer stages or smaller block_tokens")
    return _kivi_decode(q, (k_codes, k_scale, k_min, v_codes, v_scale, v_min), num_tokens, layer,
                        key_bits=key_bits, value_bits=value_bits, group_size=group_size,
                        sm_scale=float(sm_scale), tuning=tuning, interpret=interpret,
                        stage_smem=interpret is not False)


def _running_max(x, tuning: TuningConfig):
    """x [..., Tq] -> the kernel's running max at every position: the max over the position's
    split up to the end of its sub-step (splits of ceil(steps / S) steps of block_tokens,
    sub-steps of min(block_tokens, sub_tokens) tokens)."""
    Tq = x.shape[-1]
    TS = tuning.block_tokens
    SUB = min(TS, tuning.sub_tokens)
    sps = -(-(Tq // TS) // tuning.num_splits)  # steps per split
    sub_max = x.reshape(*x.shape[:-1], Tq // SUB, SUB).max(axis=-1)
    per = sps * TS // SUB  # sub-steps per split
    run = jnp.concatenate([lax.cummax(sub_max[..., a:a + per], axis=sub_max.ndim - 1)
                           for a in range(0, Tq // SUB, per)], axis=-1)
    return jnp.repeat(run, SUB, axis=-1)


def _unpack_layer(codes, bits, axis):
    """Codes of one layer with the tokens in order (the packing rule and the cache order are
    defined once, in kivi_jax.quant)."""
    from kivi_jax.quant import unpack_tokens

    return unpack_tokens(codes, bits, axis=axis)


def _cache_slot(t):
    from kivi_jax.quant import cache_slot

    return cache_slot(t)


def _token_order(x):
    """Per-token arrays [..., Tq] of the cache (value scales, minimums) from the cache order
    back to token order."""
    from kivi_jax.quant import to_cache_order

    return to_cache_order(x, -1)


@functools.partial(jax.jit, static_argnames=("key_bits", "value_bits", "group_size", "sm_scale",
                                             "fp8_values", "tuning"))
def kivi_decode_reference(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, num_tokens, layer,
                          *, key_bits: int, value_bits: int, group_size: int, sm_scale: float,
                          tuning=None, interpret=False, fp8_values: bool = False):
    """The kernel's twin in float32, in folded form: key scale folded into q per token group,
    value scale into p per token and channel group, minimums as biases. Same signature and
    outputs as `kivi_decode` (tuning/interpret ignored). fp8_values (G = D): P * s_t rounded
    to e4m3 through fp16 as the kernel does with `TuningConfig.fp8_values`, relative to the
    kernel's running max of logit + ln s_t (per split, updated every sub-step; `tuning` gives
    the splits and sub-steps, default `choose_tuning`'s), so the rounding is the kernel's up to
    f32 arithmetic."""
    del interpret
    L, B, Hq, Hkv, D, Tq = _check_inputs(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min,
                                         num_tokens, layer, key_bits, value_bits, group_size)
    G, nq = group_size, Hq // Hkv
    f32 = jnp.float32
    take = lambda x: lax.dynamic_index_in_dim(x, layer, 0, keepdims=False).astype(f32)
    sel = lambda x: lax.dynamic_index_in_dim(x, layer, 0, keepdims=False)
    kc = _unpack_layer(sel(k_codes), key_bits, 2)  # [B, Hkv, Tq, D]
    if v_codes.ndim == 6:  # the cache's blocked form
        from kivi_jax.quant import unblock_columns

        v_codes = unblock_columns(v_codes)
    vc = _unpack_layer(sel(v_codes), value_bits, 3)  # [B, Hkv, D, Tq]
    ks, kz = take(k_scale), take(k_min)
    vs, vz = _token_order(take(v_scale)), _token_order(take(v_min))
    qs = q.astype(f32).reshape(B, Hkv, nq, D) * sm_scale
    # keys: q'_g = q * s_g (per token group g), bias_g = q . z_g
    qg = qs[:, :, None] * ks[:, :, :, None, :]  # [B,H,Tq/G,nq,D]
    kcg = kc.astype(f32).reshape(B, Hkv, Tq // G, G, D)
    logits = jnp.einsum("bhgtd,bhgnd->bhngt", kcg, qg, precision="highest")
    logits = logits + jnp.einsum("bhgd,bhnd->bhng", kz, qs, precision="highest")[..., None]
    logits = logits.reshape(B, Hkv, nq, Tq)
    n = jnp.minimum(jnp.asarray(num_tokens, jnp.int32), Tq)
    valid = jnp.arange(Tq)[None, :] < n[:, None]  # [B, Tq]
    logits = jnp.where(valid[:, None, None], logits, -jnp.inf)
    mx = logits.max(axis=-1)
    safe = jnp.where(jnp.isfinite(mx), mx, 0.0)
    p = jnp.exp(logits - safe[..., None])  # [B,H,nq,Tq]
    tot = p.sum(axis=-1)
    # values: P'_c = p * s_v[t, c] per channel group c, bias = sum_t p * z_v[t, c]
    pg = p[:, :, :, None, :] * vs[:, :, None]  # [B,H,nq,D/G,Tq]
    if fp8_values:
        if G != D:
            raise ValueError(f"fp8_values needs group_size == head_dim, got G={G}, D={D}")
        if tuning is None:
            tuning = choose_tuning(B, Hkv, Tq, key_bits=key_bits, value_bits=value_bits,
                                   group_size=G, head_dim=D, q_heads=nq)
        s1 = jnp.maximum(vs[:, :, 0], 2.0 ** -24)[:, :, None]  # [B,H,1,Tq]
        lg = logits + jnp.log(s1)
        ref = _running_max(lg, tuning)  # the kernel's reference point of every token
        seen = jnp.isfinite(ref)  # positions before a split's first valid token: masked
        ref = jnp.where(seen, ref, 0.0)
        bt = jnp.exp(lg - ref)  # P * s_t <= 1 against the running max
        mx = lg.max(axis=-1)
        safe = jnp.where(jnp.isfinite(mx), mx, 0.0)
        rescale = jnp.where(seen, jnp.exp(ref - safe[..., None]), 0.0)  # the kernel's alphas
        p = bt / s1 * rescale
        tot = p.sum(axis=-1)
        Pv = 8 // value_bits  # field weight of each plane, then of each token's plane
        wgt = np.array([_f8_field_spec(value_bits, j)[2] for j in range(Pv)],
                       np.float32)[(_cache_slot(np.arange(Tq)) // PLANE) % Pv]
        b8 = (bt * (256.0 / wgt)).astype(jnp.float16).astype(jnp.float8_e4m3fn)
        pg = (b8.astype(f32) * (wgt / 256.0) * rescale)[:, :, :, None, :]
    vcg = vc.astype(f32).reshape(B, Hkv, D // G, G, Tq)
    o = jnp.einsum("bhncT,bhcgT->bhncg", pg, vcg, precision="highest")
    o = o + jnp.einsum("bhnT,bhcT->bhnc", p, vz, precision="highest")[..., None]
    o = o.reshape(B, Hkv, nq, D)
    ok = tot > 0
    o = jnp.where(ok[..., None], o / jnp.where(ok, tot, 1.0)[..., None], 0.0)
    lse = jnp.where(ok, safe + jnp.log(jnp.where(ok, tot, 1.0)), -jnp.inf)
    return o.reshape(B, Hq, D), lse.reshape(B, Hq)

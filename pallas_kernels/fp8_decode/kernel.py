"""The fp8 decode kernel: the body stage by stage, and the call around it.

A launch is a grid of units (b, h, split), one warpgroup each (flash-decoding). Unit (b, h, s)
streams the s-th slice of row b's slots for kv head h in tiles of 64 slots and leaves a
normalized partial (o, lse); `fp8_decode` merges the splits by log-sum-exp. Per tile:

    TMA      K [64, D] and V^T [D, 64] as fp8, their block scales [J, 64] (J = D / G), into
             one of STAGES slots ahead of the compute
    widen    K -> fp16 tile; V^T -> fp16 tile times each slot's value scale per channel block,
             so that P stays in [0, 1] (an fp16 P scaled by the value scales would underflow)
    scores   S^T[t, n] = sum_j ks_j[t] * (K q_j^T)[t, n]: one wgmma per channel block j with
             q zero outside block j (64 slots on M, the kv group's heads padded to 8 on N)
    softmax  online over the slots (axis 0), in log2 units (q carries sm_scale * log2(e))
    values   O^T[d, n] += Vs^T[d, :] . P^T[:, n]   (the D channels on M, heads on N)

Both products read their operands from shared memory (SMEM x SMEM wgmma: what the GPU
interpreter runs, so the CPU tests run the kernel itself). The slots are in the cache order
(`pallas_kernels.layout`: 8-bit rows are stored unswapped, so the key row of a slot and the
V^T column of that slot are one token); a slot is attended where its position is below the
row's `num_tokens`, so a unit reads whole 256-slot blocks up to the row's length.

Edges: a row with no positions (num_tokens 0) gives o = 0 and lse = -inf; a layer outside
[0, L) gives NaN (the reads are clamped); a non-finite element or scale gives NaN in the rows
and heads that attend to it. fp16 operands bound two ranges: |q * sm_scale * log2(e)| and
|dequantized value| below 65504 (an fp8 cache of 16-bit K/V holds values within that range).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.layout import CACHE_BLOCK, cache_slot
from pallas_kernels.merge import merge_partials
from pallas_kernels.tiles import (
    interpret_option,
    online_softmax_step,
    padded_heads,
    smem,
    write_partial,
)

TILE = 64  # slots per tile: wgmma's M for the scores
STAGES = 2  # tiles in flight per unit: the TMA copies run this far ahead of the compute
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_GROUPS = (32, 64, 128)  # channels per scale block (dividing D)
MAX_GROUP_HEADS = 32  # query heads per kv head (wgmma's N, padded to a multiple of 8)
SM_COUNT = 132  # H100 / H200
# Units per SM a launch aims at: an SM holds three at STAGES (shared memory), and a unit's steps
# are short and serial (copy wait, widening, two products), so more, shorter splits keep the
# copies flowing better than deeper prefetch does
UNITS_PER_SM = 16
LOG2E = math.log2(math.e)
F8 = jnp.float8_e4m3fn


def choose_splits(batch: int, kv_heads: int, capacity: int) -> int:
    """Token splits per (row, kv head): UNITS_PER_SM units per SM, at most one split per
    256-slot block."""
    want = -(-SM_COUNT * UNITS_PER_SM // (batch * kv_heads))
    return max(1, min(want, capacity // CACHE_BLOCK))


def check_inputs(q, k_codes, k_scale, v_codes, v_scale, num_tokens, group_size: int) -> None:
    """ValueError for shapes, dtypes and group sizes the kernel does not take."""
    if k_codes.ndim != 5 or v_codes.ndim != 5:
        raise ValueError(
            "k_codes [L, B, Hkv, Tq, D] and v_codes [L, B, Hkv, D, Tq] expected, got "
            f"{k_codes.shape} and {v_codes.shape}"
        )
    L, B, H, Tq, D = k_codes.shape
    J = D // group_size if group_size else 0
    expect = {
        "v_codes": ((L, B, H, D, Tq), v_codes.shape),
        "k_scale": ((L, B, H, J, Tq), k_scale.shape),
        "v_scale": ((L, B, H, J, Tq), v_scale.shape),
        "num_tokens": ((B,), num_tokens.shape),
    }
    for name, (want, got) in expect.items():
        if tuple(got) != want:
            raise ValueError(f"{name} must be {want} for k_codes {k_codes.shape}, got {got}")
    if q.ndim != 3 or q.shape[0] != B or q.shape[2] != D or q.shape[1] % H:
        raise ValueError(f"q must be [B={B}, Hq (a multiple of {H}), D={D}], got {q.shape}")
    if q.shape[1] // H > MAX_GROUP_HEADS:
        raise ValueError(
            f"at most {MAX_GROUP_HEADS} query heads per kv head, got {q.shape[1] // H}"
        )
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim must be one of {SUPPORTED_HEAD_DIMS}, got {D}")
    if group_size not in SUPPORTED_GROUPS or D % group_size:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUPS} dividing D={D}")
    if Tq % CACHE_BLOCK:
        raise ValueError(f"the slots must be a multiple of {CACHE_BLOCK}, got {Tq}")
    for name, x in (("k_codes", k_codes), ("v_codes", v_codes)):
        if x.dtype not in (jnp.uint8, F8):
            raise ValueError(f"{name} must be uint8 (stored E4M3 bytes) or float8_e4m3fn")
    for name, x in (("q", q), ("k_scale", k_scale), ("v_scale", v_scale)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got {x.dtype}")
    if not jnp.issubdtype(num_tokens.dtype, jnp.integer):
        raise ValueError(f"num_tokens must be integer, got {num_tokens.dtype}")


def query_blocks(q, kv_heads: int, group_size: int, sm_scale: float):
    """q [B, Hq, D] -> [B, Hkv, J, N, D] fp16: q * sm_scale * log2(e) (logits in log2 units),
    the kv group's heads padded to N with zeros, block j zero outside channel block j."""
    B, Hq, D = q.shape
    g = Hq // kv_heads
    qf = (q.astype(jnp.float32) * (sm_scale * LOG2E)).reshape(B, kv_heads, g, D)
    qf = jnp.pad(qf, ((0, 0), (0, 0), (0, padded_heads(g) - g), (0, 0)))
    blocks = jnp.arange(D)[None, :] // group_size == jnp.arange(D // group_size)[:, None]
    return jnp.where(blocks[:, None, :], qf[:, :, None], 0.0).astype(jnp.float16)


def _slot_positions(first_slot, shape):
    """The position of the token in each row's slot first_slot + i (axis 0 of `shape`)."""
    return cache_slot(first_slot + lax.broadcasted_iota(jnp.int32, shape, 0))


def _widen(k_s, v_s, vs_s, kb_s, vb_s, slot, group_size: int) -> None:
    """A slot's fp8 tiles to the fp16 operands: K as stored, V^T times its value scales (in
    chunks of 64 channels, the rows of a wgmma tile; a chunk spans 64 / G blocks at G < 64)."""
    kb_s[...] = k_s[slot].astype(jnp.float16)
    for c in range(vb_s.shape[0] // TILE):
        rows = pl.ds(c * TILE, TILE)
        v = v_s[slot, rows].astype(jnp.float16).astype(jnp.float32)
        first = c * TILE // group_size
        scale = vs_s[slot, first].astype(jnp.float32)[None, :]
        block = lax.broadcasted_iota(jnp.int32, v.shape, 0) // group_size
        for j in range(1, max(1, TILE // group_size)):
            scale = jnp.where(block == j, vs_s[slot, first + j].astype(jnp.float32)[None, :], scale)
        vb_s[rows] = (v * scale).astype(jnp.float16)
    plgpu.commit_smem()


def _scores(kb_s, q_s, ks_s, slot):
    """S^T [TILE, N] float32 of a tile: one product per channel block, times its key scales."""
    total = None
    for j in range(q_s.shape[0]):

        def product(acc, j=j):
            plgpu.wgmma(acc, kb_s, q_s.at[j].T)
            return acc[...]

        s = pl.run_scoped(product, plgpu.ACC((TILE, q_s.shape[1]), jnp.float32))
        s = s * ks_s[slot, j].astype(jnp.float32)[:, None]
        total = s if total is None else total + s
    return total


def _value_product(vb_s, p_s, p):
    """O^T [D, N] float32 of a tile: the scaled V^T against P (fp16, through shared memory)."""
    p_s.T[...] = p.astype(jnp.float16)
    plgpu.commit_smem()

    def product(acc):
        plgpu.wgmma(acc, vb_s, p_s.T)
        return acc[...]

    return pl.run_scoped(product, plgpu.ACC((vb_s.shape[0], p_s.shape[0]), jnp.float32))


def _body(group_size: int, per_split: int, stages: int):
    """The kernel body for splits of `per_split` tiles (a multiple of a 256-slot block)."""

    # the name Mosaic gives the kernel, which profiles show (bench/step_profile.py)
    def fp8_decode_kernel(q_g, k_g, ks_g, v_g, vs_g, held_g, layer_g, o_g, lse_g, *scratch):
        q_s, k_s, v_s, ks_s, vs_s, kb_s, vb_s, p_s, o_s, lse_s, loaded, q_loaded = scratch
        b, h, split = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
        layer, held = layer_g[0], held_g[b]
        first = split * per_split
        # whole 256-slot blocks up to the row's length: a block holds its positions in the
        # cache order, so its slots are masked by position, not by index
        tiles = jnp.clip(pl.cdiv(held, CACHE_BLOCK) * (CACHE_BLOCK // TILE) - first, 0, per_split)

        def fetch(t, slot):
            tokens = pl.ds((first + t) * TILE, TILE)
            bar = loaded.at[slot]
            plgpu.copy_gmem_to_smem(k_g.at[layer, b, h, tokens], k_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(v_g.at[layer, b, h, :, tokens], v_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(ks_g.at[layer, b, h, :, tokens], ks_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(vs_g.at[layer, b, h, :, tokens], vs_s.at[slot], bar)

        plgpu.copy_gmem_to_smem(q_g.at[b, h], q_s, q_loaded.at[0])
        for t in range(stages):
            pl.when(t < tiles)(functools.partial(fetch, t, t))
        plgpu.barrier_wait(q_loaded.at[0])

        def step(t, carry):
            o, m, l = carry
            slot = lax.rem(t, stages)
            plgpu.barrier_wait(loaded.at[slot])
            _widen(k_s, v_s, vs_s, kb_s, vb_s, slot, group_size)
            logits = _scores(kb_s, q_s, ks_s, slot)
            position = _slot_positions((first + t) * TILE, logits.shape)
            logits = jnp.where(position < held, logits, -jnp.inf)
            p, alpha, m, l = online_softmax_step(m, l, logits)
            o = o * alpha[None, :] + _value_product(vb_s, p_s, p)
            # the slot's copies were read before _value_product's barrier: refill it
            pl.when(t + stages < tiles)(lambda: fetch(t + stages, slot))
            return o, m, l

        D, N = o_s.shape
        # a finite floor for the running max: a tile of masked slots adds exp2(-inf) = 0
        init = (jnp.zeros((D, N), jnp.float32), jnp.full((N,), -1e30, jnp.float32))
        o, m, l = lax.fori_loop(0, tiles, step, (*init, jnp.zeros((N,), jnp.float32)))
        write_partial(o_s, lse_s, o_g.at[b, h, split], lse_g.at[b, h, split], o, m, l)

    return fp8_decode_kernel


def _launch(qb, k8, k_scale, v8, v_scale, held, layer, group_size, splits, stages, interpret):
    """The kernel over every unit: (o^T [B, Hkv, S, D, N], lse [B, Hkv, S, N] in log2 units)."""
    B, H, J, N, D = qb.shape
    tiles = k8.shape[3] // TILE
    blocks_per_split = -(-(tiles // (CACHE_BLOCK // TILE)) // splits)
    per_split = blocks_per_split * (CACHE_BLOCK // TILE)
    return plgpu.kernel(
        _body(group_size, per_split, stages),
        out_type=(
            jax.ShapeDtypeStruct((B, H, splits, D, N), jnp.float32),
            jax.ShapeDtypeStruct((B, H, splits, N), jnp.float32),
        ),
        grid=(B, H, splits),
        grid_names=("b", "h", "s"),
        scratch_types=[
            smem((J, N, D), jnp.float16, D),  # q per channel block
            smem((stages, TILE, D), F8, D),  # K tiles as copied
            smem((stages, D, TILE), F8, TILE),  # V^T tiles as copied
            smem((stages, J, TILE), k_scale.dtype),
            smem((stages, J, TILE), v_scale.dtype),
            smem((TILE, D), jnp.float16, D),  # K widened
            smem((D, TILE), jnp.float16, TILE),  # V^T widened and scaled
            smem((N, TILE), jnp.float16, TILE),  # P
            smem((D, N), jnp.float32),
            smem((N,), jnp.float32),
            plgpu.Barrier(num_arrivals=4, num_barriers=stages),
            plgpu.Barrier(num_arrivals=1, num_barriers=1),
        ],
        **interpret_option(interpret),
    )(qb, k8, k_scale, v8, v_scale, held, layer)


def fp8_decode(
    q,
    k_codes,
    k_scale,
    v_codes,
    v_scale,
    num_tokens,
    layer,
    *,
    group_size: int,
    sm_scale: float,
    splits: int | None = None,
    stages: int = STAGES,
    interpret=False,
):
    """Decode attention of q [B, Hq, D] over positions [0, num_tokens[b]) of `layer` of an fp8
    store pair, as the cache holds it: k_codes [L, B, Hkv, Tq, D] and v_codes (V^T)
    [L, B, Hkv, D, Tq], E4M3 bytes (uint8) or float8_e4m3fn, the slots in the cache order;
    k_scale, v_scale [L, B, Hkv, D / G, Tq] one scale per slot and channel block.
    -> (o [B, Hq, D] float32, lse [B, Hq] float32, natural log). `splits` token splits per
    (row, kv head) (default `choose_splits`); `interpret`: True or a `plgpu.InterpretGPUParams`
    runs the kernel under the GPU interpreter (any backend). Module doc: the edges."""
    check_inputs(q, k_codes, k_scale, v_codes, v_scale, num_tokens, group_size)
    L, B, H, Tq, D = k_codes.shape
    splits = choose_splits(B, H, Tq) if splits is None else splits
    if not 1 <= splits <= Tq // CACHE_BLOCK or stages < 1:
        raise ValueError(f"splits must be in [1, {Tq // CACHE_BLOCK}] and stages >= 1")
    return _fp8_decode(
        q,
        k_codes,
        k_scale,
        v_codes,
        v_scale,
        num_tokens,
        layer,
        group_size=group_size,
        sm_scale=sm_scale,
        splits=splits,
        stages=stages,
        interpret=interpret,
    )


# One jitted function: a model's layers call it with equal shapes, and XLA lowers (and Mosaic
# compiles) the kernel once for all of them instead of once per call site.
@functools.partial(
    jax.jit, static_argnames=("group_size", "sm_scale", "splits", "stages", "interpret")
)
def _fp8_decode(
    q, k_codes, k_scale, v_codes, v_scale, num_tokens, layer, *, group_size, sm_scale, splits,
    stages, interpret
):  # fmt: skip
    L, B, H, Tq, D = k_codes.shape
    layer = jnp.asarray(layer, jnp.int32)
    in_range = (layer >= 0) & (layer < L)
    to_f8 = lambda x: x if x.dtype == F8 else lax.bitcast_convert_type(x, F8)
    held = jnp.clip(num_tokens.astype(jnp.int32), 0, Tq)
    o_t, lse2 = _launch(
        query_blocks(q, H, group_size, sm_scale),
        to_f8(k_codes),
        k_scale,
        to_f8(v_codes),
        v_scale,
        held,
        jnp.clip(layer, 0, L - 1).reshape(1),
        group_size,
        splits,
        stages,
        interpret,
    )
    g = q.shape[1] // H
    o_parts = o_t.swapaxes(-1, -2)[..., :g, :]  # [B, Hkv, S, g, D]
    o, lse = merge_partials(o_parts, lse2[..., :g] / LOG2E, axis=2)
    o = jnp.where(in_range, o, jnp.nan)
    return o.reshape(B, H * g, D), lse.reshape(B, H * g)

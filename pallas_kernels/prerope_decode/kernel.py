"""The pre-RoPE decode kernel: the body stage by stage, and the call around it.

KIVI caches of keys quantized before RoPE (`KiviConfig.pre_rope`) hold codes that no product can
read as stored: a key's RoPE angle is its position's, so the key has to be dequantized, turned
into the model's basis and rotated by RoPE before it meets q. This kernel does that per tile in
registers, on the integer caches as they lie (`pallas_kernels.layout`: token-planar codes in the
cache order, key rows in the stored byte order, 2-bit V^T in blocks of 64 byte columns).

A launch is a grid of units (b, h, split), one warpgroup each (flash-decoding). A unit streams
its split's 256-token blocks (TMA copies of the key and V^T codes, the key scales and minimums
of the block's channel groups, the value scales and minimums of its slots) and leaves a
normalized partial (o, lse); `prerope_decode` merges the splits by log-sum-exp. A block is four
planes of 64 slots (a bit field of 64 byte rows of key codes, of 64 byte columns of V^T codes);
per plane:

    keys     the plane's codes times their channel group's scale plus its minimum -> fp16
             [64, D] (channels in the stored order)
    basis    two products with the basis matrix's halves: the stored channels to the model's
             (the byte swap undone and, for rotated keys, the Hadamard rotation too)
    RoPE     (x1 cos - x2 sin, x2 cos + x1 sin) at each slot's position (the angle in float32, as
             `kivi_jax.rotation.rope` computes it; approximate sine and cosine after a reduction
             to [-pi, pi]) -> fp16 halves
    scores   S^T [64, N] = K_lo q_lo^T + K_hi q_hi^T (heads padded to N, log2 units)
    softmax  online over the slots (axis 0)
    values   P scaled per slot by each channel group's value scale (bf16: no underflow), its
             slots put in V^T's stored column order by a product with the swap's permutation,
             then O^T += codes^T (bf16, exact) . P_j per group j, rows of group j kept; the
             value minimums times P accumulate per slot and are summed over the slots once,
             at the end

With residual windows or sink buffers (16-bit, full precision), one more unit per (b, h)
attends them in planes of 64 slots through the same steps: their keys in channel order (the
basis's second pair of halves), the values meeting P in their own dtype straight from the
buffers; its partial joins the merge.

Every product reads shared memory (SMEM x SMEM wgmma), which the GPU interpreter runs: the CPU
tests run the kernel itself.

Edges: a row with no held position gives o = 0, lse = -inf; a layer outside [0, L) gives NaN
(reads clamped); positions below `skip` are not read from the codes (the sinks: their buffers,
in the launch or by the caller); non-finite scales or minimums give NaN in the rows and heads
that attend them. fp16 bounds |dequantized key|, |window or sink key| and |q * sm_scale *
log2(e)| below 65504.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.layout import (
    CACHE_BLOCK,
    CACHE_PLANE,
    CODE_BLOCK,
    cache_slot,
    codes_per_byte,
    stored_byte,
    value_codes_blocked,
)
from pallas_kernels.merge import merge_partials
from pallas_kernels.tiles import (
    interpret_option,
    online_softmax_step,
    padded_heads,
    smem,
    smem_product,
    write_partial,
)

# Code blocks in flight per unit. One: a unit then holds ~95 KB of shared memory at D = 128 and
# two are resident per SM, whose interleaving hides more of a unit's serial steps (products
# waited on, reductions across warps) than a second stage of copies would
STAGES = 1
SUPPORTED_BITS = (2, 4)
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_GROUPS = (32, 64, 128)
MAX_GROUP_HEADS = 16  # query heads per kv head (N, padded to 8; the permutation's N is J * N)
SM_COUNT = 132  # H100 / H200
UNITS_PER_SM = 4  # two resident per SM (STAGES), two waves
LOG2E = math.log2(math.e)
# 2 pi in two parts for the reduction of RoPE angles: k * TWO_PI_HI is exact for |k| < 2^15
TWO_PI_HI = 6.28125
TWO_PI_LO = float(np.float32(2 * np.pi - 6.28125))


def choose_splits(batch: int, kv_heads: int, capacity: int) -> int:
    """Token splits per (row, kv head): UNITS_PER_SM units per SM, at most one split per
    256-token block."""
    want = -(-SM_COUNT * UNITS_PER_SM // (batch * kv_heads))
    return max(1, min(want, capacity // CACHE_BLOCK))


def capacity_of(v_codes, value_bits: int) -> int:
    """Tq, the slots per row, from the V^T codes as stored."""
    if value_codes_blocked(value_bits):
        return v_codes.shape[-3] * CODE_BLOCK * codes_per_byte(value_bits)
    return v_codes.shape[-1] * codes_per_byte(value_bits)


def check_inputs(
    q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, num_tokens, inv_freq, key_basis,
    *, key_bits: int, value_bits: int, group_size: int,
):  # fmt: skip
    """ValueError for shapes, dtypes, widths and group sizes the kernel does not take."""
    for name, bits in (("key_bits", key_bits), ("value_bits", value_bits)):
        if bits not in SUPPORTED_BITS:
            raise ValueError(f"{name} must be one of {SUPPORTED_BITS}, got {bits}")
    if k_codes.ndim != 5:
        raise ValueError(f"k_codes must be [L, B, Hkv, Tq/P, D], got {k_codes.shape}")
    L, B, H, rows, D = k_codes.shape
    Tq = rows * codes_per_byte(key_bits)
    G = group_size
    if G not in SUPPORTED_GROUPS or D % G:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUPS} dividing D={D}, got {G}")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim must be one of {SUPPORTED_HEAD_DIMS}, got {D}")
    if Tq % CACHE_BLOCK:
        raise ValueError(f"the slots must be a multiple of {CACHE_BLOCK}, got {Tq}")
    pv = codes_per_byte(value_bits)
    v_shape = (L, B, H, Tq // (CODE_BLOCK * pv), D, CODE_BLOCK)
    if not value_codes_blocked(value_bits):
        v_shape = (L, B, H, D, Tq // pv)
    expect = {
        "k_scale": (L, B, H, Tq // G, D),
        "k_min": (L, B, H, Tq // G, D),
        "v_codes": v_shape,
        "v_scale": (L, B, H, D // G, Tq),
        "v_min": (L, B, H, D // G, Tq),
        "num_tokens": (B,),
        "inv_freq": (D // 2,),
        "key_basis": (D, D),
    }
    arrays = dict(
        k_scale=k_scale, k_min=k_min, v_codes=v_codes, v_scale=v_scale, v_min=v_min,
        num_tokens=num_tokens, inv_freq=inv_freq, key_basis=key_basis,
    )  # fmt: skip
    for name, want in expect.items():
        if tuple(arrays[name].shape) != want:
            raise ValueError(f"{name} must be {want} for k_codes {k_codes.shape}, got "
                             f"{arrays[name].shape}")  # fmt: skip
    if q.ndim != 3 or q.shape[0] != B or q.shape[2] != D or q.shape[1] % H:
        raise ValueError(f"q must be [B={B}, Hq (a multiple of {H}), D={D}], got {q.shape}")
    if q.shape[1] // H > MAX_GROUP_HEADS:
        group = q.shape[1] // H
        raise ValueError(f"at most {MAX_GROUP_HEADS} query heads per kv head, got {group}")
    arrays.update(q=q, k_codes=k_codes)
    for name in ("k_codes", "v_codes"):
        if arrays[name].dtype != jnp.uint8:
            raise ValueError(f"{name} must be uint8 (packed codes)")
    for name in ("q", "k_scale", "k_min", "v_scale", "v_min", "inv_freq", "key_basis"):
        if not jnp.issubdtype(arrays[name].dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got {arrays[name].dtype}")
    if not jnp.issubdtype(num_tokens.dtype, jnp.integer):
        raise ValueError(f"num_tokens must be integer, got {num_tokens.dtype}")


def key_basis_halves(key_basis, key_bits: int | None, basis_scale: float):
    """The basis B [D, D] (a dequantized key row x, channels in order, is x B in the model's
    basis before RoPE: R^T for rotated keys, else the identity) as the kernel's two operands
    [2, D/2, D] fp16: half h, row c', column p is B[ch(p), h D/2 + c'] / basis_scale, ch(p) the
    channel stored at byte p of a row of `key_bits`-bit codes (`stored_byte`), so that the
    product also undoes the byte swap; key_bits None: p itself (keys in channel order, as the
    windows and sinks hold them). With basis_scale 1/sqrt(D) a Hadamard basis is +-1: exact
    in fp16."""
    d = key_basis.shape[0]
    order = np.arange(d) if key_bits is None else stored_byte(np.arange(d), key_bits)
    rows = jnp.asarray(key_basis, jnp.float32)[order] / basis_scale
    return rows.T.reshape(2, d // 2, d).astype(jnp.float16)


def query_halves(q, kv_heads: int, sm_scale: float):
    """q [B, Hq, D] -> [B, Hkv, 2, N, D/2] fp16: q * sm_scale * log2(e) in halves (the RoPE
    pairs' two sides), the kv group's heads padded to N with zeros."""
    B, Hq, D = q.shape
    g = Hq // kv_heads
    qf = (q.astype(jnp.float32) * (sm_scale * LOG2E)).reshape(B, kv_heads, g, D)
    qf = jnp.pad(qf, ((0, 0), (0, 0), (0, padded_heads(g) - g), (0, 0)))
    return qf.reshape(B, kv_heads, padded_heads(g), 2, D // 2).swapaxes(2, 3).astype(jnp.float16)


def swap_permutation():
    """[64, 64] bf16: row c has a one at column stored_byte(c) (the byte swap of a stored
    row, an involution): slot-ordered P to V^T's stored column order."""
    c = np.arange(CACHE_PLANE)
    return jnp.asarray((stored_byte(c, 2)[:, None] == c[None, :]).astype(np.float32), jnp.bfloat16)


def _cos_sin(angle):
    """cos and sin of float32 angles: reduced to [-pi, pi] first (two-part 2 pi), since the
    kernel's sine and cosine are the GPU's approximate ones (`approx_math`), accurate there;
    libdevice's accurate ones cost most of the kernel's time."""
    k = jnp.round(angle * (1 / (2 * np.pi)))
    r = (angle - k * TWO_PI_HI) - k * TWO_PI_LO
    return jnp.cos(r), jnp.sin(r)


def _plane_codes(ref, bits: int, field: int, dtype):
    """Bit field `field` of every byte of `ref` (a plane of codes), as `dtype`."""
    x = ref[...].astype(jnp.int32)
    return ((x >> (bits * field)) & ((1 << bits) - 1)).astype(dtype)


def _key_rows(ks_s, km_s, slot, quarter: int, group_size: int, shape):
    """Per-row key scale and minimum, float32 `shape` [64, D], of the plane filling quarter
    `quarter` of a 256-token block: row 16 a + c holds token 64 a + 16 quarter + c of the
    block (`cache_slot`), of channel group (64 a + 16 quarter) // G."""
    rows = lax.broadcasted_iota(jnp.int32, shape, 0) // 16
    scale = minimum = None
    for a in range(4):
        g = (64 * a + 16 * quarter) // group_size
        s = ks_s[slot, g].astype(jnp.float32)[None, :]
        m = km_s[slot, g].astype(jnp.float32)[None, :]
        scale = s if scale is None else jnp.where(rows == a, s, scale)
        minimum = m if minimum is None else jnp.where(rows == a, m, minimum)
    return scale, minimum


def _keys(k_s, ks_s, km_s, freq_s, basis_s, slot, quarter, first_slot, origin,
          *, key_bits, group_size, basis_scale):  # fmt: skip
    """Plane `quarter` of a block's keys -> float32 halves (lo, hi) [64, D/2] of RoPE(x B), x
    the dequantized key rows (stored channel order) and B the basis (`key_basis_halves`)."""
    pk = codes_per_byte(key_bits)
    codes = _plane_codes(k_s.at[slot, quarter // pk], key_bits, quarter % pk, jnp.float32)
    scale, minimum = _key_rows(ks_s, km_s, slot, quarter, group_size, codes.shape)
    position = lambda rows: origin + cache_slot(first_slot + rows)
    return _rope_keys(codes * scale + minimum, basis_s, freq_s, position, basis_scale)


def _rope_keys(x, basis_s, freq_s, position, basis_scale):
    """Key rows x float32 [64, D] (in the basis's row order) -> float32 halves (lo, hi)
    [64, D/2] of RoPE(x B), row r at position(r) (int32, given an iota of rows [64, D/2])."""
    half = basis_s.shape[1]

    def basis(kd_s):
        kd_s[...] = x.astype(jnp.float16)
        plgpu.commit_smem()

        def products(acc_lo, acc_hi):  # both in flight before the first wait
            plgpu.wgmma(acc_lo, kd_s, basis_s.at[0].T)
            plgpu.wgmma(acc_hi, kd_s, basis_s.at[1].T)
            return acc_lo[...], acc_hi[...]

        acc = plgpu.ACC((CACHE_PLANE, half), jnp.float32)
        return pl.run_scoped(products, acc, acc)

    lo, hi = pl.run_scoped(basis, smem(x.shape, jnp.float16, x.shape[-1]))
    rows = lax.broadcasted_iota(jnp.int32, lo.shape, 0)
    cos, sin = _cos_sin(position(rows).astype(jnp.float32) * freq_s[...][None, :])
    cos, sin = cos * basis_scale, sin * basis_scale
    return lo * cos - hi * sin, hi * cos + lo * sin


def _scores(q_s, lo, hi):
    """S^T [64, N] float32 = K_lo q_lo^T + K_hi q_hi^T, the key halves through shared memory."""

    def product(kr_s):
        kr_s[0] = lo.astype(jnp.float16)
        kr_s[1] = hi.astype(jnp.float16)
        plgpu.commit_smem()
        shape = (lo.shape[0], q_s.shape[1])
        return _product2(kr_s.at[0], q_s.at[0].T, kr_s.at[1], q_s.at[1].T, shape)

    return pl.run_scoped(product, smem((2, *lo.shape), jnp.float16, lo.shape[-1]))


def _product2(a1, b1, a2, b2, shape):
    """float32 `shape` = a1 . b1 + a2 . b2 on wgmma (operands in shared memory)."""

    def run(acc):
        plgpu.wgmma(acc, a1, b1)
        plgpu.wgmma(acc, a2, b2)
        return acc[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _values(p, v_s, vs_s, perm_s, slot, quarter, *, value_bits, group_size):
    """O^T [D, N] float32 of a plane without the minimums: sum over its slots of P times the
    scaled codes. Each value group j's scale goes into P (bf16, so small weights do not
    underflow), the swap's permutation puts P's slots in the stored column order of V^T, and
    the codes meet P_j on wgmma (exact in bf16), group j's rows kept."""
    J, N = vs_s.shape[1], p.shape[1]
    cols = pl.ds(quarter * CACHE_PLANE, CACHE_PLANE)
    pv = codes_per_byte(value_bits)
    D = v_s.shape[2]

    def product(p_s, pp_s, vc_s):
        for g in range(J):
            scale = vs_s[slot, g, cols].astype(jnp.float32)[:, None]
            p_s.at[pl.ds(g * N, N)].T[...] = (p * scale).astype(jnp.bfloat16)
        codes = v_s.at[slot, quarter // pv]
        vc_s[...] = _plane_codes(codes, value_bits, quarter % pv, jnp.bfloat16)
        plgpu.commit_smem()
        pp_s.T[...] = smem_product(perm_s, p_s.T, (CACHE_PLANE, J * N)).astype(jnp.bfloat16)
        plgpu.commit_smem()

        def products(*accs):  # all in flight before the first wait
            for g in range(J):
                plgpu.wgmma(accs[g], vc_s, pp_s.at[pl.ds(g * N, N)].T)
            return [a[...] for a in accs]

        return pl.run_scoped(products, *[plgpu.ACC((D, N), jnp.float32)] * J)

    parts = pl.run_scoped(
        product,
        smem((J * N, CACHE_PLANE), jnp.bfloat16, CACHE_PLANE),  # P_j, slot order
        smem((J * N, CACHE_PLANE), jnp.bfloat16, CACHE_PLANE),  # P_j, V^T's column order
        smem((D, CACHE_PLANE), jnp.bfloat16, CACHE_PLANE),  # the plane's value codes
    )
    row_group = lax.broadcasted_iota(jnp.int32, (D, N), 0) // group_size
    out = parts[0]
    for g in range(1, J):
        out = jnp.where(row_group == g, parts[g], out)
    return out


def _store_partial(o_g, lse_g, b, h, split, o, m, l):
    """Unit (b, h, split)'s normalized partial (`write_partial`) through scoped buffers."""
    pl.run_scoped(
        lambda o_s, lse_s: write_partial(
            o_s, lse_s, o_g.at[b, h, split], lse_g.at[b, h, split], o, m, l
        ),
        plgpu.SMEM(o.shape, jnp.float32),
        plgpu.SMEM(m.shape, jnp.float32),
    )


def _codes_unit(refs, scratch, b, h, split, layer, origin, held, *, key_bits, value_bits,
                group_size, per_split, stages, skip, basis_scale):  # fmt: skip
    """Unit (b, h, split) over its split's 256-token blocks of codes: positions [skip,
    held) at origin + slot."""
    q_g, k_g, kq_g, v_g, vs_g, vm_g, o_g, lse_g = refs
    ks_g, km_g = kq_g.at[0], kq_g.at[1]
    q_s, freq_s, basis_s, perm_s, fixed = scratch
    k_pieces = 4 // codes_per_byte(key_bits)  # 64-row pieces of a block's key codes
    v_pieces = 4 // codes_per_byte(value_bits)
    blocked = value_codes_blocked(value_bits)
    first = split * per_split
    blocks = jnp.clip(pl.cdiv(held, CACHE_BLOCK) - first, 0, per_split)

    def run(k_s, ks_s, km_s, v_s, vs_s, vm_s, loaded):
        groups = ks_s.shape[1]  # key groups per block

        def fetch(t, slot):
            blk = first + t
            bar = loaded.at[slot]
            for i in range(k_pieces):
                rows = pl.ds((blk * k_pieces + i) * CACHE_PLANE, CACHE_PLANE)
                plgpu.copy_gmem_to_smem(k_g.at[layer, b, h, rows], k_s.at[slot, i], bar)
            for i in range(v_pieces):
                if blocked:
                    src = v_g.at[layer, b, h, blk * v_pieces + i]
                else:
                    cols = pl.ds((blk * v_pieces + i) * CODE_BLOCK, CODE_BLOCK)
                    src = v_g.at[layer, b, h, :, cols]
                plgpu.copy_gmem_to_smem(src, v_s.at[slot, i], bar)
            grp = pl.ds(blk * groups, groups)
            plgpu.copy_gmem_to_smem(ks_g.at[b, h, grp], ks_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(km_g.at[b, h, grp], km_s.at[slot], bar)
            slots = pl.ds(blk * CACHE_BLOCK, CACHE_BLOCK)
            plgpu.copy_gmem_to_smem(vs_g.at[layer, b, h, :, slots], vs_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(vm_g.at[layer, b, h, :, slots], vm_s.at[slot], bar)

        for t in range(stages):
            pl.when(t < blocks)(functools.partial(fetch, t, t))
        plgpu.barrier_wait(fixed)  # q, the frequencies, the basis and the swap

        J, N = vs_s.shape[1], q_s.shape[1]
        D = 2 * q_s.shape[2]

        def plane(carry, slot, blk, quarter):
            o, m, l, shifts = carry
            first_slot = blk * CACHE_BLOCK + quarter * CACHE_PLANE
            lo, hi = _keys(k_s, ks_s, km_s, freq_s, basis_s, slot, quarter, first_slot, origin,
                           key_bits=key_bits, group_size=group_size,
                           basis_scale=basis_scale)  # fmt: skip
            logits = _scores(q_s, lo, hi)
            local = cache_slot(first_slot + lax.broadcasted_iota(jnp.int32, logits.shape, 0))
            logits = jnp.where((local < held) & (origin + local >= skip), logits, -jnp.inf)
            p, alpha, m, l = online_softmax_step(m, l, logits)
            pv = _values(p, v_s, vs_s, perm_s, slot, quarter, value_bits=value_bits,
                         group_size=group_size)  # fmt: skip
            # each value group's minimum weighs the slots' P: summed over the slots once, at
            # the end (a sum across the warps per plane would wait on shared memory)
            cols = pl.ds(quarter * CACHE_PLANE, CACHE_PLANE)
            shifts = tuple(
                z * alpha[None, :] + p * vm_s[slot, g, cols].astype(jnp.float32)[:, None]
                for g, z in enumerate(shifts)
            )
            return o * alpha[None, :] + pv, m, l, shifts

        def step(t, carry):
            slot = lax.rem(t, stages)
            blk = first + t
            plgpu.barrier_wait(loaded.at[slot])
            for quarter in range(4):  # the block's four planes of 64 slots
                carry = plane(carry, slot, blk, quarter)

            # the slot's last readers are every warp's (the value minimums after the last
            # plane's products): all of them pass the barrier before its refill is issued
            @pl.when(t + stages < blocks)
            def _():
                plgpu.commit_smem()
                fetch(t + stages, slot)

            return carry

        zeros = lambda shape: jnp.zeros(shape, jnp.float32)
        shifts = tuple(zeros((CACHE_PLANE, N)) for _ in range(J))
        # a finite floor for the running max: a plane of masked slots adds exp2(-inf) = 0
        init = (zeros((D, N)), jnp.full((N,), -1e30, jnp.float32), zeros((N,)), shifts)
        o, m, l, shifts = lax.fori_loop(0, blocks, step, init)
        row_group = lax.broadcasted_iota(jnp.int32, (D, N), 0) // group_size
        shift = None
        for g, z in enumerate(shifts):
            z = z.sum(axis=0)[None, :]
            shift = z if shift is None else jnp.where(row_group == g, z, shift)
        _store_partial(o_g, lse_g, b, h, split, o + shift, m, l)

    D = 2 * q_s.shape[2]
    J = D // group_size
    pl.run_scoped(
        run,
        smem((stages, k_pieces, CACHE_PLANE, D), jnp.uint8, D),  # key codes
        smem((stages, CACHE_BLOCK // group_size, D), ks_g.dtype),  # key scales
        smem((stages, CACHE_BLOCK // group_size, D), km_g.dtype),  # key minimums
        smem((stages, v_pieces, D, CODE_BLOCK), jnp.uint8, CODE_BLOCK),  # V^T codes
        smem((stages, J, CACHE_BLOCK), vs_g.dtype),  # value scales
        smem((stages, J, CACHE_BLOCK), vm_g.dtype),  # value minimums
        plgpu.Barrier(num_arrivals=k_pieces + v_pieces + 4, num_barriers=stages),
    )


def _full_precision_unit(refs, scratch, b, h, split, layer, held, length, *, window, sinks,
               basis_scale):  # fmt: skip
    """Unit (b, h, split) over the full-precision slots: the sink buffers' first N, those
    below `held` (the positions the codes hold), then the residual windows' W slots (token p
    of a row of `length` tokens in slot p % W), plane by plane through one pair of buffers
    (so that the unit needs no more shared memory than a unit of codes). Keys as stored
    (rotated, before RoPE, in channel order: the basis's natural halves); values as the
    windows' dtype, whose P rounds to it."""
    q_g, kw_g, vw_g, sk_g, sv_g, o_g, lse_g = refs
    q_s, freq_s, basis_s, fixed = scratch
    N, D = q_s.shape[1], 2 * q_s.shape[2]
    dtype = (kw_g if window else sk_g).dtype

    def plane(carry, kt_s, logits_mask, position, values):
        o, m, l = carry
        x = kt_s[...].astype(jnp.float32)
        lo, hi = _rope_keys(x, basis_s, freq_s, position, basis_scale)
        logits = _scores(q_s, lo, hi)
        rows = lax.broadcasted_iota(jnp.int32, logits.shape, 0)
        p, alpha, m, l = online_softmax_step(m, l, jnp.where(logits_mask(rows), logits, -jnp.inf))

        def product(p_s):
            p_s.T[...] = p.astype(dtype)
            plgpu.commit_smem()
            return smem_product(values, p_s.T, (D, N))

        pv = pl.run_scoped(product, smem((N, CACHE_PLANE), dtype, CACHE_PLANE))
        return o * alpha[None, :] + pv, m, l

    def sink_plane(carry, kt_s, sv_s, bar):
        # the value rows past the N sinks weigh P = 0 but must be finite: zeros, written
        # before the copies of the first N rows land
        sv_s[...] = jnp.zeros(sv_s.shape, dtype)
        plgpu.commit_smem()
        rows = pl.ds(0, sinks)
        plgpu.copy_gmem_to_smem(sk_g.at[layer, b, h], kt_s.at[rows], bar)
        plgpu.copy_gmem_to_smem(sv_g.at[layer, b, h], sv_s.at[rows], bar)
        plgpu.barrier_wait(fixed)
        plgpu.barrier_wait(bar)
        mask = lambda j: (j < sinks) & (j < held)
        return plane(carry, kt_s, mask, lambda j: j, sv_s.T)

    def window_planes(carry, kt_s, vw_s, bar):
        for i in range(window // CACHE_PLANE):
            if i or sinks:  # the previous plane's reads are done (commit_smem's barrier)
                plgpu.commit_smem()
            cols = pl.ds(i * CACHE_PLANE, CACHE_PLANE)
            plgpu.copy_gmem_to_smem(kw_g.at[layer, b, h, cols], kt_s, bar)
            plgpu.copy_gmem_to_smem(vw_g.at[layer, b, h, :, cols], vw_s, bar)
            if not (i or sinks):
                plgpu.barrier_wait(fixed)
            plgpu.barrier_wait(bar)
            # slot s holds the newest position p < length with p = s (mod W); none if p < 0
            at = lambda r, i=i: length - 1 - lax.rem(length - 1 - (i * CACHE_PLANE + r) + window,
                                                     window)  # fmt: skip
            carry = plane(carry, kt_s, lambda r, at=at: at(r) >= 0, at, vw_s)
        return carry

    zeros = lambda shape: jnp.zeros(shape, jnp.float32)
    carry = (zeros((D, N)), jnp.full((N,), -1e30, jnp.float32), zeros((N,)))
    plane_buffer = lambda rows, cols: smem((rows, cols), dtype, cols)
    copies = plgpu.Barrier(num_arrivals=2)
    if sinks:
        carry = pl.run_scoped(
            functools.partial(sink_plane, carry),
            plane_buffer(CACHE_PLANE, D), plane_buffer(CACHE_PLANE, D), copies,
        )  # fmt: skip
    if window:
        carry = pl.run_scoped(
            functools.partial(window_planes, carry),
            plane_buffer(CACHE_PLANE, D), plane_buffer(D, CACHE_PLANE), copies,
        )  # fmt: skip
    _store_partial(o_g, lse_g, b, h, split, *carry)


def _body(key_bits, value_bits, group_size, per_split, stages, skip, basis_scale, splits,
          window, sinks, max_len, layers, capacity):  # fmt: skip
    """The kernel body for `splits` splits of `per_split` 256-token blocks and, with a
    `window` or `sinks`, one more unit per (row, kv head) for them. The row lengths, the layer
    (clamped here) and the origin come as they are: no launch before it prepares them."""
    full_unit = bool(window or sinks)

    # the name Mosaic gives the kernel, which profiles show
    def prerope_decode_kernel(q_g, k_g, kq_g, v_g, vs_g, vm_g, n_g, layer_g, origin_g,
                              freq_g, basis_g, perm_g, *refs):  # fmt: skip
        *full, o_g, lse_g, q_s, freq_s, basis_s, perm_s, fixed = refs
        kw_g, vw_g = full[:2] if window else (None, None)
        sk_g, sv_g = full[-2:] if sinks else (None, None)
        b, h, split = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
        layer, origin = jnp.clip(layer_g[0], 0, layers - 1), origin_g[0]
        held, length = held_positions(n_g[b], window, max_len, capacity)
        bar = fixed.at[0]
        plgpu.copy_gmem_to_smem(q_g.at[b, h], q_s, bar)
        plgpu.copy_gmem_to_smem(freq_g, freq_s, bar)
        # the full-precision unit's keys are in channel order: the basis's second pair of
        # halves (a slice, not an index, which would leave TMA one dimension too many)
        basis = basis_g
        if full_unit:
            basis = basis_g.at[pl.ds(2 * (split == splits).astype(jnp.int32), 2)]
        plgpu.copy_gmem_to_smem(basis, basis_s, bar)
        plgpu.copy_gmem_to_smem(perm_g, perm_s, bar)
        codes = functools.partial(
            _codes_unit, (q_g, k_g, kq_g, v_g, vs_g, vm_g, o_g, lse_g),
            (q_s, freq_s, basis_s, perm_s, bar), b, h, split, layer, origin, held,
            key_bits=key_bits, value_bits=value_bits, group_size=group_size,
            per_split=per_split, stages=stages, skip=skip, basis_scale=basis_scale,
        )  # fmt: skip
        if not full_unit:
            return codes()
        full_precision = functools.partial(
            _full_precision_unit, (q_g, kw_g, vw_g, sk_g, sv_g, o_g, lse_g),
            (q_s, freq_s, basis_s, bar), b, h, split, layer, held, length, window=window,
            sinks=sinks, basis_scale=basis_scale,
        )  # fmt: skip
        pl.when(split < splits)(codes)
        pl.when(split == splits)(full_precision)

    return prerope_decode_kernel


def _launch(
    qh, k_codes, kq, v_codes, vs, vm, n, layer, origin, freq, basis, perm, full, *,
    key_bits, value_bits, group_size, splits, stages, skip, window, sinks, max_len,
    basis_scale, interpret,
):  # fmt: skip
    """The kernel over every unit: (o^T [B, Hkv, S, D, N], lse [B, Hkv, S, N], log2 units),
    S = splits, plus one for the full-precision unit where there are windows or sinks (`full`: their
    buffers, windows first)."""
    B, H, _, N, half = qh.shape
    D = 2 * half
    Tq = vs.shape[-1]
    per_split = -(-(Tq // CACHE_BLOCK) // splits)
    units = splits + bool(window or sinks)
    body = _body(key_bits, value_bits, group_size, per_split, stages, skip, basis_scale,
                 splits, window, sinks, max_len, k_codes.shape[0], Tq)  # fmt: skip
    return plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((B, H, units, D, N), jnp.float32),
            jax.ShapeDtypeStruct((B, H, units, N), jnp.float32),
        ),
        grid=(B, H, units),
        grid_names=("b", "h", "s"),
        scratch_types=[
            smem((2, N, half), jnp.float16, half),  # q halves
            smem((half,), jnp.float32),  # RoPE inverse frequencies
            smem((2, half, D), jnp.float16, D),  # the basis halves (transposed)
            smem((CACHE_PLANE, CACHE_PLANE), jnp.bfloat16, CACHE_PLANE),  # the swap
            plgpu.Barrier(num_arrivals=4, num_barriers=1),
        ],
        compiler_params=plgpu.CompilerParams(approx_math=True),  # `_cos_sin`, exp2
        **interpret_option(interpret),
    )(qh, k_codes, kq, v_codes, vs, vm, n, layer, origin, freq, basis, perm, *full)


def takes_sinks(k_sink, v_sink) -> bool:
    """Whether the launch attends these sink buffers [L, B, Hkv, N, D] itself: N a multiple of
    8 up to 64 (the keys land in whole 8-row tiles of a plane's buffer), one 16-bit dtype."""
    n = k_sink.shape[-2]
    return n % 8 == 0 and 0 < n <= CACHE_PLANE and _sixteen_bit(k_sink, v_sink)


def takes_windows(k_window, v_window) -> bool:
    """Whether the launch attends these residual windows (k [L, B, Hkv, W, D], v [L, B, Hkv,
    D, W]) itself: W a multiple of 64 (whole planes), one 16-bit dtype."""
    w = k_window.shape[-2]
    return w > 0 and w % CACHE_PLANE == 0 and _sixteen_bit(k_window, v_window)


def _sixteen_bit(*arrays) -> bool:
    dtypes = {jnp.dtype(x.dtype) for x in arrays}
    return len(dtypes) == 1 and dtypes <= {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)}


def check_full_precision(windows, sinks, skip, origin, *, L, B, H, D, Tq):
    """ValueError for residual windows or sink buffers the kernel does not take (beyond
    `takes_windows` / `takes_sinks`: their shapes, skip, origin, one dtype for both): (W, N)."""
    window = n_sinks = 0
    dtypes = set()
    if windows is not None:
        kw, vw = windows
        if kw.ndim != 5 or not takes_windows(kw, vw):
            raise ValueError(
                f"the windows' W must be a positive multiple of {CACHE_PLANE}, in one 16-bit dtype"
            )
        window = kw.shape[-2]
        want = {"k_window": (L, B, H, window, D), "v_window": (L, B, H, D, window)}
        for name, x in zip(want, windows, strict=True):
            if tuple(x.shape) != want[name]:
                raise ValueError(f"{name} must be {want[name]}, got {x.shape}")
        if not (isinstance(origin, int) and origin == 0):
            raise ValueError("the windows are a whole row's: origin must be 0")
        dtypes.add(kw.dtype)
    if sinks is not None:
        if sinks[0].ndim != 5 or not takes_sinks(*sinks):
            raise ValueError(
                f"N sinks must be a multiple of 8 up to {CACHE_PLANE}, in one 16-bit dtype"
            )
        n_sinks = sinks[0].shape[-2]
        for name, x in zip(("k_sink", "v_sink"), sinks, strict=True):
            if tuple(x.shape) != (L, B, H, n_sinks, D):
                raise ValueError(f"{name} must be {(L, B, H, n_sinks, D)}, got {x.shape}")
        if skip != n_sinks:
            raise ValueError(f"skip must be N = {n_sinks} with the sink buffers, got {skip}")
        dtypes.add(sinks[0].dtype)
    if len(dtypes) > 1:
        raise ValueError(f"windows and sinks must share one 16-bit dtype, got {dtypes}")
    if n_sinks > Tq:
        raise ValueError(f"N = {n_sinks} sinks exceed the {Tq} slots")
    return window, n_sinks


def prerope_decode(
    q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, num_tokens, layer, inv_freq,
    key_basis=None, *, key_bits: int, value_bits: int, group_size: int, sm_scale: float,
    basis_scale: float = 1.0, skip: int = 0, origin=0, windows=None, sinks=None,
    max_len: int = 0, splits: int | None = None, stages: int = STAGES, interpret=False,
):  # fmt: skip
    """Decode attention of q [B, Hq, D] over positions [0, num_tokens[b]) of `layer` of a KIVI
    store pair whose keys were quantized before RoPE, as the cache holds it
    (`pallas_kernels.layout`): k_codes [L, B, Hkv, Tq/Pk, D] (token-planar, rows in the stored
    byte order), k_scale and k_min [L, B, Hkv, Tq/G, D] (channel order); v_codes (V^T) [L, B,
    Hkv, Tq/256, D, 64] at 2 bits, [L, B, Hkv, D, Tq/2] at 4, v_scale and v_min [L, B, Hkv,
    D/G, Tq] (the cache order). A dequantized key x (model channel order) is x B in the
    model's basis (`key_basis` [D, D], identity if None; the Hadamard un-rotation R^T for
    rotated keys, with basis_scale = 1/sqrt(D) so that B / basis_scale is exact in fp16), then
    rotated by RoPE at its position origin + t with `inv_freq` [D/2] (the half-split layout,
    angles in float32). Positions below `skip` are not read from the codes.

    `windows`: (k_window [L, B, Hkv, W, D], v_window [L, B, Hkv, D, W]), the cache's residual
    windows (16-bit, as the cache stores them: keys before RoPE and in the codes' basis, W a
    multiple of 64, token p of a row in slot p % W, origin 0): num_tokens[b] is then the row's
    length n (capped at `max_len` if > 0), the codes hold positions [skip, n - W) and the
    windows the min(n, W) newest. `sinks`: (k_sink, v_sink) [L, B, Hkv, N, D] (skip = N): the
    first N positions in full precision, attended from these buffers where the codes hold
    them (below num_tokens, or n - W with windows). Both go to one more unit per (row, kv
    head) of the launch, merged with the splits.
    -> (o [B, Hq, D] float32, lse [B, Hq] float32, natural log). Module doc: the edges."""
    D = q.shape[-1]
    key_basis = jnp.eye(D, dtype=jnp.float32) if key_basis is None else key_basis
    check_inputs(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, num_tokens, inv_freq,
                 key_basis, key_bits=key_bits, value_bits=value_bits,
                 group_size=group_size)  # fmt: skip
    L, B, H = k_codes.shape[:3]
    Tq = capacity_of(v_codes, value_bits)
    check_full_precision(windows, sinks, skip, origin, L=L, B=B, H=H, D=D, Tq=Tq)
    splits = choose_splits(B, H, Tq) if splits is None else splits
    if not 1 <= splits <= Tq // CACHE_BLOCK or stages < 1:
        raise ValueError(f"splits must be in [1, {Tq // CACHE_BLOCK}] and stages >= 1")
    return _prerope_decode(
        q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, num_tokens, layer, inv_freq,
        key_basis, origin, windows, sinks, key_bits=key_bits, value_bits=value_bits,
        group_size=group_size, sm_scale=sm_scale, basis_scale=basis_scale, skip=skip,
        max_len=max_len, splits=splits, stages=stages, interpret=interpret,
    )  # fmt: skip


def held_positions(num_tokens, window: int, max_len: int, capacity: int):
    """(held, n) int32 of rows of num_tokens (arrays or, in the kernel, a scalar): the row's
    length n (num_tokens, capped at max_len if > 0) and the positions the codes hold, the
    first `held` (n less the W windows' slots, clamped to [0, capacity])."""
    n = jnp.asarray(num_tokens).astype(jnp.int32)
    n = jnp.minimum(n, max_len) if max_len else n
    return jnp.clip(n - window, 0, capacity), n


# One jitted function: a model's layers call it with equal shapes, and XLA lowers (and Mosaic
# compiles) the kernel once for all of them instead of once per call site.
@functools.partial(
    jax.jit,
    static_argnames=("key_bits", "value_bits", "group_size", "sm_scale", "basis_scale", "skip",
                     "max_len", "splits", "stages", "interpret"),
)  # fmt: skip
def _prerope_decode(
    q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, num_tokens, layer, inv_freq,
    key_basis, origin, windows, sinks, *, key_bits, value_bits, group_size, sm_scale,
    basis_scale, skip, max_len, splits, stages, interpret,
):  # fmt: skip
    L, B, H, _, D = k_codes.shape
    window = 0 if windows is None else windows[0].shape[-2]
    n_sinks = 0 if sinks is None else sinks[0].shape[-2]
    layer = jnp.asarray(layer, jnp.int32)
    in_range = (layer >= 0) & (layer < L)
    at = jnp.clip(layer, 0, L - 1)
    # the layer's key scales and minimums in the stored channel order of the codes' rows, in
    # one gather (the minimums in the scales' dtype, which a cache stores both in)
    stored = stored_byte(np.arange(D), key_bits)
    kq = jnp.take(jnp.stack([k_scale[at], k_min[at].astype(k_scale.dtype)]), stored, axis=-1)
    basis = key_basis_halves(key_basis, key_bits, basis_scale)
    if window or n_sinks:  # the full-precision keys are in channel order
        basis = jnp.concatenate([basis, key_basis_halves(key_basis, None, basis_scale)])
    o_t, lse2 = _launch(
        query_halves(q, H, sm_scale), k_codes, kq, v_codes, v_scale, v_min,
        num_tokens.astype(jnp.int32), layer.reshape(1),
        jnp.asarray(origin, jnp.int32).reshape(1),
        jnp.asarray(inv_freq, jnp.float32), basis, swap_permutation(),
        (*(windows or ()), *(sinks or ())), key_bits=key_bits, value_bits=value_bits,
        group_size=group_size, splits=splits, stages=stages, skip=skip, window=window,
        sinks=n_sinks, max_len=max_len, basis_scale=basis_scale, interpret=interpret,
    )  # fmt: skip
    g = q.shape[1] // H
    o_parts = o_t.swapaxes(-1, -2)[..., :g, :]  # [B, Hkv, S, g, D]
    o, lse = merge_partials(o_parts, lse2[..., :g] / LOG2E, axis=2)
    o = jnp.where(in_range, o, jnp.nan)
    return o.reshape(B, H * g, D), lse.reshape(B, H * g)

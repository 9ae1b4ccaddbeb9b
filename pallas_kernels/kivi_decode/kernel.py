"""The KIVI decode kernel body (Pallas Mosaic GPU, sm_90), as named stages.

One *unit* is one warpgroup streaming one split of one (b, h) row: a block holds one unit, or W
of them (`TuningConfig.wg_per_block`), or with the in-kernel merge a cluster of blocks holds a
row. A unit runs:

    prologue      q into shared memory (copied, or scaled and permuted in the kernel) and into
                  registers as the key product's B operand
    loop          per 256-token step of its split, through the TMA pipeline:
      loads         the step's buffers (`_views`): key codes, key scales / minimums, value
                    codes, value scales / minimums (the dense bias: 16-group minimum blocks)
      scores        S^T (64 tokens, N heads) per plane: code fields x fp16(q * s_g) on
                    mma.sync, plus the key bias q . z_g
      softmax       the online softmax in log2 units: per warpgroup (the max exchanged, or voted
                    on: lazy max) or per warp (`warp_softmax`); P (with the value scale at
                    G = D) stored to shared memory as the value product's B
      values        O^T (64 channels, N) += codes x P on mma.sync (fp8 wgmma with fp8_values)
    epilogue      the partial (o, lse) of the split: written out, or merged with the row's other
                  splits in the kernel (`merge_splits`)

The S^T / O^T orientation puts the 64 tokens (or channels) of a plane on mma's M and the padded
query heads of the kv group on N (8 at GQA 4). docs/kernel.md explains each technique.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kivi_decode.config import (
    BIAS_ROWS,
    STEP_TOKENS,
    Plan,
    value_channel_order,
)
from pallas_kernels.sm90.codes import (
    code_field8,
    code_field8_reference,
    f8_field_spec,
    field_sub,
    field_sub_weight,
    field_to_f16,
    natural_bytes,
    widen8,
    widen_codes,
)
from pallas_kernels.sm90.epilogue import merge_splits, transpose_rows
from pallas_kernels.sm90.layout import (
    PLANE,
    VSUB_C,
    VW_C,
    WG_LAYOUT,
    plane_tokens,
    swizzle_transforms,
    warp_groups,
)
from pallas_kernels.sm90.mma import (
    group_min_mma,
    halves,
    halves_const,
    mma,
    mma_rhs,
    row_half,
    rows_of,
    scale_rhs,
    swap_halves,
    warp_rhs,
)
from pallas_kernels.sm90.pipeline import pipeline
from pallas_kernels.sm90.reduce import (
    exceed_barrier,
    merge_warp_rows,
    reduction_scratch,
    warp_group_sum,
    warp_max,
    warp_sync,
    warpgroup_max_open,
    warpgroup_reduce,
    warpgroup_sync,
)
from pallas_kernels.sm90.smem import (
    bias_rows,
    dense_rows,
    group_vecs,
    q_tile,
    row_halves_load,
    store_bias_rows,
    store_p_perm,
    warp_value_codes,
    warp_vec_load,
    zero_smem,
)

_WGT = plgpu.Layout.WGMMA_TRANSPOSED
f16, f32 = jnp.float16, jnp.float32
VCH = 256  # value-scale chunk: a TMA box is at most 256 wide


def pipeline_blocks(plan: Plan):
    """The pipelined inputs: (block shape, dtype, SMEM transforms, axis of the block index)
    of the key codes, key scales, key minimums, value codes, value scales, value minimums.

    Natively the code tiles are swizzled (the byte-permuted widening reads them so); the value
    codes come as 64-byte tiles, so that a plane's 64 value columns are whole swizzle tiles.
    Value scales are viewed as [D/G, Tq/VCH, VCH]: a TMA box is at most 256 wide."""
    TS, D, G = STEP_TOKENS, plan.D, plan.G
    u8 = jnp.uint8
    kc_rows, g_rows, v_cols = TS // plan.Pk, TS // G, TS // plan.Pv
    ktf = swizzle_transforms(u8, D) if plan.native else ()
    vtf = swizzle_transforms(u8, PLANE) if plan.native else ()
    vcodes = ((v_cols // PLANE, D, PLANE), u8, vtf, 0) if plan.vblock else ((D, v_cols), u8, vtf, 1)
    return [
        ((kc_rows, D), u8, ktf, 0),
        ((g_rows, D), f16, (), 0),
        ((g_rows, D), f16, (), 0),
        vcodes,
        ((D // G, TS // VCH, VCH), f16, (), 1),
        ((D // G, TS // VCH, VCH), f16, (), 1),
    ]


def piped_inputs(plan: Plan) -> list[int]:
    """The inputs the pipeline streams (dense_bias: the key minimums come as blocks of their
    own)."""
    return [j for j in range(6) if not (plan.dense_bias and j == 2)]


def _zeros_wg(NP):
    return plgpu.layout_cast(jnp.zeros((PLANE, NP), f32), WG_LAYOUT)


class _Unit:
    """One unit's trace: its shared-memory views, its row and split, and the stages below as
    methods over them (each stage reads the unit's state, none mutates another's)."""

    def __init__(
        self,
        plan: Plan,
        sc: dict,
        gmem,
        o_g,
        lse_g,
        layer_g,
        nt_g,
        q_g,
        wg,
        b,
        h,
        s,
        q_scale,
        windows=None,
        window_scale=None,
        sinks=None,
    ):
        self.plan, self.sc, self.gmem = plan, sc, gmem
        self.o_g, self.lse_g, self.q_g = o_g, lse_g, q_g
        self.wg, self.b, self.h, self.s = wg, b, h, s
        self.q_scale = q_scale
        P = plan
        # This warpgroup's own SMEM (W > 1: every scratch buffer has a leading wg axis).
        self.own = (lambda k: sc[k].at[wg]) if P.W > 1 else sc.__getitem__
        own = self.own
        (self.q_s, self.p_s, self.o_s, self.lse_s, self.bar) = (
            own(k) for k in ("q_s", "p_s", "o_s", "lse_s", "bar")
        )
        self.vd8_s = own("vd8_s") if P.f8v and P.interpret else None
        self.red_s = None if P.interpret else own("red_s")  # cross-warp reduction scratch
        # A traced layer cannot raise: outside [0, L) every read takes the nearest layer (never
        # another array's memory) and the output is NaN, the library's policy
        # (`kivi_jax.cache.check_layer`), so no launch around the kernel has to apply it.
        L = gmem[0].shape[0]
        self.layer = jnp.clip(layer_g[0], 0, L - 1)
        self.layer_ok = (layer_g[0] >= 0) & (layer_g[0] < L)
        TS = STEP_TOKENS
        if P.window:  # nt_g: the rows' lengths; the newest W positions are the windows'
            self.windows, self.window_scale = windows, window_scale
            self.n_all = jnp.minimum(nt_g[b], P.length_cap) if P.length_cap else nt_g[b]
            self.n = jnp.clip(self.n_all - P.window, 0, P.Tq)
            # the sinks below the codes' split (the rest are in the windows)
            self.sinks, self.held_sinks = sinks, jnp.minimum(self.n, P.sinks)
            self.kw_s, self.vw_s, self.qn_s, self.pw_s = (
                own(k) for k in ("kw_s", "vw_s", "qn_s", "pw_s")
            )
            # chunk c's barrier (one per chunk buffer, per warpgroup)
            self.win_bar = lambda c: sc["win_bar"].at[wg * P.window_buffers + c % P.window_buffers]
        else:  # nt_g: the quantized positions to attend
            self.n = jnp.minimum(nt_g[b], P.Tq)
        self.first = s * P.steps_per_split
        self.start = self.first * TS
        self.nsteps = jnp.clip(
            lax.div(self.n - self.start + (TS - 1), jnp.int32(TS)),
            0,
            jnp.minimum(P.steps_per_split, P.total_steps - self.first),
        )
        if P.skip:  # steps wholly before the first attended position are not run, so a split
            # that runs holds an attended token in its first step (none: a row of n <= skip)
            split_end = self.first + jnp.minimum(P.steps_per_split, P.total_steps - self.first)
            self.first = jnp.maximum(self.first, P.skip // TS)
            self.start = self.first * TS
            end = jnp.where(self.n > P.skip, split_end - self.first, 0)
            self.nsteps = jnp.clip(lax.div(self.n - self.start + (TS - 1), jnp.int32(TS)), 0, end)
        # the copies' issuing warp (the pipeline's and dense_bias's): wg % 4, so that a block's
        # W issuing warps sit on different schedulers; one-warpgroup blocks take it from the
        # block index, so that the blocks an SM holds tend to issue from different schedulers
        self.copy_warp = lax.rem(wg, 4) if P.W > 1 else lax.rem((b * P.Hkv + h) * P.S + s, 4)
        if P.dense_bias:  # the minimums block, the warps' bias rows and the block's barrier
            self.kzc_s, self.kb_s, self.kz_bar = own("kzc_s"), own("kb_s"), own("kz_bar")
        self.vtf = pipeline_blocks(P)[3][2]
        if P.native:  # the key codes widened without exponent bits (fields as subnormals)
            self.widen_k0 = functools.partial(
                widen8, transforms=swizzle_transforms(jnp.uint8, P.D), exponent=False
            )
            self.widen_v0 = functools.partial(
                widen8, transforms=swizzle_transforms(jnp.uint8, PLANE), exponent=False
            )
            self.widen_v = functools.partial(
                widen8, transforms=swizzle_transforms(jnp.uint8, PLANE)
            )
        else:
            self.widen_k0 = self.widen_v0 = lambda ref: natural_bytes(ref[...]).astype(jnp.uint16)
            self.widen_v = lambda ref: widen_codes(natural_bytes(ref[...]))

    # ---- shared helpers -------------------------------------------------------------------

    def red(self, x, kind):
        """x (64, N) reduced over its rows ("add" / "max"): per-warpgroup scratch when several
        warpgroups share the block (`warpgroup_reduce`)."""
        if self.plan.W > 1 and self.plan.native:
            return warpgroup_reduce(x, kind, self.red_s)
        return x.max(axis=0) if kind == "max" else x.sum(axis=0)

    def loop_max(self, x):
        """The step's cross-warp max: on mma.sync one barrier (`warpgroup_max_open`; the barrier
        before P is read orders its reads before the next step's writes)."""
        if not self.plan.f8v and self.plan.native:
            return warpgroup_max_open(x, self.red_s)
        return self.red(x, "max")

    # ---- prologue -------------------------------------------------------------------------

    def load_query(self):
        """q into shared memory (the caller's, scaled and permuted here with q_prologue) and
        into registers as the key product's B operand (loop-invariant)."""
        P = self.plan
        if self.q_scale is not None:
            q_tile(
                self.q_g.at[self.b, self.h],
                self.q_s.at[0],
                nq=P.nq,
                scale=self.q_scale,
                dup=P.pk and not P.tuning.pack_zeros,
                signs=P.q_signs,
            )
            warpgroup_sync(P.interpret)
            plgpu.commit_smem()
        else:
            plgpu.copy_gmem_to_smem(self.q_g.at[self.b, self.h], self.q_s, self.bar)
            plgpu.barrier_wait(self.bar)
        self.qb = mma_rhs(self.q_s.at[0].T, P.interpret)

    # ---- loads ----------------------------------------------------------------------------

    def views(self, refs, kb=None):
        """Accessors of one step's SMEM buffers. Scale and minimum accessors take a group g
        (one vector) or (g, n): the rows of n groups. kb (dense_bias): the step's first row of
        the bias rows."""
        P = self.plan
        D = P.D
        grows = lambda g, n: g if n == 0 else pl.ds(g, n)
        vchunk = lambda p: (p * PLANE) // VCH  # value scales: [D/G, TS/VCH, VCH]
        voff = lambda p: (p * PLANE) % VCH
        if P.dense_bias:  # the minimums come as bias rows (`kbias`), not per step
            refs = (*refs[:2], None, *refs[2:])
        kc_s, ks_s, kz_s, vc_s, vs_s, vz_s = refs
        return dict(
            vc=vc_s,
            kcodes=lambda r: kc_s.at[pl.ds(r * PLANE, PLANE), pl.ds(0, D)],
            kscale=lambda g, n=0: ks_s.at[grows(g, n)],
            kmin=lambda g, n=0: kz_s.at[grows(g, n)],
            # dense_bias: the key bias of the groups gs (one per warp)
            kbias=lambda gs: bias_rows(
                self.kb_s.at[pl.ds(kb, STEP_TOKENS // P.G)], gs, dup_half=P.pz
            ),
            vcodes=(lambda r, m: vc_s.at[r, pl.ds(m * PLANE, PLANE)])
            if P.vblock
            else (lambda r, m: vc_s.at[pl.ds(m * PLANE, PLANE), pl.ds(r * PLANE, PLANE)]),
            vcodes_all=(lambda r: vc_s.at[r])
            if P.vblock
            else (lambda r: vc_s.at[:, pl.ds(r * PLANE, PLANE)]),
            vscale=lambda p: lambda g, n=0: vs_s.at[grows(g, n), vchunk(p), pl.ds(voff(p), PLANE)],
            vmin=lambda p: lambda g, n=0: vz_s.at[grows(g, n), vchunk(p), pl.ds(voff(p), PLANE)],
            # planes p, p + 1 (p even; one value-scale chunk holds both)
            vscale2=lambda p: (
                lambda g, n=0: vs_s.at[grows(g, n), vchunk(p), pl.ds(voff(p), 2 * PLANE)]
            ),
            vmin2=lambda p: (
                lambda g, n=0: vz_s.at[grows(g, n), vchunk(p), pl.ds(voff(p), 2 * PLANE)]
            ),
        )

    # ---- scores ---------------------------------------------------------------------------

    def scores(self, v):
        """S^T tiles (64 tokens, NP) of the step, f32, the key scale folded into q: S^T of
        plane p (field j, group g) = (codes_j * 2^(bits j - 24)) . fp16(q * s_g) *
        2^(24 - bits j) + q . z_g. The code fields enter as fp16 subnormals (`field_sub`: one
        `and` per element pair), B = q * s_g is one fp16x2 multiply per register of q's B
        operand (`scale_rhs`) per group, and q . z_g comes from one more mma.sync per two
        distinct group vectors (`rows_of`) or from the dense bias rows. Each warp scales by
        the vectors of its own 16 rows' group (`warp_groups`): one per 256-token block at
        G >= 64, two at G = 32. pk: planes 2t and 2t + 1 in one tile (columns 0-3, 4-7)."""
        if self.plan.interpret:
            return self._scores_interpreted(v)
        P = self.plan
        zero = _zeros_wg(P.NP)
        q = self.qb
        vecs, codes, bqs = {}, {}, {}
        wide = P.tuning.fold_v_warp
        # one key per distinct per-warp group vector (G >= 64: one per 256-token block),
        # paired for the bias products
        key = [warp_groups(p, P.G) for p in range(P.planes)]

        def vec(which, gs):
            """The scale or minimum vector of the groups gs (one per warp)."""
            if (which, gs) not in vecs:
                vecs[which, gs] = warp_vec_load(v[which], gs, perm=True, wide=wide)
            return vecs[which, gs]

        uniq = list(dict.fromkeys(key))
        bias = {}
        if P.dense_bias:  # each warp's row of the block's products (`_bias_step`)
            bias = {k: v["kbias"](k) for k in uniq}
            uniq = []
        for i in range(0, len(uniq), 2):
            pair = uniq[i : i + 2]  # the last one alone: rows 8..15 left undefined
            a = rows_of(*(vec("kmin", k) for k in pair))
            c = mma(zero, a, q, False)
            for h, k in enumerate(pair):
                bias[k] = row_half(c, h)
                if P.pz:  # q in columns 0-3 only: the heads' bias into 4-7 too
                    bias[k] = bias[k] + swap_halves(bias[k], False)

        def code_tile(p):
            r = p // P.Pk
            if r not in codes:  # one SMEM load of a byte tile serves its Pk planes
                codes[r] = self.widen_k0(v["kcodes"](r))
            return codes[r]

        def rhs(k):
            if k not in bqs:  # q (pk without pack_zeros: in both halves) * s_g
                bqs[k] = scale_rhs(q, vec("kscale", k))
            return bqs[k]

        field = lambda x, p: field_sub(x, P.key_bits, p % P.Pk)
        out = []
        if P.pk:  # planes 2t, 2t + 1 (one key group) into one tile
            for t in range(P.tiles):
                p0, p1 = 2 * t, 2 * t + 1
                x, b = code_tile(p0), rhs(key[p0])
                x0 = mma(zero, field(x, p0), b, False)
                x1 = mma(zero, field(x, p1), b, False)
                # columns 0-3 of the even plane's, 4-7 of the odd's, each with its field's
                # weight
                wt = halves_const(
                    field_sub_weight(P.key_bits, p0 % P.Pk),
                    field_sub_weight(P.key_bits, p1 % P.Pk),
                    P.NP,
                    False,
                )
                x = x0 + swap_halves(x1, False) if P.pz else halves(x0, x1, False)
                out.append(x * lax.broadcast_in_dim(wt, (PLANE, P.NP), [1]) + bias[key[p0]])
            return out
        for p in range(P.planes):
            x, b = code_tile(p), rhs(key[p])
            x = mma(zero, field(x, p), b, False)
            out.append(x * field_sub_weight(P.key_bits, p % P.Pk) + bias[key[p]])
        return out

    def _scores_interpreted(self, v):
        """`scores` under the interpreter: per warp's 16 rows (its own group), in jnp."""
        P = self.plan
        q = self.qb  # (D, NP) array
        out = []
        for t in range(P.tiles):
            # pk: the odd plane against B with q's heads in columns 4-7
            ps_ = (2 * t, 2 * t + 1) if P.pk else (t,)
            blocks = []
            for w in range(4):
                xs = []
                for p in ps_:
                    g = warp_groups(p, P.G)[w]
                    a = field_sub(self.widen_k0(v["kcodes"](p // P.Pk)), P.key_bits, p % P.Pk)
                    bq = (q * v["kscale"](g)[...][:, None]).astype(f16)
                    x = jnp.dot(a[16 * w : 16 * (w + 1)], bq, preferred_element_type=f32)
                    xs.append(x * field_sub_weight(P.key_bits, p % P.Pk))
                bias = jnp.dot(v["kmin"](g)[...].astype(f32), q.astype(f32))
                if P.pz:  # both planes' products in columns 0-3
                    x = xs[0] + swap_halves(xs[1], True)
                    bias = bias + swap_halves(bias, True)
                else:
                    x = halves(*xs, True) if P.pk else xs[0]
                blocks.append(x + bias[None])
            out.append(jnp.concatenate(blocks, axis=0))
        return out

    # ---- value operands -------------------------------------------------------------------

    def b_shift(self, p):
        """lgmax: log2 of the constant c_p in the value product's B = P * s_t * c_p of plane p
        (field j): fp8_values 256 / w_j (the e4m3 field reads as code * w_j * 2^-9); else
        2^(VSUB_C - bits j) (the subnormal field reads as code * 2^(bits j - 24)). Either way
        the product weighs every plane's codes alike (undone at the end) and B <= 2^shift: in
        e4m3, resp. fp16, range."""
        P = self.plan
        if P.f8v:
            return 8.0 - float(np.log2(f8_field_spec(P.value_bits, p % P.Pv)[2]))
        return float(VSUB_C - P.slack - P.value_bits * (p % P.Pv))

    def vw_shift(self, p):
        """fvw: log2 of the factor P of plane p (field j) is stored with."""
        return float(VW_C - self.plan.value_bits * (p % self.plan.Pv))

    def vw_const(self, t, inverse: bool, shape=None):
        """fvw: vw_shift (inverse: 2^-vw_shift) of score tile t; pk: the (NP,) vector of plane
        2t's in columns 0-3 and 2t + 1's in 4-7 (`halves_const`), broadcast to `shape` (rows)
        where given."""
        P = self.plan
        f = (lambda p: 2.0 ** -self.vw_shift(p)) if inverse else self.vw_shift
        if not P.pk:
            return f(t)
        c = halves_const(f(2 * t), f(2 * t + 1), P.NP, P.interpret)
        return c if shape is None else lax.broadcast_in_dim(c, shape, [1])

    def val_prep(self, v):
        """lgmax (logits in log2 units): per plane p, the (64, N) broadcasts of log2 s_t,
        u = 2^-b_shift(p) / s_t and z_t * u, with s_t clamped to 2^-24 so that a zero scale
        stays finite. The B operand is then B = 2^(logit + log2 s_t - m + b_shift(p)) = P * s_t
        * c_p, and P = B * u, P * z_t = B * (z_t * u): one fma each for the sums. pk: per tile,
        plane 2t's in columns 0-3 and 2t + 1's in 4-7 (natively computed once per tile on
        lane-dependent row vectors, `halves`)."""
        P = self.plan
        ld = lambda which, p: plgpu.load(v[which](p)(0), (), layout=WG_LAYOUT.reduce(1))
        bc = lambda x: lax.broadcast_in_dim(x, (PLANE, P.NP), [0])

        def terms(sv, zv, nb):
            l2s = jnp.log2(jnp.maximum(sv.astype(f32), 2.0**-24))
            # u from log2 s_t (two instructions) rather than a division, which compiles to
            # about eight with its range checks
            u = jnp.exp2(nb - l2s)
            return bc(l2s), bc(u), bc(zv.astype(f32) * u)

        if P.pk and P.native:
            out = []
            for t in range(P.tiles):
                pick = lambda f, t=t: halves(f(2 * t), f(2 * t + 1), False, rows=True)
                nb = pick(
                    lambda p: plgpu.layout_cast(
                        jnp.full((PLANE,), -self.b_shift(p), f32), WG_LAYOUT.reduce(1)
                    )
                )
                # both planes' vectors from one ref (they share a chunk: VCH >= 128)
                ld2 = lambda which, t=t: row_halves_load(v[which](2 * t)(0), PLANE)
                out.append(terms(ld2("vscale2"), ld2("vmin2"), nb))
            return out
        out = [terms(ld("vscale", p), ld("vmin", p), -self.b_shift(p)) for p in range(P.planes)]
        if P.pk:
            out = [
                tuple(
                    halves(a, b, P.interpret)
                    for a, b in zip(out[2 * t], out[2 * t + 1], strict=True)
                )
                for t in range(P.tiles)
            ]
        return out

    def value_codes(self, v, p, m, cache):
        """The value product's A operand of plane p, channel tile m: (64 channels, 64 tokens).
        G = D: the code field as fp16 subnormals (`field_sub`); fold_v_warp: the same in the
        warps' channel order; else the exact dequantization (codes * s + z per channel group,
        each warp its group's vectors); fp8_values: the e4m3 field."""
        P = self.plan
        if P.f8v:
            return self._value_field8(v, p, m, cache)
        if P.vsub:
            r = (p // P.Pv, m, "sub")
            if r not in cache:  # one SMEM load of a byte tile serves all its Pv planes
                cache[r] = self.widen_v0(v["vcodes"](p // P.Pv, m))
            return field_sub(cache[r], P.value_bits, p % P.Pv)
        if P.fvw:  # warp w's rows are the channels (D/4) w + 16 m + (0..15)
            r = (p // P.Pv, m, "warp")
            if r not in cache:
                cache[r] = widen8(
                    v["vcodes_all"](p // P.Pv),
                    self.vtf,
                    exponent=False,
                    warp_rows=(P.D // 4, 16 * m),
                )
            return field_sub(cache[r], P.value_bits, p % P.Pv)
        r = (p // P.Pv, m)
        if r not in cache:
            cache[r] = self.widen_v(v["vcodes"](*r))
        c = field_to_f16(cache[r], P.value_bits, p % P.Pv)
        # channel groups of the tile's rows (the channels m * 64 + 16 w + ...)
        groups = tuple((m * PLANE + 16 * w) // P.G for w in range(4))
        sc, mn = group_vecs(
            v["vscale"](p),
            v["vmin"](p),
            groups,
            (PLANE, PLANE),
            cache,
            ("v", p),
            P.native,
            P.native,
        )
        return c * sc + mn

    def _value_field8(self, v, p, m, cache):
        """fp8_values: the value code field of plane p, channel tile m, as the e4m3 A operand
        (64 channels, 64 tokens) = code * weight * 2^-9 (`f8_field_spec`)."""
        P = self.plan
        r = (p // P.Pv, m)
        spec = f8_field_spec(P.value_bits, p % P.Pv)
        if P.interpret:
            return code_field8_reference(v["vcodes"](*r)[...], spec, jnp.float8_e4m3fn)
        if r not in cache:  # one SMEM load of a byte tile serves all its Pv planes
            cache[r] = plgpu.load(v["vcodes"](*r), (), layout=plgpu.Layout.WGMMA_8BIT)
        return code_field8(cache[r], spec, jnp.float8_e4m3fn)

    # ---- softmax --------------------------------------------------------------------------

    def m_shifts(self, m):
        """lgmax: m - b_shift(p) of every score tile (pk: planes 2t and 2t + 1 in the tile's
        halves), for the running max m."""
        P = self.plan
        return [
            (
                halves(m - self.b_shift(2 * t), m - self.b_shift(2 * t + 1), P.interpret)
                if P.pk
                else m - self.b_shift(t)
            )
            for t in range(P.tiles)
        ]

    def lg_weights(self, st, mps):
        """lgmax: the value product's B = 2^(logit + log2 s_t - m + b_shift(p)) of every score
        tile, from the running max's `m_shifts` mps."""
        return [
            jnp.exp2(x - lax.broadcast_in_dim(mv, (PLANE, self.plan.NP), [1]))
            for x, mv in zip(st, mps, strict=True)
        ]

    def lazy_state(self, m):
        """lazy_max: the loop's running-max state for the running max m: m + slack (the vote's
        threshold) and the tiles' `m_shifts`, so that a common step forms neither; m itself is
        thr - slack (in f32, to ~2^-24 of |m| + slack)."""
        return (m + self.plan.slack, *self.m_shifts(m))

    @staticmethod
    def lg_sums(l_t, zacc, bs, pre):
        """lgmax: the running sums of P = B * u and P * z_t = B * (z_t * u) (`val_prep`) over
        the tiles' weights bs."""
        for p, x in enumerate(bs):
            l_t, zacc = l_t + x * pre[p][1], zacc + x * pre[p][2]
        return l_t, zacc

    def store_tile(self, x16, t):
        """Score tile t's P (pk: planes 2t and 2t + 1) as the value product's B: pzv, one
        [N, 64] tile per plane (columns 0-3 into plane 2t's rows 0-3, 4-7 into plane 2t + 1's),
        else p_s[t] (natively with the tokens in the byte-permuted contraction order)."""
        P, p_s = self.plan, self.p_s
        if not P.pzv:
            if P.native:
                store_p_perm(x16, p_s.at[t])
            else:
                p_s.at[t].T[...] = plgpu.layout_cast(x16, _WGT)
            return
        if P.native:
            store_p_perm(x16, p_s.at[pl.ds(2 * t, 2)], split=True)
            return
        p_s[2 * t, 0:4, :] = x16[:, 0:4].T
        p_s[2 * t + 1, 0:4, :] = x16[:, 4:8].T

    def masked(self, xs, tok0):
        """The scores of the tokens at and past the row's length (ragged rows, padding), and
        before `skip`, at -inf."""
        P = self.plan
        rows = plgpu.broadcasted_iota(jnp.int32, (PLANE, P.NP), 0, layout=WG_LAYOUT)
        if P.pk:  # columns 4-7 of tile t are plane 2t + 1's
            odd = plgpu.broadcasted_iota(jnp.int32, (PLANE, P.NP), 1, layout=WG_LAYOUT) >= 4
            tok = lambda t: jnp.where(odd, plane_tokens(2 * t + 1, rows), plane_tokens(2 * t, rows))
        else:
            tok = lambda p: plane_tokens(p, rows)
        if P.skip:  # and before the first attended position (sinks)
            keep = lambda t: (t < self.n) & (t >= P.skip)
        else:
            keep = lambda t: t < self.n
        return [jnp.where(keep(tok0 + tok(p)), x, -jnp.inf) for p, x in enumerate(xs)]

    def step_softmax(self, refs, tok0, carry, kb=None):
        """One step: loads, scores, the softmax update and the value product."""
        P = self.plan
        v = self.views(refs, kb)
        m_run, l_t, accs, zaccs = carry
        st = self.scores(v)
        # Only the last step of a row can hold masked tokens: the others skip the compare and
        # select per element (a branch per step instead).
        whole = tok0 + STEP_TOKENS <= self.n
        if P.skip:  # the first steps hold the skipped positions too
            whole = whole & (tok0 >= P.skip)
        st = lax.cond(whole, list, lambda xs: self.masked(xs, tok0), st)
        pre = None
        if P.lgmax:  # the running max over logit + log2 s_t keeps B = P * s_t * c_p small
            pre = self.val_prep(v)  # (pk: per tile)
            st = [x + pre[p][0] for p, x in enumerate(st)]
        if P.wsm:
            return self.warp_softmax_step(v, st, pre, (m_run, l_t, accs, zaccs))
        tmax = st[0]
        for x in st[1:]:
            tmax = jnp.maximum(tmax, x)
        if P.lazy_max:  # m_run: (m + slack, the tiles' m - b_shift) (`lazy_state`)
            m_new, l_t, accs, zaccs = self.lazy_softmax(st, tmax, pre, m_run, l_t, accs, zaccs)
            return self.value_product(v, accs, zaccs, m_new, l_t, synced=True)
        mx = self.loop_max(tmax)
        if P.pk:  # a head's max over both halves (its even and odd planes)
            mx = jnp.maximum(mx, swap_halves(mx, P.interpret))
        m_new = jnp.maximum(m_run, mx)
        alpha = jnp.exp2(m_run - m_new)  # logits in log2 units
        ab = lax.broadcast_in_dim(alpha, (PLANE, P.NP), [1])
        resc = lambda x: x * ab
        if P.lgmax:  # B = P * s_t * c_p (the scale folded into the exponent), f32 sums
            bs = self.lg_weights(st, self.m_shifts(m_new))
            l_t, zacc = self.lg_sums(resc(l_t), resc(zaccs[0]), bs, pre)
            zaccs = (zacc,)
        elif P.fvw:  # P of plane p stored as P * 2^(VW_C - bits j)
            ps = [
                jnp.exp2(
                    x - lax.broadcast_in_dim(m_new - self.vw_const(p, False), (PLANE, P.NP), [1])
                )
                for p, x in enumerate(st)
            ]
            l_t = resc(l_t)
            for p, x in enumerate(ps):
                l_t = l_t + x * self.vw_const(p, True, (PLANE, P.NP))
            zaccs = tuple(resc(z) for z in zaccs)
        else:
            mb = lax.broadcast_in_dim(m_new, (PLANE, P.NP), [1])
            ps = [jnp.exp2(x - mb) for x in st]
            l_t = resc(l_t)
            for x in ps:
                l_t = l_t + x
        accs = tuple(resc(a) for a in accs)
        if P.f8v:  # the B operand of every plane: e4m3 (through fp16) of B'
            for p in range(P.planes):
                x16 = plgpu.layout_cast(bs[p].astype(f16), _WGT)
                self.p_s.at[p].T[...] = x16.astype(self.p_s.dtype)
        if P.vsub:
            for p in range(P.tiles):
                self.store_tile(bs[p].astype(f16), p)
        if not P.lgmax:
            for p in range(P.tiles):
                self.store_tile(ps[p].astype(f16), p)
        if P.f8v:  # wgmma reads P through the async proxy; mma.sync's loads do not
            plgpu.commit_smem()  # (they need only the warpgroup barrier)
        return self.value_product(v, accs, zaccs, m_new, l_t)

    def lazy_softmax(self, st, tmax, pre, mstate, l_t, accs, zaccs):
        """lazy_max: the step's softmax update with P (B = P * s_t * c_p) computed against the
        running max m and stored before anything crosses the warps; the barrier that hands P
        over also ORs whether some score passes m + slack (`exceed_barrier`). If none does
        (the common step): the sums, the state kept. Else: the exact cross-warp max
        (`warpgroup_max_open`), the rescale, P recomputed and stored again, one more barrier.
        mstate: `lazy_state(m)`, carried so that a common step forms neither the threshold nor
        the shifts. Returns (mstate, l_t, accs, zaccs) with P in p_s behind a barrier."""
        P = self.plan

        def store(bs):
            for p in range(P.tiles):
                self.store_tile(bs[p].astype(f16), p)

        thr, *mps = mstate
        bs = self.lg_weights(st, mps)  # past thr (or m = -inf) redone below
        store(bs)
        exceed = exceed_barrier(tmax, thr)  # the barrier after the stores

        def fast():
            l2, z2 = self.lg_sums(l_t, zaccs[0], bs, pre)
            return mstate, l2, accs, (z2,)

        def slow():
            mx = self.loop_max(tmax)  # its barrier; the one below orders its reads
            if P.pk:  # a head's max over both halves (its even and odd planes)
                mx = jnp.maximum(mx, swap_halves(mx, P.interpret))
            m_run = thr - P.slack
            m_new = jnp.maximum(m_run, mx)
            ab = lax.broadcast_in_dim(jnp.exp2(m_run - m_new), (PLANE, P.NP), [1])
            new = self.lazy_state(m_new)
            bs2 = self.lg_weights(st, new[1:])
            l2, z2 = self.lg_sums(l_t * ab, zaccs[0] * ab, bs2, pre)
            store(bs2)
            warpgroup_sync(P.interpret)
            return new, l2, tuple(a * ab for a in accs), (z2,)

        return lax.cond(exceed > 0, slow, fast)

    def warp_softmax_step(self, v, st, pre, carry):
        """The softmax update and value product of a step per warp (warp_softmax): each warp's
        running max, sums and (D/16 channel tiles of) output cover the tokens of its own key
        rows, 16 per plane; P goes from the score registers into the value product's B operand
        by `warp_rhs`, each warp loads the value code bytes of its tokens for every channel
        (`warp_value_codes`). No SMEM writes, no barrier."""
        P = self.plan
        m_run, l_t, accs, (zacc,) = carry
        tmax = st[0]
        for x in st[1:]:
            tmax = jnp.maximum(tmax, x)
        mw = warp_max(tmax)
        m_new = jnp.maximum(m_run, mw)
        # a warp whose tokens are all masked so far keeps m = -inf: a finite stand-in keeps
        # the exponents at -inf (weights 0) rather than NaN
        ms = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        ab = lax.broadcast_in_dim(jnp.exp2(m_run - ms), (PLANE, P.NP), [1])
        l_t, zacc = l_t * ab, zacc * ab
        accs = [a * ab for a in accs]
        bs = [
            jnp.exp2(x - lax.broadcast_in_dim(ms - self.b_shift(p), (PLANE, P.NP), [1]))
            for p, x in enumerate(st)
        ]
        for p, x in enumerate(bs):
            l_t, zacc = l_t + x * pre[p][1], zacc + x * pre[p][2]
        accs = list(accs)
        rhs = [warp_rhs(x.astype(f16)) for x in bs]
        for m in range(P.D // 16):
            for r in range(P.planes // P.Pv):
                codes = warp_value_codes(v["vc"], self.vtf, m, r * PLANE)
                for j in range(P.Pv):
                    accs[m] = mma(
                        accs[m], field_sub(codes, P.value_bits, j), rhs[r * P.Pv + j], P.interpret
                    )
        return m_new, l_t, tuple(accs), (zacc,)

    # ---- values ---------------------------------------------------------------------------

    def value_product(self, v, accs, zaccs, m_new, l_t, synced=False):
        """The step's value product over P in p_s (stored by every warp; synced: the
        warpgroup barrier after its stores has passed) into accs."""
        P = self.plan
        if P.f8v:
            return m_new, l_t, self._value_product_fp8(v, accs), zaccs
        pb = lambda p: self.p_s.at[p].T
        cache = {}
        if not synced:  # P (stored by every warp) as each warp's B operand, in registers
            warpgroup_sync(P.interpret)
        new = list(accs)
        vec = functools.partial(
            warp_vec_load,
            groups=P.value_groups_of_warps,
            perm=True,
            wide=P.tuning.fold_v_warp,
            align4=True,
        )
        ng = max(P.value_groups_of_warps) + 1  # fvw: value groups per token
        for p in range(P.planes):
            if P.pk and not P.pzv:  # tile p // 2's P: B of both its planes, whose products go
                # to the even (accs[:mtiles]) and odd (accs[mtiles:]) sets
                if p % 2 == 0:
                    t = p // 2
                    b = mma_rhs(pb(t), P.interpret)
                    if P.fvw:  # both planes' minimums' terms, B's halves scaled by their own
                        # plane's value scales
                        c = group_min_mma(
                            v["vmin"](p)(0, ng), self.p_s.at[t], v["vmin"](p + 1)(0, ng)
                        )
                        zaccs = (zaccs[0] + c * self.vw_const(t, True, (PLANE, P.NP)),)
                        b = scale_rhs(b, vec(v["vscale2"](p), n_half=PLANE))
                for mt in range(P.mtiles):
                    i = mt + P.mtiles * (p % 2)
                    new[i] = mma(new[i], self.value_codes(v, p, mt, cache), b, P.interpret)
                continue
            b = mma_rhs(pb(p), P.interpret)
            if P.fvw:  # sum_t z_t P_t of the warp's group; B = P * s_t
                # the minimums' term of all groups over the warp's own tokens
                c = group_min_mma(v["vmin"](p)(0, ng), self.p_s.at[p])
                zaccs = (zaccs[0] + c * 2.0 ** -self.vw_shift(p),)
                b = scale_rhs(b, vec(v["vscale"](p)))
            for mt in range(P.mtiles):
                new[mt] = mma(new[mt], self.value_codes(v, p, mt, cache), b, P.interpret)
        return m_new, l_t, tuple(new), zaccs

    def _value_product_fp8(self, v, accs):
        """fp8_values: the value product on fp8 wgmma (A the e4m3 code fields, B = e4m3(P *
        s_t * 256 / w_j) from p_s). Hopper's fp8 wgmma accumulates with ~14 significant bits,
        so a step's product goes into fresh accumulators, added in f32. Under the interpreter
        the A operand is staged through SMEM (its wgmma takes SMEM operands only)."""
        P = self.plan
        pb = lambda p: self.p_s.at[p].T
        vd = self.vd8_s
        if P.interpret:
            new = []
            for mt in range(P.mtiles):

                def pv(acc, mt=mt):
                    cache = {}  # values loaded in one scope must not leak into another
                    for p in range(P.planes):
                        vd[...] = self.value_codes(v, p, mt, cache)
                        plgpu.commit_smem()
                        plgpu.wgmma(acc, vd, pb(p))
                        plgpu.wgmma_wait(0)
                    return acc[...]

                new.append(accs[mt] + pl.run_scoped(pv, plgpu.ACC((PLANE, P.NP), f32)))
            return tuple(new)
        cache = {}

        def fresh(*acc_refs):
            # dequantize the next tile on the CUDA cores while the previous wgmma runs
            for p in range(P.planes):
                for mt in range(P.mtiles):
                    plgpu.wgmma(acc_refs[mt], self.value_codes(v, p, mt, cache), pb(p))
                if p:
                    plgpu.wgmma_wait(P.mtiles)
            plgpu.wgmma_wait(0)
            return [a[...] for a in acc_refs]

        new = pl.run_scoped(fresh, *[plgpu.ACC((PLANE, P.NP), f32)] * P.mtiles)
        return tuple(a + x for a, x in zip(accs, new, strict=True))

    # ---- loop -----------------------------------------------------------------------------

    def step(self, idx, *refs):
        """The pipeline's step i (one 256-token block of the split)."""
        *refs, carry = refs
        (i,) = idx
        if self.plan.dense_bias:
            return self._bias_step(i, refs, carry)
        return self.step_softmax(refs, self.start + i * STEP_TOKENS, carry)

    def _bias_block(self, c):
        """dense_bias: the first key group of minimums block c of this split, clamped so that
        the block ends inside the cache (its steps' rows then start further in)."""
        P = self.plan
        return jnp.minimum(
            self.first * (STEP_TOKENS // P.G) + BIAS_ROWS * c, P.Tq // P.G - BIAS_ROWS
        )

    def _fetch_bias(self, c):
        """dense_bias: minimums block c into kzc_s (one TMA by the copy warp)."""

        def issue():
            plgpu.copy_gmem_to_smem(
                self.srcs[2].at[pl.ds(self._bias_block(c), BIAS_ROWS)], self.kzc_s, self.kz_bar
            )

        plgpu.warp_map(lambda w: pl.when(w == self.copy_warp)(issue))

    def _bias_step(self, i, refs, carry):
        """dense_bias: step i, and at the first step of a minimums block, the bias of all its
        16 groups, one mma.sync per 16 channels (`dense_rows`), stored to the warp's rows of
        kb_s (only the warp reads them: a warp barrier; the previous block's reads are ordered
        before by the last step's warpgroup barrier). The next block is copied once every warp
        has read this one: after the step's warpgroup barrier."""
        P = self.plan
        n_g = STEP_TOKENS // P.G
        bias_steps = BIAS_ROWS * P.G // STEP_TOKENS
        c, first_of = lax.div(i, bias_steps), lax.rem(i, bias_steps) == 0

        def block_bias():
            plgpu.barrier_wait(self.kz_bar)
            store_bias_rows(
                mma(_zeros_wg(P.NP), dense_rows(self.kzc_s), self.qb, P.interpret), self.kb_s
            )
            warp_sync()

        pl.when(first_of)(block_bias)
        carry = self.step_softmax(
            refs,
            self.start + i * STEP_TOKENS,
            carry,
            kb=(self.first + i) * n_g - self._bias_block(c),
        )
        pl.when(first_of & (i + bias_steps < self.nsteps))(lambda: self._fetch_bias(c + 1))
        return carry

    def run_loop(self):
        """The split's steps through the TMA pipeline; returns the final carry (running max,
        sums, accumulators, minimums' terms)."""
        P = self.plan
        m0 = plgpu.layout_cast(jnp.full((P.NP,), -jnp.inf, f32), WG_LAYOUT.reduce(0))
        l0 = _zeros_wg(P.NP)
        zero = lambda: _zeros_wg(P.NP)
        # pk: the value products of the even planes, then of the odd planes (pzv: one set,
        # every plane's product in columns 0-3)
        a0 = tuple(
            zero()
            for _ in range(P.D // 16 if P.wsm else P.mtiles * (2 if P.pk and not P.pzv else 1))
        )
        if P.pzv:  # the planes' B tiles: rows 4-7 stay zero (the stores write rows 0-3)
            if P.interpret:
                self.p_s[...] = jnp.zeros(self.p_s.shape, self.p_s.dtype)
            else:
                zero_smem(self.p_s, swizzle_transforms(f16, PLANE))
                warpgroup_sync(P.interpret)
        z0 = (zero(),) if P.lgmax or P.fvw else ()  # sum_t P * z_t
        # Block indices are offset by this split's first step (a traced value).
        blk = lambda i: self.first + i
        blocks = pipeline_blocks(P)
        specs = [
            plgpu.BlockSpec(
                shape, functools.partial(_block_index, len(shape), axis, blk), transforms=tf
            )
            for shape, _, tf, axis in blocks
        ]
        self.srcs = [x.at[self.layer, self.b, self.h] for x in self.gmem]
        if P.dense_bias:  # the first minimums block (`_bias_step` copies the others)
            pl.when(self.nsteps > 0)(lambda: self._fetch_bias(0))
        m_init = self.lazy_state(m0) if P.lazy_max else m0
        init = (m_init, l0, a0, z0)
        if P.own_pipeline:
            piped = piped_inputs(P)
            sc = self.sc
            return pipeline(
                self.step,
                [specs[j] for j in piped],
                [self.srcs[j] for j in piped],
                [sc[f"buf{j}"].at[self.wg] for j in piped],
                sc["pipe_bar"],
                self.wg,
                P.tuning.stages,
                self.nsteps,
                init,
                sync=P.no_auto_barriers,
                one_warp=P.native,
                empty=sc["empty_bar"] if P.release else None,
                issuer=self.copy_warp,
                spread=P.tuning.spread_copies,
                sync_every=P.lazy_max,
            )
        return plgpu.emit_pipeline(
            self.step,
            grid=(self.nsteps,),
            in_specs=specs,
            max_concurrent_steps=P.tuning.stages,
            init_carry=init,
        )(*self.srcs)

    # ---- the residual windows -------------------------------------------------------------

    @property
    def window_unit(self):
        """Whether this unit attends its row's windows: the row's last split, whose unit has
        the least of the quantized region to stream (often none in short rows)."""
        return self.s == self.plan.S - 1

    def fetch_chunk(self, c: int = 0):
        """Chunk c (64 slots) of the row's key window [64, D] and value window [D, 64] into
        chunk buffer c % window_buffers (TMA, its `win_bar`; the value rows in the output's
        channel order, `window_value_rows`); the chunk after the windows' is the sinks' (keys
        [N, D] into the buffer's first N rows, values as prepared by `sink_operands`).
        Natively one chunk's buffers: two full windows would halve the blocks an SM holds."""
        P = self.plan
        buf, bar = c % P.window_buffers, self.win_bar(c)
        if c < P.window // PLANE:
            kw_g, vw_g, _ = self.windows
            slots = pl.ds(c * PLANE, PLANE)
            keys = kw_g.at[self.layer, self.b, self.h].at[slots]
            values = vw_g.at[self.layer, self.b, self.h]
        else:
            ks_g, vs_g = self.sinks
            slots = pl.ds(0, PLANE)
            keys = ks_g.at[self.layer, self.b, self.h]
            values = vs_g.at[self.b, self.h]
        n_keys = keys.shape[0]
        dst = self.kw_s.at[buf] if n_keys == PLANE else self.kw_s.at[buf, pl.ds(0, n_keys)]
        plgpu.copy_gmem_to_smem(keys, dst, bar)
        for dst, first, n in window_value_rows(P):
            plgpu.copy_gmem_to_smem(
                values.at[pl.ds(first, n), slots], self.vw_s.at[buf, pl.ds(dst, n)], bar
            )

    def start_window(self):
        """The window tail's first chunks (one per buffer) in flight, and q in the natural
        order and the windows' dtype into qn_s (rows nq.. zero)."""
        P = self.plan
        for c in range(P.window_buffers):
            self.fetch_chunk(c)
        _, _, qr_g = self.windows
        if P.native:  # qr_g is the caller's q, rotated here too where the prologue is ours
            signs = P.q_signs if P.q_in_kernel else None
            q_tile(
                qr_g.at[self.b, self.h],
                self.qn_s,
                nq=P.nq,
                scale=None,
                dup=False,
                natural=True,
                signs=signs,
            )
        else:
            q = qr_g.at[self.b, self.h][...].astype(self.qn_s.dtype)
            self.qn_s[...] = jnp.pad(q, ((0, P.NP - P.nq), (0, 0)))

    def attend_window(self):
        """The windows' attention, merged into the unit's normalized partial in o_s / lse_s.
        Per chunk of 64 slots (chunk 0 fetched while the loop ran): S^T (64 slots, N) =
        K_w q^T on mma.sync in the windows' 16-bit dtype (float32 sums), the slots at and past
        min(n, W) masked, an online softmax in log2 units, P rounded to the windows' dtype as
        the B operand of O^T (64 channels, N) += V_w^T P; then the log-sum-exp merge with the
        partial. Order does not matter within the windows (a row's newest tokens in its
        ring's slots), so no position is computed."""
        P = self.plan
        NP, dt = P.NP, jnp.dtype(P.window_dtype)
        if P.interpret:
            load = lambda ref, layout=None: ref[...]
        else:
            load = lambda ref, layout=WG_LAYOUT: plgpu.load(ref, (), layout=layout)
        bc = lambda x: lax.broadcast_in_dim(x, (PLANE, NP), [1])
        zero = _zeros_wg(NP)
        slots = jnp.clip(self.n_all, 0, P.window)
        rows = plgpu.broadcasted_iota(jnp.int32, (PLANE, NP), 0, layout=WG_LAYOUT)
        m = plgpu.layout_cast(jnp.full((NP,), -jnp.inf, f32), WG_LAYOUT.reduce(0))
        l = plgpu.layout_cast(jnp.zeros((NP,), f32), WG_LAYOUT.reduce(0))
        accs = [zero] * P.mtiles
        warpgroup_sync(P.interpret)  # qn_s's stores, the epilogue's o_s / lse_s stores
        qb = mma_rhs(self.qn_s.T, P.interpret)
        for c in range(P.window_chunks):
            buf = c % P.window_buffers
            if c:  # the previous chunk's P and (one buffer) windows are read by every warp
                warpgroup_sync(P.interpret)
            if c >= P.window_buffers:  # then refill the buffer
                self.fetch_chunk(c)
            plgpu.barrier_wait(self.win_bar(c))
            x = mma(zero, load(self.kw_s.at[buf]), qb, P.interpret) * self.window_scale
            # a held logit of -inf (an infinite key, or q . k past float32) becomes NaN, as in
            # `kivi_jax.attention`: at -inf it would weigh 0, the key silently ignored
            if c < P.window // PLANE:
                held = c * PLANE + rows < slots
            else:  # the sinks' chunk: slots past N (stale keys, zero values) never held
                held = rows < self.held_sinks
            x = jnp.where(held, jnp.where(x == -jnp.inf, jnp.nan, x), -jnp.inf)
            m_new = jnp.maximum(m, self.red(x, "max"))
            ms = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2(m - ms)
            p = jnp.exp2(x - bc(ms))
            l = l * alpha + self.red(p, "add")
            self.pw_s.T[...] = plgpu.layout_cast(p.astype(dt), _WGT)
            warpgroup_sync(P.interpret)
            pb = mma_rhs(self.pw_s.T, P.interpret)
            vs = lambda t, buf=buf: self.vw_s.at[buf, pl.ds(t * PLANE, PLANE)]
            accs = [mma(a * bc(alpha), load(vs(t)), pb, P.interpret) for t, a in enumerate(accs)]
            m = m_new
        # the merge: weights of the partial and of the windows' sum, per head
        ms = jnp.where(m == -jnp.inf, 0.0, m)
        lse_m = load(self.lse_s, WG_LAYOUT.reduce(0))
        has = l != 0  # (not l > 0: a NaN sum, a non-finite window key, stays NaN)
        lse_w = jnp.where(has, (ms + jnp.log2(jnp.where(has, l, 1.0))) * LN2, -jnp.inf)
        top = jnp.maximum(lse_m, lse_w)
        top = jnp.where(top == -jnp.inf, 0.0, top)
        wm, ww = jnp.exp(lse_m - top), jnp.exp(lse_w - top)
        tot = wm + ww
        ok = tot != 0
        inv = jnp.where(ok, 1.0 / jnp.where(ok, tot, 1.0), 0.0)
        fm, fw = bc(wm * inv), bc(jnp.where(has, ww * inv / jnp.where(has, l, 1.0), 0.0))
        for t, acc in enumerate(accs):
            tile = pl.ds(t * PLANE, PLANE)
            self.o_s[tile, :] = load(self.o_s.at[tile]) * fm + acc * fw
        self.lse_s[...] = jnp.where(ok, top + jnp.log(jnp.where(ok, tot, 1.0)), -jnp.inf)
        warpgroup_sync(P.interpret)

    # ---- epilogue -------------------------------------------------------------------------

    def epilogue(self, carry):
        """The split's normalized partial output and log-sum-exp into o_s / lse_s, then
        written out (or merged with the row's other splits in the kernel)."""
        P = self.plan
        m_run, l_t, accs, zaccs = carry
        o_s, lse_s = self.o_s, self.lse_s
        if P.lazy_max:
            m_run = m_run[0] - P.slack
        if P.wsm:  # the warps' partial softmax states -> the warpgroup's
            m_all = self.red(lax.broadcast_in_dim(m_run, (PLANE, P.NP), [1]), "max")
            fw = lax.broadcast_in_dim(
                jnp.exp2(m_run - jnp.where(m_all == -jnp.inf, 0.0, m_all)), (PLANE, P.NP), [1]
            )
            m_run, l_t, zaccs = m_all, l_t * fw, (zaccs[0] * fw,)
        l = self.red(l_t, "add")
        if P.pk:  # columns 0-3: heads over the even planes; 4-7: over the odd ones
            l = l + swap_halves(l, P.interpret)
            if not P.pzv:  # (pzv: every plane's value product in columns 0-3 already)
                accs = [
                    accs[mt] + swap_halves(accs[P.mtiles + mt], P.interpret)
                    for mt in range(P.mtiles)
                ]
        ok = l > 0
        inv = jnp.where(ok, 1.0 / jnp.where(ok, l, 1.0), 0.0)
        inv = jnp.where(self.layer_ok, inv, jnp.nan)  # every o below is scaled by it
        ib = lax.broadcast_in_dim(inv, (PLANE, P.NP), [1])
        if P.lgmax:  # the minimums' term; the codes' product weighs 2^-1 (fp8) or
            # 2^(VSUB_C - 24) (subnormal fields)
            zs = self.red(zaccs[0], "add")
            if P.pk:
                zs = zs + swap_halves(zs, P.interpret)
            zs = lax.broadcast_in_dim(zs, (PLANE, P.NP), [1])
            cw = 2.0 if P.f8v else float(2 ** (24 - VSUB_C + P.slack))
            if P.wsm:  # o = sum over warps of acc * fw * cw / l, plus zs / l
                for mt in range(P.mtiles):
                    o_s[pl.ds(mt * PLANE, PLANE), :] = zs * ib
                warpgroup_sync(P.interpret)
                merge_warp_rows([a * (fw * (cw * ib)) for a in accs], o_s)
            else:
                accs = [(a * cw if cw != 1.0 else a) + zs for a in accs]
        if P.fvw:  # the codes' product weighs 2^(VW_C - 24); the warp's minimums' term, its
            # group's sums over the four warps' tokens
            zt = warp_group_sum(zaccs[0], P.value_groups_of_warps, self.red_s)
            if P.pk:  # columns 4-7: the odd planes' terms of heads 0-3
                zt = zt + swap_halves(zt, P.interpret)
            accs = [a * float(2 ** (24 - VW_C)) + zt for a in accs]
        for mt in range(P.mtiles if not P.wsm else 0):
            o_s[pl.ds(mt * PLANE, PLANE), :] = accs[mt] * ib
        # log2 units -> natural log
        lse = (m_run + jnp.log2(jnp.where(ok, l, 1.0))) * float(np.log(2.0))
        lse_s[...] = jnp.where(ok, lse, -jnp.inf)
        if P.window:
            pl.when(self.window_unit)(self.attend_window)
        if P.cluster:
            self.merge(lax.div(self.s, jnp.int32(P.W)))
            return
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, self.o_g.at[self.b, self.h, self.s])
        plgpu.copy_smem_to_gmem(lse_s, self.lse_g.at[self.b, self.h, self.s])
        plgpu.wait_smem_to_gmem(0)

    def merge(self, c):
        """merge_splits: the row's partials meet in block 0 (c), warpgroup 0 merges them into
        its own tiles and writes the row; blocks c > 0 stay until it has read them."""
        P, sc = self.plan, self.sc
        warpgroup_sync(P.interpret)  # every thread's o_s / lse_s stores before the arrival
        plgpu.barrier_arrive(sc["ready"])
        lead = c == 0
        if P.W > 1:
            lead = lead & (self.wg == 0)

        @pl.when(lead)
        def _():
            plgpu.barrier_wait(sc["ready"])
            merge_splits(sc["o_s"], sc["lse_s"], W=P.W, C=P.cluster, interpret=P.interpret)
            warpgroup_sync(P.interpret)
            out = self.o_s
            if P.out_dtype:  # the row as the caller takes it: no transpose launched after
                rows = value_channel_order(P)
                transpose_rows(
                    self.o_s,
                    sc["out_s"],
                    rows=rows,
                    interpret=P.interpret,
                    signs=P.o_signs,
                    spare=sc.get("rot_s"),
                )
                out = sc["out_s"].at[pl.ds(0, P.nq)]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out, self.o_g.at[self.b, self.h])
            plgpu.copy_smem_to_gmem(self.lse_s, self.lse_g.at[self.b, self.h])
            plgpu.wait_smem_to_gmem(0)

        if P.cluster > 1:  # each block's warpgroup 0 arrives once, block 0's after its reads
            pl.when(self.wg == 0)(lambda: plgpu.barrier_arrive(sc["done"]))
            pl.when(c != 0)(lambda: plgpu.barrier_wait(sc["done"]))

    def run(self):
        if self.plan.window:  # in flight while the loop runs
            pl.when(self.window_unit)(self.start_window)
        self.load_query()
        self.epilogue(self.run_loop())


WINDOW_ROWS = 16  # value-window rows per TMA copy where they go in the output's channel order
LN2 = float(np.log(2.0))


def window_value_rows(plan: Plan) -> list[tuple[int, int, int]]:
    """The copies of the value window [D, W] into SMEM: (first SMEM row, first channel, rows)
    of each, so that SMEM row r holds the channel of the kernel's output row r: one copy of
    all D rows in the natural order, 16-row copies in fold_v_warp's (`value_channel_order`)."""
    rows = value_channel_order(plan)
    if rows is None:
        return [(0, 0, plan.D)]
    return [(r, int(rows[r]), WINDOW_ROWS) for r in range(0, plan.D, WINDOW_ROWS)]


def _block_index(ndim, axis, blk, i):
    """Block indices of step i: `blk(i)` on `axis`, 0 elsewhere."""
    return tuple(blk(i) if d == axis else 0 for d in range(ndim))


def scratch_buffers(plan: Plan) -> dict:
    """The kernel's shared memory, by name (W > 1: every buffer has a leading warpgroup
    axis)."""
    P = plan
    W, NP, D = P.W, P.NP, P.D
    per_wg = lambda *shape: (W, *shape) if W > 1 else shape
    scratch = {
        "q_s": plgpu.SMEM(per_wg(1, NP, D), f16, transforms=swizzle_transforms(f16, D)),
        "p_s": (
            plgpu.SMEM(per_wg(8, 64), f16)
            if P.wsm
            # P stays in registers
            else plgpu.SMEM(
                per_wg(P.planes, NP, PLANE),
                jnp.float8_e4m3fn,
                transforms=swizzle_transforms(jnp.float8_e4m3fn, PLANE),
            )
            if P.f8v
            else plgpu.SMEM(
                per_wg(P.planes, NP, PLANE), f16, transforms=swizzle_transforms(f16, PLANE)
            )
        ),
        "o_s": plgpu.SMEM(per_wg(D, NP), f32),
        "lse_s": plgpu.SMEM(per_wg(NP), f32),
        "bar": plgpu.Barrier(num_barriers=W) if W > 1 else plgpu.Barrier(),
    }
    if P.f8v and P.interpret:  # the interpreter's wgmma takes its A operand from SMEM
        scratch["vd8_s"] = plgpu.SMEM(
            per_wg(PLANE, PLANE),
            jnp.float8_e4m3fn,
            transforms=swizzle_transforms(jnp.float8_e4m3fn, 64),
        )
    if P.own_pipeline:  # the pipeline's buffers and barriers, per warpgroup
        blocks = pipeline_blocks(P)
        piped = piped_inputs(P)
        for j in piped:
            shape, dtype, tf, _ = blocks[j]
            scratch[f"buf{j}"] = plgpu.SMEM((W, P.tuning.stages, *shape), dtype, transforms=tf)
        scratch["pipe_bar"] = plgpu.Barrier(
            num_arrivals=len(piped), num_barriers=W * P.tuning.stages
        )
        if P.release:
            scratch["empty_bar"] = plgpu.Barrier(num_arrivals=1, num_barriers=W * P.tuning.stages)
    if P.dense_bias:  # a minimums block, the bias rows of its 16 groups (per warp), the
        # block's barrier
        scratch["kzc_s"] = plgpu.SMEM(per_wg(BIAS_ROWS, D), f16)
        scratch["kb_s"] = plgpu.SMEM(per_wg(BIAS_ROWS, 4, NP), f32)
        scratch["kz_bar"] = (
            plgpu.Barrier(num_arrivals=1, num_barriers=W)
            if W > 1
            else plgpu.Barrier(num_arrivals=1)
        )
    if P.out_dtype:  # the merged row in the caller's layout [NP, D] (`transpose_rows`)
        scratch["out_s"] = plgpu.SMEM((NP, D), jnp.dtype(P.out_dtype))
        if P.o_signs is not None:  # its rotation's other buffer between the warps' stages
            scratch["rot_s"] = plgpu.SMEM((D, NP), f32)
    if P.cluster:  # merge_splits: every warpgroup's partial ready; block 0's reads done
        scratch["ready"] = plgpu.ClusterBarrier(collective_axes=("c",), num_arrivals=W)
        if P.cluster > 1:
            scratch["done"] = plgpu.ClusterBarrier(collective_axes=("c",), num_arrivals=1)
    if P.window:  # the windows, q in the natural order, P; the windows' barrier
        dt = jnp.dtype(P.window_dtype)
        nb = P.window_buffers
        kw, vw = per_wg(nb, PLANE, D), per_wg(nb, D, PLANE)
        scratch["kw_s"] = plgpu.SMEM(kw, dt, transforms=swizzle_transforms(dt, D))
        scratch["vw_s"] = plgpu.SMEM(vw, dt, transforms=swizzle_transforms(dt, PLANE))
        scratch["qn_s"] = plgpu.SMEM(per_wg(NP, D), dt, transforms=swizzle_transforms(dt, D))
        scratch["pw_s"] = plgpu.SMEM(
            per_wg(NP, PLANE), dt, transforms=swizzle_transforms(dt, PLANE)
        )
        copies = 1 + len(window_value_rows(P))
        scratch["win_bar"] = plgpu.Barrier(num_arrivals=copies, num_barriers=W * nb)
    if P.native:  # the cross-warp reductions' scratch (`warpgroup_reduce`, `warpgroup_max_open`)
        scratch["red_s"] = plgpu.SMEM(per_wg(reduction_scratch(NP)), f32)
    return scratch


def build_kernel(plan: Plan, q_scale: float | None = None, window_scale: float | None = None):
    """The kernel of one launch: (layer [1], num_tokens [B], q, *cache[, q_raw], windows...)
    -> (o, lse) partials [B, Hkv, S, D, NP], [B, Hkv, S, NP] (merge_splits: the merged rows
    [B, Hkv, D, NP], [B, Hkv, NP]; with `plan.out_dtype` o is [B, Hkv, nq, D] in that dtype,
    the natural channel order). q_scale: the kernel takes the caller's q [B, Hkv, nq, D]
    and runs its prologue itself (`q_prologue`); None: q comes prepared [B, Hkv, 1, NP, D]
    fp16. With `plan.window`: num_tokens holds the rows' lengths, and after the cache come the
    caller's q [B, Hkv, nq, D] (unless q_scale already makes q_g that), the key windows
    [L, B, Hkv, W, D] and the value windows [L, B, Hkv, D, W]; window_scale is the logits'
    scale (log2 units). With `plan.sinks` = N, then k_sink [L, B, Hkv, N, D] and the layer's
    sink values as a window chunk [B, Hkv, D, 64] (`decode.sink_operands`)."""
    P = plan
    W, S, C, Hkv = P.W, P.S, P.cluster, P.Hkv
    scratch = scratch_buffers(P)
    names = list(scratch)

    def kivi_decode_sm90(layer_g, nt_g, q_g, *refs):
        if P.tuning.pdl and P.native:  # the preceding kernels' outputs are visible after it
            plgpu.griddepcontrol_wait()
        gmem, refs = refs[:6], refs[6:]
        windows = None
        if P.window:
            qr_g = q_g if q_scale is not None else refs[0]
            refs = refs if q_scale is not None else refs[1:]
            windows, refs = (*refs[:2], qr_g), refs[2:]
        sinks = None
        if P.sinks:  # k_sink [L, B, Hkv, N, D], the layer's values as a chunk [B, Hkv, D, 64]
            sinks, refs = refs[:2], refs[2:]
        o_g, lse_g, *scratch_refs = refs
        sc = dict(zip(names, scratch_refs, strict=True))
        unit = lambda wg, b, h, s: _Unit(
            P,
            sc,
            gmem,
            o_g,
            lse_g,
            layer_g,
            nt_g,
            q_g,
            wg,
            b,
            h,
            s,
            q_scale,
            windows,
            window_scale,
            sinks,
        ).run()
        if C:  # one cluster of C blocks per row (b, h); split s = c W + wg
            wg = lax.axis_index("wg") if W > 1 else 0
            r, c = lax.axis_index("row"), lax.axis_index("c")
            unit(wg, lax.div(r, jnp.int32(Hkv)), lax.rem(r, jnp.int32(Hkv)), c * W + wg)
        elif W > 1:  # unit u = (b, h, s) of this warpgroup; the last block may have idle ones
            wg = lax.axis_index("wg")
            u = lax.axis_index("blk") * W + wg
            b, h, s = lax.div(u, Hkv * S), lax.rem(lax.div(u, S), Hkv), lax.rem(u, S)
            pl.when(u < P.B * Hkv * S)(lambda: unit(wg, b, h, s))
        else:
            unit(0, lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s"))

    threads = dict(num_threads=W, thread_name="wg") if W > 1 else {}
    if C:
        grid = dict(
            grid=(P.B * Hkv,), grid_names=("row",), cluster=(C,), cluster_names=("c",), **threads
        )
        parts = ()  # the merged row
    elif W > 1:
        grid = dict(grid=(-(-P.B * Hkv * S // W),), grid_names=("blk",), **threads)
        parts = (S,)
    else:
        grid = dict(grid=(P.B, Hkv, S), grid_names=("b", "h", "s"))
        parts = (S,)
    o_type = (
        jax.ShapeDtypeStruct((P.B, Hkv, P.nq, P.D), jnp.dtype(P.out_dtype))
        if P.out_dtype
        else jax.ShapeDtypeStruct((P.B, Hkv, *parts, P.D, P.NP), f32)
    )
    return plgpu.kernel(
        kivi_decode_sm90,
        out_type=(
            o_type,
            jax.ShapeDtypeStruct((P.B, Hkv, *parts, P.NP), f32),
        ),
        **grid,
        scratch_types=list(scratch.values()),
        # Lane semantics: every register array here is built in a layout the code names (the
        # mma fragments, the rows of the epilogue), so Mosaic's layout inference, which the
        # Warpgroup default runs over the whole kernel, has nothing to choose and costs seconds
        # of lowering per distinct launch (a model compiles one per shape).
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
            unsafe_no_auto_barriers=P.no_auto_barriers,
            lowering_semantics=plgpu.LoweringSemantics.Lane,
        ),
        interpret=P.interpret if P.interpret else False,
    )

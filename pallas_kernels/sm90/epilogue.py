"""The in-kernel split merge (`merge_splits`) and the merged row's transpose
(`transpose_rows`).

The log-sum-exp merge of one row's split partials, run by warpgroup 0 of the row's cluster
over distributed shared memory once every warpgroup has its partial in SMEM, in place of an
XLA merge after the launch; then the row in the caller's layout and dtype, in place of an XLA
transpose. Natively inline Mosaic GPU (mapa + ld.shared::cluster, ex2/lg2.approx; 16-byte
loads and scalar stores); under the interpreter (one block per row only) the same in jnp.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.rotation import sign_bits, unrotate_stages
from pallas_kernels.sm90.inline import const_i32
from pallas_kernels.sm90.layout import PLANE

MAX_CLUSTER = 8  # the portable cluster size limit (blocks): `merge_splits`' cluster of a row


def merge_splits(o_all, lse_all, *, W: int, C: int, interpret):
    """The log-sum-exp merge of one row's S = C * W splits inside the kernel
    (`TuningConfig.merge_splits`): run by warpgroup 0 of the cluster's block 0 once every
    warpgroup of the cluster has its partial in its own SMEM (o_all [W, D, NP] f32,
    normalized; lse_all [W, NP] f32, natural log, -inf for an empty split; without the W axis
    at W = 1). Writes the merged (o, lse) over
    warpgroup 0's tiles (o_all[0], lse_all[0]); rows whose splits are all empty give o = 0,
    lse = -inf, as `merge_partials`.

    Natively every thread merges whole 16-byte chunks of the [D, NP] tile (chunk k = thread +
    128 i: D NP / 512 of them, four columns of one row each), reading block c's tiles over
    distributed shared memory (mapa + ld.shared::cluster; the local block's with plain loads),
    with ex2/lg2.approx; one warpgroup barrier between the reads and the lse store (other
    threads still read lse_all[0]). The interpreter has no distributed shared memory (C = 1
    only there): jnp over the local tiles."""
    tile = (lambda r, j: r.at[j]) if W > 1 else (lambda r, j: r)
    if interpret:
        if C != 1:
            raise NotImplementedError("the interpreter merges one block's splits only (C = 1)")
        D, NP = tile(o_all, 0).shape
        ls = [tile(lse_all, j)[...] for j in range(W)]
        mx = functools.reduce(jnp.maximum, ls)
        safe = jnp.where(mx > -jnp.inf, mx, 0.0)
        ws = [jnp.exp(x - safe) for x in ls]
        tot = functools.reduce(jnp.add, ws)
        ok = tot > 0
        inv = jnp.where(ok, 1.0 / jnp.where(ok, tot, 1.0), 0.0)
        for mt in range(D // PLANE):
            rows = pl.ds(mt * PLANE, PLANE)
            acc = functools.reduce(
                jnp.add,
                [
                    tile(o_all, j)[rows, :] * lax.broadcast_in_dim(ws[j], (PLANE, NP), [1])
                    for j in range(W)
                ],
            )
            tile(o_all, 0)[rows, :] = acc * lax.broadcast_in_dim(inv, (PLANE, NP), [1])
        tile(lse_all, 0)[...] = jnp.where(ok, safe + jnp.log(jnp.where(ok, tot, 1.0)), -jnp.inf)
        return

    D, NP = o_all.shape[-2:]
    chunks = D * NP // 512

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
    def merge(_, o_ref, l_ref):
        i8, i32, f32 = (
            ir.IntegerType.get_signless(8),
            ir.IntegerType.get_signless(32),
            ir.F32Type.get(),
        )
        v4 = ir.VectorType.get((4,), f32)
        tid = arith.andi(mgpu_utils.thread_idx(), const_i32(127))  # (warpgroup 0: 0-127 already)
        o_base, l_base = mgpu_utils.memref_ptr(o_ref), mgpu_utils.memref_ptr(l_ref)
        as_i32 = lambda p: llvm.ptrtoint(i32, p)
        struct = llvm.StructType.get_literal([f32] * 4)
        cst = lambda v: arith.constant(f32, v)
        asm1 = lambda op, x: llvm.inline_asm(
            f32, [x], f"{op} $0, $1;", "=f,f", has_side_effects=False
        )

        def load(base, off, c):
            """The 16 bytes at byte offset off of the tile `base` in block c of the cluster."""
            at = mgpu_utils.getelementptr(base, [off], i8)
            if c == 0:  # this block (the merging warpgroup's)
                return [
                    vector.extract(
                        llvm.load(v4, at, alignment=16), dynamic_position=[], static_position=[k]
                    )
                    for k in range(4)
                ]
            remote = llvm.inline_asm(
                i32,
                [as_i32(at), const_i32(c)],
                "mapa.shared::cluster.u32 $0, $1, $2;",
                "=r,r,r",
                has_side_effects=False,
            )
            out = llvm.inline_asm(
                struct,
                [remote],
                "ld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [$4];",
                "=f,=f,=f,=f,r",
                has_side_effects=True,
            )
            return [llvm.extractvalue(f32, out, [k]) for k in range(4)]

        splits = [(c, w) for c in range(C) for w in range(W)]
        log2e, ln2 = float(np.log2(np.e)), float(np.log(2.0))
        merged, lses = [], []
        for i in range(chunks):
            k = arith.addi(tid, const_i32(128 * i))
            off = arith.muli(k, const_i32(16))  # bytes into a [D, NP] tile
            col = arith.muli(
                arith.remui(arith.muli(k, const_i32(4)), const_i32(NP)), const_i32(4)
            )  # bytes
            if i == 0 or 512 % NP:  # (chunks 128 apart share their columns where NP | 512)
                ls = [load(l_base, arith.addi(col, const_i32(w * NP * 4)), c) for c, w in splits]
            os_ = [load(o_base, arith.addi(off, const_i32(w * D * NP * 4)), c) for c, w in splits]
            out_o, out_l = [], []
            for e in range(4):
                mx = functools.reduce(arith.maximumf, [x[e] for x in ls])
                safe = arith.select(
                    arith.cmpf(arith.CmpFPredicate.OGT, mx, cst(-np.inf)), mx, cst(0.0)
                )
                ws = [
                    asm1("ex2.approx.ftz.f32", arith.mulf(arith.subf(x[e], safe), cst(log2e)))
                    for x in ls
                ]
                tot = functools.reduce(arith.addf, ws)
                acc = functools.reduce(
                    arith.addf, [arith.mulf(w, o[e]) for w, o in zip(ws, os_, strict=True)]
                )
                ok = arith.cmpf(arith.CmpFPredicate.OGT, tot, cst(0.0))
                out_o.append(arith.select(ok, arith.divf(acc, tot), cst(0.0)))
                lg = arith.addf(safe, arith.mulf(asm1("lg2.approx.ftz.f32", tot), cst(ln2)))
                out_l.append(arith.select(ok, lg, cst(-np.inf)))
            merged.append((off, vector.from_elements(v4, out_o)))
            lses.append((col, vector.from_elements(v4, out_l), k))
        mgpu_utils.warpgroup_barrier()  # every thread's reads of lse_all[0] before its store
        for off, v in merged:
            llvm.store(v, mgpu_utils.getelementptr(o_base, [off], i8), alignment=16)
        for col, v, k in lses:  # the chunks of row 0 hold every column once
            first = arith.cmpi(arith.CmpIPredicate.ult, k, const_i32(NP // 4))
            with mgpu_utils.when(first):
                llvm.store(v, mgpu_utils.getelementptr(l_base, [col], i8), alignment=16)

    merge(o_all, lse_all)


def fold_channel(r, D: int):
    """The channel of the kernel's output row r under fold_v_warp (`value_channel_order`):
    row 64 m + 16 w + i holds channel (D/4) w + 16 m + i; r an int or numpy array."""
    return (D // 4) * ((r >> 4) & 3) + 16 * (r >> 6) + (r & 15)


def _row_bits(chan: np.ndarray) -> list[int]:
    """For a bit permutation `chan` (the channel of each row r), the row bit behind each
    channel bit: chan[r ^ (1 << result[k])] = chan[r] ^ (1 << k)."""
    D = chan.size
    bits = D.bit_length() - 1
    rbit = [0] * bits
    for b in range(bits):
        k = int(chan[1 << b]).bit_length() - 1
        if chan[0] != 0 or chan[1 << b] != 1 << k:
            raise ValueError("the rows' channel order is not a permutation of the index bits")
        rbit[k] = b
    xor_of = lambda r: functools.reduce(
        lambda a, b: a ^ int(chan[1 << b]), [b for b in range(bits) if r >> b & 1], 0
    )
    if any(int(chan[r]) != xor_of(r) for r in range(D)):
        raise ValueError("the rows' channel order is not a permutation of the index bits")
    return rbit


def transpose_rows(o_s, out_s, *, rows, interpret, signs=None, spare=None):
    """The merged row's output in the caller's layout: out_s[n, rows[r]] = o_s[r, n] for each
    row r of o_s [D, NP] (float32; `rows` the channel of each row, None for the natural order,
    else fold_v_warp's, `fold_channel`) and each padded head n, in out_s's dtype ([NP, D],
    16-bit or float32; rounded to nearest even, as XLA's convert rounds).

    signs: each head's output first rotated back from the values' stored basis, o R^T with
    R = diag(signs) H / sqrt(D) (`pallas_kernels.rotation`), in float32: the Walsh-Hadamard
    transform over the channels, whose stages pair rows a bit of r apart (the channel order a
    permutation of r's bits, `_row_bits`): between warps through shared memory (o_s and
    `spare`, a [D, NP] float32 buffer, in turn, a warpgroup barrier after each stage), within
    a warp by shuffles; then the channel's sign and 1 / sqrt(D). o_s is overwritten.

    Run by warpgroup 0 between warpgroup barriers (its threads read rows another thread
    wrote). Natively thread r moves row r: NP / 4 16-byte loads and NP scalar stores, a
    warp's stores to one head covering 32 consecutive channels (two runs of 16 under
    fold_v_warp), so without bank conflicts; threads past D idle."""
    D, NP = o_s.shape
    if rows is not None and not np.array_equal(rows, fold_channel(np.arange(D), D)):
        raise ValueError("transpose_rows: rows must be the natural or fold_v_warp's order")
    if interpret:
        x = o_s[...]
        if rows is not None:
            x = jnp.take(x, np.argsort(rows), axis=0)  # row c: channel c
        x = x.T
        if signs is not None:
            x = unrotate_stages(x, signs)
        out_s[...] = x.astype(out_s.dtype)
        return
    if D > 128 or NP % 4:
        raise NotImplementedError(f"transpose_rows: D={D} > 128 or NP={NP} not a multiple of 4")
    if signs is not None and (len(signs) != D or spare is None or spare.shape != o_s.shape):
        raise ValueError("transpose_rows: the rotation needs D signs and a spare [D, NP] buffer")
    dtype = jnp.dtype(out_s.dtype)
    elem = {
        jnp.dtype(jnp.float32): ir.F32Type.get,
        jnp.dtype(jnp.bfloat16): ir.BF16Type.get,
        jnp.dtype(jnp.float16): ir.F16Type.get,
    }[dtype]
    chan = np.arange(D) if rows is None else np.asarray(rows)
    rbit = _row_bits(chan) if signs is not None else []
    across = [b for b in rbit if b >= 5]  # row bits of the warp index: through SMEM
    within = [b for b in rbit if b < 5]  # lane bits: shuffles

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType()),
    )
    def move(_, o_ref, out_ref, spare_ref):
        i8, i32, f32 = (
            ir.IntegerType.get_signless(8),
            ir.IntegerType.get_signless(32),
            ir.F32Type.get(),
        )
        v4 = ir.VectorType.get((4,), f32)
        r = arith.andi(mgpu_utils.thread_idx(), const_i32(127))
        out_base = mgpu_utils.memref_ptr(out_ref)
        bufs = [mgpu_utils.memref_ptr(o_ref), mgpu_utils.memref_ptr(spare_ref)]
        if rows is None:
            c = r
        else:  # fold_channel in i32 arithmetic
            bits = lambda shift, mask: arith.andi(arith.shrui(r, const_i32(shift)), const_i32(mask))
            c = arith.addi(
                arith.muli(bits(4, 3), const_i32(D // 4)),
                arith.addi(arith.muli(arith.shrui(r, const_i32(6)), const_i32(16)), bits(0, 15)),
            )
        active = arith.cmpi(arith.CmpIPredicate.ult, r, const_i32(D))
        high = lambda b: arith.cmpi(  # row r is the pair's second (its channel bit set)
            arith.CmpIPredicate.ne, arith.andi(r, const_i32(1 << b)), const_i32(0)
        )
        butterfly = lambda hi, mine, other: arith.select(
            hi, arith.subf(other, mine), arith.addf(mine, other)
        )

        def load_row(base, row):
            vals = []
            for j in range(NP // 4):
                off = arith.addi(arith.muli(row, const_i32(NP * 4)), const_i32(16 * j))
                v = llvm.load(v4, mgpu_utils.getelementptr(base, [off], i8), alignment=16)
                vals += [
                    vector.extract(v, dynamic_position=[], static_position=[k]) for k in range(4)
                ]
            return vals

        def store_row(base, row, vals):
            for j in range(NP // 4):
                off = arith.addi(arith.muli(row, const_i32(NP * 4)), const_i32(16 * j))
                v = vector.from_elements(v4, vals[4 * j : 4 * j + 4])
                llvm.store(v, mgpu_utils.getelementptr(base, [off], i8), alignment=16)

        src = 0
        for b in across:  # one stage per warp-index bit: rows of other warps, through SMEM
            with mgpu_utils.when(active):
                partner = arith.xori(r, const_i32(1 << b))
                mine, other = load_row(bufs[src], r), load_row(bufs[src], partner)
                hi = high(b)
                store_row(
                    bufs[1 - src],
                    r,
                    [butterfly(hi, x, y) for x, y in zip(mine, other, strict=True)],
                )
            mgpu_utils.warpgroup_barrier()
            src = 1 - src
        with mgpu_utils.when(active):
            vals = load_row(bufs[src], r)
            for b in within:  # the stages within the warp
                hi = high(b)
                vals = [butterfly(hi, x, mgpu_utils.shfl_bfly(x, 1 << b)) for x in vals]
            if signs is not None:  # channel c's sign into the sign bit, and 1 / sqrt(D)
                words = sign_bits(signs, 32)
                word = const_i32(words[0])
                for w in range(1, len(words)):
                    is_w = arith.cmpi(
                        arith.CmpIPredicate.eq, arith.shrui(c, const_i32(5)), const_i32(w)
                    )
                    word = arith.select(is_w, const_i32(words[w]), word)
                bit = arith.andi(arith.shrui(word, arith.andi(c, const_i32(31))), const_i32(1))
                flip = arith.shli(bit, const_i32(31))
                norm = arith.constant(f32, ir.FloatAttr.get(f32, 1 / np.sqrt(D)))
                vals = [
                    arith.mulf(arith.bitcast(f32, arith.xori(arith.bitcast(i32, x), flip)), norm)
                    for x in vals
                ]
            col = arith.muli(c, const_i32(dtype.itemsize))
            for n, x in enumerate(vals):
                if dtype != jnp.dtype(jnp.float32):
                    x = arith.truncf(elem(), x)
                off = arith.addi(col, const_i32(n * D * dtype.itemsize))
                at = mgpu_utils.getelementptr(out_base, [off], i8)
                llvm.store(x, at, alignment=dtype.itemsize)

    move(o_s, out_s, o_s if spare is None else spare)

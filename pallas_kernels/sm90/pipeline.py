"""The TMA pipeline of one warpgroup, without Mosaic's automatic barriers.

`pipeline` is `plgpu.emit_pipeline` for one warpgroup of a block of one or several, each with
its own buffers and barriers, where the caller chooses who issues the copies (all four warps,
one warp, or copies spread over the warps) and how a slot is handed back for refilling (a
warpgroup barrier, or an mbarrier every thread arrives on). Pallas-level code (`pl.when`,
`plgpu.copy_gmem_to_smem`, `lax.fori_loop`); its barriers with `sync` are
`reduce.warpgroup_sync`'s native one.
"""

from __future__ import annotations

import functools

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.sm90.reduce import warpgroup_sync


def pipeline(
    step,
    specs,
    srcs,
    bufs,
    barrier,
    wg,
    stages: int,
    nsteps,
    carry,
    sync: bool = False,
    one_warp: bool = False,
    empty=None,
    issuer=None,
    spread: bool = False,
    sync_every: bool = False,
):
    """`plgpu.emit_pipeline` for one warpgroup (of a block of one or several, each with its
    own buffers): steps 0 .. nsteps-1 of `specs` (block shapes and index maps over `srcs`, GMEM)
    go through `bufs[j]` [stages, *block] with `barrier[wg * stages + slot]`; `step(idx,
    *slot_refs, carry)` as for emit_pipeline. A slot is refilled right after its step, ordered
    after every warp's reads by a warpgroup barrier: each copy's own (Mosaic's auto barriers),
    or, with `sync` (a kernel compiled without auto barriers), one before all of the step's
    copies (one barrier instead of six, and none of the code between them).
    one_warp: the copies are issued by one warp of the warpgroup (warp `issuer`, by default
    wg % 4, so that the block's W issuing warps sit on different schedulers) instead of by all
    four: in the warpgroup semantics every warp computes the copies' coordinates and every
    thread arrives on the barrier (the kernel's native launches). empty (with one_warp and sync):
    barriers [wg * stages + slot] of one warpgroup arrival each: every thread arrives once it
    has read the slot, and only the issuing warp waits there before refilling it, in place of
    the warpgroup barrier (`TuningConfig.release_slots`). spread (with one_warp): copy j
    from warp (issuer + j) % 4, so that no warp computes more than two copies' coordinates
    (`TuningConfig.spread_copies`).
    sync_every (with sync): the warpgroup barrier after every step, also the last `stages`
    that refill nothing: the step's own hand-overs count on it (`TuningConfig.lazy_max`)."""

    def copies(i, slot, which=None):
        for j, (spec, src, buf) in enumerate(zip(specs, srcs, bufs, strict=True)):
            if which is not None and j not in which:
                continue
            at = tuple(
                pl.ds(ix * n, n) for ix, n in zip(spec.index_map(i), spec.block_shape, strict=True)
            )
            plgpu.copy_gmem_to_smem(src.at[at], buf.at[slot], barrier.at[wg * stages + slot])

    release = empty is not None  # the caller passes it only with one_warp and sync

    def fetch(i, slot, first=False):
        if sync and not first and not release and not sync_every:
            warpgroup_sync(False)
        if one_warp:

            def issue(which=None):
                if release and not first:  # every warp has read the slot
                    plgpu.barrier_wait(empty.at[wg * stages + slot])
                copies(i, slot, which)

            # warp semantics: the issuing warp's 32 threads arrive for all 128
            who = lax.rem(wg, 4) if issuer is None else issuer
            if spread:  # copy j from warp (who + j) % 4

                def per_warp(w):
                    for k in range(min(4, len(specs))):
                        which = tuple(range(k, len(specs), 4))
                        pl.when(w == lax.rem(who + k, 4))(functools.partial(issue, which))

                plgpu.warp_map(per_warp)
            else:
                plgpu.warp_map(lambda w: pl.when(w == who)(issue))
        else:
            copies(i, slot)

    for k in range(stages):
        pl.when(k < nsteps)(functools.partial(fetch, k, k, True))

    def body(i, carry):
        slot = lax.rem(i, stages)
        plgpu.barrier_wait(barrier.at[wg * stages + slot])
        carry = step((i,), *[buf.at[slot] for buf in bufs], carry)
        if release:
            plgpu.barrier_arrive(empty.at[wg * stages + slot])
        if sync and sync_every and not release:
            warpgroup_sync(False)
        pl.when(i + stages < nsteps)(lambda: fetch(i + stages, slot))
        return carry

    return lax.fori_loop(0, nsteps, body, carry)

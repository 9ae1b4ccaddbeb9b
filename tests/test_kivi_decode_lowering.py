"""pallas_kernels.kivi_decode on the CPU: the native kernel's lowering and the feature gating.

The native kernel (inline Mosaic GPU: byte-permuted code tiles, per-warp vectors, its own
barriers) cannot run under the interpreter; here it goes through the real sm_90 lowering
(`jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",))`, no GPU needed) for the production
launches and each per-shape feature, and `Plan`'s properties say where each feature applies
(natively on the GPU: test_kivi_decode_gpu).
"""

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest
from kivi_decode_cases import (
    CASES,
    FLAG_CASES,
    GPU_CASES,
    GPU_WINDOW_CASES,
    TC,
    WINDOW_CASES,
    Case,
    anchor,
    case_plan,
    cross_lower,
    ids,
    plan,
)

from pallas_kernels.kivi_decode import SMEM_LIMIT, choose_tuning
from pallas_kernels.kivi_decode.config import (
    BIAS_ROWS,
    merge_cluster,
    merged_splits,
    padded_heads,
    smem_bytes,
    value_channel_order,
    windows_fit,
)
from pallas_kernels.sm90.layout import RESCALE_SLACK

# ---- cross-lowering ------------------------------------------------------------------------

PRODUCTION = [CASES[0], CASES[1], CASES[5], CASES[7]]


@pytest.mark.parametrize("case", PRODUCTION, ids=ids(PRODUCTION))
def test_production_launches_cross_lower_for_sm90(case):
    cross_lower(case)


@pytest.mark.parametrize("case", PRODUCTION, ids=ids(PRODUCTION))
def test_chosen_launches_cross_lower_for_sm90(case):
    """The same shapes under choose_tuning's launch (tuning None)."""
    cross_lower(case.replace(tuning=None))


@pytest.mark.parametrize("case", FLAG_CASES, ids=ids(FLAG_CASES))
def test_tuning_flags_cross_lower_for_sm90(case):
    cross_lower(case)


WINDOWED = WINDOW_CASES + GPU_WINDOW_CASES


@pytest.mark.parametrize("case", WINDOWED, ids=ids(WINDOWED))
def test_window_launches_cross_lower_for_sm90(case):
    """The residual windows attended in the kernel, natively: fold_v_warp's channel order of
    the value window's copies (2-bit G = 32), the per-warp softmax, the in-kernel merge."""
    cross_lower(case)


@pytest.mark.parametrize("case", [PRODUCTION[0], GPU_WINDOW_CASES[0]], ids=str)
def test_skipped_prefix_cross_lowers_for_sm90(case):
    """Sinks: the first positions masked and the steps before them not run, natively."""
    cross_lower(case, skip=8)


@pytest.mark.parametrize("case", GPU_WINDOW_CASES, ids=ids(GPU_WINDOW_CASES))
def test_sinks_chunk_cross_lowers_for_sm90(case):
    """A cache's 8 sinks as the window unit's last chunk, natively: their keys' copy into the
    first rows of the chunk's key buffer, their values' in the output's channel order."""
    tma_loads = lambda modules: "".join(modules).count("cp.async.bulk.tensor.shared.cluster.global")
    fold_v_warp = case.key_bits == case.value_bits == 2 and case.D // 4 <= case.G < case.D
    value_copies = case.D // 16 if fold_v_warp else 1  # `window_value_rows`
    assert tma_loads(cross_lower(case, sinks=8)) == tma_loads(cross_lower(case)) + 1 + value_copies


ROTATED = {c.name: c for c in GPU_WINDOW_CASES}


@pytest.mark.parametrize(
    "name, final_rows",
    [("W128-choose-K2V2-G128", False), ("W128-choose-K2V2-G128-B1", True)],
)
def test_rotations_in_the_kernel_cross_lower_for_sm90(name, final_rows):
    """q rotated in the kernel's own prologue and o rotated back where the kernel writes the
    final rows (`q_signs`, `o_signs`): the Walsh-Hadamard stages across a row's lanes are warp
    shuffles, three per column of a thread's 16 for the codes' tile and the windows' (D = 128:
    8 blocks of 16 columns per row), and for the output five per padded head (the channel bits
    of a warp's 32 lanes; the other two through shared memory); none without them; the same
    with the sinks in the kernel's chunk (which reads the windows' tile of q)."""
    shuffles = lambda modules: "".join(modules).count("nvvm.shfl.sync bfly")
    case = ROTATED[name]
    for sinks in (0, 8):
        plain = cross_lower(case, sinks=sinks)
        rotated = cross_lower(case, sinks=sinks, rotated=True)
        assert shuffles(rotated) - shuffles(plain) == 2 * 3 * 16 + (5 * 8 if final_rows else 0)


def test_window_gating():
    """choose_tuning with windows: the launch sizes as without them; where the windows' chunk
    buffers fit (`windows_fit`), the q prologue in the kernel, and a one-wave launch of one
    warpgroup per block merges its splits there; elsewhere the launch stays as it was and the
    call declines the windows (attended outside the kernel): the four-warpgroup anchor, and
    long 4-bit launches whose blocks per SM the buffers would halve. At one row up to 8k
    tokens the windows' launch takes 8 splits that its cluster merges (`merged_splits`) where
    the bare launch leaves 9-33 splits to XLA."""
    cases = (
        (2, 1, 1280),
        (2, 1, 16640),
        (2, 2, 8448),
        (2, 8, 8448),
        (2, 8, 131072),
        (4, 8, 8448),
        (4, 8, 131328),
    )
    sizes = lambda t: (t.num_splits, t.stages, t.wg_per_block, t.warp_softmax)
    for bits, B, T in cases:
        kw = dict(key_bits=bits, value_bits=bits, group_size=128, q_heads=4)
        bare, win = choose_tuning(B, 8, T, **kw), choose_tuning(B, 8, T, **kw, window=128)
        assert sizes(win) == sizes(bare)
        size = functools.partial(
            smem_bytes, key_bits=bits, value_bits=bits, group_size=128, padded_heads=8
        )
        fits = windows_fit(bare, T // 256, 128, size)
        assert win.q_prologue == (fits or bare.q_prologue)
        one_wave = fits and win.wg_per_block == 1 and B * 8 * win.num_splits <= 132
        assert win.merge_splits == (bare.merge_splits or (one_wave and win.num_splits <= 8))
    kw = dict(key_bits=2, value_bits=2, group_size=128, q_heads=4)
    assert choose_tuning(1, 8, 1280, **kw, window=128).merge_splits
    for bits, T in ((2, 2304), (2, 4352), (2, 8448), (4, 4352), (4, 8448)):
        kw_bits = dict(kw, key_bits=bits, value_bits=bits)
        bare, win = choose_tuning(1, 8, T, **kw_bits), choose_tuning(1, 8, T, **kw_bits, window=128)
        assert bare.num_splits > 8 and not bare.merge_splits
        assert (win.num_splits, win.merge_splits, win.pdl, win.q_prologue) == (8, True, True, True)
        assert sizes(win)[1:] == sizes(bare)[1:]
    assert merged_splits(8, 65, 4, 132) == 0  # 16k tokens: 9 steps per split cost more
    assert merged_splits(16, 17, 4, 132) == 0  # two rows: 16 clusters exceed half the SMs
    assert merged_splits(8, 33, 3, 132) == 8
    assert choose_tuning(8, 8, 131072, **kw, window=128) == choose_tuning(8, 8, 131072, **kw)
    four = dict(key_bits=4, value_bits=4, group_size=128, q_heads=4)
    assert choose_tuning(8, 8, 8448, **four, window=128).q_prologue  # short units: taken
    long = choose_tuning(8, 8, 131328, **four)  # 129 steps per split: declined
    assert choose_tuning(8, 8, 131328, **four, window=128) == long
    size = functools.partial(smem_bytes, key_bits=4, value_bits=4, group_size=128, padded_heads=8)
    assert size(long, window=128) <= SMEM_LIMIT  # it would fit, halving the blocks per SM


@pytest.mark.parametrize("kbg", ["2:128", "2:32"])
def test_dense_bias_cross_lowers_for_sm90(kbg):
    """choose_tuning's anchor launch with dense_bias through the real sm_90 lowering (native
    only: the interpreter ignores the flag), over 32 key groups: two blocks, the second
    clamped to the cache's end in the last split."""
    kb, G = map(int, kbg.split(":"))
    tun = dataclasses.replace(anchor(kb, G), dense_bias=True)
    assert plan(tun, G=G, D=128, nq=4, Tq=32 * G).dense_bias
    cross_lower(
        Case("dense", 2, 32, 8, 128, 32 * G, kb, kb, G, jnp.float16, (32 * G, 1000), 1, tun)
    )


def test_merge_splits_gating_and_cross_lowering():
    """merge_splits applies where W divides S and the row's C = S / W blocks fit a portable
    cluster (one block under the interpreter); elsewhere the XLA merge runs. choose_tuning's
    anchor launches lower for sm_90 with it and pdl (the merge's distributed shared memory
    reads and griddepcontrol.wait in the module)."""
    on = lambda **kw: TC(merge_splits=True, **kw)
    assert merge_cluster(on(num_splits=8, wg_per_block=4), False) == 2
    assert merge_cluster(on(num_splits=8, wg_per_block=1), False) == 8
    assert merge_cluster(on(num_splits=16, wg_per_block=1), False) == 0  # past 8 blocks
    assert merge_cluster(on(num_splits=6, wg_per_block=4), False) == 0  # W does not divide
    assert merge_cluster(on(num_splits=8, wg_per_block=4), True) == 0
    assert merge_cluster(on(num_splits=4, wg_per_block=4), True) == 1
    assert merge_cluster(TC(num_splits=8, wg_per_block=4), False) == 0
    assert plan(on(num_splits=8, wg_per_block=4)).cluster == 2
    for kb, G in ((2, 128), (2, 32), (4, 128)):
        tun = dataclasses.replace(anchor(kb, G), merge_splits=True, pdl=True)
        assert merge_cluster(tun, False) > 1
        mods = cross_lower(
            Case("merge", 1, 32, 8, 128, 2048, kb, kb, G, jnp.float16, (2048 - 100,), 0, tun)
        )
        assert any("ld.shared::cluster" in m and "griddepcontrol.wait" in m for m in mods)


def test_lazy_max_vote_in_the_lowered_module():
    """lazy_max (the common step's cross-warp max a vote at the P barrier) applies natively in
    the shared softmax with the subnormal value fold: choose_tuning's 2-bit G=128 anchor launch
    lowers for sm_90 with it (the barrier's OR reduction in the module), with and without the
    in-kernel merge, and without it the module has no vote. (The interpreter ignores it:
    test_kivi_decode_numerics.test_interpret_lazy_max_matches_reference.)"""
    a = anchor()
    case = Case("lazy", 1, 32, 8, 128, 4096, 2, 2, 128, jnp.float16, (4096 - 100,), 0)
    for merge in (True, False):
        tun = dataclasses.replace(a, lazy_max=True, merge_splits=merge, pdl=merge, q_prologue=merge)
        assert case_plan(case.replace(tuning=tun)).lazy_max
        mods = cross_lower(case.replace(tuning=tun))
        assert any("bar.red.or.pred" in m for m in mods)
    assert a.lazy_max  # choose_tuning's at the anchor
    off = cross_lower(case.replace(tuning=dataclasses.replace(a, lazy_max=False)))
    assert not any("bar.red.or.pred" in m for m in off)


# ---- gating (`Plan`) -----------------------------------------------------------------------


def test_native_only_features_are_off_under_the_interpreter():
    """The features that exist only as inline Mosaic GPU (the kernel's own barriers and what
    needs them, the per-warp softmax and value fold, the q prologue, clusters of more than one
    block) are off under the interpreter, which runs the same launch on its jnp path through
    plgpu.emit_pipeline (one warpgroup) or the kernel's pipeline (several); natively they
    apply."""
    every = TC(
        num_splits=8,
        wg_per_block=4,
        fold_v_warp=True,
        warp_softmax=False,
        lazy_max=True,
        pack_planes=True,
        pack_zeros=True,
        dense_bias=True,
        release_slots=True,
        spread_copies=True,
        merge_splits=True,
        pdl=True,
        q_prologue=True,
    )
    for G, D in ((128, 128), (32, 128), (64, 64)):
        for tun in (
            every,
            dataclasses.replace(every, warp_softmax=True),
            dataclasses.replace(every, wg_per_block=1),
        ):
            p = plan(tun, G=G, D=D, interpret=True)
            assert not (
                p.no_auto_barriers
                or p.wsm
                or p.fvw
                or p.lazy_max
                or p.dense_bias
                or p.q_in_kernel
                or p.release
            ), (G, D, tun)
            assert p.cluster == 0 and p.slack == 0.0
            assert p.own_pipeline == (tun.wg_per_block > 1)
            assert p.pk and p.vsub == (G == D)  # the jnp path takes these
    assert plan(dataclasses.replace(every, num_splits=4), interpret=True).cluster == 1
    n = plan(every)  # natively: each where it applies
    assert n.no_auto_barriers and n.own_pipeline and n.lazy_max and n.dense_bias
    assert n.q_in_kernel and n.release and n.cluster == 2 and n.slack == RESCALE_SLACK
    assert plan(every, G=32).fvw
    assert plan(dataclasses.replace(every, warp_softmax=True)).wsm


def test_dense_bias_gating():
    """dense_bias takes the key bias from 16-group blocks only natively, without Mosaic's auto
    barriers and outside the per-warp softmax, where a block of 16 groups spans whole steps
    and there are at least 16 groups in the cache; elsewhere the flag is ignored (the
    per-step bias)."""
    on = TC(warp_softmax=False, dense_bias=True)
    assert plan(on, G=128, D=128, Tq=2048).dense_bias and plan(on, G=32, D=128, Tq=512).dense_bias
    assert plan(on, G=64, D=64).dense_bias
    assert not plan(on, G=128, D=128, Tq=2048 - 128).dense_bias  # 15 groups
    assert not plan(on, G=128, D=128, interpret=True).dense_bias
    for flags in (
        dict(dense_bias=False),
        dict(warp_softmax=True),  # (at G = D)
        dict(fp8_values=True),
    ):  # (at G = D: the fp8 path keeps the auto barriers)
        assert not plan(dataclasses.replace(on, **flags), G=128, D=128).dense_bias, flags
    assert BIAS_ROWS * 32 % 256 == 0  # G = 32: a block of 16 groups is two steps
    # shared memory: the block and the bias rows in, the per-step minimums out
    kw = dict(key_bits=2, value_bits=2, group_size=128, padded_heads=8)
    base = dataclasses.replace(choose_tuning(8, 8, 131072), dense_bias=False)
    extra = 16 * 128 * 2 + 16 * 4 * 8 * 4 - base.stages * 256 // 128 * 128 * 2
    assert (
        smem_bytes(dataclasses.replace(base, dense_bias=True), **kw)
        == smem_bytes(base, **kw) + base.wg_per_block * extra
    )
    # not where the per-warp softmax runs (choose_tuning's 4-bit G = D launch)
    four = dataclasses.replace(
        choose_tuning(8, 8, 131072, key_bits=4, value_bits=4), dense_bias=True
    )
    assert four.warp_softmax and not plan(four, key_bits=4, value_bits=4).dense_bias
    # the GPU cases that name it take it
    dense = [c for c in GPU_CASES if c.tuning is not None and c.tuning.dense_bias]
    assert len(dense) == 5
    for c in dense:
        assert case_plan(c).dense_bias, c.name
        assert (
            smem_bytes(
                c.tuning,
                key_bits=c.key_bits,
                value_bits=c.value_bits,
                group_size=c.G,
                head_dim=c.D,
                padded_heads=padded_heads(c.Hq // c.Hkv),
            )
            <= SMEM_LIMIT
        ), c.name


def test_value_fold_gating():
    """The value scale folds into P (B = P * s_t, the code fields as fp16 subnormals, the
    running max over logit + log2 s_t) only where a token has one channel group (G = D), on
    mma.sync; natively and under the interpreter alike."""
    for interpret in (False, True):
        for G, D in ((128, 128), (64, 64)):
            p = plan(TC(), G=G, D=D, interpret=interpret)
            assert p.vsub and p.lgmax and not p.f8v
        for G, D in ((64, 128), (32, 128)):
            p = plan(TC(), G=G, D=D, interpret=interpret)
            assert not p.vsub and not p.lgmax
    f8 = plan(TC(fp8_values=True))  # the fp8 value product folds it into its own B
    assert f8.f8v and not f8.vsub and f8.lgmax


def test_fp8_value_gating():
    """fp8_values applies at G = D (the value scale folds into B per token), is opt-in, and
    runs under the interpreter too; elsewhere both products stay on mma.sync."""
    on = TC(fp8_values=True)
    for interpret in (False, True):
        assert plan(on, G=128, D=128, interpret=interpret).f8v
        assert plan(on, G=64, D=64, interpret=interpret).f8v
        assert not plan(on, G=64, D=128, interpret=interpret).f8v
        assert not plan(on, G=32, D=128, interpret=interpret).f8v
    assert not plan(TC(), G=128, D=128).f8v
    assert plan(on, G=32, D=128).no_auto_barriers  # G < D: both products on mma.sync


def test_value_warp_fold_gating_and_channel_order():
    """fold_v_warp applies natively where each warp's D/4 value channels lie in one group of
    several (D/4 <= G < D); the output rows it produces are a permutation whose warp-w rows of
    every value tile are the channels (D/4) w .. (D/4) (w + 1) - 1 (one group), which
    `kivi_decode` puts back."""
    on = TC(fold_v_warp=True)
    for G, D in ((32, 128), (64, 128), (32, 64)):
        p = plan(on, G=G, D=D)
        assert p.fvw
        rows = value_channel_order(p)
        assert sorted(rows) == list(range(D))
        for m in range(D // 64):
            for w in range(4):
                ch = rows[64 * m + 16 * w : 64 * m + 16 * w + 16]
                assert len(set(ch // G)) == 1 and ch[0] // G == (D // 4) * w // G
                assert p.value_groups_of_warps[w] == ch[0] // G
    assert not plan(on, G=128, D=128).fvw  # G = D: the scale folds into P
    assert not plan(on, G=64, D=64).fvw
    assert not plan(on, G=32, D=128, interpret=True).fvw
    assert not plan(TC(), G=32, D=128).fvw  # opt-in
    assert value_channel_order(plan(TC(), G=32, D=128)) is None
    assert (value_channel_order(plan(on, G=32, D=64)) == np.arange(64)).all()


def test_plane_packing_gating():
    """pack_planes applies where the query heads of a kv head fit in half of mma's N = 8, not
    in the per-warp softmax or with fp8 values; with fold_v_warp too (natively: the
    interpreter, which has no fold_v_warp, packs the exact value path); the interpreter takes
    it too. pack_zeros only with it."""
    on = TC(wg_per_block=4, warp_softmax=False, pack_planes=True)
    for heads, G, D in ((4, 128, 128), (1, 32, 128), (3, 64, 64)):
        assert plan(on, G=G, D=D, nq=heads).pk
        assert plan(on, G=G, D=D, nq=heads, interpret=True).pk
    assert not plan(on, nq=5).pk  # 5..8 heads fill N = 8
    assert not plan(TC(wg_per_block=4, warp_softmax=False)).pk  # opt-in
    assert not plan(dataclasses.replace(on, fp8_values=True)).pk
    fvw = dataclasses.replace(on, fold_v_warp=True)
    assert plan(fvw, G=32).pk and plan(fvw, G=32).fvw
    assert plan(fvw, G=32, interpret=True).pk
    assert not plan(fvw, G=32, interpret=True).fvw
    assert not plan(fvw, G=32, nq=8).pk
    # the per-warp softmax (G = D) keeps its own path
    assert not plan(TC(pack_planes=True)).pk
    # zero padding: with the packed planes only; P as one B tile per plane without fold_v_warp
    pz = dataclasses.replace(on, pack_zeros=True)
    assert plan(pz).pz and plan(pz).pzv
    assert plan(dataclasses.replace(pz, fold_v_warp=True), G=32).pz
    assert not plan(dataclasses.replace(pz, fold_v_warp=True), G=32).pzv
    assert not plan(pz, nq=8).pz and not plan(TC(pack_zeros=True)).pz


def test_no_auto_barriers_gating():
    """Mosaic's auto barriers go only where every cross-warp hand-over of the loop has its own
    barrier: natively with both products on mma.sync (the kernel's own pipeline, one warp
    issuing the copies); the fp8 value product's SMEM stores rely on them, and the
    interpreter has them. With one warpgroup and the auto barriers the pipeline is
    plgpu.emit_pipeline."""
    W4 = TC(wg_per_block=4)
    assert plan(W4, G=128).no_auto_barriers
    assert plan(W4, G=32).no_auto_barriers  # keys fold, values dequantized
    assert plan(TC(wg_per_block=3)).no_auto_barriers
    assert not plan(W4, interpret=True).no_auto_barriers
    assert plan(TC()).no_auto_barriers and plan(TC()).own_pipeline  # one warpgroup
    f8 = dataclasses.replace(W4, fp8_values=True)
    assert not plan(f8).no_auto_barriers and plan(f8).own_pipeline  # W > 1: its own pipeline
    f8_1 = TC(fp8_values=True)
    assert not plan(f8_1).no_auto_barriers and not plan(f8_1).own_pipeline  # emit_pipeline
    assert not plan(TC(), interpret=True).own_pipeline
    # release_slots needs the kernel's own barriers
    rel = TC(wg_per_block=4, release_slots=True)
    assert plan(rel).release and not plan(rel, interpret=True).release
    assert not plan(dataclasses.replace(rel, fp8_values=True)).release


def test_warp_softmax_gating():
    """The per-warp softmax needs both products on mma.sync with the value scale folded into P
    as subnormal fields (G = D), natively; the interpreter takes the shared softmax."""
    on = TC()
    assert plan(on, G=128, D=128).wsm and plan(on, G=64, D=64).wsm
    assert not plan(on, G=32, D=128).wsm  # two channel groups per 64-channel tile
    assert not plan(on, interpret=True).wsm
    for flags in (dict(warp_softmax=False), dict(fp8_values=True)):
        assert not plan(dataclasses.replace(on, **flags)).wsm, flags


def test_lazy_max_gating():
    """lazy_max applies natively in the shared softmax with the subnormal value fold (G = D
    on mma.sync, without the auto barriers): not in the per-warp softmax, with fp8 values, at
    G < D or under the interpreter; where it applies the running max may lag by the slack."""
    on = TC(wg_per_block=4, warp_softmax=False, lazy_max=True)
    assert plan(on).lazy_max and plan(on).slack == RESCALE_SLACK
    assert plan(on, G=64, D=64).lazy_max
    assert not plan(on, G=32).lazy_max
    assert not plan(on, interpret=True).lazy_max
    for flags in (dict(lazy_max=False), dict(warp_softmax=True), dict(fp8_values=True)):
        p = plan(dataclasses.replace(on, **flags))
        assert not p.lazy_max and p.slack == 0.0, flags


def test_gpu_cases_take_their_features():
    """Every GPU case's launch runs natively the features it names where they apply (a case
    meant for a feature does test it)."""
    for c in GPU_CASES:
        if c.tuning is None:
            continue
        p = case_plan(c)
        t = c.tuning
        assert p.native and p.no_auto_barriers == (not p.f8v), c.name
        if c.name.startswith("dense"):
            assert p.dense_bias, c.name
        if c.name.startswith(("pack", "pz")):
            assert p.pk and p.pz == t.pack_zeros, c.name
        if "fvw" in c.name:
            assert p.fvw, c.name
        if c.name.startswith("wsm"):
            assert p.wsm, c.name
        if c.name.startswith("fp8"):
            assert p.f8v, c.name
        if c.name.startswith("release"):
            assert p.release, c.name


def test_call_tuning_takes_the_windows_where_they_fit():
    """The launch of a call left to choose: choose_tuning's with the windows where they fit,
    else its launch without them (4-bit B=8 T=128k: long units, windows_fit declines)."""
    from pallas_kernels.kivi_decode import call_tuning, choose_tuning

    small = dict(key_bits=2, value_bits=2, group_size=128, q_heads=4)
    tun, taken = call_tuning(1, 8, 8192, window=128, **small)
    assert taken and tun == choose_tuning(1, 8, 8192, window=128, **small) and tun.q_prologue
    long4 = dict(key_bits=4, value_bits=4, group_size=128, q_heads=4)
    tun, taken = call_tuning(8, 8, 131072, window=128, **long4)
    assert not taken and tun == choose_tuning(8, 8, 131072, **long4)
    assert call_tuning(1, 8, 8192, **small) == (choose_tuning(1, 8, 8192, **small), False)

"""pallas_kernels.kivi_decode natively on an sm_90 GPU (skipped elsewhere).

The native kernel on larger shapes over the TuningConfig's features, outputs poisoned first
(an element the kernel fails to write shows up as NaN), the same bits run to run, against the
float32 twin within the module's tolerances; the features that must not change a bit
(dense_bias, the unblocked value codes, pdl and the q prologue) bit for bit; the in-kernel
merge and the lazy max against the launches without them.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kivi_decode_cases import (
    GPU_CASES,
    GPU_WINDOW_CASES,
    ON_GPU,
    TOL,
    anchor,
    case_cache,
    case_windows,
    compare,
    ids,
    make_cache,
    make_q,
    plan,
    run_case,
    tol_for,
    twin_flags,
)

from kivi_jax.quant import block_columns, value_codes_blocked
from pallas_kernels.kivi_decode import kivi_decode, kivi_decode_reference
from pallas_kernels.kivi_decode.config import merge_cluster

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (sm_90)")]


def poison():
    """Fill and free a NaN buffer so that the allocator hands its memory to the next outputs:
    an element the kernel (or the merge) fails to write then shows up as NaN."""
    buf = jnp.full((64 << 20,), jnp.nan, jnp.float32).block_until_ready()
    del buf


def poisoned_runs(q, cache, nt, kw, tun, other):
    """The kernel at layer 1 under `tun` twice (asserted the same bits) and under `other`, each
    on outputs poisoned first. Returns ((o, lse) of tun, (o, lse) of other)."""

    def run(t):
        poison()
        return jax.block_until_ready(
            jax.jit(lambda *c: kivi_decode(q, *c, nt, jnp.int32(1), **kw, tuning=t))(*cache)
        )

    (o, lse), (o2, lse2), theirs = run(tun), run(tun), run(other)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o2), err_msg="not deterministic")
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse2), err_msg="not deterministic")
    return (o, lse), theirs


@pytest.mark.parametrize("case", GPU_WINDOW_CASES, ids=ids(GPU_WINDOW_CASES))
def test_gpu_windows_match_reference(case):
    """The residual windows attended in the kernel, natively, against the twin."""
    run_case(case, 3, False)


ROW_CASES = GPU_WINDOW_CASES[-5:]  # one-wave launches that merge their splits


@pytest.mark.parametrize("case", ROW_CASES, ids=ids(ROW_CASES))
def test_gpu_final_rows_in_the_query_dtype(case):
    """A launch that merges its splits and attends the windows writes the rows as the caller
    takes them (`transpose_rows`: the natural and fold_v_warp's channel order), on poisoned
    outputs: in the query's dtype, the float32 rows rounded once, bit for bit (the float32
    rows against the twin: `test_gpu_windows_match_reference`)."""
    cache, nt = case_cache(case, 3), jnp.asarray(case.lengths, jnp.int32)
    q, windows = make_q(4, case.B, case.Hq, case.D, case.dtype), case_windows(case, 3)

    def run(dt):
        poison()
        layer = jnp.int32(case.layer)
        out = kivi_decode(q, *cache, nt, layer, **case.kw, windows=windows, out_dtype=dt)
        return jax.block_until_ready(out)

    (o32, lse32), (o16, lse16) = run(jnp.float32), run(case.dtype)
    assert o16.dtype == case.dtype and o16.shape == q.shape
    np.testing.assert_array_equal(np.asarray(o16), np.asarray(o32.astype(case.dtype)))
    np.testing.assert_array_equal(np.asarray(lse16), np.asarray(lse32))


SKIP_CASES = [GPU_WINDOW_CASES[0], dataclasses.replace(GPU_CASES[0], lengths=(8192, 5000, 300, 0))]


@pytest.mark.parametrize("skip", [8, 300])
@pytest.mark.parametrize("case", SKIP_CASES, ids=ids(SKIP_CASES))
def test_gpu_skip_matches_reference(case, skip):
    """Positions [0, skip) left out (a cache's sinks), natively: within the first step and
    past whole steps, with the windows in the kernel and without."""
    run_case(case, 9, False, skip=skip)


# the sinks in the window unit (natural and fold_v_warp's channel order), and merged outside
SINK_CASES = [*SKIP_CASES, GPU_WINDOW_CASES[1]]


@pytest.mark.parametrize("case", SINK_CASES, ids=ids(SINK_CASES))
def test_gpu_sinks_match_reference(case):
    """A cache's 8 sinks from their own buffers merged with the splits, natively: as the twin,
    and as the call without them merged with the sinks' own softmax."""
    run_case(case, 10, False, sinks=8)


ROTATED_CASES = [*GPU_WINDOW_CASES[:2], GPU_WINDOW_CASES[5], SKIP_CASES[1]]


@pytest.mark.parametrize("sinks", [0, 8])
@pytest.mark.parametrize("case", ROTATED_CASES, ids=ids(ROTATED_CASES))
def test_gpu_rotations_match_reference(case, sinks):
    """q rotated and o rotated back by the call (`q_signs`, `o_signs`) natively: q in the
    kernel's prologue (the windows' launches, the sinks in their chunk or not), else in XLA's
    preparation of q; o where the kernel writes the final rows (the one-row case), else in the
    XLA merge; as the twin, and as the call on q rotated beforehand with its o rotated back."""
    run_case(case, 13, False, sinks=sinks, rotated=True)


def test_gpu_sinks_merged_outside_in_the_warps_channel_order():
    """fold_v_warp's parts come in the warps' channel order and are put back after the merge:
    12 sinks (not whole 8-row tiles: merged outside the kernel) join it in that order."""
    run_case(GPU_WINDOW_CASES[1], 11, False, sinks=12)


@pytest.mark.parametrize("case", GPU_CASES, ids=ids(GPU_CASES))
def test_gpu_matches_reference_and_is_deterministic(case):
    B, Hq, Hkv, D, Tq = case.B, case.Hq, case.Hkv, case.D, case.T
    kb, vb, G, tun = case.key_bits, case.value_bits, case.G, case.tuning
    key = jax.random.key(B * 1000 + Tq + kb * 10 + vb + G)
    ks = jax.random.split(key, 7)
    L = 3
    u8 = lambda k, s: jax.random.bits(k, s, jnp.uint8)  # random bytes: valid packed codes
    f = lambda k, s, lo, hi: jax.random.uniform(k, s, jnp.float32, lo, hi).astype(jnp.float16)
    cache = (
        u8(ks[0], (L, B, Hkv, Tq * kb // 8, D)),
        f(ks[1], (L, B, Hkv, Tq // G, D), 0.02, 0.3),
        f(ks[2], (L, B, Hkv, Tq // G, D), -0.6, 0.0),
        # the cache's value codes: 2-bit in blocks of 64 byte columns
        u8(
            ks[3],
            (L, B, Hkv, Tq * vb // 8 // 64, D, 64)
            if value_codes_blocked(vb)
            else (L, B, Hkv, D, Tq * vb // 8),
        ),
        f(ks[4], (L, B, Hkv, D // G, Tq), 0.02, 0.3),
        f(ks[5], (L, B, Hkv, D // G, Tq), -0.6, 0.0),
    )
    q = jax.random.normal(ks[6], (B, Hq, D), jnp.float32).astype(case.dtype)
    rng = np.random.default_rng(Tq + B)
    lengths = rng.integers(1, Tq + 1, B)
    lengths[0] = 0
    lengths[-1] = Tq - 13
    nt = jnp.asarray(lengths, jnp.int32)
    kw = dict(key_bits=kb, value_bits=vb, group_size=G, sm_scale=1 / math.sqrt(D), tuning=tun)
    fn = jax.jit(lambda q, nt, layer, *c: kivi_decode(q, *c, nt, layer, **kw))
    outs = []
    for _ in range(2):
        poison()
        outs.append(jax.block_until_ready(fn(q, nt, jnp.int32(1), *cache)))
    (o, lse), (o2, lse2) = outs
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o2), err_msg="not deterministic")
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse2), err_msg="not deterministic")
    ro, rlse = kivi_decode_reference(
        q,
        *cache,
        nt,
        jnp.int32(1),
        **{k: v for k, v in kw.items() if k != "tuning"},
        **twin_flags(tun, G, D),
    )
    compare(o, lse, ro, rlse, tol_for(tun, G, D, case.dtype))


@pytest.mark.parametrize("kbg", ["2:128", "2:32", "2:64", "4:32"])
def test_gpu_dense_bias_gives_the_same_bits(kbg):
    """dense_bias computes the key bias of 16 groups in one mma.sync's rows, with the same
    products in the same order as the per-step bias mma: choose_tuning's anchor launches give
    the same outputs bit for bit with it and without, over ragged lengths, splits whose blocks
    start off the 16-group grid and a last block clamped to the cache's end."""
    kb, G = map(int, kbg.split(":"))
    B, Hq, Hkv, D, Tq = 3, 32, 8, 128, 16384 + 3 * 256
    tun = anchor(kb, G)
    dense, tun = (dataclasses.replace(tun, dense_bias=x) for x in (True, False))
    assert plan(dense, G=G, D=D, Tq=Tq, key_bits=kb, value_bits=kb).dense_bias
    q, nt = make_q(4, B, Hq, D, jnp.float16), jnp.asarray([Tq, 7001, 255], jnp.int32)
    cache = make_cache(kb * G, 2, B, Hkv, D, Tq, kb, kb, G)
    run = lambda t: jax.jit(
        lambda *c: kivi_decode(
            q,
            *c,
            nt,
            jnp.int32(1),
            key_bits=kb,
            value_bits=kb,
            group_size=G,
            sm_scale=1 / math.sqrt(D),
            tuning=t,
        )
    )(*cache)
    a, b = run(dense), run(tun)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    ro, rlse = kivi_decode_reference(
        q,
        *cache,
        nt,
        jnp.int32(1),
        key_bits=kb,
        value_bits=kb,
        group_size=G,
        sm_scale=1 / math.sqrt(D),
    )
    compare(*a, ro, rlse, TOL[jnp.dtype(jnp.float16)])


@pytest.mark.parametrize("kbg", ["2:128", "2:32", "4:128", "2:64"])
def test_gpu_unblocked_value_codes_give_the_same_bits(kbg):
    """choose_tuning's anchor launches natively over the blocked and the unblocked value codes:
    the same SMEM image, the same outputs bit for bit."""
    kb, G = map(int, kbg.split(":"))
    B, Hq, Hkv, D, Tq = 3, 32, 8, 128, 16384
    tun = anchor(kb, G)
    kw = dict(key_bits=kb, value_bits=kb, group_size=G, sm_scale=1 / math.sqrt(D), tuning=tun)
    q, nt = make_q(3, B, Hq, D, jnp.bfloat16), jnp.asarray([Tq, 7001, 255], jnp.int32)
    cache = make_cache(kb + G, 2, B, Hkv, D, Tq, kb, kb, G, blocked=False)
    blocked = (*cache[:3], block_columns(cache[3]), *cache[4:])
    fn = jax.jit(lambda *c: kivi_decode(q, *c, nt, jnp.int32(1), **kw))
    a, b = fn(*blocked), fn(*cache)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    ro, rlse = kivi_decode_reference(
        q, *cache, nt, jnp.int32(1), **{k: v for k, v in kw.items() if k != "tuning"}
    )
    compare(*a, ro, rlse, TOL[jnp.dtype(jnp.bfloat16)])


@pytest.mark.parametrize("kbg", ["2:128", "2:32", "4:128"])
@pytest.mark.parametrize(
    "flags",
    [
        dict(merge_splits=True),
        dict(merge_splits=True, pdl=True, q_prologue=True),
        dict(pdl=True),
        dict(q_prologue=True),
    ],
    ids=["merge", "merge-pdl-q", "pdl", "q"],
)
def test_gpu_merge_splits_and_pdl(kbg, flags):
    """choose_tuning's anchor launches (clusters of 2, 2 and 8 blocks per row) with the
    in-kernel merge, PDL and/or the in-kernel q prologue, on poisoned outputs over ragged
    lengths (an empty row, empty splits): the XLA merge's outputs to float32 rounding (the
    merge's ex2/lg2.approx), the reference within the dtype's bound, the same bits run to run;
    pdl and q_prologue alone change no bit (the same fp16 q tile as XLA's prologue)."""
    kb, G = map(int, kbg.split(":"))
    B, Hq, Hkv, D, Tq = 4, 32, 8, 128, 16384
    base = dataclasses.replace(  # the XLA merge and prologue, no PDL
        anchor(kb, G), merge_splits=False, pdl=False, q_prologue=False
    )
    tun = dataclasses.replace(base, **flags)
    q, nt = make_q(7, B, Hq, D, jnp.bfloat16), jnp.asarray([Tq, 0, 7001, 255], jnp.int32)
    cache = make_cache(kb * G + 1, 2, B, Hkv, D, Tq, kb, kb, G)
    kw = dict(key_bits=kb, value_bits=kb, group_size=G, sm_scale=1 / math.sqrt(D))
    (o, lse), (xo, xlse) = poisoned_runs(q, cache, nt, kw, tun, base)
    if flags.get("merge_splits"):
        assert merge_cluster(tun, False) > 1
        np.testing.assert_allclose(np.asarray(o), np.asarray(xo), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(xlse), rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_array_equal(np.asarray(o), np.asarray(xo))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(xlse))
    ro, rlse = kivi_decode_reference(q, *cache, nt, jnp.int32(1), **kw)
    compare(o, lse, ro, rlse, TOL[jnp.dtype(jnp.bfloat16)])


@pytest.mark.parametrize("merge", [True, False], ids=["merge", "xla-merge"])
def test_gpu_lazy_max(merge):
    """lazy_max at choose_tuning's 2-bit G=128 anchor launch over key scales that grow along
    the row (the running max passes its slack at later steps, not only the first: the exact
    exchange, the rescale and P redone mid-row) and one late group whose scores jump, on
    poisoned outputs over ragged lengths (an empty row, a partial last step): the reference
    within the dtype's bound, the default kernel's output to fp16 rounding of P, the same bits
    run to run."""
    B, Hq, Hkv, D, Tq, G = 4, 32, 8, 128, 16384, 128
    base = dataclasses.replace(
        anchor(2, G), merge_splits=merge, pdl=merge, q_prologue=merge, lazy_max=False
    )
    tun = dataclasses.replace(base, lazy_max=True)
    kc, ks, km, *vals = make_cache(23, 2, B, Hkv, D, Tq, 2, 2, G)
    ramp = np.linspace(1.0, 8.0, Tq // G, dtype=np.float32)
    ramp[-20] = 24.0  # a late jump
    ks = (ks.astype(jnp.float32) * ramp[None, None, None, :, None]).astype(jnp.float16)
    cache = (kc, ks, km, *vals)
    q, nt = make_q(9, B, Hq, D, jnp.bfloat16), jnp.asarray([Tq, 0, 7001, 255], jnp.int32)
    kw = dict(key_bits=2, value_bits=2, group_size=G, sm_scale=1 / math.sqrt(D))
    (o, lse), (bo, blse) = poisoned_runs(q, cache, nt, kw, tun, base)
    # against the exact-max kernel (the same scores bit for bit; P rounded to fp16 against
    # another reference max, the sums in f32): o to fp16 rounding, lse to f32's
    compare(o, lse, bo, blse, TOL[jnp.dtype(jnp.bfloat16)])
    fin = np.isfinite(np.asarray(blse))
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(blse)[fin], rtol=0, atol=1e-4)
    # against the twin: these logits reach ~40 (log2 units), and the fp16 operand q * s_g
    # carries 2^-12 of them, so lse's bound is relative here (the module's TOL is absolute
    # for logits of a few units)
    ro, rlse = kivi_decode_reference(q, *cache, nt, jnp.int32(1), **kw)
    rlse = np.asarray(rlse)
    den = np.where(
        np.isfinite(rlse), np.maximum(1.0, np.abs(np.where(np.isfinite(rlse), rlse, 0.0))), 1.0
    )
    compare(o, np.asarray(lse) / den, ro, rlse / den, TOL[jnp.dtype(jnp.bfloat16)])

"""pallas_kernels.kivi_decode on the CPU: the numbers.

The kernel under the Mosaic GPU interpreter (the jnp path of the same function, race detection
on) against its float32 twin on small random caches (bits 2/4 and mixed, G 32/64/128, GQA
ratios, ragged lengths incl. 0 and partial blocks, D 64/128, a nonzero layer) over the
TuningConfig's features; the twin against a plain dequantize-then-softmax attention and the fp8
twin's running max; the code fields and byte orders of the native path; choose_tuning's
choices; argument and TuningConfig errors.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kivi_decode_cases import (
    CASE,
    CASES,
    FLAG_CASES,
    MERGE_CASES,
    TC,
    WINDOW_CASES,
    Case,
    anchor,
    case_cache,
    case_plan,
    case_sinks,
    case_windows,
    compare,
    ids,
    interpreter,
    make_cache,
    make_q,
    plain_attention,
    plan,
    run_case,
)

from pallas_kernels.kivi_decode import (
    SMEM_LIMIT,
    TuningConfig,
    choose_tuning,
    kivi_decode,
    kivi_decode_reference,
)
from pallas_kernels.kivi_decode.config import STEP_TOKENS, merge_cluster, smem_bytes
from pallas_kernels.kivi_decode.decode import kernel_call, sinks_in_kernel
from pallas_kernels.kivi_decode.reference import _running_max
from pallas_kernels.sm90 import codes, layout

# ---- the interpreter against the twin ------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_interpret_matches_reference(case):
    run_case(case, seed=case.shape_seed, interpret=interpreter())


@pytest.mark.parametrize("case", FLAG_CASES, ids=ids(FLAG_CASES))
def test_interpret_tuning_flags_match_reference(case):
    run_case(case, seed=11, interpret=interpreter())


@pytest.mark.parametrize("case", WINDOW_CASES, ids=ids(WINDOW_CASES))
def test_interpret_windows_match_reference(case):
    """The residual windows attended in the kernel and merged into the row's last split."""
    run_case(case, 5, interpreter())


@pytest.mark.parametrize("skip", [40, 300])
def test_interpret_skip_matches_reference(skip):
    """Positions [0, skip) left out (a cache's sinks, attended from their own buffer): within
    the first step, and past whole steps; with the windows in the kernel and without."""
    run_case(WINDOW_CASES[0], 7, interpreter(), skip=skip)
    run_case(CASES[0], 8, interpreter(), skip=skip)


@pytest.mark.parametrize(
    "case",
    [CASES[0], WINDOW_CASES[0], WINDOW_CASES[3]],
    ids=["splits-merged-outside", "windows", "windows-merged-in-kernel"],
)
def test_a_traced_layer_out_of_range_reads_in_bounds_and_gives_nan(case):
    """The kernel applies the library's layer policy itself (no launch around it does): a
    traced layer outside [0, L) reads the nearest layer and every output row is NaN, empty
    rows included, as in the twin; a traced layer in range is that layer; a concrete one out
    of range is a ValueError."""
    cache, windows = case_cache(case, 3), case_windows(case, 3)
    q = make_q(4, case.B, case.Hq, case.D, case.dtype)
    nt = jnp.asarray(case.lengths, jnp.int32)
    kw = dict(**case.kw, tuning=case.tuning, windows=windows)
    f = jax.jit(lambda layer: kivi_decode(q, *cache, nt, layer, interpret=interpreter(), **kw))
    for bad in (3, -1):
        o, _ = f(jnp.int32(bad))
        assert np.isnan(np.asarray(o, np.float32)).all(), bad
        ro, _ = kivi_decode_reference(q, *cache, nt, jnp.int32(bad), **kw)
        assert np.isnan(np.asarray(ro, np.float32)).all(), bad
    o, lse = f(jnp.int32(2))
    want, want_lse = kivi_decode(q, *cache, nt, 2, interpret=interpreter(), **kw)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    with pytest.raises(ValueError, match=r"layer must be in \[0, 3\), got 3"):
        kivi_decode(q, *cache, nt, 3, interpret=interpreter(), **kw)


@pytest.mark.parametrize("n", [8, 40, 12, 72])
def test_interpret_sinks_match_reference(n):
    """A cache's sinks (the first n positions in full precision) attended from their own
    buffers, rows reading all, half or none of them: as the twin, and as the call without them
    merged with the sinks' own softmax. With the windows in the kernel, 8 and 40 sinks are the
    window unit's last chunk, 12 (not whole 8-row tiles) and 72 (past one chunk) join the
    merge of the splits, as they do without the windows."""
    run_case(WINDOW_CASES[0], 9, interpreter(), sinks=n)
    run_case(CASES[0], 10, interpreter(), sinks=n)


@pytest.mark.parametrize(
    "case, sinks",
    [(WINDOW_CASES[0], 8), (CASES[0], 8), (CASES[2], 0), (WINDOW_CASES[3], 8)],
    ids=["windows-sinks-in-kernel", "sinks-merged-outside", "D64-bare", "final-rows"],
)
def test_interpret_rotations_match_reference(case, sinks):
    """q rotated and o rotated back by the call (`q_signs`, `o_signs`: the cache's Hadamard
    rotation of keys and values): as the twin, and as the call on q rotated beforehand with
    its o rotated back after; the windows, the sinks in the kernel's chunk and those merged
    outside all read the rotated q; o rotated back in the XLA merge, or where the kernel
    merges its splits and writes the final rows (WINDOW_CASES[3]) by the kernel."""
    run_case(case, 12, interpreter(), sinks=sinks, rotated=True)


@pytest.mark.parametrize(
    "signs, match",
    [((1.0,) * 64, "D=128 signs"), ((1.0,) * 127 + (0.5,), r"\+1 or -1")],
    ids=["count", "value"],
)
def test_bad_rotation_signs_are_named(signs, match):
    case = CASES[0]
    cache = case_cache(case, 0)
    q = make_q(1, case.B, case.Hq, case.D, case.dtype)
    with pytest.raises(ValueError, match=match):
        kivi_decode(q, *cache, jnp.asarray(case.lengths, jnp.int32), 0, **case.kw, q_signs=signs)


def test_sinks_in_the_kernel_where_they_fit_a_chunk():
    """The window unit takes the sinks when they fill whole 8-row tiles of one 64-slot chunk
    in the windows' dtype; the rest are merged outside (`sinks_in_kernel`)."""
    s = lambda n, dt=jnp.bfloat16: (jnp.zeros((1, 1, 1, n, 64), dt),) * 2
    assert sinks_in_kernel(s(8), 128, "bfloat16") and sinks_in_kernel(s(64), 64, "bfloat16")
    assert not sinks_in_kernel(s(8), 0, "bfloat16")  # no windows in the launch
    assert not sinks_in_kernel(s(12), 128, "bfloat16") and not sinks_in_kernel(
        s(72), 128, "bfloat16"
    )
    assert not sinks_in_kernel(s(8, jnp.float32), 128, "bfloat16")


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda k, v: (k, v, v), "sinks must be a pair"),
        (lambda k, v: (k[:, :1], v), "k_sink must be"),
        (lambda k, v: (k, v[..., :4, :]), "v_sink must be k_sink's shape"),
        (lambda k, v: (k, v.astype(jnp.int32)), "v_sink must be floating point"),
    ],
)
def test_bad_sinks_are_named(change, match):
    case = CASES[0]
    cache, q = case_cache(case, 2), make_q(3, case.B, case.Hq, case.D, case.dtype)
    n = jnp.asarray(case.lengths, jnp.int32)
    sinks = change(*case_sinks(case, 2, 8))
    with pytest.raises(ValueError, match=match):
        kivi_decode(q, *cache, n, 0, **case.kw, interpret=interpreter(), skip=8, sinks=sinks)
    with pytest.raises(ValueError, match=match):
        kivi_decode_reference(q, *cache, n, 0, **case.kw, skip=8, sinks=sinks)


def test_sinks_need_skip_to_be_their_count():
    """The codes of the sink positions are stand-ins: attending them too would count the
    sinks twice."""
    case = CASES[0]
    cache, q = case_cache(case, 2), make_q(3, case.B, case.Hq, case.D, case.dtype)
    n = jnp.asarray(case.lengths, jnp.int32)
    with pytest.raises(ValueError, match="with 8 sinks skip must be 8"):
        kivi_decode(
            q, *cache, n, 0, **case.kw, interpret=interpreter(), sinks=case_sinks(case, 2, 8)
        )


@pytest.mark.parametrize("skip", [-1, 2.0, True])
def test_a_bad_skip_is_named(skip):
    case = CASES[0]
    cache, q = case_cache(case, 2), make_q(3, case.B, case.Hq, case.D, case.dtype)
    n = jnp.asarray(case.lengths, jnp.int32)
    with pytest.raises(ValueError, match="skip must be a non-negative int"):
        kivi_decode(q, *cache, n, 0, **case.kw, interpret=interpreter(), skip=skip)


def test_windows_cap_the_lengths_at_max_len():
    """An overflowed row (length past the cache's max_len) attends its first max_len tokens:
    the kernel's cap gives the bits of lengths clamped before the call, and the twin's."""
    case = WINDOW_CASES[0]
    cache, q = case_cache(case, 2), make_q(3, case.B, case.Hq, case.D, case.dtype)
    windows = case_windows(case, 2)
    over = jnp.asarray([900, 641, 0], jnp.int32)
    call = lambda n, cap: kivi_decode(
        q, *cache, n, 1, **case.kw, tuning=case.tuning, interpret=interpreter(),
        windows=windows, max_len=cap,
    )  # fmt: skip
    o, lse = call(over, 640)
    co, clse = call(jnp.minimum(over, 640), 0)
    np.testing.assert_array_equal(o, co)
    np.testing.assert_array_equal(lse, clse)
    ro, rlse = kivi_decode_reference(q, *cache, over, 1, **case.kw, windows=windows, max_len=640)
    compare(o, lse, ro, rlse, 4e-3)


def test_windows_non_finite_keys_give_nan_never_a_finite_output():
    """A held window key whose logit is -inf (q . k past float32) gives NaN in the heads of
    its kv head, as `kivi_jax.attention` documents; a -inf key in a slot past the row's
    length is masked and changes nothing."""
    case = WINDOW_CASES[0]
    cache, q = case_cache(case, 4), make_q(5, case.B, case.Hq, case.D, case.dtype)
    q = jnp.abs(q)  # every channel's product with a huge negative key is negative
    kw, vw = case_windows(case, 4)
    big = jnp.finfo(case.dtype).max
    nt = jnp.asarray(case.lengths, jnp.int32)  # (640, 100, 0)
    kw = kw.at[1, 0, 1, 5].set(-big)  # row 0, kv head 1: a held slot
    kw = kw.at[1, 1, 0, 110].set(-big)  # row 1 holds 100 slots: slot 110 is not held
    args = (q, *cache, nt, 1)
    o, lse = kivi_decode(*args, **case.kw, tuning=case.tuning, interpret=interpreter(),
                         windows=(kw, vw))  # fmt: skip
    ro, rlse = kivi_decode_reference(*args, **case.kw, windows=(kw, vw))
    nq = case.Hq // case.Hkv
    for out in (o, ro):
        out = np.asarray(out)
        assert np.isnan(out[0, nq : 2 * nq]).all()  # kv head 1 of row 0
        assert np.isfinite(np.delete(out, np.s_[nq : 2 * nq], axis=1)[0]).all()
        assert np.isfinite(out[1]).all()


def test_windows_that_do_not_fit_raise_not_implemented():
    """choose_tuning's four-warpgroup launch leaves no shared memory for the windows: the
    call declines (NotImplementedError: `decode_attention` then attends them outside)."""
    case = WINDOW_CASES[0].replace(B=8, Hkv=8, Hq=32, T=131072, lengths=None, tuning=None)
    q = make_q(0, case.B, case.Hq, case.D, case.dtype)
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)
    L, B, H, T, D = 1, 8, 8, 131072, 128
    u8, f16 = jnp.uint8, jnp.float16
    cache = (
        spec((L, B, H, T // 4, D), u8),
        spec((L, B, H, T // 128, D), f16),
        spec((L, B, H, T // 128, D), f16),
        spec((L, B, H, T // 4 // 64, D, 64), u8),
        spec((L, B, H, 1, T), f16),
        spec((L, B, H, 1, T), f16),
    )
    windows = (spec((L, B, H, 128, D), jnp.bfloat16), spec((L, B, H, D, 128), jnp.bfloat16))
    f = lambda q, *a: kivi_decode(
        q, *a[:6], jnp.zeros((B,), jnp.int32), 0, **case.kw, windows=a[6:]
    )
    with pytest.raises(NotImplementedError, match="windows do not fit"):
        jax.eval_shape(f, q, *cache, *windows)


@pytest.mark.parametrize("case", MERGE_CASES, ids=ids(MERGE_CASES))
def test_interpret_merge_splits_matches_reference(case):
    """merge_splits under the interpreter: one block's splits (S = W, C = 1) merged in the
    kernel, rows of no tokens included."""
    assert merge_cluster(case.tuning, interpreter()) == 1
    assert case_plan(case, interpret=True).cluster == 1
    run_case(case, seed=5, interpret=interpreter())


@pytest.mark.parametrize(
    "case", [MERGE_CASES[1], WINDOW_CASES[3], WINDOW_CASES[0]], ids=lambda c: c.name
)
def test_out_dtype_is_the_float32_output_rounded_once(case):
    """o in the query's dtype: where the launch merges its splits and nothing is merged after
    it, the kernel writes the rows itself ([B, Hkv, nq, D], `Plan.out_dtype`; the first two
    cases), else the merge after the launch rounds them (the third); either way the float32
    output rounded once, bit for bit, and the twin's likewise."""
    cache, nt = case_cache(case, 3), jnp.asarray(case.lengths, jnp.int32)
    q, windows = make_q(4, case.B, case.Hq, case.D, case.dtype), case_windows(case, 3)
    kw = dict(**case.kw, windows=windows)
    run = lambda f, dt, **k: f(q, *cache, nt, jnp.int32(case.layer), **kw, **k, out_dtype=dt)
    kern = lambda dt: run(kivi_decode, dt, tuning=case.tuning, interpret=interpreter())
    (o32, lse32), (o16, lse16) = kern(jnp.float32), kern(case.dtype)
    assert o32.dtype == jnp.float32 and o16.dtype == case.dtype
    np.testing.assert_array_equal(np.asarray(o16), np.asarray(o32.astype(case.dtype)))
    np.testing.assert_array_equal(np.asarray(lse16), np.asarray(lse32))
    (r32, _), (r16, _) = (
        run(kivi_decode_reference, jnp.float32),
        run(kivi_decode_reference, case.dtype),
    )
    np.testing.assert_array_equal(np.asarray(r16), np.asarray(r32.astype(case.dtype)))
    writes_rows = kernel_call(
        q, cache, nt, 0, **kw, tuning=case.tuning, interpret=interpreter(), out_dtype="bfloat16"
    )[2].out_dtype
    assert writes_rows == ("bfloat16" if case.tuning.merge_splits else "")
    with pytest.raises(ValueError, match="out_dtype must be"):
        kern(jnp.int8)


def test_interpret_lazy_max_matches_reference():
    """lazy_max is native only (its vote is inline PTX): the interpreter takes the exact
    exchange, and a launch that names it matches the twin."""
    small = TC(
        num_splits=2,
        stages=2,
        wg_per_block=3,
        warp_softmax=False,
        pack_planes=True,
        pack_zeros=True,
        lazy_max=True,
    )
    case = Case("lazy", 2, 8, 2, 128, 1024, 2, 2, 128, jnp.float16, (1000, 0), 2, small)
    assert not case_plan(case, interpret=True).lazy_max
    run_case(case, seed=13, interpret=interpreter())


def test_interpret_true_means_gpu_interpreter():
    """attention.py passes interpret=True (a bool): the same interpreter path."""
    run_case(CASES[0], seed=3, interpret=True)


UNBLOCKED = [CASES[1], CASES[3], CASES[6]]


@pytest.mark.parametrize("case", UNBLOCKED, ids=ids(UNBLOCKED))
def test_unblocked_value_codes_give_the_same_bits(case):
    """The kernel takes the value codes as the cache's blocks [.., Tq/(64 Pv), D, 64] or as
    unblocked rows [.., D, Tq/Pv]: the same SMEM image, so the same outputs bit for bit."""
    q, nt = make_q(2, case.B, case.Hq, case.D, case.dtype), jnp.asarray(case.lengths, jnp.int32)
    outs = [
        kivi_decode(
            q,
            *case_cache(case, 9, blocked=blk),
            nt,
            jnp.int32(case.layer),
            **case.kw,
            tuning=case.tuning,
            interpret=interpreter(False),
        )
        for blk in (True, False)
    ]
    for a, b in zip(*outs, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- the twin ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES[:6], ids=ids(CASES[:6]))
def test_reference_matches_plain_attention(case):
    """The folded twin against an independent float64 dequantize-then-softmax."""
    cache = case_cache(case, 7)
    q = make_q(8, case.B, case.Hq, case.D, case.dtype)
    nt = jnp.asarray(case.lengths, jnp.int32)
    ro, rlse = kivi_decode_reference(q, *cache, nt, jnp.int32(case.layer), **case.kw)
    po, plse = plain_attention(q, cache, case.lengths, case.layer, **case.kw)
    compare(ro, rlse, po, plse, 1e-5)


def test_fp8_twin_running_max_is_the_kernels():
    """The twin's reference points: per split, the running max up to the end of each step;
    with one split of one step it is the plain max. Both forms give the same attention up to
    e4m3 rounding, so the twin with fp8_values stays within TOL_F8 of the exact twin."""
    step_max = np.array([3.0, 5.0, 2.0, 7.0, 1.0, 0.0])  # six 256-token steps, splits of three
    x = np.repeat(step_max, 256) - np.tile(np.arange(256.0), 6)  # step max at its first token
    run = _running_max(jnp.asarray(x[None]), TC(num_splits=2))
    np.testing.assert_array_equal(
        np.asarray(run)[0], np.repeat([3.0, 5.0, 5.0, 7.0, 7.0, 7.0], 256)
    )
    case = Case(
        "f8", 2, 4, 2, 128, 1024, 2, 2, 128, jnp.float16, (1000, 77), 1, TC(num_splits=2, stages=2)
    )
    cache = case_cache(case, 5)
    q = make_q(6, case.B, case.Hq, case.D, case.dtype)
    nt = jnp.asarray(case.lengths, jnp.int32)
    exact = kivi_decode_reference(q, *cache, nt, jnp.int32(case.layer), **case.kw)
    f8 = kivi_decode_reference(
        q, *cache, nt, jnp.int32(case.layer), **case.kw, fp8_values=True, tuning=case.tuning
    )
    compare(*f8, *exact, 5e-2)
    assert np.abs(np.asarray(f8[0]) - np.asarray(exact[0])).max() > 0  # it does round


# ---- code fields and byte orders -----------------------------------------------------------


def test_widen8_contraction_order():
    """PERM16 is where the 8-bit WGMMA fragment (lane k = lane % 4 holds bytes 4k..4k+3 of each
    16-column block) lands in the 16-bit fragment (columns 2k, 2k+1 of 8-column tile 2b and
    of tile 2b+1) when bytes (0, 1) and (2, 3) of each register become one fp16 pair each;
    store_p_perm writes token q of a 16-block at position 8 (q // 2 % 2) + 2 (q // 4) + q % 2;
    permute_contraction applies the order blockwise."""
    perm = layout.PERM16
    assert sorted(perm) == list(range(16))
    for k in range(4):
        for e in range(2):
            assert perm[2 * k + e] == 4 * k + e
            assert perm[8 + 2 * k + e] == 4 * k + 2 + e
    for q in range(16):
        assert 8 * (q // 2 % 2) + 2 * (q // 4) + q % 2 == perm.index(q)
    x = jnp.arange(48)
    np.testing.assert_array_equal(
        layout.permute_contraction(x), np.concatenate([np.asarray(perm) + 16 * b for b in range(3)])
    )


def test_stored_byte_order_gives_the_natural_pairs():
    """A 32-bit word of a stored code row holds the row's bytes (x0, x2, x1, x3) (the cache
    swaps the middle two, `kivi_jax.quant.swap_bytes`): as 16-bit lanes the word itself and the
    word shifted right by 8 are the pairs (x0, x1), (x2, x3) under the low-byte field masks
    (`widen8` without exponent bits), prmt selectors 0x4240 / 0x4341 pick the same pairs (with
    exponent bits), 0x3120 restores (x0, x1, x2, x3) (`code_field8`), and the per-warp loads of
    `warp_value_codes` find columns 2c, 2c + 1 at bytes 2c - c % 2 and + 2."""
    from kivi_jax.quant import swap_bytes

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (64, 8), dtype=np.uint8)
    stored = np.asarray(swap_bytes(x, -1))
    word = lambda r, k: int.from_bytes(bytes(stored[r, 4 * k : 4 * k + 4]), "little")
    byte = lambda w, i: (w >> (8 * i)) & 0xFF
    prmt = lambda w, sel: sum(byte(w, (sel >> (4 * i)) & 0xF) << (8 * i) for i in range(4))
    for r in range(64):
        for k in range(2):
            w, nat = word(r, k), x[r, 4 * k : 4 * k + 4]
            lanes = lambda v: (v & 0xFF, (v >> 16) & 0xFF)  # low bytes of the two lanes
            assert lanes(w) == (nat[0], nat[1]) and lanes(w >> 8) == (nat[2], nat[3])
            assert lanes(prmt(w, 0x4240)) == (nat[0], nat[1])  # high bytes: the exponent
            assert lanes(prmt(w, 0x4341)) == (nat[2], nat[3])  # byte (index 4, zero here)
            assert prmt(w, 0x3120).to_bytes(4, "little") == bytes(nat)
        pair = int.from_bytes(bytes(stored[r, :8]), "little")  # (w0, w1) as 8 bytes
        for c in range(4):
            f = 2 * c - c % 2
            assert ((pair >> (8 * f)) & 0xFF, (pair >> (8 * f + 16)) & 0xFF) == (
                x[r, 2 * c],
                x[r, 2 * c + 1],
            )


def test_kernel_token_map_is_the_cache_order():
    """The kernel's view of a step (`plane_tokens` for the ragged mask, `warp_groups` for the
    key vectors) is kivi_jax's cache order: row r of plane p is slot 64 p + r, which holds
    token cache_slot(64 p + r); warp w's rows 16 w .. 16 w + 15 of plane p lie in one key group."""
    from kivi_jax.quant import cache_slot

    rows = np.arange(64)
    for p in range(8):  # two 256-token blocks
        tok = np.asarray(layout.plane_tokens(p, jnp.asarray(rows, jnp.int32)))
        np.testing.assert_array_equal(tok, cache_slot(64 * p + rows))
        for G in (32, 64, 128):
            for w, g in enumerate(layout.warp_groups(p, G)):
                assert set(tok[16 * w : 16 * w + 16] // G) == {g}, (p, G, w)
    # one group per warp and block at G >= 64, two at G = 32
    for G, n in ((128, 1), (64, 1), (32, 2)):
        for w in range(4):
            assert len({layout.warp_groups(p, G)[w] for p in range(4)}) == n


def test_subnormal_code_fields():
    """`field_sub`: every code of every field, masked in place from a byte widened without
    exponent bits, is the fp16 subnormal code * 2^(bits j - 24), and a product over it times
    `field_sub_weight` weighs the code 1."""
    for bits in (2, 4):
        for j in range(8 // bits):
            for code in range(2**bits):
                byte = code << (bits * j) | (0xFF ^ ((2**bits - 1) << (bits * j)))
                x = codes.field_sub(jnp.uint16(byte), bits, j)
                assert x.dtype == jnp.float16
                assert float(x) == code * 2.0 ** (bits * j - 24), (bits, j, code)
                assert float(x) * codes.field_sub_weight(bits, j) == code


def test_fp8_value_fields():
    """Every code of every field, masked in place, is the e4m3 number code * weight * 2^-9
    (bytes 0..15: e4m3's subnormals and first binade, spacing 2^-9)."""
    f8 = jnp.float8_e4m3fn
    for bits in (2, 4):
        for j in range(8 // bits):
            _, _, weight = codes.f8_field_spec(bits, j)
            vals = np.arange(2**bits)
            # the field in place, every other bit of the byte set: the mask must clear them
            byte = vals << (bits * j) | (0xFF ^ ((2**bits - 1) << (bits * j)))
            x8 = jnp.asarray(np.broadcast_to(byte.astype(np.uint8), (4, len(vals))))
            x8 = codes.natural_bytes(x8)  # as the cache stores a row (an involution)
            val = np.asarray(
                codes.code_field8_reference(x8, codes.f8_field_spec(bits, j), f8).astype(
                    jnp.float32
                )
            )[0]
            np.testing.assert_array_equal(val, vals * weight * 2.0**-9, err_msg=f"{bits} {j}")


# ---- choose_tuning -------------------------------------------------------------------------


def test_choose_tuning_low_precision_products():
    """choose_tuning sets the opt-in fp8 value product where asked, off by default."""
    ct = choose_tuning
    assert ct(8, 8, 131072, fp8_values=True).fp8_values
    assert ct(8, 8, 131072, key_bits=4, value_bits=4, fp8_values=True).fp8_values
    assert not ct(8, 8, 131072).fp8_values


def test_choose_tuning_softmax_and_copies():
    """The per-warp softmax where one warpgroup streams a block over at least WSM_MIN_STEPS
    steps (measured slower with four warpgroups, and over a few steps per split); the slots go
    back through an mbarrier with four warpgroups unless the planes are packed (there
    even to faster without), the copies are dealt over the warps with three
    (0.7-2.2% faster)."""
    ct = choose_tuning
    big = ct(8, 8, 131072, key_bits=2, value_bits=2, group_size=128)
    assert big.wg_per_block == 4 and not big.warp_softmax
    assert big.pack_planes and not big.release_slots
    assert ct(8, 8, 131072, key_bits=2, value_bits=2, group_size=128, fp8_values=True).release_slots
    g32 = ct(8, 8, 131072, key_bits=2, value_bits=2, group_size=32)
    assert g32.wg_per_block == 3 and not g32.release_slots
    assert g32.spread_copies and not big.spread_copies
    for kb, B, T, on in (
        (4, 8, 131072, True),
        (2, 1, 131072, True),
        (2, 1, 8192, False),
        (4, 1, 32768, False),
    ):
        tun = ct(B, 8, T, key_bits=kb, value_bits=kb, group_size=128)
        steps = -(-T // STEP_TOKENS // tun.num_splits)
        assert tun.wg_per_block == 1 and tun.warp_softmax == on, (kb, B, T, steps)
        assert not tun.spread_copies and not tun.release_slots
        assert (steps >= layout.WSM_MIN_STEPS) == on


def test_choose_tuning_warpgroups_per_block():
    """Several warpgroups per block where it measured faster (2-bit at
    B * Hkv * T >= 2^22), where the W pipelines of a block fit in shared memory: W = 4 at
    G = 128, else W = 3; and the per-shape features of those launches."""
    ct = choose_tuning
    assert ct(8, 8, 131072, group_size=32).wg_per_block == 3  # four do not fit
    assert ct(32, 8, 32768, group_size=32).wg_per_block == 3
    assert ct(8, 8, 8192, group_size=32).wg_per_block == 1
    assert ct(1, 8, 131072, group_size=32).wg_per_block == 1
    assert ct(8, 8, 131072, group_size=128).wg_per_block == 4
    assert ct(8, 8, 131072, group_size=128).num_splits == 8
    # two planes per score tile at 2-bit G=128
    assert ct(8, 8, 131072, group_size=128).pack_planes
    assert ct(8, 8, 131072, group_size=32).pack_planes  # with fold_v_warp
    assert ct(8, 8, 131072, group_size=32).fold_v_warp
    assert not ct(8, 8, 131072, key_bits=4, value_bits=4, group_size=128).pack_planes
    # their padding zero where both products take it, G = D (less energy at the power cap)
    assert ct(8, 8, 131072, group_size=128).pack_zeros
    assert ct(1, 8, 8192, group_size=64, head_dim=64).pack_zeros
    assert not ct(8, 8, 131072, group_size=32).pack_zeros
    assert not ct(8, 8, 131072, group_size=64).pack_zeros
    assert not ct(8, 8, 131072, key_bits=4, value_bits=4, group_size=128).pack_zeros
    # the key bias from 16-group blocks with four warpgroups at 2-bit G=128
    assert ct(8, 8, 131072, group_size=128).dense_bias
    assert ct(32, 8, 32768, group_size=128).dense_bias
    assert not ct(1, 8, 8192, group_size=128).dense_bias  # (one warpgroup: not measured)
    assert not ct(8, 8, 131072, group_size=32).dense_bias
    assert not ct(8, 8, 131072, group_size=64).dense_bias
    # the value scale folded per warp with 64-bit vector loads at 2-bit G < D,
    # at every (B, T); not at 4 bits (mixed), not at G = D (the value scale folds into P there)
    for B, T in ((8, 131072), (1, 8192), (32, 32768)):
        t = ct(B, 8, T, group_size=32)
        assert t.fold_v_warp and plan(t, G=32, D=128).fvw
    assert ct(8, 8, 131072, group_size=32, head_dim=64).fold_v_warp
    assert not ct(8, 8, 131072, key_bits=4, value_bits=4, group_size=32).fold_v_warp
    assert not ct(8, 8, 131072, key_bits=2, value_bits=4, group_size=32).fold_v_warp
    big = ct(8, 8, 131072, group_size=128)
    assert not big.fold_v_warp
    assert not ct(8, 8, 131072, group_size=64, head_dim=64).fold_v_warp
    assert ct(8, 8, 131072, group_size=128, fp8_values=True).wg_per_block == 4
    assert ct(8, 8, 131072, group_size=64).wg_per_block == 3
    assert ct(8, 8, 131072, key_bits=4, value_bits=4, group_size=32).wg_per_block == 1
    for kb, G in ((2, 32), (2, 128)):
        t = ct(8, 8, 131072, key_bits=kb, value_bits=kb, group_size=G, wg_per_block=3)
        assert t.wg_per_block == 3
        assert smem_bytes(t, key_bits=kb, value_bits=kb, group_size=G) <= SMEM_LIMIT
    # past 8 query heads per kv head P and the q / output tiles grow: the launch still fits
    # (kivi_decode passes its head count), with fewer warpgroups where W pipelines do not
    for kb, G, heads in ((2, 32, 32), (2, 128, 32), (2, 128, 16), (4, 128, 64), (2, 32, 8)):
        t = ct(8, 8, 131072, key_bits=kb, value_bits=kb, group_size=G, q_heads=heads)
        assert (
            smem_bytes(t, key_bits=kb, value_bits=kb, group_size=G, padded_heads=heads)
            <= SMEM_LIMIT
        ), (kb, G, heads)
    assert ct(8, 8, 131072, group_size=32, q_heads=32).wg_per_block < 3
    assert ct(8, 8, 131072, group_size=32, q_heads=8) == ct(8, 8, 131072, group_size=32)
    for G in (128, 32):  # three 4-bit pipelines of 256-token steps (a block of the cache order)
        with pytest.raises(ValueError, match="shared memory"):
            ct(8, 8, 131072, key_bits=4, value_bits=4, group_size=G, wg_per_block=3)


def test_choose_tuning_fused_epilogue():
    """The in-kernel merge with PDL and the q prologue at choose_tuning's 2-bit G = 128 anchor
    (four warpgroups, two blocks per row), the lazy max with it; neither elsewhere."""
    a = anchor()
    assert a.merge_splits and a.pdl and a.q_prologue and a.lazy_max
    assert merge_cluster(a, False) == 2
    for t in (anchor(group_size=32), anchor(key_bits=4), choose_tuning(1, 8, 8192)):
        assert not (t.merge_splits or t.pdl or t.q_prologue or t.lazy_max), t


# ---- errors --------------------------------------------------------------------------------


def test_tuning_config_validates():
    with pytest.raises(ValueError, match="num_splits"):
        TuningConfig(num_splits=0)
    with pytest.raises(ValueError, match="stages"):
        TuningConfig(stages=0)
    with pytest.raises(ValueError, match="stages"):
        TuningConfig(stages=9)
    with pytest.raises(ValueError, match="wg_per_block"):
        TuningConfig(wg_per_block=5)
    t = choose_tuning(8, 8, 131072, key_bits=2, value_bits=2, group_size=128)
    assert t.num_splits >= 1
    with pytest.raises(ValueError, match="multiple of 256"):
        choose_tuning(8, 8, 131072 + 128)
    # the removed experiment flags are gone, not ignored
    for name in ("block_tokens", "fold_k", "mma_sync", "trace", "vec64"):
        with pytest.raises(TypeError):
            TuningConfig(**{name: 1})
    assert {f.name for f in dataclasses.fields(TuningConfig)} == {
        "num_splits",
        "stages",
        "wg_per_block",
        "fp8_values",
        "fold_v_warp",
        "warp_softmax",
        "lazy_max",
        "pack_planes",
        "pack_zeros",
        "dense_bias",
        "release_slots",
        "spread_copies",
        "merge_splits",
        "pdl",
        "q_prologue",
    }


def test_argument_errors():
    B, Hq, Hkv, D, Tq = 1, 4, 2, 64, 256
    cache = make_cache(0, 2, B, Hkv, D, Tq, 2, 2, 64)
    q = make_q(0, B, Hq, D, jnp.float16)
    nt, layer = jnp.asarray([10], jnp.int32), jnp.int32(0)
    kw = dict(key_bits=2, value_bits=2, group_size=64, sm_scale=0.1)
    with pytest.raises(NotImplementedError, match="key_bits=3"):
        kivi_decode(q, *cache, nt, layer, **{**kw, "key_bits": 3})
    with pytest.raises(NotImplementedError, match="group_size=16"):
        kivi_decode(q, *cache, nt, layer, **{**kw, "group_size": 16})
    with pytest.raises(NotImplementedError, match="dtype"):
        kivi_decode(q.astype(jnp.float32), *cache, nt, layer, **kw)
    with pytest.raises(ValueError, match="k_scale"):
        kivi_decode(q, cache[0], cache[1][..., :-1, :], *cache[2:], nt, layer, **kw)
    with pytest.raises(ValueError, match="v_codes"):
        kivi_decode(q, *cache[:3], cache[3].astype(jnp.int8), *cache[4:], nt, layer, **kw)
    with pytest.raises(ValueError, match="num_tokens"):
        kivi_decode(q, *cache, jnp.asarray([1, 2], jnp.int32), layer, **kw)
    with pytest.raises(ValueError, match="multiple of the kv heads"):
        kivi_decode(make_q(0, B, 3, D, jnp.float16), *cache, nt, layer, **kw)
    with pytest.raises(ValueError, match="group_size=128 must divide"):
        kivi_decode(q, *cache, nt, layer, **{**kw, "group_size": 128})
    with pytest.raises(ValueError, match="shared memory"):
        big = make_cache(0, 1, B, Hkv, D, 2048, 4, 4, 32)
        kivi_decode(
            q,
            *big,
            nt,
            layer,
            **{**kw, "key_bits": 4, "value_bits": 4, "group_size": 32},
            tuning=TC(num_splits=1, stages=8, wg_per_block=2),
        )
    with pytest.raises(NotImplementedError, match="head dim"):
        kivi_decode(make_q(0, B, Hq, 96, jnp.float16), *cache, nt, layer, **kw)


def test_case_tables_are_consistent():
    """The shared case tables: unique names, interpreter cases whose splits fit the stages (the
    note above `CASES`), and the named case lookup."""
    from kivi_decode_cases import GPU_CASES, interpreter_steps_fit

    for table in (CASES, FLAG_CASES, MERGE_CASES, GPU_CASES):
        ids(table)
    for c in CASES + FLAG_CASES + MERGE_CASES:
        assert interpreter_steps_fit(c), c.name
    assert CASE[CASES[0].name] is CASES[0]

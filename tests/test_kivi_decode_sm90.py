"""pallas_kernels.kivi_decode_sm90: the fused KIVI decode kernel against its float32 twin.

CPU (CI): the SMEM-staged variant under the Mosaic GPU interpreter with race detection, on
small random caches (bits 2/4 and K4V2, G 32/64/128, GQA ratios, ragged lengths incl. 0 and
partial blocks, D 64/128, a nonzero layer; G = D folds the value scale into P) and the
TuningConfig flags (fold_k, reload_codes, lean_values, fold_v on and off); the production
variant cross-lowered for sm_90 (flags too; its native-only paths, per-warp group vectors
and widen8, are not interpretable and are checked by cross-lowering here and natively on the
GPU); the twin against a plain dequantize-then-softmax attention; argument errors.
GPU (skipped elsewhere): the production variant natively on larger shapes, outputs poisoned
first, deterministic run to run.
"""

import dataclasses
import functools
import math
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.mosaic.gpu import core as mosaic_core
from jax.experimental.pallas import mosaic_gpu as plgpu

from kivi_jax.quant import (
    block_columns,
    pack_tokens,
    to_cache_order,
    unblock_columns,
    value_codes_blocked,
)
from pallas_kernels import kivi_decode_sm90 as kd
from pallas_kernels import sm90_fragments

ON_GPU = jax.default_backend() == "gpu"
# Tolerances (max |o - o_ref| / max |o_ref|, and |lse - lse_ref|): the kernel dequantizes in
# fp16 (one rounding of code * scale + min, relative 2^-11), feeds fp16 wgmma operands (q
# rounded to fp16 after sm_scale, P rounded to fp16) and accumulates in f32; with the value
# scale folded into P (G = D) the code fields' offsets pass through the f32 accumulator for one
# sub-step (measured ~6e-4 at 2 bits, bench/fold_error.py). bf16 q is converted to fp16
# inside, so both query dtypes get the same bound.
TOL = {jnp.dtype(jnp.float16): 4e-3, jnp.dtype(jnp.bfloat16): 4e-3}
# fp8_values: the twin rounds P * s_t to e4m3 against the kernel's own running max, but the
# logits reach that rounding through different f32 (or fp16-operand) arithmetic, so a weight
# near a rounding boundary can land one e4m3 step (2^-4 relative) away: measured up to 2.4e-3
# of max |o| under the interpreter, 1.17e-2 on the H200 (run 81: D = G = 64, three warpgroups,
# a row whose few dominant weights decide o). A wrong field weight, scale or rescale is off by
# O(1).
TOL_F8 = 2e-2


def twin_flags(tun, G, D):
    """The twin's model of the kernel's opt-in roundings under tuning `tun` (None: default)."""
    if tun is None:
        return {}
    f8 = kd._fp8_values(tun, G, D)
    return dict(fp8_values=f8, tuning=tun if f8 else None)


def tol_for(tun, G, D, dtype):
    return TOL_F8 if tun is not None and kd._fp8_values(tun, G, D) else TOL[jnp.dtype(dtype)]


def make_cache(seed, L, B, Hkv, D, Tq, kb, vb, G, blocked=None):
    """Random codes, scales and minimums in the documented layout (docs/layout.md: 2-bit value
    codes in blocks of 64 byte columns; blocked=True/False forces either form, which the kernel
    takes at both widths)."""
    blocked = value_codes_blocked(vb) if blocked is None else blocked
    rng = np.random.default_rng(seed)
    kc = rng.integers(0, 2**kb, (L, B, Hkv, Tq, D)).astype(np.uint8)
    vc = rng.integers(0, 2**vb, (L, B, Hkv, D, Tq)).astype(np.uint8)
    f = lambda shape, lo, hi: jnp.asarray(rng.uniform(lo, hi, shape), jnp.float16)
    vp = pack_tokens(vc, vb, axis=4)
    return (pack_tokens(kc, kb, axis=3),
            f((L, B, Hkv, Tq // G, D), 0.02, 0.3), f((L, B, Hkv, Tq // G, D), -0.6, 0.0),
            block_columns(vp) if blocked else vp,
            f((L, B, Hkv, D // G, Tq), 0.02, 0.3), f((L, B, Hkv, D // G, Tq), -0.6, 0.0))


def make_q(seed, B, Hq, D, dtype):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((B, Hq, D)), dtype)


def plain_attention(q, cache, num_tokens, layer, *, key_bits, value_bits, group_size,
                    sm_scale):
    """Independent float64 numpy: unpack, dequantize every element, softmax, weighted sum."""
    k_codes, k_scale, k_min, v_codes, v_scale, v_min = (np.asarray(x) for x in cache)
    if v_codes.ndim == 6:  # the cache's blocks of 64 byte columns
        v_codes = np.asarray(unblock_columns(v_codes))
    # per-token value scales are held in the cache order (docs/layout.md)
    v_scale, v_min = (np.asarray(to_cache_order(x, -1)) for x in (v_scale, v_min))
    kc = kd._unpack_layer(k_codes[layer], key_bits, 2)
    vc = np.swapaxes(np.asarray(kd._unpack_layer(v_codes[layer], value_bits, 3)), -1, -2)
    G = group_size
    K = np.asarray(kc, np.float64) * np.repeat(k_scale[layer], G, axis=2).astype(np.float64)
    K += np.repeat(k_min[layer], G, axis=2).astype(np.float64)
    V = vc.astype(np.float64) * np.repeat(np.swapaxes(v_scale[layer], -1, -2), G, axis=-1)
    V += np.repeat(np.swapaxes(v_min[layer], -1, -2), G, axis=-1)
    B, Hq, D = q.shape
    Hkv = K.shape[1]
    qq = np.asarray(q, np.float64).reshape(B, Hkv, Hq // Hkv, D) * sm_scale
    s = np.einsum("bhnd,bhtd->bhnt", qq, K)
    valid = np.arange(K.shape[2])[None] < np.asarray(num_tokens)[:, None]
    s = np.where(valid[:, None, None], s, -np.inf)
    mx = s.max(-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    p = np.exp(s - mx)
    tot = p.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        o = np.einsum("bhnt,bhtd->bhnd", p, V) / tot[..., None]
        lse = np.log(tot) + mx[..., 0]
    o = np.where(tot[..., None] > 0, o, 0.0)
    return o.reshape(B, Hq, D), lse.reshape(B, Hq)


def compare(o, lse, ro, rlse, tol):
    o, lse, ro, rlse = (np.asarray(x, np.float64) for x in (o, lse, ro, rlse))
    assert np.isfinite(o).all(), "non-finite output"
    err = np.abs(o - ro).max() / max(np.abs(ro).max(), 1e-6)
    assert err < tol, f"o: max error {err:.2e} relative to max |o_ref| (tol {tol})"
    fin = np.isfinite(rlse)
    np.testing.assert_array_equal(np.isfinite(lse), fin, err_msg="lse: -inf rows differ")
    assert (lse[~fin] == -np.inf).all()
    if fin.any():
        lerr = np.abs(lse[fin] - rlse[fin]).max()
        assert lerr < tol, f"lse: max abs error {lerr:.2e} (tol {tol})"
    assert (o[~np.isfinite(rlse)] == 0).all(), "rows with no tokens must give o = 0"


# (B, Hq, Hkv, D, Tq, key_bits, value_bits, G, q dtype, lengths, layer, tuning)
TC = kd.TuningConfig
TW = functools.partial(TC, mma_sync="")  # a TuningConfig with both products on wgmma
CASES = [
    (2, 4, 2, 128, 512, 2, 2, 128, jnp.bfloat16, (300, 0), 1, TC(256, 2, 2)),
    (2, 8, 1, 128, 512, 2, 2, 32, jnp.float16, (512, 65), 2, TC(256, 2, 2)),
    (1, 2, 2, 64, 512, 2, 2, 64, jnp.float16, (511,), 1, TC(256, 1, 2)),
    (2, 3, 1, 128, 256, 4, 4, 128, jnp.bfloat16, (1, 200), 0, TC(256, 2, 2)),
    (2, 4, 2, 64, 512, 4, 4, 32, jnp.float16, (0, 0), 1, TC(256, 2, 3)),
    (2, 16, 1, 128, 512, 4, 2, 32, jnp.bfloat16, (257, 448), 2, TC(256, 2, 2)),
    (1, 4, 4, 64, 1024, 2, 4, 64, jnp.float16, (777,), 1, TC(512, 2, 2)),
    (2, 12, 4, 128, 1024, 2, 2, 128, jnp.bfloat16, (1024, 70), 2, TC(512, 1, 2)),
]
IDS = [f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-D{c[3]}-T{c[4]}-K{c[5]}V{c[6]}-G{c[7]}" for c in CASES]


def _run_case(case, seed, interpret):
    B, Hq, Hkv, D, Tq, kb, vb, G, dt, lengths, layer, tun = case
    cache = make_cache(seed, 3, B, Hkv, D, Tq, kb, vb, G)
    q = make_q(seed + 1, B, Hq, D, dt)
    nt = jnp.asarray(lengths, jnp.int32)
    kw = dict(key_bits=kb, value_bits=vb, group_size=G, sm_scale=1 / math.sqrt(D))
    o, lse = kd.kivi_decode(q, *cache, nt, jnp.int32(layer), **kw, tuning=tun,
                            interpret=interpret)
    o, lse = jax.block_until_ready((o, lse))
    if interpret is not False:
        # The interpreter records races instead of raising: check the kernel just run.
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc

        assert not ipc.get_races().races_found, "GPU interpreter detected a data race"
    ro, rlse = kd.kivi_decode_reference(q, *cache, nt, jnp.int32(layer), **kw,
                                        **twin_flags(tun, G, D))
    compare(o, lse, ro, rlse, tol_for(tun, G, D, dt))


def _products(case, mma_sync):
    """case with its tuning's products on mma.sync ("both", the default) or wgmma ("")."""
    return (*case[:-1], dataclasses.replace(case[-1], mma_sync=mma_sync))


@pytest.mark.parametrize("mma_sync", ["both", ""], ids=["mma", "wgmma"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_interpret_matches_reference(case, mma_sync):
    _run_case(_products(case, mma_sync), seed=sum(map(ord, str(case[:8]))),
              interpret=plgpu.InterpretGPUParams(detect_races=True))


@pytest.mark.parametrize("mma_sync", ["both", ""], ids=["mma", "wgmma"])
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[5], CASES[7]],
                         ids=[IDS[0], IDS[1], IDS[5], IDS[7]])
def test_production_variant_cross_lowers_for_sm90(case, mma_sync):
    _cross_lower(_products(case, mma_sync))


def _cross_lower(case):
    B, Hq, Hkv, D, Tq, kb, vb, G, dt, lengths, layer, tun = case
    cache = make_cache(0, 3, B, Hkv, D, Tq, kb, vb, G)
    q = make_q(1, B, Hq, D, dt)
    kw = dict(key_bits=kb, value_bits=vb, group_size=G, sm_scale=0.1, tuning=tun)

    def f(q, nt, layer, *cache):
        return kd.kivi_decode(q, *cache, nt, layer, **kw)

    modules = []
    serde = mosaic_core._run_serde_pass

    def spy(module, **kwargs):
        modules.append(module.operation.get_asm(enable_debug_info=False))
        return serde(module, **kwargs)

    with mock.patch.object(mosaic_core, "_run_serde_pass", spy):
        lowered = jax.jit(f).trace(q, jnp.asarray(lengths, jnp.int32), jnp.int32(layer),
                                   *cache).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    assert modules, "no Mosaic GPU module was lowered"
    for m in modules:
        bad = splat_register_casts(m)
        assert not bad, f"{len(bad)} splat constants cast into registers: {bad[:2]}"
    return modules


def splat_register_casts(module_asm: str) -> list[str]:
    """Casts of splat constants into a tiled layout's registers in a lowered Mosaic GPU module.

    Cross-lowering stops before Mosaic's LLVM passes, which cannot reconcile these (a constant
    passed into `plgpu.inline_mgpu` stays a splat: run 92 failed natively with "LLVM
    Translation failed for operation: builtin.unrealized_conversion_cast"); this finds them on
    any machine."""
    defs = dict(re.findall(r"^\s*(%[\w#]+)(?::\d+)? = (.*)$", module_asm, re.M))
    cast = r"builtin\.unrealized_conversion_cast (%[\w#]+) : (\S+) to "
    bad = []
    for rhs in defs.values():
        m = re.match(cast + "vector<", rhs)
        src = defs.get(m.group(1), "") if m else ""
        if re.match(cast + "vector<", src) and re.match(r"[fi]\d+$|bf16$", re.match(cast, src)[2]):
            bad.append(rhs[:120])
    return bad


@pytest.mark.parametrize("case", CASES[:6], ids=IDS[:6])
def test_reference_matches_plain_attention(case):
    """The folded twin against an independent float64 dequantize-then-softmax."""
    B, Hq, Hkv, D, Tq, kb, vb, G, dt, lengths, layer, _ = case
    cache = make_cache(7, 3, B, Hkv, D, Tq, kb, vb, G)
    q = make_q(8, B, Hq, D, dt)
    nt = jnp.asarray(lengths, jnp.int32)
    kw = dict(key_bits=kb, value_bits=vb, group_size=G, sm_scale=1 / math.sqrt(D))
    ro, rlse = kd.kivi_decode_reference(q, *cache, nt, jnp.int32(layer), **kw)
    po, plse = plain_attention(q, cache, lengths, layer, **kw)
    compare(ro, rlse, po, plse, 1e-5)


# TuningConfig flags: small shapes, each flag in the interpreter (fold_v on and off at G = D;
# fold_k on mma.sync at G 128 / 64 / 32; reload_codes; D = 64) and
# cross-lowered for sm_90 (lean_values changes only the wgmma waits of the production
# variant, which the SMEM-staged interpreter variant does not have: cross-lowering only).
FLAG_CASES = [
    (2, 8, 1, 128, 256, 2, 2, 32, jnp.float16, (256, 65), 1,
     TW(256, 1, 2, reload_codes=True, lean_values=True, fold_v=True)),
    (2, 3, 1, 128, 256, 4, 4, 128, jnp.bfloat16, (1, 200), 0, TW(256, 2, 2)),
    (1, 8, 2, 128, 256, 2, 2, 128, jnp.float16, (256,), 0, TW(256, 1, 2, fold_v=True)),
    (1, 8, 2, 128, 256, 2, 2, 128, jnp.float16, (256,), 1, TW(256, 1, 2, fold_v=False)),
    (1, 4, 2, 64, 256, 2, 4, 64, jnp.float16, (190,), 2,
     TW(256, 1, 2, reload_codes=True, lean_values=True)),
    # k_chunks: the key product over two head-dim halves; sub_tokens=512: 8 planes per softmax
    # update (2-bit G=32: two groups per plane; 4-bit: a fori_loop over 512-token sub-steps).
    (2, 8, 1, 128, 1024, 2, 2, 32, jnp.float16, (1024, 300), 1,
     TW(512, 1, 2, k_chunks=2, sub_tokens=512)),
    (2, 4, 2, 128, 1024, 4, 4, 128, jnp.bfloat16, (700, 1), 2,
     TW(512, 2, 2, k_chunks=2, sub_tokens=512)),
    (1, 4, 2, 64, 512, 2, 2, 64, jnp.float16, (450,), 0, TW(256, 2, 2, k_chunks=2)),
    # wg_per_block: several (b, h, split) units per block, each warpgroup with its own
    # pipeline and SMEM; 2 * 2 * 2 = 8 units in blocks of 3 (the last one partly idle), ragged
    # lengths (one split of row 1 gets no steps), 3 stages with more steps than stages.
    (2, 4, 2, 128, 1024, 2, 2, 128, jnp.bfloat16, (1000, 200), 1,
     TW(256, 2, 3, wg_per_block=3)),
    (2, 8, 1, 128, 512, 4, 4, 32, jnp.float16, (512, 65), 2, TW(256, 3, 2, wg_per_block=2)),
    # fp8_values: the value product on fp8 tensor cores (against the twin's e4m3 model of
    # P * s_t), 2 and 4 bits, D = G = 64, two warpgroups
    (2, 4, 2, 128, 512, 2, 2, 128, jnp.bfloat16, (512, 130), 1, TW(256, 2, 2, fp8_values=True)),
    (2, 12, 2, 128, 512, 4, 4, 128, jnp.float16, (300, 512), 0,
     TW(256, 1, 2, fp8_values=True)),
    (1, 4, 2, 64, 512, 2, 2, 64, jnp.float16, (450,), 0, TW(256, 2, 2, fp8_values=True)),
    (2, 8, 2, 128, 1024, 2, 4, 128, jnp.float16, (1000, 0), 2,
     TW(256, 2, 2, fp8_values=True, wg_per_block=2)),
    # mma_sync: warp-level products (the interpreter computes them in jnp; the native
    # mma.sync path is cross-lowered here and run by the GPU cases)
    (2, 8, 1, 128, 512, 2, 2, 32, jnp.float16, (512, 65), 2, TC(256, 2, 2, mma_sync="both")),
    (2, 8, 2, 128, 1024, 2, 4, 128, jnp.float16, (1000, 0), 2,
     TC(256, 2, 2, mma_sync="both", wg_per_block=3)),
    # fold_k on mma.sync: subnormal code fields, q * s_g per register, q . z_g by mma.sync;
    # G 128 / 64 (D = 64, 4-bit keys) / 32 (per-warp groups, 8 planes per sub-step), with
    # three warpgroups and with the fp8 value product
    (2, 4, 2, 128, 512, 2, 2, 128, jnp.bfloat16, (512, 130), 1, TC(256, 2, 2, fold_k=True)),
    (1, 4, 2, 64, 512, 4, 2, 64, jnp.bfloat16, (450,), 0, TC(256, 2, 2, fold_k=True)),
    (2, 8, 1, 128, 1024, 2, 2, 32, jnp.float16, (1024, 300), 1,
     TC(512, 1, 2, fold_k=True, sub_tokens=512)),
    (2, 8, 2, 128, 1024, 2, 4, 128, jnp.float16, (1000, 0), 2,
     TC(256, 2, 2, fold_k=True, wg_per_block=3)),
    (2, 4, 2, 128, 512, 2, 2, 128, jnp.bfloat16, (512, 130), 1,
     TC(256, 2, 2, fold_k=True, fp8_values=True, mma_sync="keys")),
    # fold_v on mma.sync with the magic-number value fields (subnormal_values off), 2 and 4 bits
    (2, 4, 2, 128, 512, 2, 2, 128, jnp.float16, (512, 130), 1,
     TC(256, 2, 2, fold_k=True, subnormal_values=False)),
    (1, 4, 2, 64, 512, 2, 4, 64, jnp.bfloat16, (450,), 0, TC(256, 2, 2, subnormal_values=False)),
    # warp_softmax (native only: the interpreter takes the shared softmax) with the conditional
    # rescale and three warpgroups, and switched off at G = D
    (2, 8, 2, 128, 1024, 2, 2, 128, jnp.float16, (1000, 0), 2,
     TC(256, 2, 2, fold_k=True, wg_per_block=3, lazy_rescale=True)),
    (1, 4, 2, 64, 512, 2, 2, 64, jnp.bfloat16, (450,), 0,
     TC(256, 2, 2, fold_k=True, warp_softmax=False)),
    # copy_warp with release_slots (native only: cross-lowered here, run on the GPU)
    (2, 8, 2, 128, 1024, 2, 2, 128, jnp.float16, (1000, 0), 2,
     TC(256, 2, 2, fold_k=True, wg_per_block=4, release_slots=True)),
    # the copies dealt over the warps, 64-bit vector loads (native only), at G = 32 with three
    # warpgroups
    (2, 8, 1, 128, 1024, 2, 2, 32, jnp.bfloat16, (1024, 300), 1,
     TC(256, 2, 2, fold_k=True, wg_per_block=3, spread_copies=True, vec64=True)),
    # the value scale folded per warp (G < D; native only), 2-bit G = 32 with three
    # warpgroups, spread copies and 64-bit vector loads (choose_tuning's launch), and 4-bit
    # G = 32 at D = 64 with 32-bit loads
    (2, 8, 1, 128, 1024, 2, 2, 32, jnp.float16, (1024, 300), 1,
     TC(256, 2, 2, fold_k=True, wg_per_block=3, spread_copies=True, fold_v_warp=True,
        vec64=True)),
    (1, 4, 2, 64, 1024, 4, 4, 32, jnp.bfloat16, (700,), 0,
     TC(512, 1, 2, fold_k=True, fold_v_warp=True)),
    (1, 32, 1, 128, 512, 2, 2, 32, jnp.float16, (500,), 0,
     TC(256, 2, 2, fold_k=True, fold_v_warp=True, vec64=True)),  # 32 heads: a larger scratch
    # two planes per score tile (at most four query heads per kv head): G = 128 with three
    # warpgroups and a ragged row, G = 32 (exact values), 4-bit with three heads, mixed bits
    # at D = 64 with two heads
    (2, 8, 2, 128, 1024, 2, 2, 128, jnp.float16, (1000, 0), 2,
     TC(256, 2, 2, fold_k=True, wg_per_block=3, warp_softmax=False, pack_planes=True)),
    (2, 4, 1, 128, 1024, 2, 2, 32, jnp.bfloat16, (1024, 300), 1,
     TC(256, 2, 2, fold_k=True, wg_per_block=3, pack_planes=True)),
    (2, 6, 2, 128, 1024, 4, 4, 128, jnp.bfloat16, (1000, 513), 0,
     TC(512, 2, 2, fold_k=True, warp_softmax=False, pack_planes=True)),
    (1, 4, 2, 64, 512, 2, 4, 64, jnp.float16, (450,), 0,
     TC(256, 2, 2, fold_k=True, warp_softmax=False, pack_planes=True)),
    # two planes per score tile with the value scale folded per warp (native only: the
    # interpreter runs them packed on the exact value path): 2-bit G = 32 with three
    # warpgroups, spread copies and 64-bit vectors (the anchor's launch), G = 64 with three
    # heads and a ragged row
    (2, 4, 1, 128, 1024, 2, 2, 32, jnp.float16, (1024, 300), 1,
     TC(256, 2, 2, fold_k=True, wg_per_block=3, spread_copies=True, fold_v_warp=True,
        vec64=True, pack_planes=True)),
    (2, 6, 2, 128, 1024, 2, 2, 64, jnp.bfloat16, (1000, 513), 0,
     TC(256, 2, 2, fold_k=True, wg_per_block=3, fold_v_warp=True, vec64=True,
        pack_planes=True)),
    # packed planes with zero padding (pack_zeros): G = 128 with three warpgroups and a ragged
    # row (keys and values), 4-bit with three heads, and (native only, cross-lowered here) G =
    # 32 with the value scale folded per warp (the keys' padding only)
    (2, 8, 2, 128, 1024, 2, 2, 128, jnp.float16, (1000, 0), 2,
     TC(256, 2, 2, fold_k=True, wg_per_block=3, warp_softmax=False, pack_planes=True,
        pack_zeros=True)),
    (2, 6, 2, 128, 1024, 4, 4, 128, jnp.bfloat16, (1000, 513), 0,
     TC(256, 2, 2, fold_k=True, warp_softmax=False, pack_planes=True, pack_zeros=True)),
    (2, 4, 1, 128, 1024, 2, 2, 32, jnp.float16, (1024, 300), 1,
     TC(256, 2, 2, fold_k=True, wg_per_block=3, spread_copies=True, fold_v_warp=True,
        vec64=True, pack_planes=True, pack_zeros=True)),
    (1, 4, 2, 64, 512, 2, 4, 64, jnp.float16, (450,), 0,
     TC(256, 2, 2, fold_k=True, warp_softmax=False, pack_planes=True, pack_zeros=True)),
    # the conditional rescale in the shared softmax (native only: cross-lowered here), with and
    # without packed planes
    (2, 8, 2, 128, 1024, 2, 2, 128, jnp.bfloat16, (1000, 0), 2,
     TC(256, 2, 2, fold_k=True, wg_per_block=4, warp_softmax=False, lazy_rescale=True)),
    (2, 4, 1, 128, 1024, 2, 2, 32, jnp.float16, (1024, 300), 1,
     TC(256, 2, 2, fold_k=True, wg_per_block=3, lazy_rescale=True, pack_planes=True)),
]
FLAG_IDS = [f"K{c[5]}V{c[6]}-G{c[7]}-D{c[3]}-T{c[4]}-fold{int(c[-1].fold_k)}-reload"
            f"{int(c[-1].reload_codes)}-lean{int(c[-1].lean_values)}-foldv{int(c[-1].fold_v)}"
            f"-kch{c[-1].k_chunks}-sub{c[-1].sub_tokens}-wg{c[-1].wg_per_block}"
            f"-f8v{int(c[-1].fp8_values)}-mma{c[-1].mma_sync or 0}"
            f"-vsub{int(c[-1].subnormal_values)}-wsm{int(c[-1].warp_softmax)}"
            f"-lazy{int(c[-1].lazy_rescale)}-cw{int(c[-1].copy_warp)}{int(c[-1].release_slots)}"
            f"-sp{int(c[-1].spread_copies)}{int(c[-1].vec64)}-fvw{int(c[-1].fold_v_warp)}"
            f"-pk{int(c[-1].pack_planes)}{int(c[-1].pack_zeros)}"
            for c in FLAG_CASES]


@pytest.mark.parametrize("case", FLAG_CASES, ids=FLAG_IDS)
def test_interpret_tuning_flags_match_reference(case):
    _run_case(case, seed=11, interpret=plgpu.InterpretGPUParams(detect_races=True))


# natively only the widen8 path undoes the cache's stored byte order (the natural-order paths
# run under the interpreter only: test_native_only_paths_are_gated)
NATIVE = [i for i, c in enumerate(FLAG_CASES) if kd._uses_widen8(c[-1], False)]


@pytest.mark.parametrize("case", [FLAG_CASES[i] for i in NATIVE],
                         ids=[FLAG_IDS[i] for i in NATIVE])
def test_tuning_flags_cross_lower_for_sm90(case):
    _cross_lower(case)


def test_widen8_contraction_order():
    """_PERM16 is where the 8-bit WGMMA fragment (lane k = lane % 4 holds bytes 4k..4k+3 of each
    16-column block) lands in the 16-bit fragment (columns 2k, 2k+1 of 8-column tile 2b and
    of tile 2b+1) when bytes (0, 1) and (2, 3) of each register become one fp16 pair each;
    _store_p_perm writes token q of a 16-block at position 8 (q // 2 % 2) + 2 (q // 4) + q % 2;
    permute_contraction applies the order blockwise."""
    perm = sm90_fragments._PERM16
    assert sorted(perm) == list(range(16))
    for k in range(4):
        for e in range(2):
            assert perm[2 * k + e] == 4 * k + e
            assert perm[8 + 2 * k + e] == 4 * k + 2 + e
    for q in range(16):
        assert 8 * (q // 2 % 2) + 2 * (q // 4) + q % 2 == perm.index(q)
    x = jnp.arange(48)
    np.testing.assert_array_equal(kd.permute_contraction(x),
                                  np.concatenate([np.asarray(perm) + 16 * b for b in range(3)]))


def test_stored_byte_order_gives_the_natural_pairs():
    """A 32-bit word of a stored code row holds the row's bytes (x0, x2, x1, x3) (the cache
    swaps the middle two, `kivi_jax.quant.swap_bytes`): as 16-bit lanes the word itself and the
    word shifted right by 8 are the pairs (x0, x1), (x2, x3) under the low-byte field masks
    (`_widen8` without exponent bits), prmt selectors 0x4240 / 0x4341 pick the same pairs (with
    exponent bits), 0x3120 restores (x0, x1, x2, x3) (`_code_field8`), and the per-warp loads of
    `_warp_value_codes` find columns 2c, 2c + 1 at bytes 2c - c % 2 and + 2."""
    from kivi_jax.quant import swap_bytes

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (64, 8), dtype=np.uint8)
    stored = np.asarray(swap_bytes(x, -1))
    word = lambda r, k: int.from_bytes(bytes(stored[r, 4 * k:4 * k + 4]), "little")
    byte = lambda w, i: (w >> (8 * i)) & 0xFF
    prmt = lambda w, sel: sum(byte(w, (sel >> (4 * i)) & 0xF) << (8 * i) for i in range(4))
    for r in range(64):
        for k in range(2):
            w, nat = word(r, k), x[r, 4 * k:4 * k + 4]
            lanes = lambda v: (v & 0xFF, (v >> 16) & 0xFF)  # low bytes of the two lanes
            assert lanes(w) == (nat[0], nat[1]) and lanes(w >> 8) == (nat[2], nat[3])
            assert lanes(prmt(w, 0x4240)) == (nat[0], nat[1])  # high bytes: the exponent
            assert lanes(prmt(w, 0x4341)) == (nat[2], nat[3])  # byte (index 4, zero here)
            assert prmt(w, 0x3120).to_bytes(4, "little") == bytes(nat)
        pair = int.from_bytes(bytes(stored[r, :8]), "little")  # (w0, w1) as 8 bytes
        for c in range(4):
            f = 2 * c - c % 2
            assert ((pair >> (8 * f)) & 0xFF, (pair >> (8 * f + 16)) & 0xFF) == (x[r, 2 * c],
                                                                                x[r, 2 * c + 1])


def test_native_only_paths_are_gated():
    """widen8 (and the per-warp vectors) are inline Mosaic GPU: never under the interpreter, and
    widen8 not where the operands stay in the natural order or the key rows are chunked."""
    d = TC()
    assert kd._uses_widen8(d, False)
    assert not kd._uses_widen8(d, plgpu.InterpretGPUParams())
    for flags in (dict(p_direct=True), dict(p_concat=True), dict(k_chunks=2),
                  dict(widen8=False)):
        assert not kd._uses_widen8(TC(**flags), False), flags
        # natively only widen8 undoes the cache's stored byte order: the others interpret only
        B, Hq, Hkv, D, Tq, kb, vb, G = 1, 4, 2, 128, 256, 2, 2, 128
        cache = make_cache(0, 1, B, Hkv, D, Tq, kb, vb, G)
        with pytest.raises(NotImplementedError, match="interpreter"):
            kd.kivi_decode(make_q(1, B, Hq, D, jnp.float16), *cache, jnp.array([256], jnp.int32),
                           jnp.int32(0), key_bits=kb, value_bits=vb, group_size=G,
                           sm_scale=0.1, tuning=TC(**flags))


def test_trace_gating_and_cross_lowering():
    """TuningConfig.trace (diagnostics: unit stamps in three padded lse columns) runs natively
    only, with three free padded columns; there it lowers for sm_90 (the stamps' inline PTX
    included) on choose_tuning's anchor launch."""
    B, Hkv, D, Tq, kb, G = 1, 2, 128, 512, 2, 128
    cache = make_cache(0, 1, B, Hkv, D, Tq, kb, kb, G)
    tun = dataclasses.replace(
        kd.choose_tuning(8, 8, 131072, key_bits=kb, value_bits=kb, group_size=G), trace=True)
    nt = jnp.array([Tq], jnp.int32)
    call = lambda Hq, **kw: kd.kivi_decode(
        make_q(1, B, Hq, D, jnp.float16), *cache, nt, jnp.int32(0), key_bits=kb,
        value_bits=kb, group_size=G, sm_scale=0.1, tuning=tun, **kw)
    with pytest.raises(NotImplementedError, match="natively"):
        call(4 * Hkv, interpret=True)
    with pytest.raises(NotImplementedError, match="three padded columns"):
        jax.jit(lambda: call(8 * Hkv)).trace().lower(lowering_platforms=("cuda",))
    _cross_lower((B, 4 * Hkv, Hkv, D, Tq, kb, kb, G, jnp.float16, [Tq], 0, tun))


def test_dense_bias_gating():
    """dense_bias takes the key bias from 16-group blocks only natively on the folded mma.sync
    key product in the widen8 order, one sub-step per copy step, whole blocks of steps and at
    least 16 groups in the cache; elsewhere the flag is ignored (the per-step bias)."""
    on = TC(fold_k=True, warp_softmax=False, dense_bias=True)
    assert kd._dense_bias(on, 128, 128, False, 2048) and kd._dense_bias(on, 32, 128, False, 512)
    assert kd._dense_bias(on, 64, 64, False)  # (tokens not given: any)
    assert not kd._dense_bias(on, 128, 128, False, 2048 - 128)  # 15 groups
    assert not kd._dense_bias(on, 128, 128, plgpu.InterpretGPUParams())
    for flags in (dict(dense_bias=False), dict(fold_k=False), dict(skip="bias"),
                  dict(mma_sync="values"), dict(k_chunks=2), dict(widen8=False),
                  dict(block_tokens=512),  # (sub_tokens 256 < block_tokens)
                  dict(warp_softmax=True),  # (at G = D)
                  dict(copy_warp=False)):  # (one warpgroup: Mosaic's pipeline and barriers)
        assert not kd._dense_bias(dataclasses.replace(on, **flags), 128, 128, False), flags
    # 512-token steps in one sub-step: a block of 16 groups of 128 spans four steps; of 16
    # groups of 32 (512 tokens), one
    big = dataclasses.replace(on, block_tokens=512, sub_tokens=512)
    assert kd._dense_bias(big, 128, 128, False) and kd._dense_bias(big, 32, 128, False)
    # shared memory: the block and the bias rows in, the per-step minimums out
    kw = dict(key_bits=2, value_bits=2, group_size=128, padded_heads=8)
    base = dataclasses.replace(kd.choose_tuning(8, 8, 131072), dense_bias=False)
    extra = 16 * 128 * 2 + 16 * 4 * 8 * 4 - base.stages * 256 // 128 * 128 * 2
    assert (kd.smem_bytes(dataclasses.replace(base, dense_bias=True), **kw)
            == kd.smem_bytes(base, **kw) + base.wg_per_block * extra)
    # not where the per-warp softmax runs (choose_tuning's 4-bit G = D launch)
    four = dataclasses.replace(kd.choose_tuning(8, 8, 131072, key_bits=4, value_bits=4),
                               dense_bias=True)
    assert not kd._dense_bias(four, 128, 128, False)
    # the GPU cases that name it take it
    dense = [c for c in GPU_CASES if c[-1] is not None and c[-1].dense_bias]
    assert len(dense) == 5
    for _B, Hq, Hkv, D, Tq, kb, vb, G, _dt, tun in dense:
        assert kd._dense_bias(tun, G, D, False, Tq), (kb, G, tun)
        assert kd.smem_bytes(tun, key_bits=kb, value_bits=vb, group_size=G, head_dim=D,
                             padded_heads=kd._padded_heads(Hq // Hkv)) <= kd.SMEM_LIMIT, tun


@pytest.mark.parametrize("kbg", ["2:128", "2:32"])
def test_dense_bias_cross_lowers_for_sm90(kbg):
    """choose_tuning's anchor launch with dense_bias through the real sm_90 lowering (native
    only: the interpreter ignores the flag), over 32 key groups: two blocks, the second
    clamped to the cache's end in the last split."""
    kb, G = map(int, kbg.split(":"))
    tun = dataclasses.replace(kd.choose_tuning(8, 8, 131072, key_bits=kb, value_bits=kb,
                                               group_size=G), dense_bias=True)
    assert kd._dense_bias(tun, G, 128, False, 32 * G)
    _cross_lower((2, 32, 8, 128, 32 * G, kb, kb, G, jnp.float16, [32 * G, 1000], 1, tun))


def test_value_fold_gating():
    """The value scale folds into P only where a token has one channel group (G = D) and P is
    stored transposed; widen8 and the interpreter both take it."""
    assert kd._folds_values(TC(), 128, 128) and kd._folds_values(TC(), 64, 64)
    assert not kd._folds_values(TC(), 64, 128) and not kd._folds_values(TC(), 32, 128)
    assert not kd._folds_values(TC(fold_v=False), 128, 128)
    assert not kd._folds_values(TC(p_direct=True), 128, 128)
    assert not kd._folds_values(TC(p_concat=True), 128, 128)
    assert kd._uses_widen8(TC(fold_v=True), False)


def test_value_warp_fold_gating_and_channel_order():
    """fold_v_warp applies natively where each warp's D/4 value channels lie in one group of
    several (D/4 <= G < D) on the mma.sync value product; the output rows it produces are a
    permutation whose warp-w rows of every value tile are the channels (D/4) w .. (D/4) (w + 1)
    - 1 (one group), which `_kivi_decode` puts back."""
    on = TC(fold_k=True, fold_v_warp=True)
    for G, D in ((32, 128), (64, 128), (32, 64)):
        assert kd._folds_values_warp(on, G, D, False)
        rows = kd.value_channel_order(on, G, D, False)
        assert sorted(rows) == list(range(D))
        for m in range(D // 64):
            for w in range(4):
                ch = rows[64 * m + 16 * w:64 * m + 16 * w + 16]
                assert len(set(ch // G)) == 1 and ch[0] // G == (D // 4) * w // G
    assert not kd._folds_values_warp(on, 128, 128, False)  # G = D: fold_v
    assert not kd._folds_values_warp(on, 64, 64, False)
    assert not kd._folds_values_warp(on, 32, 128, plgpu.InterpretGPUParams())
    assert not kd._folds_values_warp(TC(fold_k=True), 32, 128, False)  # opt-in
    assert not kd._folds_values_warp(dataclasses.replace(on, mma_sync="keys"), 32, 128, False)
    assert kd.value_channel_order(TC(fold_k=True), 32, 128, False) is None
    assert (kd.value_channel_order(on, 32, 64, False) == np.arange(64)).all()


def test_plane_packing_gating():
    """pack_planes applies where the query heads of a kv head fit in half of mma's N = 8, with
    the folded key product and both products on mma.sync, not in the per-warp softmax or with
    fp8 values or the run-40 value fold; with fold_v_warp too (natively: the interpreter, which
    has no fold_v_warp, packs the exact value path); the interpreter takes it too."""
    on = TC(fold_k=True, wg_per_block=4, warp_softmax=False, pack_planes=True)
    for heads, G, D in ((4, 128, 128), (1, 32, 128), (3, 64, 64)):
        assert kd._packs_planes(on, G, D, heads, False)
        assert kd._packs_planes(on, G, D, heads, plgpu.InterpretGPUParams())
    assert not kd._packs_planes(on, 128, 128, 5, False)  # 5..8 heads fill N = 8
    assert not kd._packs_planes(TC(fold_k=True, wg_per_block=4), 128, 128, 4, False)  # opt-in
    assert not kd._packs_planes(dataclasses.replace(on, fold_k=False), 128, 128, 4, False)
    assert not kd._packs_planes(dataclasses.replace(on, mma_sync="keys"), 128, 128, 4, False)
    assert not kd._packs_planes(dataclasses.replace(on, fp8_values=True), 128, 128, 4, False)
    assert not kd._packs_planes(dataclasses.replace(on, subnormal_values=False), 128, 128, 4,
                                False)
    fvw = dataclasses.replace(on, fold_v_warp=True, vec64=True)
    assert kd._packs_planes(fvw, 32, 128, 4, False) and kd._folds_values_warp(fvw, 32, 128, False)
    assert kd._packs_planes(fvw, 32, 128, 4, plgpu.InterpretGPUParams())
    assert not kd._folds_values_warp(fvw, 32, 128, plgpu.InterpretGPUParams())
    assert not kd._packs_planes(fvw, 32, 128, 8, False)
    # the per-warp softmax (one warpgroup per block, 256-token steps) keeps its own path
    assert not kd._packs_planes(TC(fold_k=True, pack_planes=True), 128, 128, 4, False)


def test_no_auto_barriers_gating():
    """Mosaic's auto barriers go only where every cross-warp hand-over of the loop has its own
    barrier: the kernel's own pipeline (several warpgroups per block, or one with copy_warp),
    both products on mma.sync, P through widen8's store, natively; never with
    plgpu.emit_pipeline, the SMEM-staged, wgmma or fp8 paths or the run-40 value fold."""
    W4 = TC(fold_k=True, wg_per_block=4)
    assert kd._no_auto_barriers(W4, 128, 128, False)
    assert kd._no_auto_barriers(W4, 32, 128, False)  # keys fold, values dequantized
    assert kd._no_auto_barriers(TC(wg_per_block=3), 128, 128, False)
    assert not kd._no_auto_barriers(W4, 128, 128, plgpu.InterpretGPUParams())
    assert not kd._no_auto_barriers(W4, 128, 128, False, stage_smem=True)
    assert kd._no_auto_barriers(TC(fold_k=True), 128, 128, False)  # one warpgroup, copy_warp
    # one warpgroup through plgpu.emit_pipeline, which relies on the auto barriers
    assert not kd._no_auto_barriers(TC(fold_k=True, copy_warp=False), 128, 128, False)
    for flags in (dict(mma_sync="keys"), dict(mma_sync=""), dict(fp8_values=True),
                  dict(subnormal_values=False), dict(widen8=False),
                  dict(fold_k=True, mma_sync="values")):
        assert not kd._no_auto_barriers(dataclasses.replace(W4, **flags), 128, 128, False), flags


def test_warp_softmax_gating():
    """The per-warp softmax needs both products on mma.sync with the value scale folded into P
    as subnormal fields (G = D), widen8 natively and one sub-step per copy step; choose_tuning
    takes it where one warpgroup streams a block over at least 16 steps (measured slower with
    four warpgroups, and over a few steps per split)."""
    on = TC(fold_k=True)
    assert kd._warp_softmax(on, 128, 128, False) and kd._warp_softmax(on, 64, 64, False)
    assert not kd._warp_softmax(on, 32, 128, False)  # two channel groups per 64-channel tile
    assert not kd._warp_softmax(on, 128, 128, plgpu.InterpretGPUParams())
    assert not kd._warp_softmax(TC(512, fold_k=True), 128, 128, False)  # two sub-steps a step
    for flags in (dict(warp_softmax=False), dict(mma_sync="keys"), dict(mma_sync="values"),
                  dict(subnormal_values=False), dict(fold_v=False), dict(fp8_values=True),
                  dict(widen8=False)):
        assert not kd._warp_softmax(dataclasses.replace(on, **flags), 128, 128, False), flags
    big = kd.choose_tuning(8, 8, 131072, key_bits=2, value_bits=2, group_size=128)
    assert big.wg_per_block == 4 and not big.warp_softmax
    # one warp issues the copies wherever warpgroups share a block; the slots go back through
    # an mbarrier with four of them unless the planes are packed (runs 96-98: even to faster
    # without), measured even to slower with three
    assert big.copy_warp and big.pack_planes and not big.release_slots
    assert kd.choose_tuning(8, 8, 131072, key_bits=2, value_bits=2, group_size=128,
                            fp8_values=True, mma_sync="keys").release_slots
    # with three, the copies are dealt over the warps instead (runs 73, 76: 0.7-2.2% faster)
    g32 = kd.choose_tuning(8, 8, 131072, key_bits=2, value_bits=2, group_size=32)
    assert g32.wg_per_block == 3 and g32.copy_warp and not g32.release_slots
    assert g32.spread_copies and not big.spread_copies
    for kb, B, T, on in ((4, 8, 131072, True), (2, 1, 131072, True), (2, 1, 8192, False),
                         (4, 1, 32768, False)):
        tun = kd.choose_tuning(B, 8, T, key_bits=kb, value_bits=kb, group_size=128)
        steps = -(-T // tun.block_tokens // tun.num_splits)
        assert tun.wg_per_block == 1 and tun.warp_softmax == on, (kb, B, T, steps)
        assert not tun.spread_copies and not tun.release_slots
        assert (steps >= kd._WSM_MIN_STEPS) == on


def test_key_fold_gating():
    """fold_k: on mma.sync the key scale folds in registers at every G (with the keys on wgmma
    it is ignored); the key product then stays in one chunk; choose_tuning turns it on for
    mma.sync."""
    on, on_wg = TC(fold_k=True), TC(fold_k=True, mma_sync="")
    for G in (32, 64, 128):
        assert kd._folds_keys_mma(on, G) and kd._folds_keys_mma(TC(fold_k=True, mma_sync="keys"), G)
        assert not kd._folds_keys_mma(on_wg, G) and not kd._folds_keys_mma(TC(), G)
        assert not kd._folds_keys_mma(TC(fold_k=True, mma_sync="values"), G)
    assert kd._key_chunks(TC(k_chunks=2, fold_k=True), 128, 128) == 1
    assert kd._key_chunks(TC(k_chunks=2, fold_k=True), 128, 32) == 1
    assert kd._key_chunks(TC(k_chunks=2, mma_sync=""), 128, 32) == 2
    assert kd._key_chunks(TC(k_chunks=2), 128, 32) == 2
    assert kd._uses_widen8(TC(fold_k=True), False)
    ct = kd.choose_tuning
    assert ct(8, 8, 131072).fold_k and ct(8, 8, 131072, group_size=32).fold_k
    assert ct(8, 8, 131072, fp8_values=True).fold_k
    assert not ct(8, 8, 131072, mma_sync="").fold_k


def test_kernel_token_map_is_the_cache_order():
    """The kernel's view of a sub-step (`_plane_tokens` for the ragged mask, `_warp_groups` for
    the key vectors) is kivi_jax's cache order: row r of plane p is slot 64 p + r, which holds
    token cache_slot(64 p + r); warp w's rows 16 w .. 16 w + 15 of plane p lie in one key group."""
    from kivi_jax.quant import cache_slot

    rows = np.arange(64)
    for p in range(8):  # two 256-token blocks (sub_tokens=512)
        tok = np.asarray(kd._plane_tokens(p, jnp.asarray(rows, jnp.int32)))
        np.testing.assert_array_equal(tok, cache_slot(64 * p + rows))
        for G in (32, 64, 128):
            for w, g in enumerate(kd._warp_groups(p, G)):
                assert set(tok[16 * w:16 * w + 16] // G) == {g}, (p, G, w)
    # one group per warp and block at G >= 64, two at G = 32
    for G, n in ((128, 1), (64, 1), (32, 2)):
        for w in range(4):
            assert len({kd._warp_groups(p, G)[w] for p in range(4)}) == n


def test_subnormal_code_fields():
    """`_field_sub`: every code of every field, masked in place from a byte widened without
    exponent bits, is the fp16 subnormal code * 2^(bits j - 24), and a product over it times
    `_field_sub_weight` weighs the code 1."""
    for bits in (2, 4):
        for j in range(8 // bits):
            for code in range(2 ** bits):
                byte = code << (bits * j) | (0xFF ^ ((2 ** bits - 1) << (bits * j)))
                x = kd._field_sub(jnp.uint16(byte), bits, j)
                assert x.dtype == jnp.float16
                assert float(x) == code * 2.0 ** (bits * j - 24), (bits, j, code)
                assert float(x) * kd._field_sub_weight(bits, j) == code


def test_fp8_value_gating_and_fields():
    """fp8_values applies at G = D (the value scale folds into B per token), is opt-in and
    replaces fold_v; every code of every field, masked in place, is the e4m3 number
    code * weight * 2^-9 (bytes 0..15: e4m3's subnormals and first binade, spacing 2^-9)."""
    on = TC(fp8_values=True)
    assert kd._fp8_values(on, 128, 128) and kd._fp8_values(on, 64, 64)
    assert not kd._fp8_values(on, 64, 128) and not kd._fp8_values(on, 32, 128)
    assert not kd._fp8_values(TC(), 128, 128)
    assert not kd._fp8_values(TC(fp8_values=True, p_direct=True), 128, 128)
    f8 = jnp.float8_e4m3fn
    for bits in (2, 4):
        for j in range(8 // bits):
            _, _, weight = kd._f8_field_spec(bits, j)
            codes = np.arange(2 ** bits)
            # the field in place, every other bit of the byte set: the mask must clear them
            byte = codes << (bits * j) | (0xFF ^ ((2 ** bits - 1) << (bits * j)))
            x8 = jnp.asarray(np.broadcast_to(byte.astype(np.uint8), (4, len(codes))))
            x8 = kd._natural_bytes(x8)  # as the cache stores a row (an involution)
            val = np.asarray(kd._code_field8_reference(x8, kd._f8_field_spec(bits, j), f8)
                             .astype(jnp.float32))[0]
            np.testing.assert_array_equal(val, codes * weight * 2.0 ** -9, err_msg=f"{bits} {j}")


def test_fp8_twin_running_max_is_the_kernels():
    """The twin's reference points: per split, the running max up to the end of each sub-step;
    with one split of one sub-step it is the plain max. Both forms give the same attention up
    to e4m3 rounding, so the twin with fp8_values stays within TOL_F8 of the exact twin."""
    sub_max = np.array([3., 5., 2., 7., 1., 0.])  # six 256-token steps, splits of three
    x = np.repeat(sub_max, 256) - np.tile(np.arange(256.0), 6)  # step max at its first token
    run = kd._running_max(jnp.asarray(x[None]), TC(block_tokens=256, num_splits=2))
    np.testing.assert_array_equal(np.asarray(run)[0], np.repeat([3., 5., 5., 7., 7., 7.], 256))
    case = (2, 4, 2, 128, 1024, 2, 2, 128, jnp.float16, (1000, 77), 1, TC(256, 2, 2))
    B, Hq, Hkv, D, Tq, kb, vb, G, dt, lengths, layer, tun = case
    cache = make_cache(5, 3, B, Hkv, D, Tq, kb, vb, G)
    q = make_q(6, B, Hq, D, dt)
    kw = dict(key_bits=kb, value_bits=vb, group_size=G, sm_scale=1 / math.sqrt(D))
    nt = jnp.asarray(lengths, jnp.int32)
    exact = kd.kivi_decode_reference(q, *cache, nt, jnp.int32(layer), **kw)
    f8 = kd.kivi_decode_reference(q, *cache, nt, jnp.int32(layer), **kw, fp8_values=True,
                                  tuning=tun)
    compare(*f8, *exact, 5e-2)
    assert np.abs(np.asarray(f8[0]) - np.asarray(exact[0])).max() > 0  # it does round


def test_choose_tuning_low_precision_products():
    """choose_tuning sets the opt-in fp8 value product where asked, off by default."""
    ct = kd.choose_tuning
    assert ct(8, 8, 131072, fp8_values=True).fp8_values
    assert ct(8, 8, 131072, key_bits=4, value_bits=4, fp8_values=True).fp8_values
    assert not ct(8, 8, 131072).fp8_values


def test_choose_tuning_mma_sync():
    """Each product on mma.sync unless it takes an 8-bit wgmma (run 40), where it applies at
    the group size: fp8_values only at G = D."""
    ct = kd.choose_tuning
    assert ct(8, 8, 131072).mma_sync == "both"
    assert ct(8, 8, 131072, fp8_values=True).mma_sync == "keys"
    assert ct(8, 8, 131072, group_size=32, fp8_values=True).mma_sync == "both"
    assert ct(8, 8, 131072, mma_sync="values").mma_sync == "values"
    with pytest.raises(ValueError, match="mma_sync"):
        kd.TuningConfig(mma_sync="all")


def test_choose_tuning_warpgroups_per_block():
    """Several warpgroups per block where runs 20, 40 and 47 measured it faster (2-bit at
    B * Hkv * T >= 2^22: G = 32, and G = 128 with the key product on mma.sync), where the W
    pipelines of a block fit in shared memory: W = 4 at G = 128 with fold_k, else W = 3."""
    ct = kd.choose_tuning
    assert ct(8, 8, 131072, group_size=32).wg_per_block == 3  # four do not fit
    assert ct(32, 8, 32768, group_size=32).wg_per_block == 3
    assert ct(8, 8, 8192, group_size=32).wg_per_block == 1
    assert ct(1, 8, 131072, group_size=32).wg_per_block == 1
    assert ct(8, 8, 131072, group_size=128).wg_per_block == 4
    assert ct(8, 8, 131072, group_size=128).num_splits == 8
    # two planes per score tile at 2-bit G=128 only (run 92)
    assert ct(8, 8, 131072, group_size=128).pack_planes
    assert ct(8, 8, 131072, group_size=32).pack_planes  # with fold_v_warp (run 109)
    assert ct(8, 8, 131072, group_size=32).fold_v_warp
    assert not ct(8, 8, 131072, key_bits=4, value_bits=4, group_size=128).pack_planes
    # their padding zero where both products take it, G = D (run 115: at the power cap)
    assert ct(8, 8, 131072, group_size=128).pack_zeros
    assert ct(1, 8, 8192, group_size=64, head_dim=64).pack_zeros
    assert not ct(8, 8, 131072, group_size=32).pack_zeros
    assert not ct(8, 8, 131072, group_size=64).pack_zeros
    assert not ct(8, 8, 131072, key_bits=4, value_bits=4, group_size=128).pack_zeros
    # the key bias from 16-group blocks with four warpgroups at 2-bit G=128 (runs 118-119)
    assert ct(8, 8, 131072, group_size=128).dense_bias
    assert ct(32, 8, 32768, group_size=128).dense_bias
    assert not ct(1, 8, 8192, group_size=128).dense_bias  # (one warpgroup: not measured)
    assert not ct(8, 8, 131072, group_size=32).dense_bias
    assert not ct(8, 8, 131072, group_size=64).dense_bias
    # the value scale folded per warp with 64-bit vector loads at 2-bit G < D (runs 97-98),
    # at every (B, T); not at 4 bits (mixed), not at G = D (fold_v folds it there)
    for B, T in ((8, 131072), (1, 8192), (32, 32768)):
        t = ct(B, 8, T, group_size=32)
        assert t.fold_v_warp and t.vec64 and kd._folds_values_warp(t, 32, 128, False)
    assert ct(8, 8, 131072, group_size=32, head_dim=64).fold_v_warp
    assert not ct(8, 8, 131072, key_bits=4, value_bits=4, group_size=32).fold_v_warp
    assert not ct(8, 8, 131072, key_bits=2, value_bits=4, group_size=32).fold_v_warp
    big = ct(8, 8, 131072, group_size=128)
    assert not big.fold_v_warp and not big.vec64
    assert not ct(8, 8, 131072, group_size=64, head_dim=64).fold_v_warp
    assert ct(8, 8, 131072, group_size=128, fp8_values=True).wg_per_block == 4
    assert ct(8, 8, 131072, group_size=64).wg_per_block == 3
    assert ct(8, 8, 131072, group_size=128, mma_sync="").wg_per_block == 1
    assert ct(8, 8, 131072, key_bits=4, value_bits=4, group_size=32).wg_per_block == 1
    for kb, G in ((2, 32), (2, 128)):
        t = ct(8, 8, 131072, key_bits=kb, value_bits=kb, group_size=G, wg_per_block=3)
        assert t.wg_per_block == 3
        assert kd.smem_bytes(t, key_bits=kb, value_bits=kb, group_size=G) <= kd.SMEM_LIMIT
    # past 8 query heads per kv head P and the q / output tiles grow: the launch still fits
    # (kivi_decode passes its head count), with fewer warpgroups where W pipelines do not
    for kb, G, heads in ((2, 32, 32), (2, 128, 32), (2, 128, 16), (4, 128, 64), (2, 32, 8)):
        t = ct(8, 8, 131072, key_bits=kb, value_bits=kb, group_size=G, q_heads=heads)
        assert kd.smem_bytes(t, key_bits=kb, value_bits=kb, group_size=G,
                             padded_heads=heads) <= kd.SMEM_LIMIT, (kb, G, heads)
    assert ct(8, 8, 131072, group_size=32, q_heads=32).wg_per_block < 3
    assert ct(8, 8, 131072, group_size=32, q_heads=8) == ct(8, 8, 131072, group_size=32)
    for G in (128, 32):  # three 4-bit pipelines of 256-token steps (a block of the cache order)
        with pytest.raises(ValueError, match="shared memory"):
            ct(8, 8, 131072, key_bits=4, value_bits=4, group_size=G, wg_per_block=3)


@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[6]],
                         ids=[IDS[1], IDS[3], IDS[6]])
def test_unblocked_value_codes_give_the_same_bits(case):
    """The kernel takes the value codes as the cache's blocks [.., Tq/(64 Pv), D, 64] or as
    unblocked rows [.., D, Tq/Pv]: the same SMEM image, so the same outputs bit for bit."""
    B, Hq, Hkv, D, Tq, kb, vb, G, dt, lengths, layer, tun = case
    kw = dict(key_bits=kb, value_bits=vb, group_size=G, sm_scale=1 / math.sqrt(D), tuning=tun,
              interpret=plgpu.InterpretGPUParams())
    q, nt = make_q(2, B, Hq, D, dt), jnp.asarray(lengths, jnp.int32)
    outs = [kd.kivi_decode(q, *make_cache(9, 3, B, Hkv, D, Tq, kb, vb, G, blocked=blk), nt,
                           jnp.int32(layer), **kw) for blk in (True, False)]
    for a, b in zip(*outs, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_interpret_true_means_gpu_interpreter():
    """attention.py passes interpret=True (a bool): same SMEM-staged interpreter path."""
    _run_case(CASES[0], seed=3, interpret=True)


def test_tuning_config_validates():
    with pytest.raises(ValueError, match="block_tokens"):
        kd.TuningConfig(block_tokens=96)
    with pytest.raises(ValueError, match="num_splits"):
        kd.TuningConfig(num_splits=0)
    with pytest.raises(ValueError, match="stages"):
        kd.TuningConfig(stages=0)
    with pytest.raises(ValueError, match="skip"):
        kd.TuningConfig(skip="everything")
    with pytest.raises(ValueError, match="k_chunks"):
        kd.TuningConfig(k_chunks=3)
    with pytest.raises(ValueError, match="sub_tokens"):
        kd.TuningConfig(sub_tokens=128)
    with pytest.raises(ValueError, match="wg_per_block"):
        kd.TuningConfig(wg_per_block=5)
    t = kd.choose_tuning(8, 8, 131072, key_bits=2, value_bits=2, group_size=128)
    assert t.block_tokens == 256 and t.num_splits >= 1


def test_argument_errors():
    B, Hq, Hkv, D, Tq = 1, 4, 2, 64, 256
    cache = make_cache(0, 2, B, Hkv, D, Tq, 2, 2, 64)
    q = make_q(0, B, Hq, D, jnp.float16)
    nt, layer = jnp.asarray([10], jnp.int32), jnp.int32(0)
    kw = dict(key_bits=2, value_bits=2, group_size=64, sm_scale=0.1)
    with pytest.raises(NotImplementedError, match="key_bits=3"):
        kd.kivi_decode(q, *cache, nt, layer, **{**kw, "key_bits": 3})
    with pytest.raises(NotImplementedError, match="group_size=16"):
        kd.kivi_decode(q, *cache, nt, layer, **{**kw, "group_size": 16})
    with pytest.raises(NotImplementedError, match="dtype"):
        kd.kivi_decode(q.astype(jnp.float32), *cache, nt, layer, **kw)
    with pytest.raises(ValueError, match="k_scale"):
        kd.kivi_decode(q, cache[0], cache[1][..., :-1, :], *cache[2:], nt, layer, **kw)
    with pytest.raises(ValueError, match="v_codes"):
        kd.kivi_decode(q, *cache[:3], cache[3].astype(jnp.int8), *cache[4:], nt, layer, **kw)
    with pytest.raises(ValueError, match="num_tokens"):
        kd.kivi_decode(q, *cache, jnp.asarray([1, 2], jnp.int32), layer, **kw)
    with pytest.raises(ValueError, match="multiple of the kv heads"):
        kd.kivi_decode(make_q(0, B, 3, D, jnp.float16), *cache, nt, layer, **kw)
    with pytest.raises(ValueError, match="group_size=128 must divide"):
        kd.kivi_decode(q, *cache, nt, layer, **{**kw, "group_size": 128})
    with pytest.raises(ValueError, match="shared memory"):
        big = make_cache(0, 1, B, Hkv, D, 2048, 4, 4, 32)
        kd.kivi_decode(q, *big, nt, layer, **{**kw, "key_bits": 4, "value_bits": 4,
                                              "group_size": 32}, tuning=TC(512, 1, 8))
    with pytest.raises(NotImplementedError, match="head dim"):
        kd.kivi_decode(make_q(0, B, Hq, 96, jnp.float16), *cache, nt, layer, **kw)


GPU_CASES = [  # larger shapes, native production variant
    (4, 32, 8, 128, 8192, 2, 2, 128, jnp.bfloat16, None),
    (3, 32, 8, 128, 8192, 2, 2, 32, jnp.float16, None),
    (2, 64, 8, 128, 8192, 4, 4, 128, jnp.bfloat16, None),
    (3, 32, 8, 128, 8192, 4, 2, 32, jnp.float16, None),
    (2, 16, 16, 64, 4096, 2, 4, 64, jnp.bfloat16, None),
    (3, 32, 8, 128, 8192, 2, 2, 128, jnp.float16, TW(512, 3, 2)),
    (2, 32, 8, 128, 8192, 2, 2, 32, jnp.bfloat16, TW(1024, 2, 2)),
    (2, 72, 4, 128, 4096, 2, 2, 64, jnp.float16, None),
    (3, 32, 8, 128, 8192, 2, 2, 32, jnp.float16, TW(512, 4, 2, sub_tokens=512, lean_values=True)),
    (2, 32, 8, 128, 8192, 4, 4, 128, jnp.bfloat16, TW(256, 4, 2, lean_values=True)),
    # G = 32 with per-element selects instead of the per-warp group vectors of the default.
    (3, 32, 8, 128, 8192, 4, 4, 32, jnp.bfloat16, TW(256, 4, 2, warp_groups=False)),
    # G = D with the scales applied to the codes (fold_v off); 4-bit; fewer live tiles.
    (3, 32, 8, 128, 8192, 2, 2, 128, jnp.float16, TW(256, 4, 2, fold_v=False)),
    (2, 32, 8, 128, 8192, 4, 4, 128, jnp.bfloat16, TW(256, 4, 2)),
    (3, 32, 8, 128, 8192, 2, 2, 128, jnp.float16,
     TW(256, 4, 2, reload_codes=True, lean_values=True)),
    # Three warpgroups per block, each with its own pipeline (the last block partly idle:
    # 3 * 8 * 5 = 120 units in 40 blocks; 4 * 8 * 3 = 96 in 32; 2 * 8 * 7 = 112 in 38).
    (3, 32, 8, 128, 8192, 2, 2, 128, jnp.bfloat16, TW(256, 5, 2, wg_per_block=3)),
    (4, 32, 8, 128, 8192, 2, 2, 32, jnp.float16, TW(256, 3, 2, wg_per_block=3)),
    (2, 64, 8, 128, 8192, 4, 4, 128, jnp.float16, TW(256, 7, 2, wg_per_block=2)),
    (2, 32, 8, 128, 8192, 4, 2, 64, jnp.bfloat16, TW(256, 4, 2, wg_per_block=2)),
    # fp8_values (against the twin's e4m3 model of P * s_t), 2 and 4 bits, D = 64, B = 8
    (4, 32, 8, 128, 8192, 2, 2, 128, jnp.bfloat16, TW(256, 4, 2, fp8_values=True)),
    (2, 64, 8, 128, 8192, 4, 4, 128, jnp.float16, TW(256, 4, 2, fp8_values=True)),
    (3, 32, 8, 64, 8192, 2, 2, 64, jnp.float16, TW(256, 5, 2, fp8_values=True, wg_per_block=3)),
    (8, 32, 8, 128, 32768, 2, 2, 128, jnp.bfloat16,
     TW(256, 8, 2, fp8_values=True)),
    # mma_sync: both products on warp-level mma.sync, exact and low-precision, G 32/64/128
    (4, 32, 8, 128, 8192, 2, 2, 128, jnp.bfloat16, TC(256, 4, 2, mma_sync="both")),
    (3, 32, 8, 128, 8192, 2, 2, 32, jnp.float16, TC(256, 4, 2, mma_sync="both", wg_per_block=3)),
    (2, 32, 8, 128, 8192, 4, 2, 64, jnp.bfloat16, TC(256, 4, 2, mma_sync="both")),
    (3, 32, 8, 64, 8192, 2, 2, 64, jnp.float16, TC(256, 5, 2, mma_sync="both", fold_v=False)),
    # fold_k on mma.sync (subnormal code fields, q * s_g per register, q . z_g by mma.sync):
    # G 128 / 32 (per-warp groups) / 64 (D = 64), three warpgroups, with the fp8 value product
    (4, 32, 8, 128, 8192, 2, 2, 128, jnp.bfloat16, TC(256, 4, 2, fold_k=True, wg_per_block=3)),
    (3, 32, 8, 128, 8192, 2, 2, 32, jnp.float16, TC(256, 4, 2, fold_k=True, wg_per_block=3)),
    (2, 64, 8, 128, 8192, 4, 4, 128, jnp.float16, TC(256, 4, 2, fold_k=True)),
    (3, 32, 8, 128, 8192, 4, 2, 64, jnp.bfloat16, TC(256, 4, 2, fold_k=True)),
    (2, 16, 16, 64, 4096, 2, 4, 64, jnp.float16, TC(256, 3, 2, fold_k=True)),
    (4, 32, 8, 128, 8192, 2, 2, 128, jnp.bfloat16,
     TC(256, 4, 2, fold_k=True, fp8_values=True, mma_sync="keys", wg_per_block=3)),
    # compiled without auto barriers (`_no_auto_barriers`): four warpgroups at G = 128 (the
    # anchor's launch), three at G = 32, two at 4 bits
    (4, 32, 8, 128, 16384, 2, 2, 128, jnp.float16, TC(256, 4, 2, fold_k=True, wg_per_block=4)),
    (3, 32, 8, 128, 8192, 2, 2, 32, jnp.bfloat16, TC(256, 5, 2, fold_k=True, wg_per_block=3)),
    (2, 64, 8, 128, 8192, 4, 4, 128, jnp.bfloat16,
     TC(256, 6, 2, fold_k=True, wg_per_block=2)),
    # the per-warp softmax (`_warp_softmax`; also in the TC configurations at G = D above, where
    # TuningConfig's default turns it on) with 24 padded heads (three column tiles per warp)
    # and three warpgroups; with the conditional rescale (4-bit; D = 64); and switched off
    (3, 72, 4, 128, 8192, 2, 2, 128, jnp.float16, TC(256, 5, 2, fold_k=True, wg_per_block=3)),
    (2, 64, 8, 128, 8192, 4, 4, 128, jnp.float16, TC(256, 4, 2, fold_k=True, lazy_rescale=True)),
    (2, 16, 16, 64, 4096, 2, 2, 64, jnp.bfloat16, TC(256, 3, 2, fold_k=True, lazy_rescale=True)),
    (4, 32, 8, 128, 16384, 2, 2, 128, jnp.bfloat16,
     TC(256, 4, 2, fold_k=True, wg_per_block=4, warp_softmax=False)),
    # the copies issued by one warp per warpgroup (`copy_warp`, the default: the cases with
    # several warpgroups above), here with the slots released through an mbarrier
    # (`release_slots`) at four warpgroups and at 4 bits with two; and switched off
    (4, 32, 8, 128, 16384, 2, 2, 128, jnp.float16,
     TC(256, 4, 2, fold_k=True, wg_per_block=4, release_slots=True)),
    (2, 64, 8, 128, 8192, 4, 4, 128, jnp.bfloat16,
     TC(256, 6, 2, fold_k=True, wg_per_block=2, release_slots=True)),
    (3, 32, 8, 128, 8192, 2, 2, 32, jnp.bfloat16,
     TC(256, 5, 2, fold_k=True, wg_per_block=3, copy_warp=False)),
    # the copies dealt over the warpgroup's warps (`spread_copies`): four warpgroups with the
    # slots released through an mbarrier, three at G = 32, one (the kernel's own pipeline)
    (4, 32, 8, 128, 16384, 2, 2, 128, jnp.bfloat16,
     TC(256, 4, 2, fold_k=True, wg_per_block=4, release_slots=True, spread_copies=True)),
    (3, 32, 8, 128, 8192, 2, 2, 32, jnp.float16,
     TC(256, 5, 2, fold_k=True, wg_per_block=3, spread_copies=True)),
    (2, 64, 8, 128, 8192, 4, 4, 128, jnp.bfloat16, TC(256, 4, 2, fold_k=True, spread_copies=True)),
    # the key vectors by 64-bit loads (`vec64`): G = 128 with four warpgroups, G = 32 with
    # three (two groups per warp and block), G = 64 at D = 64 with mixed bits, 24 padded heads
    # (three column tiles), 4-bit with one warpgroup (the per-warp softmax)
    (4, 32, 8, 128, 16384, 2, 2, 128, jnp.float16,
     TC(256, 4, 2, fold_k=True, wg_per_block=4, release_slots=True, vec64=True)),
    (3, 32, 8, 128, 8192, 2, 2, 32, jnp.bfloat16,
     TC(256, 5, 2, fold_k=True, wg_per_block=3, vec64=True)),
    (2, 16, 16, 64, 4096, 2, 4, 64, jnp.float16, TC(256, 3, 2, fold_k=True, vec64=True)),
    (3, 72, 4, 128, 8192, 2, 2, 64, jnp.bfloat16,
     TC(256, 5, 2, fold_k=True, wg_per_block=3, vec64=True)),
    (2, 64, 8, 128, 8192, 4, 4, 128, jnp.float16, TC(256, 4, 2, fold_k=True, vec64=True)),
    # the value scale folded per warp (`fold_v_warp`, runs 90-91; with vec64 the default at
    # 2-bit G < D since run 98) with 32-bit vector loads: 2-bit G = 32 with three warpgroups,
    # G = 64 with mixed bits, 4-bit G = 32 with one warpgroup, D = 64 G = 32
    (3, 32, 8, 128, 8192, 2, 2, 32, jnp.float16,
     TC(256, 5, 2, fold_k=True, wg_per_block=3, spread_copies=True, fold_v_warp=True)),
    (2, 32, 8, 128, 8192, 4, 2, 64, jnp.bfloat16, TC(256, 4, 2, fold_k=True, fold_v_warp=True)),
    (3, 32, 8, 128, 8192, 4, 4, 32, jnp.bfloat16, TC(512, 4, 2, fold_k=True, fold_v_warp=True)),
    (2, 16, 16, 64, 4096, 2, 2, 32, jnp.float16,
     TC(256, 3, 2, fold_k=True, wg_per_block=3, fold_v_warp=True)),
    # two planes per score tile (`pack_planes`): the anchor's 2-bit G=128 (four warpgroups,
    # release_slots) and G=32 (three, spread_copies) launches, 4-bit G=128 with one warpgroup
    # and three heads, mixed bits at D = 64 with one head
    (4, 32, 8, 128, 16384, 2, 2, 128, jnp.float16,
     TC(256, 4, 2, fold_k=True, wg_per_block=4, release_slots=True, warp_softmax=False,
        pack_planes=True)),
    (3, 32, 8, 128, 8192, 2, 2, 32, jnp.bfloat16,
     TC(256, 5, 2, fold_k=True, wg_per_block=3, spread_copies=True, pack_planes=True)),
    (2, 24, 8, 128, 8192, 4, 4, 128, jnp.bfloat16,
     TC(512, 4, 2, fold_k=True, warp_softmax=False, pack_planes=True)),
    (2, 16, 16, 64, 4096, 2, 4, 64, jnp.float16,
     TC(256, 3, 2, fold_k=True, warp_softmax=False, pack_planes=True)),
    # the conditional rescale in the shared softmax (`lazy_rescale` without warp_softmax), alone
    # and with packed planes, at the anchor's 2-bit launches
    (4, 32, 8, 128, 16384, 2, 2, 128, jnp.bfloat16,
     TC(256, 4, 2, fold_k=True, wg_per_block=4, release_slots=True, warp_softmax=False,
        lazy_rescale=True)),
    (3, 32, 8, 128, 8192, 2, 2, 32, jnp.float16,
     TC(256, 5, 2, fold_k=True, wg_per_block=3, spread_copies=True, lazy_rescale=True)),
    (4, 32, 8, 128, 16384, 2, 2, 128, jnp.float16,
     TC(256, 4, 2, fold_k=True, wg_per_block=4, release_slots=True, warp_softmax=False,
        lazy_rescale=True, pack_planes=True)),
    (3, 32, 8, 128, 8192, 2, 2, 32, jnp.bfloat16,
     TC(256, 5, 2, fold_k=True, wg_per_block=3, spread_copies=True, lazy_rescale=True,
        pack_planes=True)),
    # choose_tuning's launches of stop 22: 2-bit G < D with the value scale folded per warp
    # and 64-bit vector loads (G = 32 with three warpgroups and spread copies, G = 64 with
    # three, D = 64 G = 32 with one), and the packed anchor with the warpgroup barrier
    (3, 32, 8, 128, 8192, 2, 2, 32, jnp.float16,
     TC(256, 5, 2, fold_k=True, wg_per_block=3, spread_copies=True, fold_v_warp=True,
        vec64=True)),
    (2, 32, 8, 128, 8192, 2, 2, 64, jnp.bfloat16,
     TC(256, 4, 2, fold_k=True, wg_per_block=3, spread_copies=True, fold_v_warp=True,
        vec64=True)),
    (2, 16, 16, 64, 4096, 2, 2, 32, jnp.bfloat16,
     TC(256, 3, 2, fold_k=True, fold_v_warp=True, vec64=True)),
    (4, 32, 8, 128, 16384, 2, 2, 128, jnp.bfloat16,
     TC(256, 4, 2, fold_k=True, wg_per_block=4, warp_softmax=False, pack_planes=True)),
    # fold_v_warp at 32 query heads per kv head (the group sums' scratch past its default)
    (2, 32, 1, 128, 8192, 2, 2, 32, jnp.bfloat16,
     TC(256, 4, 2, fold_k=True, fold_v_warp=True, vec64=True)),
    # fold_v_warp with two planes per score tile: the anchor's 2-bit G = 32 launch, G = 64
    # with three heads, D = 64 G = 32 with one warpgroup and 32-bit vectors
    (3, 32, 8, 128, 8192, 2, 2, 32, jnp.float16,
     TC(256, 5, 2, fold_k=True, wg_per_block=3, spread_copies=True, fold_v_warp=True,
        vec64=True, pack_planes=True)),
    (2, 24, 8, 128, 8192, 2, 2, 64, jnp.bfloat16,
     TC(256, 4, 2, fold_k=True, wg_per_block=3, fold_v_warp=True, vec64=True,
        pack_planes=True)),
    (2, 16, 16, 64, 4096, 2, 2, 32, jnp.bfloat16,
     TC(256, 3, 2, fold_k=True, warp_softmax=False, fold_v_warp=True, pack_planes=True)),
    # packed planes with zero padding (`pack_zeros`, runs 115-116): the anchor's 2-bit G = 128
    # and G = 32 launches, G = 64 with three heads, 4-bit G = 128 with one warpgroup and three
    # heads, mixed bits at D = 64 with one head
    (4, 32, 8, 128, 16384, 2, 2, 128, jnp.float16,
     TC(256, 4, 2, fold_k=True, wg_per_block=4, warp_softmax=False, pack_planes=True,
        pack_zeros=True)),
    (3, 32, 8, 128, 8192, 2, 2, 32, jnp.bfloat16,
     TC(256, 5, 2, fold_k=True, wg_per_block=3, spread_copies=True, fold_v_warp=True,
        vec64=True, pack_planes=True, pack_zeros=True)),
    (2, 24, 8, 128, 8192, 2, 2, 64, jnp.float16,
     TC(256, 4, 2, fold_k=True, wg_per_block=3, fold_v_warp=True, vec64=True,
        pack_planes=True, pack_zeros=True)),
    (2, 24, 8, 128, 8192, 4, 4, 128, jnp.bfloat16,
     TC(512, 4, 2, fold_k=True, warp_softmax=False, pack_planes=True, pack_zeros=True)),
    (2, 16, 16, 64, 4096, 2, 4, 64, jnp.float16,
     TC(256, 3, 2, fold_k=True, warp_softmax=False, pack_planes=True, pack_zeros=True)),
    # the key bias from 16-group blocks (`dense_bias`, run 118): the anchor's 2-bit G = 128 and
    # G = 32 launches (packed, zero-padded), G = 64 with three heads and unpacked planes,
    # 4-bit G = 128 with one warpgroup and the shared softmax, 512-token steps at G = 32 (one
    # warpgroup, three stages)
    (4, 32, 8, 128, 16384, 2, 2, 128, jnp.bfloat16,
     TC(256, 4, 2, fold_k=True, wg_per_block=4, warp_softmax=False, pack_planes=True,
        pack_zeros=True, dense_bias=True)),
    (3, 32, 8, 128, 8192, 2, 2, 32, jnp.float16,
     TC(256, 5, 2, fold_k=True, wg_per_block=3, spread_copies=True, fold_v_warp=True,
        vec64=True, pack_planes=True, pack_zeros=True, dense_bias=True)),
    (2, 24, 8, 128, 8192, 2, 2, 64, jnp.bfloat16,
     TC(256, 4, 2, fold_k=True, wg_per_block=3, fold_v_warp=True, vec64=True,
        dense_bias=True)),
    (2, 64, 8, 128, 8192, 4, 4, 128, jnp.float16,
     TC(256, 4, 2, fold_k=True, warp_softmax=False, release_slots=True, dense_bias=True)),
    (3, 32, 8, 128, 8192, 2, 2, 32, jnp.bfloat16,
     TC(512, 4, 3, sub_tokens=512, fold_k=True, fold_v_warp=True, vec64=True,
        dense_bias=True)),
]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (sm_90)")
@pytest.mark.parametrize("case", GPU_CASES, ids=[str(i) for i in range(len(GPU_CASES))])
def test_gpu_matches_reference_and_is_deterministic(case):
    B, Hq, Hkv, D, Tq, kb, vb, G, dt, tun = case
    key = jax.random.key(B * 1000 + Tq + kb * 10 + vb + G)
    ks = jax.random.split(key, 7)
    L = 3
    u8 = lambda k, s: jax.random.bits(k, s, jnp.uint8)  # random bytes: valid packed codes
    f = lambda k, s, lo, hi: jax.random.uniform(k, s, jnp.float32, lo, hi).astype(jnp.float16)
    cache = (u8(ks[0], (L, B, Hkv, Tq * kb // 8, D)), f(ks[1], (L, B, Hkv, Tq // G, D), .02, .3),
             f(ks[2], (L, B, Hkv, Tq // G, D), -.6, 0.),
             # the cache's value codes: 2-bit in blocks of 64 byte columns
             u8(ks[3], (L, B, Hkv, Tq * vb // 8 // 64, D, 64) if value_codes_blocked(vb) else
                (L, B, Hkv, D, Tq * vb // 8)),
             f(ks[4], (L, B, Hkv, D // G, Tq), .02, .3), f(ks[5], (L, B, Hkv, D // G, Tq), -.6, 0.))
    q = jax.random.normal(ks[6], (B, Hq, D), jnp.float32).astype(dt)
    rng = np.random.default_rng(Tq + B)
    lengths = rng.integers(1, Tq + 1, B)
    lengths[0] = 0
    lengths[-1] = Tq - 13
    nt = jnp.asarray(lengths, jnp.int32)
    kw = dict(key_bits=kb, value_bits=vb, group_size=G, sm_scale=1 / math.sqrt(D), tuning=tun)
    fn = jax.jit(lambda q, nt, layer, *c: kd.kivi_decode(q, *c, nt, layer, **kw))
    outs = []
    for _ in range(2):
        # Poison: fill and free a NaN buffer so the allocator hands its memory to the outputs;
        # an element the kernel (or the merge) fails to write then shows up as NaN.
        poison = jnp.full((64 << 20,), jnp.nan, jnp.float32).block_until_ready()
        del poison
        outs.append(jax.block_until_ready(fn(q, nt, jnp.int32(1), *cache)))
    (o, lse), (o2, lse2) = outs
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o2), err_msg="not deterministic")
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse2), err_msg="not deterministic")
    ro, rlse = kd.kivi_decode_reference(q, *cache, nt, jnp.int32(1), **{
        k: v for k, v in kw.items() if k != "tuning"}, **twin_flags(tun, G, D))
    compare(o, lse, ro, rlse, tol_for(tun, G, D, dt))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (sm_90)")
@pytest.mark.parametrize("kbg", ["2:128", "2:32", "2:64", "4:32"])
def test_gpu_dense_bias_gives_the_same_bits(kbg):
    """dense_bias computes the key bias of 16 groups in one mma.sync's rows, with the same
    products in the same order as the per-step bias mma: choose_tuning's anchor launches give
    the same outputs bit for bit with it and without, over ragged lengths, splits whose blocks
    start off the 16-group grid and a last block clamped to the cache's end."""
    kb, G = map(int, kbg.split(":"))
    B, Hq, Hkv, D, Tq = 3, 32, 8, 128, 16384 + 3 * 256
    tun = kd.choose_tuning(8, 8, 131072, key_bits=kb, value_bits=kb, group_size=G)
    dense, tun = (dataclasses.replace(tun, dense_bias=x) for x in (True, False))
    assert kd._dense_bias(dense, G, D, False, Tq)
    q, nt = make_q(4, B, Hq, D, jnp.float16), jnp.asarray([Tq, 7001, 255], jnp.int32)
    cache = make_cache(kb * G, 2, B, Hkv, D, Tq, kb, kb, G)
    run = lambda t: jax.jit(lambda *c: kd.kivi_decode(
        q, *c, nt, jnp.int32(1), key_bits=kb, value_bits=kb, group_size=G,
        sm_scale=1 / math.sqrt(D), tuning=t))(*cache)
    a, b = run(dense), run(tun)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    ro, rlse = kd.kivi_decode_reference(q, *cache, nt, jnp.int32(1), key_bits=kb,
                                        value_bits=kb, group_size=G, sm_scale=1 / math.sqrt(D))
    compare(*a, ro, rlse, TOL[jnp.dtype(jnp.float16)])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (sm_90)")
def test_gpu_trace_stamps_and_the_same_bits():
    """trace=True (bench/tail_probe.py): the merged outputs bit for bit as without it; in the
    lse partials' last three columns every unit's start before its end (mod 2^24 ns, within
    the launch's milliseconds), SM ids below the device's count, and four units per SM block
    at the anchor's W = 4 on one SM each."""
    kb, G, B, Hq, Hkv, D, Tq = 2, 128, 2, 32, 8, 128, 16384
    tun = kd.choose_tuning(8, 8, 131072, key_bits=kb, value_bits=kb, group_size=G)
    # (trace keeps the XLA merge: the untraced launch's too, for the same bits)
    tun = dataclasses.replace(tun, merge_splits=False)
    traced = dataclasses.replace(tun, trace=True)
    q, nt = make_q(5, B, Hq, D, jnp.float16), jnp.asarray([Tq, 9001], jnp.int32)
    cache = make_cache(11, 2, B, Hkv, D, Tq, kb, kb, G)
    kw = dict(key_bits=kb, value_bits=kb, group_size=G, sm_scale=1 / math.sqrt(D))
    run = lambda t: jax.jit(lambda *c: kd.kivi_decode(q, *c, nt, jnp.int32(1), **kw,
                                                      tuning=t))(*cache)
    for x, y in zip(run(traced), run(tun), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    kern, args, _ = kd._kernel_call(q, cache, nt, jnp.int32(1), **kw, tuning=traced,
                                    interpret=False, stage_smem=False)
    _, lse_parts = jax.jit(kern)(*args)
    x = np.asarray(lse_parts)[..., -3:].astype(np.int64).reshape(-1, 3)
    dur = (x[:, 1] - x[:, 0]) % (1 << 24)
    # (%globaltimer ticks in steps of up to 1 us: a unit with no steps may read 0)
    assert (dur >= 0).all() and (dur < 5_000_000).all() and dur.max() > 0, dur
    sms = getattr(jax.devices()[0], "core_count", 132)
    assert ((x[:, 2] >= 0) & (x[:, 2] < sms)).all()
    W = tun.wg_per_block
    blocks = x[:, 2].reshape(-1, W)  # a block's W units run on one SM
    assert (blocks == blocks[:, :1]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (sm_90)")
@pytest.mark.parametrize("kbg", ["2:128", "2:32", "4:128", "2:64"])
def test_gpu_unblocked_value_codes_give_the_same_bits(kbg):
    """choose_tuning's anchor launches natively over the blocked and the unblocked value codes:
    the same SMEM image, the same outputs bit for bit."""
    kb, G = map(int, kbg.split(":"))
    B, Hq, Hkv, D, Tq = 3, 32, 8, 128, 16384
    tun = kd.choose_tuning(8, 8, 131072, key_bits=kb, value_bits=kb, group_size=G)
    kw = dict(key_bits=kb, value_bits=kb, group_size=G, sm_scale=1 / math.sqrt(D), tuning=tun)
    q, nt = make_q(3, B, Hq, D, jnp.bfloat16), jnp.asarray([Tq, 7001, 255], jnp.int32)
    cache = make_cache(kb + G, 2, B, Hkv, D, Tq, kb, kb, G, blocked=False)
    blocked = (*cache[:3], block_columns(cache[3]), *cache[4:])
    fn = jax.jit(lambda *c: kd.kivi_decode(q, *c, nt, jnp.int32(1), **kw))
    a, b = fn(*blocked), fn(*cache)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    ro, rlse = kd.kivi_decode_reference(q, *cache, nt, jnp.int32(1), **{
        k: v for k, v in kw.items() if k != "tuning"})
    compare(*a, ro, rlse, TOL[jnp.dtype(jnp.bfloat16)])


# merge_splits: the row's splits merged inside the kernel (one cluster of C blocks per row).
# The interpreter merges one block's splits (S = W, C = 1), rows of no tokens included.
MERGE_CASES = [
    (2, 8, 1, 128, 512, 4, 4, 32, jnp.float16, (512, 65), 2,
     TW(256, 2, 2, wg_per_block=2, merge_splits=True)),
    (2, 8, 2, 128, 512, 2, 2, 128, jnp.bfloat16, (300, 0), 1,
     TC(256, 2, 2, fold_k=True, wg_per_block=2, merge_splits=True)),
    (2, 4, 2, 64, 512, 2, 2, 64, jnp.float16, (450, 200), 0, TC(256, 1, 2, merge_splits=True)),
]


@pytest.mark.parametrize("case", MERGE_CASES, ids=[f"W{c[-1].wg_per_block}-K{c[5]}-G{c[7]}"
                                                   for c in MERGE_CASES])
def test_interpret_merge_splits_matches_reference(case):
    assert kd._merge_cluster(case[-1], plgpu.InterpretGPUParams()) == 1
    _run_case(case, seed=5, interpret=plgpu.InterpretGPUParams(detect_races=True))


def test_merge_splits_gating_and_cross_lowering():
    """merge_splits applies where W divides S and the row's C = S / W blocks fit a portable
    cluster (one block under the interpreter), not with trace; elsewhere the XLA merge runs.
    choose_tuning's anchor launches lower for sm_90 with it and pdl (the merge's distributed
    shared memory reads and griddepcontrol.wait in the module)."""
    on = lambda **kw: TC(merge_splits=True, **kw)
    assert kd._merge_cluster(on(num_splits=8, wg_per_block=4), False) == 2
    assert kd._merge_cluster(on(num_splits=8, wg_per_block=1), False) == 8
    assert kd._merge_cluster(on(num_splits=16, wg_per_block=1), False) == 0  # past 8 blocks
    assert kd._merge_cluster(on(num_splits=6, wg_per_block=4), False) == 0  # W does not divide
    assert kd._merge_cluster(on(num_splits=8, wg_per_block=4), plgpu.InterpretGPUParams()) == 0
    assert kd._merge_cluster(on(num_splits=4, wg_per_block=4, trace=True), False) == 0
    assert kd._merge_cluster(TC(num_splits=8, wg_per_block=4), False) == 0
    B, Hq, Hkv, D, Tq = 1, 32, 8, 128, 2048
    for kb, G in ((2, 128), (2, 32), (4, 128)):
        tun = dataclasses.replace(kd.choose_tuning(8, 8, 131072, key_bits=kb, value_bits=kb,
                                                   group_size=G), merge_splits=True, pdl=True)
        assert kd._merge_cluster(tun, False) > 1
        mods = _cross_lower((B, Hq, Hkv, D, Tq, kb, kb, G, jnp.float16, [Tq - 100], 0, tun))
        assert any("ld.shared::cluster" in m and "griddepcontrol.wait" in m for m in mods)


def _poisoned_runs(q, cache, nt, kw, tun, other):
    """The kernel at layer 1 under `tun` twice (asserted the same bits) and under `other`, each
    on outputs poisoned first: a NaN buffer filled and freed so that the allocator hands its
    memory to the outputs, where an element the kernel fails to write shows up as NaN. Returns
    ((o, lse) of tun, (o, lse) of other)."""
    def run(t):
        poison = jnp.full((64 << 20,), jnp.nan, jnp.float32).block_until_ready()
        del poison
        return jax.block_until_ready(jax.jit(lambda *c: kd.kivi_decode(
            q, *c, nt, jnp.int32(1), **kw, tuning=t))(*cache))

    (o, lse), (o2, lse2), theirs = run(tun), run(tun), run(other)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o2), err_msg="not deterministic")
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse2), err_msg="not deterministic")
    return (o, lse), theirs


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (sm_90)")
@pytest.mark.parametrize("kbg", ["2:128", "2:32", "4:128"])
@pytest.mark.parametrize("flags", [
    dict(merge_splits=True), dict(merge_splits=True, pdl=True, q_prologue=True), dict(pdl=True),
    dict(q_prologue=True)], ids=["merge", "merge-pdl-q", "pdl", "q"])
def test_gpu_merge_splits_and_pdl(kbg, flags):
    """choose_tuning's anchor launches (clusters of 2, 2 and 8 blocks per row) with the
    in-kernel merge, PDL and/or the in-kernel q prologue, on poisoned outputs over ragged
    lengths (an empty row, empty splits): the XLA merge's outputs to float32 rounding (the
    merge's ex2/lg2.approx), the reference within the dtype's bound, the same bits run to run;
    pdl and q_prologue alone change no bit (the same fp16 q tile as XLA's prologue)."""
    kb, G = map(int, kbg.split(":"))
    B, Hq, Hkv, D, Tq = 4, 32, 8, 128, 16384
    base = dataclasses.replace(  # the XLA merge and prologue, no PDL
        kd.choose_tuning(8, 8, 131072, key_bits=kb, value_bits=kb, group_size=G),
        merge_splits=False, pdl=False, q_prologue=False)
    tun = dataclasses.replace(base, **flags)
    q, nt = make_q(7, B, Hq, D, jnp.bfloat16), jnp.asarray([Tq, 0, 7001, 255], jnp.int32)
    cache = make_cache(kb * G + 1, 2, B, Hkv, D, Tq, kb, kb, G)
    kw = dict(key_bits=kb, value_bits=kb, group_size=G, sm_scale=1 / math.sqrt(D))
    (o, lse), (xo, xlse) = _poisoned_runs(q, cache, nt, kw, tun, base)
    if flags.get("merge_splits"):
        assert kd._merge_cluster(tun, False) > 1
        np.testing.assert_allclose(np.asarray(o), np.asarray(xo), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(xlse), rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_array_equal(np.asarray(o), np.asarray(xo))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(xlse))
    ro, rlse = kd.kivi_decode_reference(q, *cache, nt, jnp.int32(1), **kw)
    compare(o, lse, ro, rlse, TOL[jnp.dtype(jnp.bfloat16)])


def test_lazy_max_gating_and_cross_lowering():
    """lazy_max (the common step's cross-warp max a vote at the P barrier) applies natively in
    the shared softmax with the subnormal value fold: choose_tuning's 2-bit G=128 anchor launch
    lowers for sm_90 with it (the barrier's OR reduction in the module), with and without the
    in-kernel merge. The interpreter ignores it: the same launch under the GPU interpreter
    matches the reference."""
    anchor = kd.choose_tuning(8, 8, 131072, key_bits=2, value_bits=2, group_size=128)
    B, Hq, Hkv, D, Tq = 1, 32, 8, 128, 4096
    for merge in (True, False):
        tun = dataclasses.replace(anchor, lazy_max=True, merge_splits=merge, pdl=merge,
                                  q_prologue=merge)
        mods = _cross_lower((B, Hq, Hkv, D, Tq, 2, 2, 128, jnp.float16, [Tq - 100], 0, tun))
        assert any("bar.red.or.pred" in m for m in mods)
    assert anchor.lazy_max  # choose_tuning's since run 132
    off = _cross_lower((B, Hq, Hkv, D, Tq, 2, 2, 128, jnp.float16, [Tq - 100], 0,
                        dataclasses.replace(anchor, lazy_max=False)))
    assert not any("bar.red.or.pred" in m for m in off)
    small = TC(256, 2, 2, fold_k=True, wg_per_block=3, warp_softmax=False, pack_planes=True,
               pack_zeros=True, lazy_max=True)
    _run_case((2, 8, 2, 128, 1024, 2, 2, 128, jnp.float16, (1000, 0), 2, small), seed=13,
              interpret=plgpu.InterpretGPUParams(detect_races=True))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (sm_90)")
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
        kd.choose_tuning(8, 8, 131072, key_bits=2, value_bits=2, group_size=G),
        merge_splits=merge, pdl=merge, q_prologue=merge, lazy_max=False)
    tun = dataclasses.replace(base, lazy_max=True)
    kc, ks, km, *vals = make_cache(23, 2, B, Hkv, D, Tq, 2, 2, G)
    ramp = np.linspace(1.0, 8.0, Tq // G, dtype=np.float32)
    ramp[-20] = 24.0  # a late jump
    ks = (ks.astype(jnp.float32) * ramp[None, None, None, :, None]).astype(jnp.float16)
    cache = (kc, ks, km, *vals)
    q, nt = make_q(9, B, Hq, D, jnp.bfloat16), jnp.asarray([Tq, 0, 7001, 255], jnp.int32)
    kw = dict(key_bits=2, value_bits=2, group_size=G, sm_scale=1 / math.sqrt(D))
    (o, lse), (bo, blse) = _poisoned_runs(q, cache, nt, kw, tun, base)
    # against the exact-max kernel (the same scores bit for bit; P rounded to fp16 against
    # another reference max, the sums in f32): o to fp16 rounding, lse to f32's
    compare(o, lse, bo, blse, TOL[jnp.dtype(jnp.bfloat16)])
    fin = np.isfinite(np.asarray(blse))
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(blse)[fin], rtol=0, atol=1e-4)
    # against the twin: these logits reach ~40 (log2 units), and the fp16 operand q * s_g
    # carries 2^-12 of them, so lse's bound is relative here (the module's TOL is absolute
    # for logits of a few units)
    ro, rlse = kd.kivi_decode_reference(q, *cache, nt, jnp.int32(1), **kw)
    rlse = np.asarray(rlse)
    den = np.where(np.isfinite(rlse), np.maximum(1.0, np.abs(np.where(np.isfinite(rlse), rlse,
                                                                      0.0))), 1.0)
    compare(o, np.asarray(lse) / den, ro, rlse / den, TOL[jnp.dtype(jnp.bfloat16)])

"""Shared cases and helpers of the `pallas_kernels.kivi_decode` tests.

The test modules split by what they check:
  test_kivi_decode_numerics  the interpreter against the float32 twin, the twin against plain
                             attention, the code fields and byte orders, choose_tuning,
                             argument and TuningConfig errors (CPU)
  test_kivi_decode_lowering  the sm_90 cross-lowerings and the gating (`Plan`) (CPU)
  test_kivi_decode_gpu       natively on an sm_90 GPU (skipped elsewhere)

A `Case` is one launch: shape, bits, group size, query dtype, row lengths, layer and tuning.
"""

from __future__ import annotations

import dataclasses
import math
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import core as mosaic_core
from jax.experimental.pallas import mosaic_gpu as plgpu

from kivi_jax.quant import (
    block_columns,
    pack_tokens,
    to_cache_order,
    unblock_columns,
    unpack_tokens,
    value_codes_blocked,
)
from pallas_kernels.kivi_decode import TuningConfig, kivi_decode, kivi_decode_reference
from pallas_kernels.kivi_decode.config import Plan
from pallas_kernels.kivi_decode.decode import sinks_in_kernel
from pallas_kernels.rotation import rotate_rows, unrotate_rows

TC = TuningConfig
ON_GPU = jax.default_backend() == "gpu"
# Tolerances (max |o - o_ref| / max |o_ref|, and |lse - lse_ref|): the kernel dequantizes in
# fp16 (one rounding of code * scale + min, relative 2^-11), feeds fp16 tensor-core operands
# (q rounded to fp16 after sm_scale, P rounded to fp16) and accumulates in f32; with the value
# scale folded into P (G = D) the code fields' offsets pass through the f32 accumulator for one
# sub-step (measured ~6e-4 at 2 bits). bf16 q is converted to fp16 inside, so both query dtypes
# get the same bound.
TOL = {jnp.dtype(jnp.float16): 4e-3, jnp.dtype(jnp.bfloat16): 4e-3}
# fp8_values: the twin rounds P * s_t to e4m3 against the kernel's own running max, but the
# logits reach that rounding through different f32 (or fp16-operand) arithmetic, so a weight
# near a rounding boundary can land one e4m3 step (2^-4 relative) away: measured up to 2.4e-3
# of max |o| under the interpreter, 1.17e-2 on the H200 (D = G = 64, three warpgroups,
# a row whose few dominant weights decide o). A wrong field weight, scale or rescale is off by
# O(1).
TOL_F8 = 2e-2


@dataclasses.dataclass(frozen=True)
class Case:
    """One launch. lengths None: drawn per case (the GPU cases); tuning None: choose_tuning's."""

    name: str
    B: int
    Hq: int
    Hkv: int
    D: int
    T: int  # the quantized capacity Tq
    key_bits: int
    value_bits: int
    G: int
    dtype: object
    lengths: tuple[int, ...] | None = None
    layer: int = 1
    tuning: TuningConfig | None = None
    window: int = 0  # residual-window slots attended in the kernel (lengths: the rows' n)

    @property
    def shape_seed(self) -> int:
        """A seed from the shape (the interpreter cases' data)."""
        return sum(
            map(
                ord,
                str(
                    (
                        self.B,
                        self.Hq,
                        self.Hkv,
                        self.D,
                        self.T,
                        self.key_bits,
                        self.value_bits,
                        self.G,
                    )
                ),
            )
        )

    @property
    def kw(self) -> dict:
        return dict(
            key_bits=self.key_bits,
            value_bits=self.value_bits,
            group_size=self.G,
            sm_scale=1 / math.sqrt(self.D),
        )

    def replace(self, **kw) -> Case:
        return dataclasses.replace(self, **kw)


def interpreter_steps_fit(case: Case) -> bool:
    """A split of `case` takes at most `stages` steps (see the note above `CASES`)."""
    steps = case.T // 256
    return -(-steps // case.tuning.num_splits) <= case.tuning.stages


def ids(cases) -> list[str]:
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), f"duplicate case names: {names}"
    return names


def plan(
    tuning: TuningConfig,
    *,
    G: int = 128,
    D: int = 128,
    nq: int = 4,
    Tq: int = 131072,
    interpret: bool = False,
    key_bits: int = 2,
    value_bits: int = 2,
    B: int = 1,
    Hkv: int = 8,
    vblock: bool | None = None,
) -> Plan:
    """The `Plan` of a launch (interpret: under the GPU interpreter)."""
    vblock = value_codes_blocked(value_bits) if vblock is None else vblock
    return Plan(
        tuning=tuning,
        B=B,
        Hkv=Hkv,
        nq=nq,
        D=D,
        Tq=Tq,
        L=1,
        key_bits=key_bits,
        value_bits=value_bits,
        G=G,
        interpret=interpret,
        vblock=vblock,
    )


def case_plan(case: Case, interpret: bool = False) -> Plan:
    return plan(
        case.tuning,
        G=case.G,
        D=case.D,
        nq=case.Hq // case.Hkv,
        Tq=case.T,
        interpret=interpret,
        key_bits=case.key_bits,
        value_bits=case.value_bits,
        B=case.B,
        Hkv=case.Hkv,
    )


def fp8_applies(tun: TuningConfig | None, G: int, D: int) -> bool:
    """The value product on fp8 (`Plan.f8v`): fp8_values at G = D."""
    return tun is not None and tun.fp8_values and G == D


def twin_flags(tun, G, D):
    """The twin's model of the kernel's opt-in roundings under tuning `tun` (None: default)."""
    if tun is None:
        return {}
    f8 = fp8_applies(tun, G, D)
    return dict(fp8_values=f8, tuning=tun if f8 else None)


def tol_for(tun, G, D, dtype):
    return TOL_F8 if fp8_applies(tun, G, D) else TOL[jnp.dtype(dtype)]


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
    return (
        pack_tokens(kc, kb, axis=3),
        f((L, B, Hkv, Tq // G, D), 0.02, 0.3),
        f((L, B, Hkv, Tq // G, D), -0.6, 0.0),
        block_columns(vp) if blocked else vp,
        f((L, B, Hkv, D // G, Tq), 0.02, 0.3),
        f((L, B, Hkv, D // G, Tq), -0.6, 0.0),
    )


def make_q(seed, B, Hq, D, dtype):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((B, Hq, D)), dtype)


def case_cache(case: Case, seed: int, L: int = 3, blocked=None):
    return make_cache(
        seed,
        L,
        case.B,
        case.Hkv,
        case.D,
        case.T,
        case.key_bits,
        case.value_bits,
        case.G,
        blocked=blocked,
    )


def case_windows(case: Case, seed: int, L: int = 3):
    """Random residual windows of `case` (k [L, B, Hkv, W, D], v [L, B, Hkv, D, W], the
    query's dtype), or None without windows. Slots past a row's length hold data too: the
    kernel must mask them."""
    if not case.window:
        return None
    rng = np.random.default_rng(seed + 7)
    shape = (L, case.B, case.Hkv, case.window, case.D)
    k = jnp.asarray(rng.standard_normal(shape), case.dtype)
    v = jnp.asarray(rng.standard_normal(shape), case.dtype).swapaxes(-1, -2)
    return k, v


def plain_attention(q, cache, num_tokens, layer, *, key_bits, value_bits, group_size, sm_scale):
    """Independent float64 numpy: unpack, dequantize every element, softmax, weighted sum."""
    k_codes, k_scale, k_min, v_codes, v_scale, v_min = (np.asarray(x) for x in cache)
    if v_codes.ndim == 6:  # the cache's blocks of 64 byte columns
        v_codes = np.asarray(unblock_columns(v_codes))
    # per-token value scales are held in the cache order (docs/layout.md)
    v_scale, v_min = (np.asarray(to_cache_order(x, -1)) for x in (v_scale, v_min))
    kc = unpack_tokens(k_codes[layer], key_bits, axis=2)
    vc = np.swapaxes(np.asarray(unpack_tokens(v_codes[layer], value_bits, axis=3)), -1, -2)
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


def interpreter(detect_races: bool = True):
    return plgpu.InterpretGPUParams(detect_races=detect_races)


def case_sinks(case: Case, seed: int, n: int, L: int = 3):
    """Random sinks of `case`: k, v [L, B, Hkv, n, D] in the query's dtype, the keys larger
    than the cache's as attention sinks are."""
    kk, kv = jax.random.split(jax.random.key(seed + 100))
    shape = (L, case.B, case.Hkv, n, case.D)
    k = (3.0 * jax.random.normal(kk, shape)).astype(case.dtype)
    v = jax.random.normal(kv, shape).astype(case.dtype)
    return k, v


def sink_lengths(case: Case, n: int) -> tuple[int, ...]:
    """Row lengths of `case` for n sinks: rows that read all n sinks from their buffers, half
    of them (the other half in the windows, or not yet written), none (a row within its
    windows, or empty), in turn."""
    w = case.window
    pick = lambda b, length: (max(length, w + n), w + n // 2, w // 2)[b % 3]
    return tuple(pick(b, length) for b, length in enumerate(case.lengths))


def sinks_held(case: Case, n: int) -> np.ndarray:
    """[B]: how many of the n sinks each row of `case` reads from their buffers: those below
    its positions read from the codes."""
    lengths = np.asarray(case.lengths)
    return np.minimum(np.clip(lengths - case.window, 0, case.T), n)


def rotation_signs(D: int) -> tuple[float, ...]:
    """A fixed pattern of D signs for the rotation of q (both signs in every 16-column block)."""
    return tuple(float(x) for x in np.random.default_rng(D).choice([-1.0, 1.0], D))


def run_case(
    case: Case, seed: int, interpret, skip: int = 0, sinks: int = 0, rotated: bool = False
):
    """The kernel on `case` (interpret: the GPU interpreter's params or True; False: natively)
    against the twin within the case's tolerance; the interpreter's race detector clean.
    skip: positions [0, skip) not attended (a cache's sinks); sinks: that many sinks attended
    from buffers of their own (`case_sinks`, skip = sinks; rows reading all, half and none of
    them, `sink_lengths`); then also against the call without them merged with the sinks' own
    softmax in float64. rotated: q given and o returned in the model's basis, the keys and
    values stored rotated by the signs of `rotation_signs` (the call's `q_signs`, `o_signs`);
    then also against the call on q rotated beforehand, its output rotated back after."""
    if sinks:
        case = dataclasses.replace(case, lengths=sink_lengths(case, sinks))
    cache = case_cache(case, seed)
    q = make_q(seed + 1, case.B, case.Hq, case.D, case.dtype)
    nt = jnp.asarray(case.lengths, jnp.int32)
    windows = case_windows(case, seed)
    sink_bufs = case_sinks(case, seed, sinks) if sinks else None
    skip = sinks or skip
    signs = rotation_signs(case.D) if rotated else None
    call = lambda s, q=q, signs=signs, out=jnp.float32: kivi_decode(
        q,
        *cache,
        nt,
        jnp.int32(case.layer),
        **case.kw,
        tuning=case.tuning,
        interpret=interpret,
        windows=windows,
        skip=skip,
        sinks=s,
        q_signs=signs,
        o_signs=signs,
        out_dtype=out,
    )
    o, lse = call(sink_bufs)
    o, lse = jax.block_until_ready((o, lse))
    if interpret is not False:
        # The interpreter records races instead of raising: check the kernel just run.
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc

        assert not ipc.get_races().races_found, "GPU interpreter detected a data race"
    ro, rlse = kivi_decode_reference(
        q,
        *cache,
        nt,
        jnp.int32(case.layer),
        **case.kw,
        **twin_flags(case.tuning, case.G, case.D),
        windows=windows,
        skip=skip,
        sinks=sink_bufs,
        q_signs=signs,
        o_signs=signs,
    )
    compare(o, lse, ro, rlse, tol_for(case.tuning, case.G, case.D, case.dtype))
    if rotated:  # the same rotation as q's beforehand, whose rounding to q's dtype (the call
        # rotates in float32) moves the logits by up to ~1e-2: a wrong rotation moves them O(1)
        qr = rotate_rows(q, signs).astype(q.dtype)
        o_r, lse_r = jax.block_until_ready(call(sink_bufs, q=qr, signs=None, out=jnp.float32))
        compare(o, lse, unrotate_rows(o_r, signs), lse_r, 3e-2)
        return
    if sinks:
        o0, lse0 = jax.block_until_ready(call(None))
        so, slse = _sinks_softmax(q, sink_bufs, case, seed)
        want_o, want_lse = _merge2(o0, lse0, so, slse)
        if sinks_in_kernel(sink_bufs, case.window, case.dtype):
            # a window chunk: P rounded to the windows' dtype for the value product
            compare(o, lse, want_o, want_lse, tol_for(case.tuning, case.G, case.D, case.dtype))
        else:  # merged outside in float32
            np.testing.assert_allclose(np.asarray(o, np.float64), want_o, rtol=0, atol=2e-5)
            np.testing.assert_allclose(np.asarray(lse, np.float64), want_lse, rtol=0, atol=2e-5)


def _sinks_softmax(q, sinks, case: Case, seed: int):
    """(o, lse) of q over the held sinks of `case.layer` alone, float64 numpy (lse -inf, o 0
    where a row holds none)."""
    k, v = (np.asarray(x, np.float64)[case.layer] for x in sinks)  # [B, Hkv, N, D]
    held = sinks_held(case, k.shape[2])
    nq = case.Hq // case.Hkv
    qs = np.asarray(q, np.float64).reshape(case.B, case.Hkv, nq, case.D) / np.sqrt(case.D)
    s = np.einsum("bhqd,bhnd->bhqn", qs, k)
    s = np.where(np.arange(k.shape[2])[None, None, None, :] < held[:, None, None, None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    tot = p.sum(-1)
    o = np.einsum("bhqn,bhnd->bhqd", p, v) / np.where(tot > 0, tot, 1.0)[..., None]
    lse = np.where(
        tot > 0,
        np.where(np.isfinite(m[..., 0]), m[..., 0], 0.0) + np.log(np.where(tot > 0, tot, 1.0)),
        -np.inf,
    )
    return o.reshape(case.B, case.Hq, case.D), lse.reshape(case.B, case.Hq)


def _merge2(o1, l1, o2, l2):
    """The log-sum-exp merge of two partials, float64 numpy."""
    o1, l1 = np.asarray(o1, np.float64), np.asarray(l1, np.float64)
    m = np.maximum(l1, l2)
    m = np.where(np.isfinite(m), m, 0.0)
    w1, w2 = np.exp(l1 - m), np.exp(l2 - m)
    tot = w1 + w2
    o = (w1[..., None] * o1 + w2[..., None] * o2) / np.where(tot > 0, tot, 1.0)[..., None]
    return o, np.where(tot > 0, m + np.log(np.where(tot > 0, tot, 1.0)), -np.inf)


def splat_register_casts(module_asm: str) -> list[str]:
    """Casts of splat constants into a tiled layout's registers in a lowered Mosaic GPU module.

    Cross-lowering stops before Mosaic's LLVM passes, which cannot reconcile these (a constant
    passed into `plgpu.inline_mgpu` stays a splat: a native build failed with "LLVM
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


def cross_lower(case: Case, skip: int = 0, sinks: int = 0, rotated: bool = False) -> list[str]:
    """`kivi_decode` on `case` through the real sm_90 lowering (on any machine); returns the
    Mosaic GPU modules lowered (their assembly), none with splat register casts. sinks: that
    many sinks (`case_sinks`; skip = sinks); rotated: q and o rotated by the call (`q_signs`,
    `o_signs`)."""
    cache = case_cache(case, 0)
    q = make_q(1, case.B, case.Hq, case.D, case.dtype)
    kw = dict(
        key_bits=case.key_bits,
        value_bits=case.value_bits,
        group_size=case.G,
        sm_scale=0.1,
        tuning=case.tuning,
    )
    windows = case_windows(case, 0) or ()
    sink_bufs = case_sinks(case, 0, sinks) if sinks else ()
    nw = len(windows)

    def f(q, nt, layer, *arrays):
        return kivi_decode(
            q,
            *arrays[:6],
            nt,
            layer,
            **kw,
            windows=arrays[6 : 6 + nw] or None,
            skip=sinks or skip,
            sinks=arrays[6 + nw :] or None,
            q_signs=rotation_signs(case.D) if rotated else None,
            o_signs=rotation_signs(case.D) if rotated else None,
        )

    modules = []
    serde = mosaic_core._run_serde_pass

    def spy(module, **kwargs):
        modules.append(module.operation.get_asm(enable_debug_info=False))
        return serde(module, **kwargs)

    with mock.patch.object(mosaic_core, "_run_serde_pass", spy):
        lowered = (
            jax.jit(f)
            .trace(
                q,
                jnp.asarray(case.lengths, jnp.int32),
                jnp.int32(case.layer),
                *cache,
                *windows,
                *sink_bufs,
            )
            .lower(lowering_platforms=("cuda",))
        )
    assert "mosaic_gpu" in lowered.as_text()
    assert modules, "no Mosaic GPU module was lowered"
    for m in modules:
        bad = splat_register_casts(m)
        assert not bad, f"{len(bad)} splat constants cast into registers: {bad[:2]}"
    return modules


def anchor(key_bits: int = 2, group_size: int = 128, **kw) -> TuningConfig:
    """choose_tuning's launch at the anchor shape (B = 8, Hkv = 8, T = 128k)."""
    from pallas_kernels.kivi_decode import choose_tuning

    return choose_tuning(
        8, 8, 131072, key_bits=key_bits, value_bits=key_bits, group_size=group_size, **kw
    )


# ---- the cases ----------------------------------------------------------------------------

f16, bf16 = jnp.float16, jnp.bfloat16

# fmt: off
# Small launches under the interpreter (and cross-lowered): bits 2/4 and K4V2 / K2V4, G 32/64/
# 128, GQA ratios, ragged lengths incl. 0 and partial blocks, D 64/128, a nonzero layer.
# Under the interpreter a split takes at most `stages` steps of 256 tokens: with more, the
# interpreter's race detector (JAX 0.11) reports every slot's refill as racing with the reads
# before it, also in a bare `plgpu.emit_pipeline` (`interpreter_steps_fit` checks).
CASES = [
    Case("B2-Hq4-Hkv2-D128-T512-K2V2-G128", 2, 4, 2, 128, 512, 2, 2, 128, bf16, (300, 0), 1,
         TC(num_splits=2, stages=2)),
    Case("B2-Hq8-Hkv1-D128-T512-K2V2-G32", 2, 8, 1, 128, 512, 2, 2, 32, f16, (512, 65), 2,
         TC(num_splits=2, stages=2)),
    Case("B1-Hq2-Hkv2-D64-T512-K2V2-G64", 1, 2, 2, 64, 512, 2, 2, 64, f16, (511,), 1,
         TC(num_splits=1, stages=2)),
    Case("B2-Hq3-Hkv1-D128-T256-K4V4-G128", 2, 3, 1, 128, 256, 4, 4, 128, bf16, (1, 200), 0,
         TC(num_splits=2, stages=2)),
    Case("B2-Hq4-Hkv2-D64-T512-K4V4-G32", 2, 4, 2, 64, 512, 4, 4, 32, f16, (0, 0), 1,
         TC(num_splits=2, stages=3)),
    Case("B2-Hq16-Hkv1-D128-T512-K4V2-G32", 2, 16, 1, 128, 512, 4, 2, 32, bf16, (257, 448), 2,
         TC(num_splits=2, stages=2)),
    Case("B1-Hq4-Hkv4-D64-T1024-K2V4-G64", 1, 4, 4, 64, 1024, 2, 4, 64, f16, (777,), 1,
         TC(num_splits=2, stages=2)),
    Case("B2-Hq12-Hkv4-D128-T1024-K2V2-G128", 2, 12, 4, 128, 1024, 2, 2, 128, bf16, (1024, 70), 2,
         TC(num_splits=1, stages=4)),
]
CASE = {c.name: c for c in CASES}

# The TuningConfig's features on small shapes: under the interpreter (whose jnp path runs the
# features that are not native-only) and cross-lowered for sm_90 (all of them).
FLAG_CASES = [
    Case("K2V2-G32-T256-S1", 2, 8, 1, 128, 256, 2, 2, 32, f16, (256, 65), 1,
         TC(num_splits=1, stages=2)),
    Case("K4V4-G128-T256-S2", 2, 3, 1, 128, 256, 4, 4, 128, bf16, (1, 200), 0,
         TC(num_splits=2, stages=2)),
    Case("K2V2-G128-T256-S1", 1, 8, 2, 128, 256, 2, 2, 128, f16, (256,), 0,
         TC(num_splits=1, stages=2)),
    Case("K2V4-G64-D64-T256-S1", 1, 4, 2, 64, 256, 2, 4, 64, f16, (190,), 2,
         TC(num_splits=1, stages=2)),
    # several steps per split: 2-bit G = 32 (two groups per plane), 4-bit G = 128, D = 64
    Case("K2V2-G32-T1024-S1", 2, 8, 1, 128, 1024, 2, 2, 32, f16, (1024, 300), 1,
         TC(num_splits=1, stages=4)),
    Case("K4V4-G128-T1024-S2", 2, 4, 2, 128, 1024, 4, 4, 128, bf16, (700, 1), 2,
         TC(num_splits=2, stages=2)),
    Case("K2V2-G64-D64-T512-S2", 1, 4, 2, 64, 512, 2, 2, 64, f16, (450,), 0,
         TC(num_splits=2, stages=2)),
    # wg_per_block: several (b, h, split) units per block, each warpgroup with its own
    # pipeline and SMEM; 2 * 2 * 2 = 8 units in blocks of 3 (the last one partly idle), ragged
    # lengths (one split of row 1 gets no steps), 3 stages with more steps than stages.
    Case("K2V2-G128-W3-stages3", 2, 4, 2, 128, 1024, 2, 2, 128, bf16, (1000, 200), 1,
         TC(num_splits=2, stages=3, wg_per_block=3)),
    Case("K4V4-G32-W2-S3", 2, 8, 1, 128, 512, 4, 4, 32, f16, (512, 65), 2,
         TC(num_splits=3, stages=2, wg_per_block=2)),
    # fp8_values: the value product on fp8 tensor cores (against the twin's e4m3 model of
    # P * s_t), 2 and 4 bits, D = G = 64, two warpgroups
    Case("fp8-K2V2-G128", 2, 4, 2, 128, 512, 2, 2, 128, bf16, (512, 130), 1,
         TC(num_splits=2, stages=2, fp8_values=True)),
    Case("fp8-K4V4-G128", 2, 12, 2, 128, 512, 4, 4, 128, f16, (300, 512), 0,
         TC(num_splits=1, stages=2, fp8_values=True)),
    Case("fp8-K2V2-G64-D64", 1, 4, 2, 64, 512, 2, 2, 64, f16, (450,), 0,
         TC(num_splits=2, stages=2, fp8_values=True)),
    Case("fp8-K2V4-G128-W2", 2, 8, 2, 128, 1024, 2, 4, 128, f16, (1000, 0), 2,
         TC(num_splits=2, stages=2, fp8_values=True, wg_per_block=2)),
    # both products on mma.sync with three warpgroups, mixed bits; G 128 / 64 (D = 64, 4-bit
    # keys)
    Case("K2V4-G128-W3", 2, 8, 2, 128, 1024, 2, 4, 128, f16, (1000, 0), 2,
         TC(num_splits=2, stages=2, wg_per_block=3)),
    Case("K2V2-G128-T512", 2, 4, 2, 128, 512, 2, 2, 128, bf16, (512, 130), 1,
         TC(num_splits=2, stages=2)),
    Case("K4V2-G64-D64", 1, 4, 2, 64, 512, 4, 2, 64, bf16, (450,), 0, TC(num_splits=2, stages=2)),
    # warp_softmax (native only: the interpreter takes the shared softmax) with three
    # warpgroups, and switched off at G = D
    Case("wsm-K2V2-G128-W3", 2, 8, 2, 128, 1024, 2, 2, 128, f16, (1000, 0), 2,
         TC(num_splits=2, stages=2, wg_per_block=3)),
    Case("nowsm-K2V2-G64-D64", 1, 4, 2, 64, 512, 2, 2, 64, bf16, (450,), 0,
         TC(num_splits=2, stages=2, warp_softmax=False)),
    # release_slots with four warpgroups (native only: cross-lowered here, run on the GPU), and
    # four warpgroups in the shared softmax
    Case("release-K2V2-G128-W4", 2, 8, 2, 128, 1024, 2, 2, 128, f16, (1000, 0), 2,
         TC(num_splits=2, stages=2, wg_per_block=4, release_slots=True)),
    Case("nowsm-K2V2-G128-W4", 2, 8, 2, 128, 1024, 2, 2, 128, bf16, (1000, 0), 2,
         TC(num_splits=2, stages=2, wg_per_block=4, warp_softmax=False)),
    # the copies dealt over the warps at G = 32 with three warpgroups
    Case("spread-K2V2-G32-W3", 2, 8, 1, 128, 1024, 2, 2, 32, bf16, (1024, 300), 1,
         TC(num_splits=2, stages=2, wg_per_block=3, spread_copies=True)),
    # the value scale folded per warp with 64-bit vector loads (G < D; native only), 2-bit
    # G = 32 with three warpgroups and spread copies, 4-bit G = 32 at D = 64, 32 heads
    Case("fvw-K2V2-G32-W3-spread", 2, 8, 1, 128, 1024, 2, 2, 32, f16, (1024, 300), 1,
         TC(num_splits=2, stages=2, wg_per_block=3, spread_copies=True, fold_v_warp=True)),
    Case("fvw-K4V4-G32-D64", 1, 4, 2, 64, 1024, 4, 4, 32, bf16, (700,), 0,
         TC(num_splits=1, stages=4, fold_v_warp=True)),
    Case("fvw-K2V2-G32-Hq32", 1, 32, 1, 128, 512, 2, 2, 32, f16, (500,), 0,
         TC(num_splits=2, stages=2, fold_v_warp=True)),  # 32 heads: a larger scratch
    # two planes per score tile (at most four query heads per kv head): G = 128 with three
    # warpgroups and a ragged row, G = 32 (exact values), 4-bit with three heads, mixed bits
    # at D = 64 with two heads
    Case("pack-K2V2-G128-W3", 2, 8, 2, 128, 1024, 2, 2, 128, f16, (1000, 0), 2,
         TC(num_splits=2, stages=2, wg_per_block=3, warp_softmax=False, pack_planes=True)),
    Case("pack-K2V2-G32-W3", 2, 4, 1, 128, 1024, 2, 2, 32, bf16, (1024, 300), 1,
         TC(num_splits=2, stages=2, wg_per_block=3, pack_planes=True)),
    Case("pack-K4V4-G128-Hq3", 2, 6, 2, 128, 1024, 4, 4, 128, bf16, (1000, 513), 0,
         TC(num_splits=2, stages=2, warp_softmax=False, pack_planes=True)),
    Case("pack-K2V4-G64-D64", 1, 4, 2, 64, 512, 2, 4, 64, f16, (450,), 0,
         TC(num_splits=2, stages=2, warp_softmax=False, pack_planes=True)),
    # two planes per score tile with the value scale folded per warp (native only: the
    # interpreter runs them packed on the exact value path): 2-bit G = 32 with three
    # warpgroups and spread copies (the anchor's launch), G = 64 with three heads and a ragged
    # row
    Case("pack-fvw-K2V2-G32-W3-spread", 2, 4, 1, 128, 1024, 2, 2, 32, f16, (1024, 300), 1,
         TC(num_splits=2, stages=2, wg_per_block=3, spread_copies=True, fold_v_warp=True,
            pack_planes=True)),
    Case("pack-fvw-K2V2-G64-W3", 2, 6, 2, 128, 1024, 2, 2, 64, bf16, (1000, 513), 0,
         TC(num_splits=2, stages=2, wg_per_block=3, fold_v_warp=True, pack_planes=True)),
    # packed planes with zero padding (pack_zeros): G = 128 with three warpgroups and a ragged
    # row (keys and values), 4-bit with three heads, and (native only, cross-lowered here) G =
    # 32 with the value scale folded per warp (the keys' padding only)
    Case("pz-K2V2-G128-W3", 2, 8, 2, 128, 1024, 2, 2, 128, f16, (1000, 0), 2,
         TC(num_splits=2, stages=2, wg_per_block=3, warp_softmax=False, pack_planes=True,
            pack_zeros=True)),
    Case("pz-K4V4-G128-Hq3", 2, 6, 2, 128, 1024, 4, 4, 128, bf16, (1000, 513), 0,
         TC(num_splits=2, stages=2, warp_softmax=False, pack_planes=True, pack_zeros=True)),
    Case("pz-fvw-K2V2-G32-W3-spread", 2, 4, 1, 128, 1024, 2, 2, 32, f16, (1024, 300), 1,
         TC(num_splits=2, stages=2, wg_per_block=3, spread_copies=True, fold_v_warp=True,
            pack_planes=True, pack_zeros=True)),
    Case("pz-K2V4-G64-D64", 1, 4, 2, 64, 512, 2, 4, 64, f16, (450,), 0,
         TC(num_splits=2, stages=2, warp_softmax=False, pack_planes=True, pack_zeros=True)),
]

# merge_splits: the row's splits merged inside the kernel (one cluster of C blocks per row).
# The interpreter merges one block's splits (S = W, C = 1), rows of no tokens included.
MERGE_CASES = [
    Case("W2-K4-G32", 2, 8, 1, 128, 512, 4, 4, 32, f16, (512, 65), 2,
         TC(num_splits=2, stages=2, wg_per_block=2, merge_splits=True)),
    Case("W2-K2-G128", 2, 8, 2, 128, 512, 2, 2, 128, bf16, (300, 0), 1,
         TC(num_splits=2, stages=2, wg_per_block=2, merge_splits=True)),
    Case("W1-K2-G64", 2, 4, 2, 64, 512, 2, 2, 64, f16, (450, 200), 0,
         TC(num_splits=1, stages=2, merge_splits=True)),
]

# The residual windows attended in the kernel (`windows`): lengths are the rows' n, the
# quantized region [0, n - W); rows shorter than the window (only the windows), empty rows, a
# row of both; W 64 and 128; one warpgroup per block, and the in-kernel merge.
WINDOW_CASES = [
    Case("W128-K2V2-G128-S2", 3, 8, 2, 128, 512, 2, 2, 128, bf16, (640, 100, 0), 1,
         TC(num_splits=2, stages=2), window=128),
    Case("W64-K4V4-G64-D64-S2", 2, 4, 2, 64, 512, 4, 4, 64, f16, (364, 64), 2,
         TC(num_splits=2, stages=2), window=64),
    Case("W128-K2V2-G32-S1", 2, 8, 1, 128, 256, 2, 2, 32, f16, (384, 1), 1,
         TC(num_splits=1, stages=2), window=128),
    Case("W128-K4V2-G64-merge", 2, 4, 2, 64, 512, 4, 2, 64, bf16, (578, 0), 0,
         TC(num_splits=1, stages=2, merge_splits=True), window=128),
]
# Natively: choose_tuning's launches at shapes where the windows fit beside one warpgroup's
# pipelines (fold_v_warp's channel order at 2-bit G = 32 included), and explicit splits.
GPU_WINDOW_CASES = [
    Case("W128-choose-K2V2-G128", 4, 32, 8, 128, 8192, 2, 2, 128, bf16,
         (8192 + 128, 5000, 127, 0), window=128),
    Case("W128-choose-K2V2-G32", 3, 32, 8, 128, 8192, 2, 2, 32, f16, (8320, 129, 3000),
         window=128),
    Case("W128-choose-K4V4-G128", 2, 64, 8, 128, 8192, 4, 4, 128, bf16, (64, 7000),
         window=128),
    Case("W128-K2V2-G128-S4", 3, 32, 8, 128, 8192, 2, 2, 128, f16, (8320, 4000, 0),
         tuning=TC(num_splits=4, stages=2), window=128),
    Case("W64-choose-K2V4-G64-D64", 2, 16, 16, 64, 4096, 2, 4, 64, bf16, (4160, 33), window=64),
    # one-wave launches that merge their splits and write the final rows (`Plan.out_dtype`),
    # in the natural and fold_v_warp's channel order
    Case("W128-choose-K2V2-G128-B1", 1, 32, 8, 128, 1024, 2, 2, 128, bf16, (1100,), window=128),
    Case("W128-choose-K2V2-G32-B2", 2, 32, 8, 128, 1024, 2, 2, 32, f16, (1152, 300),
         window=128),
    # one row up to 8k: 8 splits merged in the cluster instead of 16-32 merged by XLA
    Case("W128-choose-K2V2-G128-B1-4k", 1, 32, 8, 128, 4096, 2, 2, 128, bf16, (4200,),
         window=128),
    Case("W128-choose-K4V4-G128-B1-8k", 1, 64, 8, 128, 8192, 4, 4, 128, f16, (5000,),
         window=128),
    # SmolLM2's heads (3 kv heads of D = 64, 3 queries each) at G = 32: fold_v_warp's order
    Case("W128-choose-K2V2-G32-D64-B1-8k", 1, 9, 3, 64, 8192, 2, 2, 32, bf16, (8300,),
         window=128),
]

# Larger launches natively on the GPU (lengths drawn per case: one empty row, one partial last
# step); tuning None: choose_tuning's launch.
GPU_CASES = [
    Case("choose-K2V2-G128", 4, 32, 8, 128, 8192, 2, 2, 128, bf16),
    Case("choose-K2V2-G32", 3, 32, 8, 128, 8192, 2, 2, 32, f16),
    Case("choose-K4V4-G128", 2, 64, 8, 128, 8192, 4, 4, 128, bf16),
    Case("choose-K4V2-G32", 3, 32, 8, 128, 8192, 4, 2, 32, f16),
    Case("choose-K2V4-G64-D64", 2, 16, 16, 64, 4096, 2, 4, 64, bf16),
    Case("choose-K2V2-G64-Hq18", 2, 72, 4, 128, 4096, 2, 2, 64, f16),
    # explicit splits, one warpgroup per block (the per-warp softmax at G = D)
    Case("K2V2-G128-S3", 3, 32, 8, 128, 8192, 2, 2, 128, f16, tuning=TC(num_splits=3, stages=2)),
    Case("K2V2-G32-S2", 2, 32, 8, 128, 8192, 2, 2, 32, bf16, tuning=TC(num_splits=2, stages=2)),
    Case("K2V2-G32-S4", 3, 32, 8, 128, 8192, 2, 2, 32, f16, tuning=TC(num_splits=4, stages=2)),
    Case("K4V4-G128-S4", 2, 32, 8, 128, 8192, 4, 4, 128, bf16, tuning=TC(num_splits=4, stages=2)),
    # G = 32 at 4 bits: per-warp group vectors over two groups per warp and block
    Case("K4V4-G32-S4", 3, 32, 8, 128, 8192, 4, 4, 32, bf16, tuning=TC(num_splits=4, stages=2)),
    Case("K2V2-G128-S4", 3, 32, 8, 128, 8192, 2, 2, 128, f16, tuning=TC(num_splits=4, stages=2)),
    Case("K2V2-G128-S4-B4", 4, 32, 8, 128, 8192, 2, 2, 128, bf16,
         tuning=TC(num_splits=4, stages=2)),
    Case("K4V2-G64-S4", 2, 32, 8, 128, 8192, 4, 2, 64, bf16, tuning=TC(num_splits=4, stages=2)),
    Case("K4V2-G64-S4-B3", 3, 32, 8, 128, 8192, 4, 2, 64, bf16, tuning=TC(num_splits=4, stages=2)),
    Case("K4V4-G128-Hq8-S4", 2, 64, 8, 128, 8192, 4, 4, 128, f16,
         tuning=TC(num_splits=4, stages=2)),
    Case("K2V2-G64-D64-S5", 3, 32, 8, 64, 8192, 2, 2, 64, f16, tuning=TC(num_splits=5, stages=2)),
    Case("K2V4-G64-D64-S3", 2, 16, 16, 64, 4096, 2, 4, 64, f16, tuning=TC(num_splits=3, stages=2)),
    Case("K2V2-G64-D64-S3", 2, 16, 16, 64, 4096, 2, 2, 64, bf16, tuning=TC(num_splits=3, stages=2)),
    # several warpgroups per block, each with its own pipeline (the last block partly idle:
    # 3 * 8 * 5 = 120 units in 40 blocks; 4 * 8 * 3 = 96 in 32; 2 * 8 * 7 = 112 in 38); compiled
    # without auto barriers: four at G = 128 (the anchor's), three at G = 32, two at 4 bits
    Case("K2V2-G128-W3-S5", 3, 32, 8, 128, 8192, 2, 2, 128, bf16,
         tuning=TC(num_splits=5, stages=2, wg_per_block=3)),
    Case("K2V2-G32-W3-S3", 4, 32, 8, 128, 8192, 2, 2, 32, f16,
         tuning=TC(num_splits=3, stages=2, wg_per_block=3)),
    Case("K4V4-G128-W2-S7", 2, 64, 8, 128, 8192, 4, 4, 128, f16,
         tuning=TC(num_splits=7, stages=2, wg_per_block=2)),
    Case("K4V2-G64-W2", 2, 32, 8, 128, 8192, 4, 2, 64, bf16,
         tuning=TC(num_splits=4, stages=2, wg_per_block=2)),
    Case("K2V2-G32-W3-S4", 3, 32, 8, 128, 8192, 2, 2, 32, f16,
         tuning=TC(num_splits=4, stages=2, wg_per_block=3)),
    Case("K2V2-G128-W3-S4", 4, 32, 8, 128, 8192, 2, 2, 128, bf16,
         tuning=TC(num_splits=4, stages=2, wg_per_block=3)),
    Case("K2V2-G128-W4", 4, 32, 8, 128, 16384, 2, 2, 128, f16,
         tuning=TC(num_splits=4, stages=2, wg_per_block=4)),
    Case("K2V2-G32-W3-S5", 3, 32, 8, 128, 8192, 2, 2, 32, bf16,
         tuning=TC(num_splits=5, stages=2, wg_per_block=3)),
    Case("K4V4-G128-W2-S6", 2, 64, 8, 128, 8192, 4, 4, 128, bf16,
         tuning=TC(num_splits=6, stages=2, wg_per_block=2)),
    # fp8_values (against the twin's e4m3 model of P * s_t), 2 and 4 bits, D = 64, B = 8,
    # three warpgroups
    Case("fp8-K2V2-G128", 4, 32, 8, 128, 8192, 2, 2, 128, bf16,
         tuning=TC(num_splits=4, stages=2, fp8_values=True)),
    Case("fp8-K4V4-G128", 2, 64, 8, 128, 8192, 4, 4, 128, f16,
         tuning=TC(num_splits=4, stages=2, fp8_values=True)),
    Case("fp8-K2V2-G64-D64-W3", 3, 32, 8, 64, 8192, 2, 2, 64, f16,
         tuning=TC(num_splits=5, stages=2, fp8_values=True, wg_per_block=3)),
    Case("fp8-K2V2-G128-B8", 8, 32, 8, 128, 32768, 2, 2, 128, bf16,
         tuning=TC(num_splits=8, stages=2, fp8_values=True)),
    Case("fp8-K2V2-G128-W3", 4, 32, 8, 128, 8192, 2, 2, 128, bf16,
         tuning=TC(num_splits=4, stages=2, fp8_values=True, wg_per_block=3)),
    # the per-warp softmax with 24 padded heads (three column tiles per warp) and three
    # warpgroups; switched off with four
    Case("wsm-K2V2-G128-Hq18-W3", 3, 72, 4, 128, 8192, 2, 2, 128, f16,
         tuning=TC(num_splits=5, stages=2, wg_per_block=3)),
    Case("nowsm-K2V2-G128-W4", 4, 32, 8, 128, 16384, 2, 2, 128, bf16,
         tuning=TC(num_splits=4, stages=2, wg_per_block=4, warp_softmax=False)),
    # the slots released through an mbarrier (`release_slots`) at four warpgroups, in the
    # shared softmax, and at 4 bits with two
    Case("release-K2V2-G128-W4", 4, 32, 8, 128, 16384, 2, 2, 128, f16,
         tuning=TC(num_splits=4, stages=2, wg_per_block=4, release_slots=True)),
    Case("release-nowsm-K2V2-G128-W4", 4, 32, 8, 128, 16384, 2, 2, 128, bf16,
         tuning=TC(num_splits=4, stages=2, wg_per_block=4, release_slots=True, warp_softmax=False)),
    Case("release-K4V4-G128-W2", 2, 64, 8, 128, 8192, 4, 4, 128, bf16,
         tuning=TC(num_splits=6, stages=2, wg_per_block=2, release_slots=True)),
    # the copies dealt over the warpgroup's warps (`spread_copies`): four warpgroups with the
    # slots released through an mbarrier, three at G = 32, one (the kernel's own pipeline)
    Case("spread-release-K2V2-G128-W4", 4, 32, 8, 128, 16384, 2, 2, 128, bf16,
         tuning=TC(num_splits=4, stages=2, wg_per_block=4, release_slots=True, spread_copies=True)),
    Case("spread-K2V2-G32-W3", 3, 32, 8, 128, 8192, 2, 2, 32, f16,
         tuning=TC(num_splits=5, stages=2, wg_per_block=3, spread_copies=True)),
    Case("spread-K4V4-G128", 2, 64, 8, 128, 8192, 4, 4, 128, bf16,
         tuning=TC(num_splits=4, stages=2, spread_copies=True)),
    # fold_v_warp's 64-bit key vector loads where the value fold does not apply (G = D):
    # four warpgroups at G = 128, mixed bits at D = 64, 4-bit with one warpgroup
    Case("wide-release-K2V2-G128-W4", 4, 32, 8, 128, 16384, 2, 2, 128, f16,
         tuning=TC(num_splits=4, stages=2, wg_per_block=4, release_slots=True, fold_v_warp=True)),
    Case("wide-K2V4-G64-D64", 2, 16, 16, 64, 4096, 2, 4, 64, f16,
         tuning=TC(num_splits=3, stages=2, fold_v_warp=True)),
    Case("wide-K4V4-G128", 2, 64, 8, 128, 8192, 4, 4, 128, f16,
         tuning=TC(num_splits=4, stages=2, fold_v_warp=True)),
    # the value scale folded per warp (`fold_v_warp`; the default at 2-bit G < D): 2-bit G = 32
    # with three warpgroups (and spread copies), G = 64 with 24 padded heads, G = 64 with mixed
    # bits, 4-bit G = 32, D = 64 G = 32 (three warpgroups, one), 32 query heads per kv head
    # (the group sums' scratch past its default)
    Case("fvw-K2V2-G32-W3", 3, 32, 8, 128, 8192, 2, 2, 32, bf16,
         tuning=TC(num_splits=5, stages=2, wg_per_block=3, fold_v_warp=True)),
    Case("fvw-spread-K2V2-G32-W3", 3, 32, 8, 128, 8192, 2, 2, 32, f16,
         tuning=TC(num_splits=5, stages=2, wg_per_block=3, spread_copies=True, fold_v_warp=True)),
    Case("fvw-K2V2-G64-Hq18-W3", 3, 72, 4, 128, 8192, 2, 2, 64, bf16,
         tuning=TC(num_splits=5, stages=2, wg_per_block=3, fold_v_warp=True)),
    Case("fvw-spread-K2V2-G64-W3", 2, 32, 8, 128, 8192, 2, 2, 64, bf16,
         tuning=TC(num_splits=4, stages=2, wg_per_block=3, spread_copies=True, fold_v_warp=True)),
    Case("fvw-K4V2-G64", 2, 32, 8, 128, 8192, 4, 2, 64, bf16,
         tuning=TC(num_splits=4, stages=2, fold_v_warp=True)),
    Case("fvw-K4V4-G32", 3, 32, 8, 128, 8192, 4, 4, 32, bf16,
         tuning=TC(num_splits=4, stages=2, fold_v_warp=True)),
    Case("fvw-K2V2-G32-D64-W3", 2, 16, 16, 64, 4096, 2, 2, 32, f16,
         tuning=TC(num_splits=3, stages=2, wg_per_block=3, fold_v_warp=True)),
    Case("fvw-K2V2-G32-D64", 2, 16, 16, 64, 4096, 2, 2, 32, bf16,
         tuning=TC(num_splits=3, stages=2, fold_v_warp=True)),
    Case("fvw-K2V2-G32-Hq32", 2, 32, 1, 128, 8192, 2, 2, 32, bf16,
         tuning=TC(num_splits=4, stages=2, fold_v_warp=True)),
    # two planes per score tile (`pack_planes`): the anchor's 2-bit G=128 (four warpgroups,
    # with and without release_slots) and G=32 (three, spread_copies) launches, 4-bit G=128
    # with one warpgroup and three heads, mixed bits at D = 64 with one head
    Case("pack-release-K2V2-G128-W4", 4, 32, 8, 128, 16384, 2, 2, 128, f16,
         tuning=TC(num_splits=4, stages=2, wg_per_block=4, release_slots=True, warp_softmax=False,
                   pack_planes=True)),
    Case("pack-K2V2-G128-W4", 4, 32, 8, 128, 16384, 2, 2, 128, bf16,
         tuning=TC(num_splits=4, stages=2, wg_per_block=4, warp_softmax=False, pack_planes=True)),
    Case("pack-spread-K2V2-G32-W3", 3, 32, 8, 128, 8192, 2, 2, 32, bf16,
         tuning=TC(num_splits=5, stages=2, wg_per_block=3, spread_copies=True, pack_planes=True)),
    Case("pack-K4V4-G128-Hq3", 2, 24, 8, 128, 8192, 4, 4, 128, bf16,
         tuning=TC(num_splits=4, stages=2, warp_softmax=False, pack_planes=True)),
    Case("pack-K2V4-G64-D64", 2, 16, 16, 64, 4096, 2, 4, 64, f16,
         tuning=TC(num_splits=3, stages=2, warp_softmax=False, pack_planes=True)),
    # fold_v_warp with two planes per score tile: the anchor's 2-bit G = 32 launch, G = 64
    # with three heads, D = 64 G = 32 with one warpgroup
    Case("pack-fvw-spread-K2V2-G32-W3", 3, 32, 8, 128, 8192, 2, 2, 32, f16,
         tuning=TC(num_splits=5, stages=2, wg_per_block=3, spread_copies=True, fold_v_warp=True,
                   pack_planes=True)),
    Case("pack-fvw-K2V2-G64-W3", 2, 24, 8, 128, 8192, 2, 2, 64, bf16,
         tuning=TC(num_splits=4, stages=2, wg_per_block=3, fold_v_warp=True, pack_planes=True)),
    Case("pack-fvw-K2V2-G32-D64", 2, 16, 16, 64, 4096, 2, 2, 32, bf16,
         tuning=TC(num_splits=3, stages=2, warp_softmax=False, fold_v_warp=True, pack_planes=True)),
    # packed planes with zero padding (`pack_zeros`): the anchor's 2-bit G = 128 and G = 32
    # launches, G = 64 with three heads, 4-bit G = 128 with one warpgroup and three heads,
    # mixed bits at D = 64 with one head
    Case("pz-K2V2-G128-W4", 4, 32, 8, 128, 16384, 2, 2, 128, f16,
         tuning=TC(num_splits=4, stages=2, wg_per_block=4, warp_softmax=False, pack_planes=True,
                   pack_zeros=True)),
    Case("pz-fvw-spread-K2V2-G32-W3", 3, 32, 8, 128, 8192, 2, 2, 32, bf16,
         tuning=TC(num_splits=5, stages=2, wg_per_block=3, spread_copies=True, fold_v_warp=True,
                   pack_planes=True, pack_zeros=True)),
    Case("pz-fvw-K2V2-G64-W3", 2, 24, 8, 128, 8192, 2, 2, 64, f16,
         tuning=TC(num_splits=4, stages=2, wg_per_block=3, fold_v_warp=True, pack_planes=True,
                   pack_zeros=True)),
    Case("pz-K4V4-G128-Hq3", 2, 24, 8, 128, 8192, 4, 4, 128, bf16,
         tuning=TC(num_splits=4, stages=2, warp_softmax=False, pack_planes=True, pack_zeros=True)),
    Case("pz-K2V4-G64-D64", 2, 16, 16, 64, 4096, 2, 4, 64, f16,
         tuning=TC(num_splits=3, stages=2, warp_softmax=False, pack_planes=True, pack_zeros=True)),
    # the key bias from 16-group blocks (`dense_bias`): the anchor's 2-bit G = 128 and
    # G = 32 launches (packed, zero-padded), G = 64 with three heads and unpacked planes,
    # 4-bit G = 128 with one warpgroup and the shared softmax, G = 32 with one warpgroup and
    # three stages
    Case("dense-pz-K2V2-G128-W4", 4, 32, 8, 128, 16384, 2, 2, 128, bf16,
         tuning=TC(num_splits=4, stages=2, wg_per_block=4, warp_softmax=False, pack_planes=True,
                   pack_zeros=True, dense_bias=True)),
    Case("dense-pz-fvw-K2V2-G32-W3", 3, 32, 8, 128, 8192, 2, 2, 32, f16,
         tuning=TC(num_splits=5, stages=2, wg_per_block=3, spread_copies=True, fold_v_warp=True,
                   pack_planes=True, pack_zeros=True, dense_bias=True)),
    Case("dense-fvw-K2V2-G64-W3", 2, 24, 8, 128, 8192, 2, 2, 64, bf16,
         tuning=TC(num_splits=4, stages=2, wg_per_block=3, fold_v_warp=True, dense_bias=True)),
    Case("dense-K4V4-G128", 2, 64, 8, 128, 8192, 4, 4, 128, f16,
         tuning=TC(num_splits=4, stages=2, warp_softmax=False, release_slots=True,
                   dense_bias=True)),
    Case("dense-fvw-K2V2-G32-stages3", 3, 32, 8, 128, 8192, 2, 2, 32, bf16,
         tuning=TC(num_splits=4, stages=3, fold_v_warp=True, dense_bias=True)),
]
# fmt: on
